//! Text read from files, made safe to print: a run's status, an error file,
//! daemon.json are any client's (or step's) words, and a terminal acts on
//! the control characters in them (`\x1b]0;…\x07` retitles it, `\x1b[2J`
//! clears it). Every such string goes through here before it is printed,
//! on a terminal or not. A step's own output (`logs`) is passed as it is.

/// `text` with every control character shown as an escape: C0 and DEL as
/// `\x1b`, C1 as `\u{9b}`, newlines and tabs too (one line of output).
pub(crate) fn visible(text: &str) -> String {
    escape(text, false)
}

/// As [`visible`], keeping `\n` and `\t` (a message of several lines).
pub(crate) fn visible_lines(text: &str) -> String {
    escape(text, true)
}

fn escape(text: &str, keep_lines: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' | '\t' if keep_lines => out.push(c),
            '\0'..='\x1f' | '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{80}'..='\u{9f}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            _ => out.push(c),
        }
    }
    out
}

/// How long ago `ms` was, for people: `42s`, `3m`, `2h`, `1d`.
pub(crate) fn age(ms: i64) -> String {
    let s = ((crate::now_ms() - ms) / 1000).max(0);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_not_sent() {
        assert_eq!(visible("a\x1b]0;pwned\x07b"), "a\\x1b]0;pwned\\x07b");
        assert_eq!(visible("\x1b[2J\u{9b}2J\x7f"), "\\x1b[2J\\u{9b}2J\\x7f");
        assert_eq!(visible("line\nnext\ttab"), "line\\x0anext\\x09tab");
        assert_eq!(visible_lines("line\nnext\ttab\r"), "line\nnext\ttab\\x0d");
        assert_eq!(visible("plain é ✓"), "plain é ✓");
    }
}
