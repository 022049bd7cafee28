//! External-job bridge files (PROTOCOL §8): request files, provider handles
//! and failures from arbitrary bytes. Never panics; whatever is accepted
//! respects the §8.2 limits and is accepted again after a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runspool::protocol::bridge::{self, Operation};

const OPS: [Operation; 5] = [Operation::Start, Operation::Status, Operation::Result, Operation::Reattach, Operation::Cancel];

fn no_nul_bounded(s: &str, max_chars: usize) {
    assert!(!s.is_empty() && !s.contains('\0') && s.trim() == s && s.chars().count() <= max_chars, "{s:?}");
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, bytes)) = data.split_first() else { return };
    let op = OPS[sel as usize % OPS.len()];

    if let Ok(h) = bridge::parse_handle(bytes, op) {
        no_nul_bounded(&h.provider_job_id, bridge::MAX_ID);
        if let Some(o) = &h.output {
            assert!(op == Operation::Result && o.len() <= bridge::MAX_OUTPUT && !o.contains('\0'));
        }
        if let Some(p) = &h.artifact_path {
            assert!(op == Operation::Result && p.starts_with('/'));
        }
        let again = serde_json::to_vec(&h).unwrap();
        assert_eq!(bridge::parse_handle(&again, op).expect("an accepted handle is accepted again"), h);
    }

    if let Ok(f) = bridge::parse_failure(bytes) {
        no_nul_bounded(&f.code, bridge::MAX_CODE);
        no_nul_bounded(&f.message, bridge::MAX_MESSAGE);
    }

    // A request file is only valid under its own name: take the stem from the body.
    let stem = serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string))
        .unwrap_or_else(|| "req-1".to_string());
    if let Ok(r) = bridge::parse_request(bytes, &stem, "run-1") {
        assert_eq!(r.id, stem);
        no_nul_bounded(&r.provider, bridge::MAX_ID);
        if r.operation == Operation::Start {
            let s = r.start.as_ref().expect("a valid start carries its input");
            assert!(!s.prompt.contains('\0'));
        }
        let again = serde_json::to_vec(&r).unwrap();
        assert_eq!(bridge::parse_request(&again, &stem, "run-1").expect("an accepted request is accepted again"), r);
    }
});
