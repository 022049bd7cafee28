//! Small helpers the subcommands share: duration arguments and the
//! directories a command creates before writing into them.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;

/// Why a duration argument was refused (clap prints it after the argument's name).
#[derive(Debug, thiserror::Error)]
pub enum DurationError {
    #[error("`{0}` is not a duration; use e.g. 500ms, 30s, 5m or 1h")]
    NotANumber(String),
    #[error("`{text}` has an unknown unit `{unit}`; use ms, s, m, h or d")]
    UnknownUnit { text: String, unit: String },
}

/// Parse `500ms`, `30s`, `5m`, `1h`, `2d` or bare seconds.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| DurationError::NotANumber(s.to_string()))?;
    let ms = match unit {
        "ms" => n,
        "" | "s" => n * 1e3,
        "m" => n * 60e3,
        "h" => n * 3600e3,
        "d" => n * 86400e3,
        _ => return Err(DurationError::UnknownUnit { text: s.to_string(), unit: unit.to_string() }),
    };
    Ok(Duration::from_millis(ms as u64))
}

/// Create `p` (and its parents) private to the user, naming it on failure.
pub fn ensure_dir(p: &Path) -> anyhow::Result<()> {
    crate::store::fsutil::mkdir_private_all(p).with_context(|| format!("cannot create {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(matches!(parse_duration("5 parsecs"), Err(DurationError::UnknownUnit { .. })));
        assert!(matches!(parse_duration("soon"), Err(DurationError::NotANumber(_))));
    }
}
