//! Keeping a run's processes contained (Linux; elsewhere these degrade to
//! what `kill` and process groups give): the runner's children (it is their
//! subreaper, `child::become_subreaper`), processes recognised by the `RUNSPOOL_*` variables they were
//! started with, and a parent-death signal for helper processes.

use std::time::{Duration, Instant};

/// The fields of /proc/<pid>/stat a supervisor needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub ppid: u32,
    pub pgrp: u32,
}

pub fn stat(pid: u32) -> Option<ProcStat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let mut f = s[s.rfind(')')? + 1..].split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgrp = f.next()?.parse().ok()?;
    Some(ProcStat { state, ppid, pgrp })
}

/// The children of this process, of all its threads (an orphan is adopted by
/// one thread of the subreaper), zombies included. Falls back to a scan of
/// /proc where `children` files are missing (no CONFIG_PROC_CHILDREN).
pub fn children() -> Vec<u32> {
    let mut out = Vec::new();
    let me = std::process::id();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{me}/task")) else { return out };
    let mut have_files = false;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            have_files = true;
            out.extend(s.split_ascii_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    if !have_files {
        out = all_pids().into_iter().filter(|&p| stat(p).is_some_and(|s| s.ppid == me)).collect();
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn all_pids() -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else { return Vec::new() };
    rd.flatten().filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok())).collect()
}

/// The value of `name` in the environment `pid` was started with (None if
/// unset or unreadable: another user's process, a zombie, a kernel thread).
pub fn environ_var(pid: u32, name: &str) -> Option<Vec<u8>> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    env.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(prefix.as_bytes()).map(<[u8]>::to_vec))
}

/// Live processes (this one excluded) whose start environment holds every
/// `NAME=value` of `marks` exactly. A process that rewrote its environment
/// (`env -i`) is not found: the marks are evidence, not a cage.
pub fn with_env(marks: &[String]) -> Vec<u32> {
    let me = std::process::id();
    let mut out = Vec::new();
    for pid in all_pids() {
        if pid == me || stat(pid).is_none_or(|s| s.state == 'Z') {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        if marks.iter().all(|m| vars.contains(&m.as_bytes())) {
            out.push(pid);
        }
    }
    out
}

/// SIGKILL every process carrying `marks` (and the process group each leads)
/// until none is left or `within` has passed. True when none is left.
pub fn kill_marked(marks: &[String], within: Duration) -> bool {
    let until = Instant::now() + within;
    loop {
        let left = with_env(marks);
        if left.is_empty() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        for pid in left {
            kill_with_group(pid);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILL `pid`, and its process group when it leads one (what a `setsid`
/// or `setpgid` escapee usually is).
pub fn kill_with_group(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    if pid <= 1 || pid > i32::MAX as u32 {
        return;
    }
    if stat(pid).is_some_and(|s| s.pgrp == pid) {
        super::child::signal_group(pid, Signal::SIGKILL);
    }
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
}

/// For `Command::pre_exec`: the child gets SIGKILL when the thread that
/// forked it exits (PR_SET_PDEATHSIG; that thread must wait for the child,
/// as `providers::run_bounded` does), and kills itself at once if `parent`
/// died before the prctl took effect. Only async-signal-safe calls.
pub fn die_with_parent(parent: u32) -> std::io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: prctl, getppid and kill are async-signal-safe system calls.
        unsafe {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = parent;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn children_lists_a_child_and_environ_finds_it() {
        let mark = format!("RUNSPOOL_PROCS_TEST={}", uuid::Uuid::new_v4());
        let (k, v) = mark.split_once('=').unwrap();
        let mut c = Command::new("sleep").arg("30").env(k, v).spawn().unwrap();
        assert!(children().contains(&c.id()));
        // spawn returns once exec closed the child's descriptors, a moment
        // before the kernel publishes the new environment.
        let until = Instant::now() + Duration::from_secs(10);
        while environ_var(c.id(), k).is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(environ_var(c.id(), k).as_deref(), Some(v.as_bytes()));
        assert_eq!(stat(c.id()).unwrap().ppid, std::process::id());
        assert_eq!(with_env(std::slice::from_ref(&mark)), vec![c.id()]);
        assert!(kill_marked(std::slice::from_ref(&mark), Duration::from_secs(10)), "a zombie no longer counts");
        let _ = c.wait();
        assert!(with_env(&[mark]).is_empty());
    }
}
