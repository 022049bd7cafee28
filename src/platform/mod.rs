//! What differs between Linux and macOS: process identity, no-replace rename,
//! process-group membership; `procs`: keeping a run's processes contained;
//! `child`: the one child supervisor (process groups, signals, the kill ladder);
//! `sdnotify`: the service manager's notify socket and watchdog;
//! `forkserver` (Linux): runners forked from one server instead of exec'd.

pub mod child;
pub mod exec;
#[cfg(target_os = "linux")]
pub mod forkserver;
pub mod procs;
pub mod sdnotify;
pub mod watch;

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// A token that differs between two processes that had the same pid:
/// `linux:<starttime ticks>` from /proc/<pid>/stat field 22.
pub fn start_identity(pid: u32) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        // Perf: one read into a buffer that fits (procfs reports a size of 0).
        let mut stat = String::with_capacity(1024);
        std::io::Read::read_to_string(&mut std::fs::File::open(format!("/proc/{pid}/stat")).ok()?, &mut stat).ok()?;
        // The command name may contain spaces and parentheses: fields start after the last ')'.
        let rest = &stat[stat.rfind(')')? + 2..];
        let ticks = rest.split(' ').nth(19)?;
        Some(format!("linux:{ticks}"))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        None
    }
}

/// Is `pid` a zombie (exited, not yet reaped)? It then runs nothing and
/// needs no signal. False where it cannot be told (no /proc).
pub fn is_zombie(pid: u32) -> bool {
    #[cfg(target_os = "linux")]
    {
        procs::stat(pid).is_some_and(|s| s.state == 'Z')
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        false
    }
}

pub fn hostname() -> String {
    nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".to_string())
}

/// Is a process with this pid alive (or a zombie)?
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => true,
        Err(_) => false,
    }
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// rename(2) that fails with EEXIST instead of replacing the target.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (a, b) = (cstr(from)?, cstr(to)?);
    #[cfg(target_os = "linux")]
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_NOREPLACE) };
    #[cfg(target_os = "macos")]
    let rc = unsafe { libc::renamex_np(a.as_ptr(), b.as_ptr(), libc::RENAME_EXCL) };
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    let rc = {
        // Elsewhere: link + unlink gives the same no-replace guarantee for files.
        let r = unsafe { libc::link(a.as_ptr(), b.as_ptr()) };
        if r == 0 {
            unsafe { libc::unlink(a.as_ptr()) }
        } else {
            r
        }
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // Filesystems without the flag (FUSE, some network filesystems):
        // link + unlink fails on an existing target just the same.
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => {
            if unsafe { libc::link(a.as_ptr(), b.as_ptr()) } == 0 {
                return if unsafe { libc::unlink(a.as_ptr()) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) };
            }
            let le = io::Error::last_os_error();
            if le.raw_os_error() == Some(libc::EEXIST) {
                return Err(le);
            }
            // No hard links either: check, then rename. Only the daemon renames
            // into run and rejected directories, so nobody races the check.
            if std::fs::symlink_metadata(to).is_ok() {
                return Err(io::Error::from_raw_os_error(libc::EEXIST));
            }
            std::fs::rename(from, to)
        }
        _ => Err(e),
    }
}

/// Pids whose process group is `pgid` and whose environment carries
/// `RUNSPOOL_RUN_ID=<run_id>`: the only processes a repair may kill, so a
/// reused pid or group id never hits a stranger.
pub fn run_processes_in_group(pgid: u32, run_id: &str) -> Vec<u32> {
    let mut out = Vec::new();
    #[cfg(target_os = "linux")]
    {
        let needle = format!("RUNSPOOL_RUN_ID={run_id}");
        let Ok(dir) = std::fs::read_dir("/proc") else { return out };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            let Some(close) = stat.rfind(')') else { continue };
            // Fields after ')': state ppid pgrp ...
            let pgrp = stat[close + 2..].split(' ').nth(2).and_then(|s| s.parse::<u32>().ok());
            if pgrp != Some(pgid) {
                continue;
            }
            if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
                if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) {
                    out.push(pid);
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        // Without /proc the group leader's existence is the best evidence there is.
        let _ = run_id;
        if pid_alive(pgid) {
            out.push(pgid);
        }
    }
    out
}

/// Free bytes and free inodes available to us under `path`.
pub fn free_space(path: &Path) -> io::Result<(u64, u64)> {
    let s = nix::sys::statvfs::statvfs(path).map_err(io::Error::from)?;
    let bytes = (s.blocks_available() as u64).saturating_mul(s.fragment_size() as u64);
    // btrfs and others allocate inodes dynamically and report 0 total and 0
    // free: that means "no limit", not "none left".
    let files = if s.files() == 0 { u64::MAX } else { s.files_available() as u64 };
    Ok((bytes, files))
}

pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig).map(|s| s.as_str().to_string()).unwrap_or_else(|_| format!("SIG{sig}"))
}

/// Close every descriptor above 2 this process inherited (a shell's stray
/// pipe, a jobserver, socket-activation descriptors), so that none is held
/// open by us or reaches a runner, step, hook or provider. Call it first
/// thing, before the process opens anything of its own; everything runspool
/// opens afterwards is close-on-exec (std's default, `fsutil::open_regular`).
pub fn close_inherited_fds() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: close_range(2) takes plain integers; nothing of ours is open yet.
        if unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) } == 0 {
            return;
        }
    }
    // Older kernels (close_range is Linux 5.9) and macOS: list what is open.
    let dir = if Path::new("/proc/self/fd").is_dir() { "/proc/self/fd" } else { "/dev/fd" };
    let listed: Vec<i32> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).filter(|&fd| fd > 2).collect(),
        Err(_) => {
            // SAFETY: getrlimit writes into the struct we pass.
            let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            let max = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 { rl.rlim_cur } else { 1024 };
            (3..max.min(65_536) as i32).collect()
        }
    };
    // The listing's own descriptor is closed by now; closing it again is a harmless EBADF.
    for fd in listed {
        // SAFETY: closing descriptors we inherited and do not use.
        unsafe { libc::close(fd) };
    }
}

/// Does the filesystem holding `path` keep a file's inode number for as long
/// as the file exists? FUSE, SMB/CIFS (with `noserverino`), 9p and vboxsf may
/// number the same file differently from one lookup to the next; every local
/// filesystem (ext4, xfs, btrfs, tmpfs, ...) does not. Decided from statfs's
/// filesystem type; an unknown answer counts as stable, the strict choice
/// (identity then rests on device and inode alone).
pub fn inode_numbers_stable(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        // fuse, smb, smb2, cifs, 9p, vboxsf
        const UNSTABLE: [u64; 6] = [0x6573_5546, 0x517B, 0xFE53_4D42, 0xFF53_4D42, 0x0102_1997, 0x786F_4256];
        match nix::sys::statfs::statfs(path) {
            Ok(s) => !UNSTABLE.contains(&(s.filesystem_type().0 as u64)),
            Err(_) => true,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        match nix::sys::statfs::statfs(path) {
            Ok(s) => {
                let name = s.filesystem_type_name();
                !(name.contains("fuse") || name == "smbfs" || name == "webdav" || name == "vboxsf")
            }
            Err(_) => true,
        }
    }
}

/// Variables that belong to the service manager and must not leak into
/// runners, steps, hooks or providers: what systemd.exec(5) sets for the
/// daemon's own service (its invocation, its manager, its notification and
/// watchdog, passed sockets and stored descriptors, memory-pressure
/// watch, credentials, the unit that triggered it) describes the daemon's
/// unit, not a step's; a step reading them would act on runspool's unit.
pub const SCRUBBED_ENV: &[&str] = &[
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "JOURNAL_STREAM",
    "INVOCATION_ID",
    "SYSTEMD_EXEC_PID",
    "MANAGERPID",
    "MEMORY_PRESSURE_WATCH",
    "MEMORY_PRESSURE_WRITE",
    "CREDENTIALS_DIRECTORY",
    "FDSTORE",
    "TRIGGER_UNIT",
    "TRIGGER_PATH",
    "TRIGGER_TIMER_REALTIME_USEC",
    "TRIGGER_TIMER_MONOTONIC_USEC",
];

/// Inotify limits and this user's current use (instances and watches),
/// counted from /proc like `inotify-info` does.
pub fn inotify_usage() -> Option<crate::protocol::daemon::InotifyUsage> {
    #[cfg(target_os = "linux")]
    {
        let lim =
            |n: &str| std::fs::read_to_string(format!("/proc/sys/fs/inotify/{n}")).ok()?.trim().parse::<u64>().ok();
        let uid = nix::unistd::getuid().as_raw();
        let (mut instances, mut watches) = (0u64, 0u64);
        for p in std::fs::read_dir("/proc").ok()?.flatten() {
            use std::os::unix::fs::MetadataExt;
            if p.metadata().map(|m| m.uid() != uid).unwrap_or(true) {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else { continue };
            for fd in fds.flatten() {
                if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify") {
                    instances += 1;
                    let info = p.path().join("fdinfo").join(fd.file_name());
                    watches += std::fs::read_to_string(info)
                        .map(|t| t.lines().filter(|l| l.starts_with("inotify wd:")).count() as u64)
                        .unwrap_or(0);
                }
            }
        }
        Some(crate::protocol::daemon::InotifyUsage {
            max_user_instances: lim("max_user_instances"),
            max_user_watches: lim("max_user_watches"),
            max_queued_events: lim("max_queued_events"),
            instances,
            watches,
        })
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// Hand the heap memory freed by the program back to the system: glibc
/// keeps it in its arenas (one per thread that allocated) otherwise, so a
/// daemon that drained a backlog of 20,000 runs stayed as large as at its
/// peak. A no-op where the allocator is not glibc's.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Does a file event say that something changed? notify 8's inotify backend
/// also reports opens and closes without a write (IN_OPEN, IN_CLOSE_NOWRITE),
/// with no switch to turn them off: a watcher that lists a directory on every
/// event would wake itself forever (its own listing opens the directory).
/// Only changes, and the close of a file written in place, wake the daemon
/// and the runner.
pub fn is_change(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind, RenameMode};

    #[test]
    fn only_changes_wake() {
        assert!(!super::is_change(&EventKind::Access(AccessKind::Open(AccessMode::Any))));
        assert!(!super::is_change(&EventKind::Access(AccessKind::Close(AccessMode::Read))));
        assert!(!super::is_change(&EventKind::Access(AccessKind::Read)));
        assert!(super::is_change(&EventKind::Access(AccessKind::Close(AccessMode::Write))));
        assert!(super::is_change(&EventKind::Create(CreateKind::File)));
        assert!(super::is_change(&EventKind::Modify(ModifyKind::Name(RenameMode::To))));
        assert!(super::is_change(&EventKind::Any));
    }
}
