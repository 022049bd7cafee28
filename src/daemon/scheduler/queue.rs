//! Queue control: `<root>/runspool/queue.json`, written by `runspool pause`,
//! `resume` and `max-running` (or any client) and honoured by the daemon
//! (docs/protocol-notes.md, "Queue control"). While `paused`, nothing is
//! claimed from the spool and no queued run starts; running runs go on.
//! `maxRunning` overrides the config's `max_running` until it is cleared.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::store::Layout;

use crate::store::queue::{identity, path, read_file, QueueFile, ReadError};

/// A regular file that does not parse may be a client's write in progress
/// (not atomic, or in pieces): left for later while its mtime is under this
/// old *and* this version was first seen under this long ago (so a future
/// mtime cannot keep it waiting), as the spool does (PROTOCOL §2.3 step 4).
const WRITE_GRACE: std::time::Duration = std::time::Duration::from_millis(2000);

/// The daemon's view of the queue file: what applies now (pause, the
/// `maxRunning` override) and what identifies the version it was read from.
/// An invalid or hostile file (FIFO, symlink, garbage) is logged once per
/// version (size and mtime) with the path and the fix and ignored: no
/// pause, no override. A regular file that does not parse is first given
/// `WRITE_GRACE` to be finished, keeping what applied before, unlogged.
#[derive(Default)]
pub struct Control {
    identity: Option<(u64, u64, u64, i64, i64, i64, i64)>,
    file: Option<QueueFile>,
    /// Why the file present is ignored.
    error: Option<String>,
    /// When this daemon saw the pause, for a file without `pausedAt`.
    seen_paused_at: Option<i64>,
    /// The invalid version (size, mtime) in its write grace, and since when.
    unfinished: Option<((u64, i64, i64), std::time::Instant)>,
    /// The invalid version (size, mtime) last warned about.
    warned: Option<(u64, i64, i64)>,
}

impl Control {
    pub fn paused(&self) -> bool {
        self.file.as_ref().is_some_and(|q| q.paused)
    }

    /// The file's `maxRunning` when set, else `configured` (the config's `max_running`).
    pub fn max_running(&self, configured: usize) -> usize {
        self.overriding().unwrap_or(configured)
    }

    /// The file's `maxRunning`, which overrides the config's until cleared.
    pub fn overriding(&self) -> Option<usize> {
        self.file.as_ref().and_then(|q| q.max_running)
    }

    /// daemon.json's `queue` object.
    pub fn info(&self, configured: usize) -> crate::protocol::daemon::QueueInfo {
        let q = self.file.as_ref();
        let paused = self.paused();
        crate::protocol::daemon::QueueInfo {
            paused,
            since: paused.then(|| q.and_then(|q| q.paused_at).or(self.seen_paused_at)).flatten(),
            reason: q.filter(|_| paused).and_then(|q| q.reason.clone()),
            max_running: self.max_running(configured),
            max_running_override: self.overriding(),
            error: self.error.clone(),
            ..Default::default()
        }
    }

    /// When an unfinished file's write grace ends: look at it again then.
    pub fn next_wake(&self) -> Option<std::time::Instant> {
        self.unfinished.map(|(_, since)| since + WRITE_GRACE)
    }

    /// Is this invalid version still in its write grace? A regular file
    /// whose mtime and first sighting are both under `WRITE_GRACE` old.
    fn in_write_grace(&mut self, path: &Path) -> bool {
        let Ok(md) = std::fs::symlink_metadata(path) else { return false };
        if !md.is_file() {
            return false; // a FIFO, symlink or directory is no write in progress
        }
        let version = (md.size(), md.mtime(), md.mtime_nsec());
        let now = std::time::Instant::now();
        let since = match self.unfinished {
            Some((v, t)) if v == version => t,
            _ => now,
        };
        self.unfinished = Some((version, since));
        let age_ms = crate::now_ms() - (md.mtime() * 1000 + md.mtime_nsec() / 1_000_000);
        age_ms < WRITE_GRACE.as_millis() as i64 && now.duration_since(since) < WRITE_GRACE
    }

    /// Re-read the file when it changed (one lstat when it did not). True
    /// when the queue was resumed: what waits in the spool is claimed now.
    pub fn check(&mut self, l: &Layout, configured: usize) -> bool {
        let path = path(l);
        let identity = identity(&path);
        if identity.is_some() && identity == self.identity {
            return false;
        }
        if identity.is_none() && self.identity.is_none() && self.file.is_none() && self.error.is_none() {
            return false;
        }
        let (was_paused, was_max) = (self.paused(), self.max_running(configured));
        let (file, error) = match read_file(&path) {
            Ok(f) => {
                (self.unfinished, self.warned) = (None, None);
                (f, None)
            }
            Err(ReadError::Invalid(_)) if self.in_write_grace(&path) => {
                // Keep what applies; the identity stays unrecorded, so it is read again.
                return false;
            }
            Err(ReadError::Invalid(e)) => {
                self.unfinished = None;
                let version = identity.map(|i| (i.2, i.3, i.4));
                if self.warned != version || version.is_none() {
                    tracing::warn!(queue = %path.display(), "queue file ignored (not paused, config max_running): {e}");
                    self.warned = version;
                }
                (None, Some(e))
            }
            Err(ReadError::Io(e)) => {
                // Keep what applies; the identity stays unrecorded, so the next turn tries again.
                tracing::warn!(queue = %path.display(), "{e}; keeping the current queue control and retrying");
                return false;
            }
        };
        (self.identity, self.file, self.error) = (identity, file, error);
        let paused = self.paused();
        if self.max_running(configured) != was_max {
            tracing::info!(queue = %path.display(), "max_running is now {} (was {was_max})", self.max_running(configured));
        }
        if paused && !was_paused {
            self.seen_paused_at = Some(crate::now_ms());
            let reason = self.file.as_ref().and_then(|q| q.reason.clone()).unwrap_or_default();
            tracing::info!(queue = %path.display(), reason = %reason, "queue paused: nothing is claimed or started until `runspool resume`");
        } else if !paused && was_paused {
            self.seen_paused_at = None;
            tracing::info!(queue = %path.display(), "queue resumed: claiming and starting again");
            return true;
        }
        false
    }
}
