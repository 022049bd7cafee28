//! seg() (PROTOCOL §6.3) on arbitrary strings: always one safe path segment
//! within its byte limit, deterministic, and an exact encoding when not hashed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runspool::protocol::seg;

fn decode(e: &str) -> Option<Vec<u8>> {
    let b = e.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

fn check(v: &str, s: &str, max: usize) {
    assert!(!s.is_empty() && s.len() <= max, "seg({v:?}) = {s:?} is not within {max} bytes");
    assert!(s != "." && s != "..", "seg({v:?}) = {s:?}");
    assert!(!s.contains('/') && !s.contains('\0') && !s.contains('\\'), "seg({v:?}) = {s:?}");
    assert!(!s.ends_with('.'), "seg({v:?}) = {s:?}");
    // Either the exact encoding (which may itself start with "~sha256-": a value
    // can spell a hash, see regressions/seg/spelled-hash) or the hash of `v`.
    if s == seg::encode_uri_component(v) {
        assert_eq!(decode(s).as_deref(), Some(v.as_bytes()), "seg({v:?}) = {s:?} does not decode back");
        assert!(s.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.!~*'()%".contains(&c)));
    } else {
        assert_eq!(s, format!("~sha256-{}", seg::sha256_hex(v.as_bytes())), "seg({v:?})");
    }
}

fuzz_target!(|data: &[u8]| {
    let v = String::from_utf8_lossy(data);
    let (a, b) = (seg::seg(&v), seg::seg250(&v));
    check(&v, &a, 255);
    check(&v, &b, 250);
    assert_eq!(a, seg::seg(&v), "deterministic");
    assert_eq!(seg::seg_max(&v, 255), a);
    let name = runspool::protocol::status::terminal_marker_name(i64::from(data.len() as u32) - 3, &v);
    assert!(name.len() <= 16 + 1 + 255 + 5 && !name.contains('/'));
});
