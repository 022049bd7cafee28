//! The spool (PROTOCOL §2): scan, claim exactly once (`claim`), reject with
//! a reason (`reject`), and a client's withdrawal of a pending request
//! (`withdraw`), and the daemon's part that works the spool off (`intake`).
//! Here: the claim's outcomes, the claimer and the write grace; the rules a
//! client shares with the claim (names, entry checks, file identity, claim
//! ids, rejection, withdrawal) are in `store::spool`.

mod claim;
pub mod intake;

pub use crate::store::spool::claimed::mark_claimed;
/// The rules clients share (names, entry checks, rejection, withdrawal) live in `store::spool`.
pub use crate::store::spool::{check_entry, claim_id, classify_name, reject, republish, same_file, FileId, Name};

use std::io;

use crate::protocol::request::Context;
use crate::protocol::status::Status;
use crate::store::{Layout, RunId, Writer};

/// How long a file that does not parse may still be a writer's work in progress.
const WRITE_GRACE_MS: i64 = 2000;

pub enum Outcome {
    Claimed(RunId, Box<Status>),
    Rejected,
    /// Left in place for a later look (busy, still being written, raced).
    Later,
    /// A capacity error: stop claiming until storage recovers.
    Capacity(io::Error),
    /// Committed (the run directory owns the request) but its queued status
    /// could not be written: the caller finishes the run by its directory
    /// (`finish_half_claim`), never by the spool name, which is gone.
    Unfinished {
        run_id: RunId,
        error: io::Error,
    },
}

pub struct Claimer<'a> {
    pub layout: &'a Layout,
    pub w: &'a mut Writer,
    pub ctx: &'a dyn Context,
    pub grace: &'a mut Grace,
    /// Requests in the spool, for `after` (PROTOCOL §15).
    pub pending: &'a mut crate::store::deps::PendingIds,
}

/// When the daemon first saw each unparsable entry in its current form
/// (device, inode, size, mtime). The 2 s grace for writers still at work
/// runs from the mtime or from that first sighting, whichever is earlier:
/// an mtime in the future (a clock skew, a `touch -d`) cannot keep an
/// unparsable file from its rejection, and the daemon never rereads it
/// twice a second forever.
#[derive(Default)]
pub struct Grace {
    first_seen: std::collections::HashMap<String, (FileId, std::time::Instant)>,
}

impl Grace {
    /// Is the entry `name`, now `id`, still within its grace?
    fn pending(&mut self, name: &str, id: FileId, mtime_ms: i64) -> bool {
        let now = std::time::Instant::now();
        let seen = match self.first_seen.get(name) {
            Some((prev, at)) if *prev == id => *at,
            _ => {
                self.first_seen.insert(name.to_string(), (id, now));
                now
            }
        };
        let by_mtime = crate::now_ms() - mtime_ms < WRITE_GRACE_MS;
        let by_sighting = now.duration_since(seen) < std::time::Duration::from_millis(WRITE_GRACE_MS as u64);
        by_mtime && by_sighting
    }

    fn forget(&mut self, name: &str) {
        self.first_seen.remove(name);
    }

    /// Forget entries no longer in the spool (called with each fresh listing).
    pub fn retain(&mut self, listed: &std::collections::HashSet<&str>) {
        self.first_seen.retain(|n, _| listed.contains(n.as_str()));
    }
}
