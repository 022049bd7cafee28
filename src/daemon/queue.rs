//! Queue control: `<root>/runspool/queue.json`, written by `runspool pause`,
//! `resume` and `max-running` (or any client) and honoured by the daemon
//! (docs/protocol-notes.md, "Queue control"). While `paused`, nothing is
//! claimed from the spool and no queued run starts; running runs go on.
//! `maxRunning` overrides the config's `max_running` until it is cleared.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::store::{fsutil, Layout};

/// Larger files are refused: the real thing is about a hundred bytes.
const MAX_BYTES: u64 = 64 * 1024;
/// A regular file that does not parse may be a client's write in progress
/// (not atomic, or in pieces): left for later while its mtime is under this
/// old *and* this version was first seen under this long ago (so a future
/// mtime cannot keep it waiting), as the spool does (PROTOCOL §2.3 step 4).
const WRITE_GRACE: std::time::Duration = std::time::Duration::from_millis(2000);

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QueueFile {
    pub version: u32,
    #[serde(default)]
    pub paused: bool,
    /// When the queue was paused (ms since the epoch); kept across resumes of other fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Overrides the config's `max_running` (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<usize>,
    #[serde(default)]
    pub updated_at: i64,
}

pub fn path(l: &Layout) -> PathBuf {
    l.daemon_dir().join("queue.json")
}

/// What identifies one version of the file cheaply (one lstat): device,
/// inode, size, mtime and ctime. None: no file.
pub fn identity(p: &Path) -> Option<(u64, u64, u64, i64, i64, i64, i64)> {
    let md = std::fs::symlink_metadata(p).ok()?;
    Some((md.dev(), md.ino(), md.size(), md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec()))
}

/// Read and check the file. Ok(None): no file. Err: a message naming the
/// path and the fix. A symlink, FIFO, directory or device is refused
/// without blocking (`fsutil::read_nofollow`).
pub fn read(p: &Path) -> Result<Option<QueueFile>, String> {
    read_file(p).map_err(|e| match e {
        ReadError::Invalid(m) | ReadError::Io(m) => m,
    })
}

/// Why the file could not be used: `Invalid` until it is changed, `Io`
/// (capacity, a transient error) worth another try.
pub enum ReadError {
    Invalid(String),
    Io(String),
}

/// [`read`], telling an invalid file from a failed read.
pub fn read_file(p: &Path) -> Result<Option<QueueFile>, ReadError> {
    let bytes = match fsutil::read_nofollow(p, MAX_BYTES + 1) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => return Err(ReadError::Invalid(e.to_string())),
        Err(e) => return Err(ReadError::Io(format!("cannot read {}: {e}", p.display()))),
    };
    parse(p, &bytes).map_err(ReadError::Invalid)
}

fn parse(p: &Path, bytes: &[u8]) -> Result<Option<QueueFile>, String> {
    let fix = "fix it with `runspool resume --reset` (which rewrites it) or remove it";
    if bytes.len() as u64 > MAX_BYTES {
        return Err(format!("{} is larger than {MAX_BYTES} bytes; {fix}", p.display()));
    }
    let q: QueueFile =
        serde_json::from_slice(bytes).map_err(|e| format!("{} is not a valid queue file ({e}); {fix}", p.display()))?;
    if q.version != 1 {
        return Err(format!("{}: version {} is not supported (only 1); {fix}", p.display(), q.version));
    }
    if q.max_running == Some(0) {
        return Err(format!("{}: maxRunning must be at least 1; {fix}", p.display()));
    }
    Ok(Some(q))
}

/// Write the file atomically (temp and rename, fsynced), creating `runspool/` if needed.
pub fn write(l: &Layout, q: &QueueFile) -> io::Result<()> {
    let dir = l.daemon_dir();
    fsutil::mkdir_private_all(&dir)?;
    let mut bytes = serde_json::to_vec_pretty(q).map_err(io::Error::other)?;
    bytes.push(b'\n');
    fsutil::write_atomic(&path(l), &bytes, true)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        assert_eq!(read(&path(&l)).unwrap(), None);
        let q = QueueFile { version: 1, paused: true, paused_at: Some(5), max_running: Some(2), ..Default::default() };
        write(&l, &q).unwrap();
        assert_eq!(read(&path(&l)).unwrap(), Some(q));
        std::fs::write(path(&l), br#"{"version":1,"maxRunning":0}"#).unwrap();
        assert!(read(&path(&l)).unwrap_err().contains("at least 1"));
        std::fs::write(path(&l), b"{nope").unwrap();
        let e = read(&path(&l)).unwrap_err();
        assert!(e.contains("queue.json") && e.contains("resume --reset"), "{e}");
        std::fs::remove_file(path(&l)).unwrap();
        nix::unistd::mkfifo(&path(&l), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(read(&path(&l)).unwrap_err().contains("FIFO"));
    }
}
