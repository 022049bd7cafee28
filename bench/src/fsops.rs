//! File operations of the benchmark and of its reference pipeline.
//!
//! The reference opens, locks and writes files exactly as runspool's store
//! does (`O_NOFOLLOW|O_NONBLOCK`, a regular-file check, temp + rename, the
//! same fsyncs), so that the two pipelines pay the same price per file and
//! the ratios compare what the pipelines do, not how they call the OS.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

pub fn mkdirs(p: &Path) -> io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(p)
}

/// Create or truncate a 0600 file with `bytes` (not atomic: for fixtures).
pub fn write_private(p: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(p)?;
    f.write_all(bytes)
}

/// fsync a directory.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC).open(dir)?.sync_all()
}

/// A dot-named temp beside `target`, unique across processes (PROTOCOL's temp shape).
fn temp_name(target: &Path) -> PathBuf {
    let base = target.file_name().map(|b| b.to_string_lossy().into_owned()).unwrap_or_default();
    let rand = uuid::Uuid::new_v4().as_u128() as u32;
    target.with_file_name(format!(".{base}.{}.{}.{rand:08x}.tmp", std::process::id(), now_ms()))
}

/// Write `bytes` to `target` atomically: temp then rename; `durable` fsyncs
/// the file and its directory. The temp never survives a failure.
pub fn write_atomic(target: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let tmp = temp_name(target);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
        drop(f);
        rename_retrying(&tmp, target)?;
        if durable {
            if let Some(dir) = target.parent() {
                fsync_dir(dir)?;
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// rename(2), retrying EBUSY/EINTR along PROTOCOL §11's ladder.
fn rename_retrying(from: &Path, to: &Path) -> io::Result<()> {
    const LADDER_MS: [u64; 9] = [10, 25, 50, 100, 200, 500, 1000, 2000, 4000];
    let mut rungs = LADDER_MS.iter();
    loop {
        match fs::rename(from, to) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => match rungs.next() {
                Some(ms) => std::thread::sleep(Duration::from_millis(*ms)),
                None => return Err(e),
            },
            r => return r,
        }
    }
}

/// Open as runspool opens files in directories others can write: no
/// symlinks, a FIFO never blocks the open, then a regular file (or a FIFO
/// when `fifo_ok`, for locks) in blocking mode.
fn open_checked(path: &Path, opts: &OpenOptions, fifo_ok: bool) -> io::Result<File> {
    use std::os::unix::fs::FileTypeExt;
    let mut opts = opts.clone();
    opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY);
    let f = opts.open(path)?;
    let kind = f.metadata()?.file_type();
    if !(kind.is_file() || (fifo_ok && kind.is_fifo())) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file; remove it", path.display()),
        ));
    }
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// Exclusive flock; false when non-blocking and busy.
pub fn flock(f: &File, nonblocking: bool) -> io::Result<bool> {
    let op = libc::LOCK_EX | if nonblocking { libc::LOCK_NB } else { 0 };
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// Open (creating 0600) a lock file and take an exclusive flock; `Ok(None)`
/// when `nonblocking` and someone else holds it.
pub fn lock(path: &Path, nonblocking: bool) -> io::Result<Option<File>> {
    let opts = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).clone();
    let f = open_checked(path, &opts, true)?;
    Ok(flock(&f, nonblocking)?.then_some(f))
}

/// Append one line to a file (0600, created if missing).
pub fn append_line(path: &Path, line: &[u8]) -> io::Result<()> {
    let mut f = open_checked(path, OpenOptions::new().append(true).create(true).mode(0o600), false)?;
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend_from_slice(line);
    buf.push(b'\n');
    f.write_all(&buf)
}

/// Create an empty regular file if it is missing.
pub fn touch(path: &Path) -> io::Result<()> {
    open_checked(path, OpenOptions::new().write(true).create(true).truncate(false).mode(0o600), false).map(|_| ())
}

/// Does a file event say something changed? notify 8 also reports opens and
/// read-only closes, so a watcher woken by them would wake itself forever
/// by its own listing (and starve the pipeline it measures on a small
/// machine). The same rule as runspool's `platform::is_change`; the bench
/// does not link the library.
pub fn is_change(r: &notify::Result<notify::Event>) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match r {
        Ok(ev) => match ev.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Access(_) => false,
            _ => true,
        },
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_leaves_no_temp_and_lock_excludes() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("status.json");
        write_atomic(&target, b"{}", true).unwrap();
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("status.json")]);
        let lock_path = dir.path().join("runner.lock");
        let held = lock(&lock_path, true).unwrap().expect("a free lock");
        assert!(lock(&lock_path, true).unwrap().is_none(), "a held lock must not be taken twice");
        drop(held);
        assert!(lock(&lock_path, true).unwrap().is_some());
    }
}
