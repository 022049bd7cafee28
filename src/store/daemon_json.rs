//! Reading `runspool/daemon.json` (PROTOCOL §10), the one way every reader
//! (the daemon at start, the CLI, the client core, `runspool providers`)
//! does: bounded, never through a link, and a file that is not the
//! daemon's report reads as none. The daemon writes it (`daemon::report`).

use crate::protocol::daemon::DaemonStatus;
use crate::store::{fsutil, Layout};

/// A larger daemon.json is not read (the real one is about a kilobyte).
pub const MAX_BYTES: u64 = 1024 * 1024;

/// daemon.json as the last daemon wrote it; None when there is none, it is
/// not a regular file, is larger than `MAX_BYTES` or does not parse.
pub fn read(l: &Layout) -> Option<DaemonStatus> {
    let bytes = fsutil::read_nofollow(&l.daemon_json(), MAX_BYTES).ok()?;
    serde_json::from_slice(&bytes).ok()
}
