//! What became of a run another run waits for (`after`, PROTOCOL §15): a
//! run (of runspool's or another host's, read-only), a request still in
//! the spool, or nothing at all. Shared by the claim (`unknown-dependency`)
//! and the scheduler (when may a dependent start, or must it fail).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

use serde::Deserialize;

use crate::protocol::request::MAX_REQUEST_BYTES;
use crate::protocol::status::State;
use crate::store::fsutil;
use crate::store::{run, Layout, RunId};

/// Where a dependency stands.
#[derive(Debug, Clone, PartialEq)]
pub enum Dep {
    /// A run in an active state, or one being claimed: not ended.
    Active,
    /// A run in a terminal state.
    Ended(State),
    /// A request in the spool that will become this run: not ended.
    Pending,
    /// A run directory whose status cannot be read (it does not parse, or is
    /// not its directory's own): not ended, as far as anyone can tell.
    Unreadable(String),
    /// Neither a run nor a request in the spool.
    Gone,
}

/// The run ids of the requests in the spool, by their file names
/// (`submit` names a request `<runId>.json`) and by the `runId` in their
/// bodies, read again only when the spool directory changed since.
#[derive(Default)]
pub struct PendingIds {
    stamp: Option<(i64, i64, u64)>,
    ids: HashSet<String>,
}

impl PendingIds {
    /// Is a request for run `id` waiting in the spool?
    pub fn contains(&mut self, layout: &Layout, id: &str) -> bool {
        let spool = layout.spool();
        let named = spool.join(format!("{id}.json"));
        if std::fs::symlink_metadata(&named).is_ok_and(|m| m.is_file()) {
            return true;
        }
        let Ok(md) = std::fs::symlink_metadata(&spool) else { return false };
        let stamp = (md.mtime(), md.mtime_nsec(), md.ino());
        if self.stamp != Some(stamp) {
            self.ids = body_run_ids(&spool);
            self.stamp = Some(stamp);
        }
        self.ids.contains(id)
    }
}

/// The `runId`s in the bodies of the spool's request files. The spool is
/// anyone's to write: nothing is followed, and no FIFO waited on.
fn body_run_ids(spool: &std::path::Path) -> HashSet<String> {
    #[derive(Deserialize)]
    struct Head {
        #[serde(rename = "runId")]
        run_id: Option<serde_json::Value>,
    }
    let Ok(rd) = std::fs::read_dir(spool) else { return HashSet::new() };
    rd.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && n.ends_with(".json"))
        .filter_map(|n| fsutil::read_nofollow(&spool.join(n), MAX_REQUEST_BYTES).ok())
        .filter_map(|b| serde_json::from_slice::<Head>(&b).ok())
        .filter_map(|h| h.run_id.and_then(|v| v.as_str().map(String::from)))
        .collect()
}

/// Where dependency `id` stands now.
pub fn look(layout: &Layout, id: &RunId, pending: &mut PendingIds) -> Dep {
    let dir = layout.run_dir(id);
    if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
        match run::read_status(&dir) {
            Ok(Some(s)) if s.state.is_active() => return Dep::Active,
            Ok(Some(s)) => return Dep::Ended(s.state),
            // Claimed, its queued status not yet written.
            Ok(None) if run::claimed(&dir) => return Dep::Active,
            Ok(None) => {}
            Err(e) => return Dep::Unreadable(e.to_string()),
        }
    }
    if pending.contains(layout, id.as_str()) {
        Dep::Pending
    } else {
        Dep::Gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::layout::RunPaths;

    #[test]
    fn a_dependency_is_a_run_a_pending_request_or_gone() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        for dir in l.dirs() {
            std::fs::create_dir_all(dir).unwrap();
        }
        let mut p = PendingIds::default();
        let id = |s: &str| RunId::parse(s).unwrap();
        assert_eq!(look(&l, &id("nobody"), &mut p), Dep::Gone);
        std::fs::write(l.spool().join("named.json"), b"{}").unwrap();
        assert_eq!(look(&l, &id("named"), &mut p), Dep::Pending);
        std::fs::write(l.spool().join("other.json"), br#"{"version":1,"runId":"in-body"}"#).unwrap();
        assert_eq!(look(&l, &id("in-body"), &mut p), Dep::Pending);
        std::fs::remove_file(l.spool().join("other.json")).unwrap();
        assert_eq!(look(&l, &id("in-body"), &mut p), Dep::Gone, "the cache follows the spool");
        let run = l.run_dir(&id("done"));
        std::fs::create_dir_all(&run).unwrap();
        let status = serde_json::json!({"runId": "done", "mode": "single", "state": "failed", "startedAt": 1});
        std::fs::write(RunPaths::status(&run), status.to_string()).unwrap();
        assert_eq!(look(&l, &id("done"), &mut p), Dep::Ended(State::Failed));
        let copy = l.run_dir(&id("copy"));
        std::fs::create_dir_all(&copy).unwrap();
        std::fs::write(RunPaths::status(&copy), status.to_string()).unwrap();
        assert!(matches!(look(&l, &id("copy"), &mut p), Dep::Unreadable(_)), "another run's status is no answer");
    }
}
