//! The queue file `<root>/runspool/queue.json` (docs/protocol-notes.md,
//! "Queue control"): its format, reading it the way a file any client can
//! replace is read, and writing it. The daemon honours it (`daemon::queue`);
//! `runspool pause`, `resume` and `max-running` (or any client) write it.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::store::{fsutil, Layout};

/// Larger files are refused: the real thing is about a hundred bytes.
const MAX_BYTES: u64 = 64 * 1024;
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
    l.queue_json()
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
