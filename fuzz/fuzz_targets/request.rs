//! Request parsing and validation (PROTOCOL §2.2) on arbitrary bytes: never
//! panics, and whatever it accepts respects every limit and validates again
//! after a round trip through its own serialization.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runspool::protocol::request::{self, Context, Item};

struct Ctx;
impl Context for Ctx {
    fn provider_configured(&self, name: &str) -> bool {
        name == "slurm"
    }
    // No filesystem: a fixed set of "existing directories".
    fn is_dir(&self, path: &str) -> bool {
        matches!(path, "/" | "/tmp" | "/work")
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() as u64 > request::MAX_REQUEST_BYTES {
        return; // the spool refuses these before reading them
    }
    let Ok(value) = request::parse(data) else { return };
    let Ok(req) = request::validate(data, &value, &Ctx) else { return };
    assert!(request::find_duplicate_key(data).is_none());
    let flat = req.flat_steps();
    assert!((1..=request::MAX_STEPS).contains(&flat.len()));
    if let Some(id) = &req.run_id {
        assert!(runspool::protocol::is_id(id, 128), "accepted runId {id:?}");
        assert!(!id.contains('/') && id != "." && id != "..");
    }
    assert!(req.cwd.starts_with('/'));
    assert!(req.timeout() >= 1 && req.timeout() <= request::MAX_TIMEOUT_MS);
    assert!((-1000..=1000).contains(&req.priority));
    for item in &req.steps {
        if let Item::Parallel(p) = item {
            assert!(!p.parallel.is_empty());
            assert!(p.concurrency.map_or(true, |c| (1..=64).contains(&c)));
        }
    }
    for (i, s) in flat.iter().enumerate() {
        assert!(s.command.is_some() != s.external_job.is_some());
        if let Some(c) = &s.command {
            assert!(!c.is_empty() && c.len() <= 4096 && !c[0].is_empty());
            assert!(c.iter().all(|a| !a.contains('\0')));
        }
        assert!(s.label(i).len() <= 4096 * 4 + 16);
    }
    // What the daemon accepted, re-serialized, is accepted again and means the same.
    let again = serde_json::to_vec(&req).expect("serialize an accepted request");
    let v2 = request::parse(&again).expect("re-parse");
    let req2 = request::validate(&again, &v2, &Ctx).expect("an accepted request validates again");
    assert_eq!(req2.mode(), req.mode());
    assert_eq!(req2.flat_steps().len(), flat.len());
    assert_eq!(req2.session(), req.session());
});
