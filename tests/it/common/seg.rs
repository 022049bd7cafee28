//! seg(): index segment encoding (PROTOCOL 6.3). An independent implementation,
//! cross-checked against the PROTOCOL examples in `seg_examples_hold`.

use sha2::{Digest, Sha256};

pub fn encode_uri_component(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{:02X}", b));
        }
    }
    out
}

fn is_portable(e: &str) -> bool {
    if e.is_empty() || e == "." || e == ".." || e.ends_with('.') {
        return false;
    }
    let lower = e.to_ascii_lowercase();
    let reserved_base = |rest: &str| rest.is_empty() || rest.starts_with('.');
    for name in ["con", "prn", "aux", "nul"] {
        if let Some(rest) = lower.strip_prefix(name) {
            if reserved_base(rest) {
                return false;
            }
        }
    }
    for name in ["com", "lpt"] {
        if let Some(rest) = lower.strip_prefix(name) {
            let b = rest.as_bytes();
            if !b.is_empty() && (b'1'..=b'9').contains(&b[0]) && reserved_base(&rest[1..]) {
                return false;
            }
        }
    }
    if lower.contains("%5c") {
        return false;
    }
    if let Some(pos) = e.rfind('.') {
        let ext = &e.as_bytes()[pos + 1..];
        if !ext.is_empty()
            && ext.len() <= 8
            && ext[0].is_ascii_alphabetic()
            && ext.iter().all(|c| c.is_ascii_alphanumeric())
        {
            return false;
        }
    }
    true
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{:02x}", b)).collect()
}

pub fn seg_max(v: &str, max: usize) -> String {
    let e = encode_uri_component(v);
    if e.len() <= max && is_portable(&e) {
        e
    } else {
        format!("~sha256-{}", sha256_hex(v.as_bytes()))
    }
}

/// seg() with max 255, from the library (PROTOCOL 6.3).
pub fn seg(v: &str) -> String {
    runspool::protocol::seg::seg(v)
}

/// seg() with max 250 (result-file names), from the library.
pub fn seg250(v: &str) -> String {
    runspool::protocol::seg::seg250(v)
}

/// The PROTOCOL examples hold, and the library agrees with this file's own
/// transcription of 6.3 on a spread of inputs.
pub fn seg_examples_hold() {
    let samples = [
        "call/a+b=",
        "",
        ".",
        "..",
        "CON",
        "con.x",
        "COM1",
        "com0",
        "lpt9.txt",
        "nul.txt",
        "trailing.",
        "s.jsonl",
        "a.b",
        "a.123",
        "a.b12345678",
        "a.abcdefgh",
        "back\\slash",
        "héllo wörld",
        "default",
        "run-0001",
        "~sha",
        "!~*'()",
        "emoji 😀",
        "prn.",
        "aux",
        "auxiliary",
        "x.JSON",
    ];
    for v in samples.iter().map(|s| s.to_string()).chain([
        "x".repeat(250),
        "x".repeat(251),
        "x".repeat(255),
        "x".repeat(256),
        "é".repeat(84),
        "é".repeat(85),
    ]) {
        assert_eq!(seg(&v), seg_max(&v, 255), "seg({v:?})");
        assert_eq!(seg250(&v), seg_max(&v, 250), "seg250({v:?})");
    }
    assert_eq!(seg("call/a+b="), "call%2Fa%2Bb%3D");
    let x255 = "x".repeat(255);
    assert_eq!(seg(&x255), x255);
    for hashed in ["", ".", "CON", "nul.txt", "trailing.", "s.jsonl", &"x".repeat(256)] {
        assert_eq!(seg(hashed), format!("~sha256-{}", sha256_hex(hashed.as_bytes())), "{hashed:?}");
    }
}
