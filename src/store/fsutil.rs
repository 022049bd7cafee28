//! Atomic writes, locks and error classification (PROTOCOL §11).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// ENOSPC, EDQUOT, EMFILE, ENFILE: conditions to wait out, never to lose data over.
pub fn is_capacity(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EMFILE) | Some(libc::ENFILE))
}

fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EINTR))
}

/// The retry ladder of §11, in milliseconds.
pub const LADDER_MS: [u64; 9] = [10, 25, 50, 100, 200, 500, 1000, 2000, 4000];

/// The ladder with its total sleep capped by `RUNSPOOL_FS_RETRY_MAX_TOTAL_MS`
/// (same length: later rungs become 0 once the budget is spent).
pub fn ladder(max_total: Option<&str>) -> Result<Vec<u64>, String> {
    let Some(raw) = max_total else { return Ok(LADDER_MS.to_vec()) };
    let budget: u64 = raw.trim().parse().map_err(|_| {
        format!("RUNSPOOL_FS_RETRY_MAX_TOTAL_MS is `{raw}`; set it to a whole number of milliseconds or unset it")
    })?;
    let mut left = budget;
    Ok(LADDER_MS
        .iter()
        .map(|&ms| {
            let s = ms.min(left);
            left -= s;
            s
        })
        .collect())
}

/// Run `f`, retrying EBUSY/EINTR along the ladder.
pub fn retry_transient<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let env = std::env::var("RUNSPOOL_FS_RETRY_MAX_TOTAL_MS").ok();
    let steps = ladder(env.as_deref()).unwrap_or_else(|_| LADDER_MS.to_vec());
    let mut i = 0;
    loop {
        match f() {
            Err(e) if is_transient(&e) && i < steps.len() => {
                std::thread::sleep(Duration::from_millis(steps[i]));
                i += 1;
            }
            r => return r,
        }
    }
}

pub fn mkdir_private(p: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(p) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        r => r,
    }
}

pub fn mkdir_private_all(p: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(p)
}

/// [`write_atomic`] into a directory that is made (0700, with its parents)
/// only when the write finds it missing. Perf: the directories of results,
/// indexes and markers exist after the first run, so each publication saves
/// the `mkdir` (EEXIST) and `stat` calls made before every write.
pub fn write_atomic_mkdir(target: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    match write_atomic(target, bytes, durable) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            target.parent().map_or(Ok(()), mkdir_private_all)?;
            write_atomic(target, bytes, durable)
        }
        r => r,
    }
}

/// fsync a directory. `O_DIRECTORY`: anything else in its place (a FIFO a
/// step planted) fails at once instead of blocking the open.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC).open(dir)?.sync_all()
}

/// A temp name for `target` in its directory, in the form [`sweep_temps`]
/// recognises (so a writer killed before its rename leaves nothing for good).
pub fn temp_name(target: &Path) -> PathBuf {
    let base = target.file_name().map(|b| b.to_string_lossy().into_owned()).unwrap_or_default();
    let tail = format!(".{}.{}.{:08x}.tmp", std::process::id(), crate::now_ms(), uuid::Uuid::new_v4().as_u128() as u32);
    let name = if 1 + base.len() + tail.len() > 255 {
        format!(".{}{}", crate::protocol::seg::sha256_hex(base.as_bytes()), tail)
    } else {
        format!(".{base}{tail}")
    };
    target.with_file_name(name)
}

/// Write `bytes` to `target` atomically: a dot-named temp in the same
/// directory, then rename. `durable` fsyncs the file and the directory.
/// The temp file never survives a failure.
pub fn write_atomic(target: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    write_atomic_mode(target, bytes, durable, 0o600)
}

/// `write_atomic` with the file's mode set to `mode` (whatever the umask)
/// before it appears under its name: for a file another user must read.
pub fn write_atomic_mode(target: &Path, bytes: &[u8], durable: bool, mode: u32) -> io::Result<()> {
    let tmp = temp_name(target);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        if mode != 0o600 {
            use std::os::unix::fs::PermissionsExt as _;
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        }
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
        drop(f);
        retry_transient(|| std::fs::rename(&tmp, target))?;
        if durable {
            if let Some(dir) = target.parent() {
                fsync_dir(dir)?;
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Remove temp files (`.<base>.<pid>.<ms>.<hex>.tmp`) left in `dir` by a
/// writer that was killed mid-write. Temps of live processes other than us
/// are left alone: a runner may be writing right now. A zombie is not live.
pub fn sweep_temps(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    let me = std::process::id();
    let mut removed = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with('.') || !name.ends_with(".tmp") {
            continue;
        }
        let parts: Vec<&str> = name.rsplitn(5, '.').collect(); // tmp, hex, ms, pid, rest
        let Some(pid) = parts.get(3).and_then(|p| p.parse::<u32>().ok()) else { continue };
        // A zombie is a writer that is gone: its parent (a daemon killed
        // meanwhile) may never reap it, and its temp must not stay for that.
        if pid != me && crate::platform::pid_alive(pid) && !crate::platform::is_zombie(pid) {
            continue;
        }
        if std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Run `f` until it stops meeting storage-capacity errors, retrying every
/// second (PROTOCOL §11: a full disk is waited out, never a reason to fail a
/// run) and saying so on stderr once a minute. For the files a runner creates
/// for itself: its lock, its logs, a step's output.
pub fn wait_out_capacity<T>(what: &Path, mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let mut waited = 0u64;
    loop {
        match f() {
            Err(e) if is_capacity(&e) => {
                if waited.is_multiple_of(60) {
                    crate::note!(
                        "{}: {e}; retrying every second until storage recovers ({waited} s so far)",
                        what.display()
                    );
                }
                std::thread::sleep(std::time::Duration::from_secs(1));
                waited += 1;
            }
            r => return r,
        }
    }
}

/// Open (creating 0600) a lock file like [`open_regular`] and take an
/// exclusive flock. `Ok(None)` when `nonblocking` and someone else holds it.
/// A FIFO is accepted here, as it always was: a flock on its inode excludes
/// like any other, and refusing it would let a step that plants one stop its
/// run's status from ever being written (nothing is read or written through a
/// lock, and the open does not block).
pub fn lock(path: &Path, nonblocking: bool) -> io::Result<Option<File>> {
    let opts = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).clone();
    let (f, _) = open_checked(path, &opts, Use::Lock)?;
    if flock(&f, nonblocking)? {
        Ok(Some(f))
    } else {
        Ok(None)
    }
}

/// Exclusive flock (std's `File::lock`, flock(2) on Linux and macOS); false
/// when non-blocking and busy. A blocking wait interrupted by a signal waits on.
pub fn flock(f: &File, nonblocking: bool) -> io::Result<bool> {
    if nonblocking {
        return match f.try_lock() {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        };
    }
    loop {
        match f.lock() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r.map(|()| true),
        }
    }
}

/// Is the lock at `path` held by a live process? Taking it is the only proof
/// of death (PROTOCOL §12): a missing lock file means no runner ever held it.
pub fn lock_held(path: &Path) -> io::Result<bool> {
    // Opened like `lock` opens it, so the two agree; never blocks.
    let f = match open_checked(path, OpenOptions::new().read(true), Use::Lock) {
        Ok((f, _)) => f,
        // A link or directory planted as a lock file is no held lock.
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::InvalidInput) => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(!flock(&f, true)?)
}

/// Open a file in a directory others can write (spool, run directories,
/// their inboxes, step outputs, logs): the one way runspool opens such files.
/// `opts` says the access (read, append, create and its mode); this adds
/// `O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC|O_NOCTTY`, so a symlink is refused and a
/// FIFO or device planted in the file's place never blocks the open. After
/// the open, `fstat` must show a regular file (else `InvalidInput`, naming the
/// path), and blocking mode is restored for the reads and writes that follow.
/// Other open errors keep their errno (`NotFound`, capacity) for the caller.
pub fn open_regular(path: &Path, opts: &OpenOptions) -> io::Result<File> {
    open_checked(path, opts, Use::Write).map(|(f, _)| f)
}

/// What a descriptor from [`open_checked`] is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Use {
    /// A lock: a FIFO is accepted too (see [`lock`]); nothing is read or written through it.
    Lock,
    /// Reading a regular file: `O_NONBLOCK` changes nothing for a regular
    /// file's reads, so it is left set (perf: two fcntl calls fewer per open,
    /// about a hundred per run).
    Read,
    /// Anything else, which may also be handed to a child as its stdout or
    /// stderr: blocking mode restored, so the child sees the usual flags.
    Write,
}

/// [`open_regular`] for `what`, with the file's metadata from its `fstat`.
fn open_checked(path: &Path, opts: &OpenOptions, what: Use) -> io::Result<(File, std::fs::Metadata)> {
    let fifo_ok = what == Use::Lock;
    use std::os::unix::fs::FileTypeExt;
    let mut opts = opts.clone();
    opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY);
    let f = match opts.open(path) {
        Ok(f) => f,
        // ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO without reader or a
        // socket opened for writing; EISDIR: a directory opened for writing.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO | libc::EISDIR)) => {
            return Err(match std::fs::symlink_metadata(path) {
                Ok(md) => not_regular(path, md.file_type()),
                Err(_) => e,
            })
        }
        Err(e) => return Err(e),
    };
    let md = f.metadata()?;
    let kind = md.file_type();
    if !(kind.is_file() || (fifo_ok && kind.is_fifo())) {
        return Err(not_regular(path, kind));
    }
    if what != Use::Write {
        return Ok((f, md));
    }
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((f, md))
}

fn not_regular(path: &Path, kind: std::fs::FileType) -> io::Error {
    use std::os::unix::fs::FileTypeExt;
    let what = if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "of an unknown kind"
    };
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is not a regular file ({what}); runspool only opens regular files here: remove it", path.display()),
    )
}

/// Ok when `dir` is a directory itself, not a symlink to one: a step may
/// turn a run's inbox into a link to any directory of the user's, whose files
/// runspool must then neither read, answer, remove nor write.
pub fn real_dir(dir: &Path) -> io::Result<()> {
    let md = std::fs::symlink_metadata(dir)?;
    if md.is_dir() {
        return Ok(());
    }
    let what = if md.file_type().is_symlink() { "a symbolic link" } else { "not a directory" };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is {what}; runspool does not follow it: remove it", dir.display()),
    ))
}

/// Open for reading through [`open_regular`].
pub fn open_read(path: &Path) -> io::Result<File> {
    open_checked(path, OpenOptions::new().read(true), Use::Read).map(|(f, _)| f)
}

/// Open for appending (created 0600 if missing) through [`open_regular`].
pub fn open_append(path: &Path) -> io::Result<File> {
    open_regular(path, OpenOptions::new().append(true).create(true).mode(0o600))
}

/// Read a small file through [`open_regular`], at most `max` bytes.
pub fn read_nofollow(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let (f, md) = open_checked(path, OpenOptions::new().read(true), Use::Read)?;
    // Perf: sized from the metadata, the read takes two calls instead of one per
    // doubling of the buffer (`take` hides the size from `read_to_end`).
    let mut buf = Vec::with_capacity(md.len().min(max) as usize + 1);
    f.take(max).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Append one line to a file (0600, created if missing) through [`open_regular`].
pub fn append_line(path: &Path, line: &[u8]) -> io::Result<()> {
    let mut f = open_append(path)?;
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend_from_slice(line);
    buf.push(b'\n');
    f.write_all(&buf)
}

/// Create an empty regular file if it is missing (through [`open_regular`]).
pub fn touch(path: &Path) -> io::Result<()> {
    open_regular(path, OpenOptions::new().write(true).create(true).truncate(false).mode(0o600)).map(|_| ())
}

pub fn remove_if_exists(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Why the filesystem under `root` is too full to claim (PROTOCOL §11):
/// free bytes below `min`, no free byte at all (whatever the floor, even
/// 0), or no free inode. None: room enough, or statvfs failed. The daemon
/// and `runspool status`/`doctor` use this one rule.
pub fn space_shortage(root: &Path, min: u64) -> Option<String> {
    match crate::platform::free_space(root) {
        Ok((bytes, _)) if bytes < min => {
            Some(format!("{bytes} bytes free under {}, below storage.min_free_bytes = {min}", root.display()))
        }
        Ok((0, _)) => Some(format!("no free bytes under {}", root.display())),
        Ok((_, 0)) => Some(format!("no free inodes under {}", root.display())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder_unset_is_unchanged() {
        assert_eq!(ladder(None).unwrap(), LADDER_MS.to_vec());
    }
    #[test]
    fn ladder_clamps_total_and_keeps_length() {
        let l = ladder(Some("100")).unwrap();
        assert_eq!(l.len(), LADDER_MS.len());
        assert_eq!(l.iter().sum::<u64>(), 100);
        assert_eq!(&l[..4], &[10, 25, 50, 15]);
    }
    #[test]
    fn ladder_zero_budget() {
        assert_eq!(ladder(Some("0")).unwrap(), vec![0; 9]);
    }
    #[test]
    fn ladder_rejects_bad_values() {
        assert!(ladder(Some("-5")).unwrap_err().contains("RUNSPOOL_FS_RETRY_MAX_TOTAL_MS"));
        assert!(ladder(Some("abc")).is_err());
    }
    #[test]
    fn atomic_write_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.json");
        write_atomic(&p, b"one", true).unwrap();
        write_atomic(&p, b"two", false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        // A failing write (the target is a directory) leaves no temp behind.
        std::fs::create_dir(d.path().join("dir")).unwrap();
        assert!(write_atomic(&d.path().join("dir"), b"x", false).is_err());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
    }
    #[test]
    fn read_nofollow_refuses_fifos_and_symlinks_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read_nofollow(&fifo, 10).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert!(!lock_held(&fifo).unwrap(), "nobody holds the FIFO, and checking it does not block");
        std::fs::write(d.path().join("real"), b"x").unwrap();
        std::os::unix::fs::symlink(d.path().join("real"), d.path().join("link")).unwrap();
        assert!(read_nofollow(&d.path().join("link"), 10).is_err());
        assert_eq!(read_nofollow(&d.path().join("real"), 10).unwrap(), b"x");
    }
    #[test]
    fn open_regular_refuses_everything_but_regular_files_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::fs::create_dir(d.path().join("dir")).unwrap();
        std::os::unix::fs::symlink(d.path().join("real"), d.path().join("link")).unwrap();
        for (name, what) in [("fifo", "a FIFO"), ("dir", "a directory"), ("link", "a symbolic link")] {
            let p = d.path().join(name);
            let results = [append_line(&p, b"x").map(|_| ()), touch(&p), read_nofollow(&p, 10).map(|_| ())];
            for r in results {
                let e = r.unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{name}: {e}");
                assert!(e.to_string().contains(what) && e.to_string().contains(name), "{name}: {e}");
            }
        }
        for name in ["dir", "link"] {
            assert_eq!(lock(&d.path().join(name), true).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        }
        assert!(!d.path().join("real").exists(), "a link is never followed to create its target");
        // A FIFO lock file locks like any other, without blocking the open.
        let held = lock(&fifo, true).unwrap().expect("the FIFO lock is free");
        assert!(lock_held(&fifo).unwrap());
        drop(held);
        // A regular file opens in blocking mode.
        let f = open_append(&d.path().join("real")).unwrap();
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK, 0);
        assert_ne!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC, 0);
    }
    #[test]
    fn long_names_use_a_hashed_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("y".repeat(250));
        write_atomic(&p, b"ok", false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"ok");
    }
}
