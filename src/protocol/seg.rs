//! Index segment encoding (PROTOCOL section 6.3).
//!
//! `seg(v)` turns an arbitrary string (a session id, a run id, a tool call id)
//! into a single, portable path segment:
//!
//! 1. `e` = `v` percent-encoded exactly as JavaScript's `encodeURIComponent`.
//! 2. If `e` is at most `max` bytes and portable, the segment is `e`.
//! 3. Otherwise it is `"~sha256-"` followed by the lowercase hex SHA-256 of the
//!    UTF-8 bytes of `v`.
//!
//! `max` is 255 for [`seg`] and 250 for [`seg250`] (result-file names, which get
//! a `.json` suffix).

use sha2::{Digest, Sha256};

/// Byte limit used by [`seg`].
pub const SEG_MAX: usize = 255;
/// Byte limit used by [`seg250`] (result-file names).
pub const SEG250_MAX: usize = 250;
/// Prefix of a hashed segment.
pub const HASH_PREFIX: &str = "~sha256-";

const UPPER_HEX: &[u8; 16] = b"0123456789ABCDEF";
const LOWER_HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether `b` is left as is by JavaScript's `encodeURIComponent`:
/// `A-Z a-z 0-9 - _ . ! ~ * ' ( )`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'!' | b'~' | b'*' | b'\'' | b'(' | b')')
}

/// Percent-encodes `v` exactly as JavaScript's `encodeURIComponent` does
/// (over the UTF-8 bytes, with uppercase hex digits).
pub fn encode_uri_component(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for &b in v.as_bytes() {
        if is_unreserved(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(UPPER_HEX[(b >> 4) as usize] as char);
            out.push(UPPER_HEX[(b & 0x0f) as usize] as char);
        }
    }
    out
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(digest.len() * 2);
    for b in digest.iter() {
        out.push(LOWER_HEX[(b >> 4) as usize] as char);
        out.push(LOWER_HEX[(b & 0x0f) as usize] as char);
    }
    out
}

/// `^(con|prn|aux|nul|com[1-9]|lpt[1-9])(\.|$)`, case-insensitively.
fn is_reserved_device_name(e: &str) -> bool {
    let b = e.as_bytes();
    // Length of the device-name prefix, if `e` starts with one.
    let prefix_len = if b.len() >= 3 {
        let head = [b[0].to_ascii_lowercase(), b[1].to_ascii_lowercase(), b[2].to_ascii_lowercase()];
        match &head {
            b"con" | b"prn" | b"aux" | b"nul" => Some(3),
            b"com" | b"lpt" if b.len() >= 4 && (b'1'..=b'9').contains(&b[3]) => Some(4),
            _ => None,
        }
    } else {
        None
    };
    match prefix_len {
        // `(\.|$)`: end of string, or a dot right after the name.
        Some(n) => b.len() == n || b[n] == b'.',
        None => false,
    }
}

/// Whether `e` contains `%5C` in any letter case.
fn contains_encoded_backslash(e: &str) -> bool {
    e.as_bytes().windows(3).any(|w| w[0] == b'%' && w[1] == b'5' && (w[2] == b'C' || w[2] == b'c'))
}

/// Whether `e` ends in `\.[A-Za-z][A-Za-z0-9]{0,7}` (a file-name extension).
///
/// Everything after the matched dot must be alphanumeric, so only the last dot
/// of `e` can start a match.
fn has_extension_suffix(e: &str) -> bool {
    let b = e.as_bytes();
    let Some(dot) = b.iter().rposition(|&c| c == b'.') else {
        return false;
    };
    let ext = &b[dot + 1..];
    !ext.is_empty()
        && ext.len() <= 8
        && ext[0].is_ascii_alphabetic()
        && ext[1..].iter().all(|c| c.is_ascii_alphanumeric())
}

/// PROTOCOL 6.3 "portable": not empty; not `.` or `..`; not ending in `.`;
/// not a reserved device name (optionally followed by a dot and more); not
/// containing `%5C` (any case); not ending in a file-name extension.
fn is_portable(e: &str) -> bool {
    !e.is_empty()
        && e != "."
        && e != ".."
        && !e.ends_with('.')
        && !is_reserved_device_name(e)
        && !contains_encoded_backslash(e)
        && !has_extension_suffix(e)
}

/// `seg(v)` with byte limit `max` (PROTOCOL 6.3).
pub fn seg_max(v: &str, max: usize) -> String {
    let e = encode_uri_component(v);
    if e.len() <= max && is_portable(&e) {
        e
    } else {
        let mut out = String::with_capacity(HASH_PREFIX.len() + 64);
        out.push_str(HASH_PREFIX);
        out.push_str(&sha256_hex(v.as_bytes()));
        out
    }
}

/// pi-subagents 0.67's `indexSegmentAliases(v, max)`: the segment written
/// today, then the pre-hash percent-encoded one when it still names a file
/// (fits in `max` bytes; not empty, `.`, `..`, ending in `.` or a reserved
/// device name) and differs. Readers of 0.67's indexes look under both.
pub fn seg_aliases(v: &str, max: usize) -> Vec<String> {
    let current = seg_max(v, max);
    let e = encode_uri_component(v);
    let historical =
        !e.is_empty() && e != "." && e != ".." && !e.ends_with('.') && !is_reserved_device_name(&e) && e.len() <= max;
    if historical && e != current {
        vec![current, e]
    } else {
        vec![current]
    }
}

/// `seg(v)` with the default byte limit of 255.
pub fn seg(v: &str) -> String {
    seg_max(v, SEG_MAX)
}

/// `seg(v)` with the byte limit of 250 used for result-file names.
pub fn seg250(v: &str) -> String {
    seg_max(v, SEG250_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashed(v: &str) -> String {
        format!("~sha256-{}", sha256_hex(v.as_bytes()))
    }

    fn assert_hashed(v: &str) {
        assert_eq!(seg(v), hashed(v), "expected {v:?} to be hashed by seg");
        assert_eq!(seg250(v), hashed(v), "expected {v:?} to be hashed by seg250");
    }

    fn assert_plain(v: &str, expected: &str) {
        assert_eq!(seg(v), expected, "seg({v:?})");
        assert_eq!(seg250(v), expected, "seg250({v:?})");
    }

    /// Printed by pi-subagents 0.67's `indexSegmentAliases(v, 250)` under node.
    #[test]
    fn aliases_match_pi_subagents() {
        assert_eq!(seg_aliases("s.jsonl", 250), vec![hashed("s.jsonl"), "s.jsonl".to_string()]);
        assert_eq!(seg_aliases("plain", 250), vec!["plain".to_string()]);
        assert_eq!(seg_aliases("a%5Cb", 250), vec!["a%255Cb".to_string()]);
        assert_eq!(seg_aliases(&"x".repeat(251), 250), vec![hashed(&"x".repeat(251))]);
        assert_eq!(seg_aliases("CON", 250), vec![hashed("CON")]);
        assert_eq!(seg_aliases("é.txt", 250), vec![hashed("é.txt"), "%C3%A9.txt".to_string()]);
        assert_eq!(seg_aliases("trailing.", 250), vec![hashed("trailing.")]);
    }

    // ---- sha256_hex ----

    #[test]
    fn sha256_hex_known_vectors() {
        assert_eq!(sha256_hex(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    // ---- encode_uri_component ----

    #[test]
    fn encode_leaves_unreserved_alone() {
        let unreserved = "ABCXYZabcxyz0189-_.!~*'()";
        assert_eq!(encode_uri_component(unreserved), unreserved);
    }

    #[test]
    fn encode_reserved_ascii() {
        assert_eq!(encode_uri_component("call/a+b="), "call%2Fa%2Bb%3D");
        assert_eq!(encode_uri_component(" "), "%20");
        assert_eq!(encode_uri_component("%"), "%25");
        assert_eq!(encode_uri_component("\\"), "%5C");
        assert_eq!(encode_uri_component("?#&;:,@$"), "%3F%23%26%3B%3A%2C%40%24");
        assert_eq!(encode_uri_component("\"<>[]{}|^`"), "%22%3C%3E%5B%5D%7B%7D%7C%5E%60");
        assert_eq!(encode_uri_component("\0\n\x7f"), "%00%0A%7F");
    }

    #[test]
    fn encode_multibyte_uses_utf8_and_uppercase_hex() {
        assert_eq!(encode_uri_component("é"), "%C3%A9"); // 2 bytes
        assert_eq!(encode_uri_component("€"), "%E2%82%AC"); // 3 bytes
        assert_eq!(encode_uri_component("😀"), "%F0%9F%98%80"); // 4 bytes
        assert_eq!(encode_uri_component("\u{FFFD}"), "%EF%BF%BD");
        assert_eq!(encode_uri_component("a€b"), "a%E2%82%ACb");
    }

    // ---- PROTOCOL 6.3 examples ----

    #[test]
    fn spec_example_encoded() {
        assert_plain("call/a+b=", "call%2Fa%2Bb%3D");
    }

    #[test]
    fn spec_example_255_x_unchanged() {
        let v = "x".repeat(255);
        assert_eq!(seg(&v), v);
    }

    #[test]
    fn spec_example_256_x_hashed() {
        let v = "x".repeat(256);
        assert_eq!(seg(&v), hashed(&v));
        assert_eq!(seg250(&v), hashed(&v));
    }

    #[test]
    fn spec_examples_hashed() {
        for v in ["", ".", "CON", "nul.txt", "trailing.", "s.jsonl"] {
            assert_hashed(v);
        }
    }

    #[test]
    fn hashed_form_shape() {
        let s = seg("");
        assert_eq!(s, "~sha256-e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(s.len(), 8 + 64);
    }

    // ---- length limits ----

    #[test]
    fn seg250_limit() {
        let v250 = "x".repeat(250);
        let v251 = "x".repeat(251);
        assert_eq!(seg250(&v250), v250);
        assert_eq!(seg250(&v251), hashed(&v251));
        assert_eq!(seg(&v251), v251);
    }

    #[test]
    fn limit_applies_to_encoded_length() {
        // 85 * "%2F" = 255 bytes once encoded: fits seg, not seg250.
        let v = "/".repeat(85);
        assert_eq!(seg(&v), "%2F".repeat(85));
        assert_eq!(seg250(&v), hashed(&v));
        // 86 * 3 = 258 > 255.
        let v = "/".repeat(86);
        assert_eq!(seg(&v), hashed(&v));
        // Multibyte: 21 emoji = 21 * 12 = 252 encoded bytes.
        let v = "😀".repeat(21);
        assert_eq!(seg(&v), "%F0%9F%98%80".repeat(21));
        assert_eq!(seg250(&v), hashed(&v));
        assert_eq!(seg_max(&v, 252), "%F0%9F%98%80".repeat(21));
        assert_eq!(seg_max(&v, 251), hashed(&v));
    }

    // ---- dots ----

    #[test]
    fn dots() {
        assert_hashed(".");
        assert_hashed("..");
        assert_hashed("...");
        assert_hashed("a.");
        assert_hashed("trailing.");
        assert_hashed("a/."); // "a%2F." still ends in "."
        assert_plain("a.-", "a.-");
    }

    #[test]
    fn leading_dot_names() {
        // ".hidden" ends in an extension-like suffix: hashed.
        assert_hashed(".hidden");
        // ".1" does not (extension must start with a letter).
        assert_plain(".1", ".1");
        assert_plain("a.1", "a.1");
        assert_plain(".x-y", ".x-y");
    }

    // ---- reserved device names ----

    #[test]
    fn reserved_names_hashed_any_case() {
        for v in [
            "con",
            "CON",
            "Con",
            "prn",
            "PRN",
            "aux",
            "AuX",
            "nul",
            "NUL",
            "com1",
            "COM9",
            "lpt1",
            "LpT9",
            "con.x",
            "con.",
            "CON.anything-at-all",
            "aux.1",
            "nul.txt",
            "com1.",
            "lpt5.foo.bar",
            "prn..",
        ] {
            assert_hashed(v);
        }
    }

    #[test]
    fn near_reserved_names_not_hashed() {
        for v in [
            "com0",
            "lpt0",
            "COM0",
            "com",
            "lpt",
            "co",
            "console",
            "connect",
            "nullable",
            "auxiliary",
            "prn1",
            "com10",
            "lpt1x",
            "xcon",
            "com1-x",
            "con-x",
            "con_1",
            "com¹",
        ] {
            let e = encode_uri_component(v);
            assert_plain(v, &e);
        }
        // "com0.x" is not a device name, but it ends in an extension.
        assert_hashed("com0.x");
        // "com0.1" is neither.
        assert_plain("com0.1", "com0.1");
    }

    #[test]
    fn reserved_check_is_on_encoded_form() {
        // A space after "con" encodes to "%20", so "con%20" does not match (\.|$).
        assert_plain("con ", "con%20");
        assert_plain("con/x", "con%2Fx");
    }

    // ---- backslash ----

    #[test]
    fn encoded_backslash_hashed() {
        assert_hashed("\\");
        assert_hashed("a\\b");
        assert_hashed("C:\\Users");
        // A literal "%5C" in the input encodes to "%255C", which contains "5C"
        // but not "%5C".
        assert_plain("%5C", "%255C");
        assert_plain("%5c", "%255c");
    }

    #[test]
    fn backslash_check_case_insensitive() {
        // encode_uri_component never yields lowercase hex, so exercise the
        // check directly.
        assert!(contains_encoded_backslash("a%5Cb"));
        assert!(contains_encoded_backslash("a%5cb"));
        assert!(contains_encoded_backslash("%5c"));
        assert!(!contains_encoded_backslash("%255C"));
        assert!(!contains_encoded_backslash("5C%"));
        assert!(!contains_encoded_backslash("%5"));
        assert!(!is_portable("x%5cy"));
        assert!(!is_portable("x%5Cy"));
    }

    // ---- extension rule ----

    #[test]
    fn extension_rule() {
        assert_hashed("a.b1");
        assert_hashed("a.b");
        assert_hashed("a.B");
        assert_hashed("a.json");
        assert_hashed("file.tar.gz");
        assert_hashed("x.abcdefgh"); // 8 chars after the dot
        assert_hashed("x.a1234567"); // 8 chars after the dot
        assert_hashed("1.2.a");
        assert_plain("a.1b", "a.1b");
        assert_plain("x.123456789", "x.123456789"); // starts with a digit
        assert_plain("x.abcdefghi", "x.abcdefghi"); // 9 chars after the dot
        assert_plain("x.a-b", "x.a-b");
        assert_plain("x.a_b", "x.a_b");
        assert_plain("x.ab!", "x.ab!");
        assert_plain("v1.2", "v1.2");
        assert_plain("a.b/c", "a.b%2Fc");
        // The extension must be right at the end: "a.b c" encodes to "a.b%20c".
        assert_plain("a.b c", "a.b%20c");
        // Only the last dot can start a match.
        assert_plain("a.b.1", "a.b.1");
        assert_plain("x.abcdefghijk.123", "x.abcdefghijk.123");
        // A multibyte extension is percent-encoded, so no match.
        assert_plain("a.é", "a.%C3%A9");
    }

    #[test]
    fn extension_suffix_direct() {
        assert!(has_extension_suffix(".a"));
        assert!(has_extension_suffix("x.Z9"));
        assert!(has_extension_suffix("x.y.abcdefgh"));
        assert!(!has_extension_suffix("x.y.abcdefghi"));
        assert!(!has_extension_suffix("x."));
        assert!(!has_extension_suffix("x.9"));
        assert!(!has_extension_suffix("abc"));
        assert!(!has_extension_suffix(""));
    }

    // ---- ordinary identifiers ----

    #[test]
    fn ordinary_ids_pass_through() {
        for v in [
            "run-0123456789abcdef",
            "3f2504e0-4f89-11d3-9a0c-0305e82c3301",
            "session_ABC",
            "toolu_01XyZ",
            "a",
            "~",
            "~sha256-abc",
            "(x)!*'",
        ] {
            assert_plain(v, v);
        }
    }

    #[test]
    fn multibyte_ids() {
        assert_plain("café", "caf%C3%A9");
        assert_plain("日本", "%E6%97%A5%E6%9C%AC");
        assert_plain("🚀 launch", "%F0%9F%9A%80%20launch");
    }
}
