//! Serde types and validation of the on-disk protocol. Pure: no I/O.

pub mod bridge;
pub mod request;
pub mod seg;
pub mod status;

/// `[A-Za-z0-9][A-Za-z0-9._-]{0,max-1}`: the grammar of spool names and run ids.
pub fn is_id(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn id_grammar() {
        assert!(is_id("a", 128));
        assert!(is_id("run-1.x_y", 128));
        assert!(!is_id("", 128));
        assert!(!is_id(".a", 128));
        assert!(!is_id("-a", 128));
        assert!(!is_id("a/b", 128));
        assert!(!is_id("..", 128));
        assert!(is_id(&"x".repeat(128), 128));
        assert!(!is_id(&"x".repeat(129), 128));
    }
}
