//! The storage reserve (docs/watching-and-storage.md): room kept so the
//! daemon can still say `degraded` in daemon.json on a full filesystem.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::store::Layout;

/// Space preallocated in `runspool/storage-reserve` so that the daemon can
/// still write its own `daemon.json` (and say `degraded`) on a filesystem
/// someone else filled to the last byte: released (unlinked, which frees
/// its blocks and its inode) when a daemon.json write meets a capacity
/// error, and what that write left over taken back at once, so spending the
/// reserve gives nobody else room; grown back to full size once there is
/// room again.
pub struct Reserve {
    path: PathBuf,
    /// Bytes allocated now (0: no reserve file).
    size: u64,
    released: bool,
    next_try: Instant,
}

const RESERVE_BYTES: u64 = 64 * 1024;
const RESERVE_RETRY: Duration = Duration::from_secs(10);

impl Reserve {
    pub fn new(l: &Layout) -> Reserve {
        Reserve { path: l.storage_reserve(), size: 0, released: false, next_try: Instant::now() }
    }

    /// Bring the reserve to its full size when it is short (at most every 10 s).
    pub fn ensure(&mut self) {
        if self.size >= RESERVE_BYTES || Instant::now() < self.next_try {
            return;
        }
        match preallocate(&self.path, RESERVE_BYTES, self.size) {
            Ok(()) => {
                self.size = RESERVE_BYTES;
                if std::mem::take(&mut self.released) {
                    tracing::info!(path = %self.path.display(), "storage reserve recreated");
                }
            }
            Err(e) => {
                self.next_try = Instant::now() + RESERVE_RETRY;
                tracing::debug!(path = %self.path.display(), error = %e, "cannot grow the storage reserve yet");
            }
        }
    }

    /// When `ensure` should try again (None: the reserve is whole).
    pub fn next_wake(&self) -> Option<Instant> {
        (self.size < RESERVE_BYTES).then_some(self.next_try)
    }

    /// Give the reserve's space back. True when there was one to give.
    pub fn release(&mut self) -> bool {
        if self.size == 0 {
            return false;
        }
        self.size = 0;
        self.released = true;
        self.next_try = Instant::now() + RESERVE_RETRY;
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                tracing::warn!(path = %self.path.display(), "released the storage reserve to write daemon.json on a full filesystem");
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot release the storage reserve");
                false
            }
        }
    }

    /// Right after a release and the write it made room for: keep what the
    /// write did not use, so the release frees nothing for anyone else.
    pub fn take_back(&mut self) {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        let avail = crate::platform::free_space(dir).map(|(b, _)| b).unwrap_or(0);
        let len = avail.min(RESERVE_BYTES) / 4096 * 4096;
        if len > 0 && preallocate(&self.path, len, 0).is_ok() {
            self.size = len;
        }
    }
}

/// Allocate `len` bytes in the regular file at `path` (created 0600, never
/// through a symlink; an existing one is reused). On failure the file is
/// cut back to `keep` bytes, or removed when `keep` is 0.
fn preallocate(path: &Path, len: u64, keep: u64) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::other(format!("{} is not a regular file; remove it", path.display())));
    }
    let r = allocate(&f, len);
    if r.is_err() {
        if keep == 0 {
            let _ = std::fs::remove_file(path);
        } else {
            let _ = f.set_len(keep);
        }
    }
    r
}

#[cfg(target_os = "linux")]
fn allocate(f: &std::fs::File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    match unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) } {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(not(target_os = "linux"))]
fn allocate(mut f: &std::fs::File, len: u64) -> io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&vec![0u8; len as usize])?;
    f.sync_all()
}
