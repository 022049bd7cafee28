//! Processes: liveness through /proc, killing everything that belongs to a
//! test root, spawning a freshly copied binary, memory use, and whether the
//! tests run as root.

use std::collections::HashSet;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use super::read_json;

/// True when `pid` exists and is not a zombie.
pub fn process_alive(pid: i64) -> bool {
    if pid <= 0 {
        return false;
    }
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return e.raw_os_error() != Some(libc::ESRCH);
    }
    match fs::read_to_string(format!("/proc/{}/stat", pid)) {
        Ok(s) => {
            // state is the field after the ")" closing the comm
            match s.rfind(')') {
                Some(p) => !s[p + 1..].trim_start().starts_with('Z'),
                None => true,
            }
        }
        Err(_) => false,
    }
}

/// True when any live (non-zombie) process has process group `pgid`.
pub fn process_group_alive(pgid: i64) -> bool {
    if pgid <= 0 {
        return false;
    }
    let Ok(rd) = fs::read_dir("/proc") else { return false };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
        if let Ok(s) = fs::read_to_string(format!("/proc/{}/stat", pid)) {
            if let Some(p) = s.rfind(')') {
                let fields: Vec<&str> = s[p + 1..].split_whitespace().collect();
                // fields[0]=state, [1]=ppid, [2]=pgrp
                if fields.len() > 2 && fields[0] != "Z" && fields[2].parse::<i64>().ok() == Some(pgid) {
                    return true;
                }
            }
        }
    }
    false
}

fn proc_mentions(pid: i64, needle: &[u8]) -> bool {
    let contains = |hay: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    if let Ok(c) = fs::read(format!("/proc/{}/cmdline", pid)) {
        if contains(&c) {
            return true;
        }
    }
    if let Ok(c) = fs::read(format!("/proc/{}/environ", pid)) {
        if contains(&c) {
            return true;
        }
    }
    false
}

/// Kill every process that belongs to `root`: pids named by status.json files
/// (runner pid, step pids, verified through /proc), and any process whose
/// command line or environment mentions the root path.
pub fn kill_root_processes(root: &Path, extra_needle: &Path) {
    let me = std::process::id() as i64;
    let needle = root.as_os_str().as_bytes().to_vec();
    let needle2 = extra_needle.as_os_str().as_bytes().to_vec();
    for _pass in 0..4 {
        let mut targets: HashSet<i64> = HashSet::new();
        // status.json pids
        let runs = root.join("async-subagent-runs");
        if let Ok(rd) = fs::read_dir(&runs) {
            for e in rd.flatten() {
                if let Some(st) = read_json(&e.path().join("status.json")) {
                    let mut pids = vec![];
                    pids.push(st["pid"].as_i64().unwrap_or(0));
                    pids.push(st["runner"]["pid"].as_i64().unwrap_or(0));
                    if let Some(steps) = st["steps"].as_array() {
                        for s in steps {
                            pids.push(s["pid"].as_i64().unwrap_or(0));
                        }
                    }
                    for p in pids {
                        if p > 1 && p != me && (proc_mentions(p, &needle) || proc_mentions(p, &needle2)) {
                            targets.insert(p);
                        }
                    }
                }
            }
        }
        // /proc scan
        if let Ok(rd) = fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
                if pid <= 1 || pid == me {
                    continue;
                }
                if proc_mentions(pid, &needle) || proc_mentions(pid, &needle2) {
                    targets.insert(pid);
                }
            }
        }
        if targets.is_empty() {
            return;
        }
        for p in &targets {
            unsafe {
                // its process group / session (runners are session leaders, steps group leaders)
                let pg = libc::getpgid(*p as libc::pid_t);
                if pg == *p as libc::pid_t {
                    libc::killpg(pg, libc::SIGKILL);
                }
                libc::kill(*p as libc::pid_t, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Spawn, retrying ETXTBSY: a binary copied moments ago may still be open for
/// writing in a child that another test thread forked and has not exec'd yet.
pub fn spawn_retrying_busy(cmd: &mut Command) -> Child {
    let mut tries = 0;
    loop {
        match cmd.spawn() {
            Ok(c) => return c,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("spawn {:?}: {}", cmd.get_program(), e),
        }
    }
}

/// Peak and current resident set size of a process in KiB (VmHWM, VmRSS).
pub fn proc_rss_kib(pid: i64) -> Option<(u64, u64)> {
    let s = fs::read_to_string(format!("/proc/{}/status", pid)).ok()?;
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// The `MachineLock` of the tests that create and remove things under
/// `/run/systemd`: journald.rs starts a journald (creating `/run/systemd/journal`
/// and `/run/systemd/system` when missing, removing them after), and
/// systemd_user.rs's user manager needs `/run/systemd/system` and compares
/// `doctor`'s journald line. Sharing one test process, they must not overlap.
pub const RUN_SYSTEMD_LOCK: &str = "runspool-run-systemd-test.lock";

/// An exclusive lock shared by every test thread and checkout on this machine
/// (one journald starter, one systemd user manager at a time), held until
/// drop. Its file, `<temp dir>/<name>`, is removed as the lock is let go, so
/// no run leaves it behind; a waiter that then wins the lock on the removed
/// file sees that the path no longer names it and locks the path anew.
pub struct MachineLock {
    path: std::path::PathBuf,
    _file: fs::File,
}

impl MachineLock {
    pub fn acquire(name: &str, timeout: Duration) -> MachineLock {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        use std::os::unix::io::AsRawFd;
        let path = std::env::temp_dir().join(name);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let file = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&path)
                .unwrap_or_else(|e| panic!("cannot open the lock file {}: {e}", path.display()));
            while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{} is still locked after {timeout:?}: another test run holds it",
                    path.display()
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            let held = file.metadata().unwrap();
            if fs::symlink_metadata(&path).is_ok_and(|m| m.dev() == held.dev() && m.ino() == held.ino()) {
                return MachineLock { path, _file: file };
            }
        }
    }
}

impl Drop for MachineLock {
    fn drop(&mut self) {
        // Removed while still locked; the lock goes when the file closes, after this.
        let _ = fs::remove_file(&self.path);
    }
}
