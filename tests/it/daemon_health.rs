//! The daemon's health as `runspool status` (no run) and `runspool doctor`
//! report it: a 100% full filesystem is `degraded` even when daemon.json could
//! not say so, and a frozen daemon is `unresponsive`.

use crate::common;

use common::*;
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn need_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("skipped: {test} needs root (mounts a small tmpfs); CI runs it as root");
        return false;
    }
    true
}

/// A tmpfs over the test root, lazily unmounted on drop.
struct Tmpfs(PathBuf);
impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn mount_tmpfs(at: &Path, size: &str) -> Tmpfs {
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
        .arg(at)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs on {}", at.display());
    Tmpfs(at.to_path_buf())
}

/// Fill the filesystem under `dir` to 100%: big files, then ever smaller ones
/// down to a single byte.
fn fill(dir: &Path) -> Vec<PathBuf> {
    fs::create_dir_all(dir).unwrap();
    let mut files = Vec::new();
    let mut size = 256 * 1024;
    let mut i = 0;
    while size >= 1 {
        loop {
            let p = dir.join(format!("fill-{i:06}"));
            i += 1;
            match fs::write(&p, vec![0xAB; size]) {
                Ok(()) => files.push(p),
                Err(e) => {
                    let _ = fs::remove_file(&p);
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling {} failed with {e}", dir.display());
                    break;
                }
            }
        }
        size /= 4;
    }
    files
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn doctor(env: &TestEnv) -> Output {
    env.cli(&["doctor", "--config", env.config_path.to_str().unwrap()])
}

/// The `storage` line of `runspool status`.
fn storage_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).lines().find(|l| l.starts_with("storage")).unwrap_or("").to_string()
}

fn signal(pid: i64, sig: i32) {
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// SIGCONT on drop, so a failing assertion never leaves the daemon stopped.
struct Cont(i64);
impl Drop for Cont {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

/// From plenty of room to 100% full in one step (one fallocate), so the
/// daemon never sees a disk that is low but not yet full.
fn fill_at_once(root: &Path) -> Vec<PathBuf> {
    let dir = root.join("filler");
    fs::create_dir_all(&dir).unwrap();
    let big = dir.join("big");
    let f = fs::File::create(&big).unwrap();
    let room = free(root).0 as libc::off_t;
    use std::os::fd::AsRawFd;
    assert_eq!(unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, room) }, 0, "fallocate {room} bytes");
    drop(f);
    let mut filler = fill(&dir);
    filler.push(big);
    assert_eq!(free(root).0, 0, "the tmpfs is not full");
    filler
}

#[test]
fn full_filesystem_is_degraded_in_status_and_doctor() {
    if !need_root("full_filesystem_is_degraded_in_status_and_doctor") {
        return;
    }
    let mut env = TestEnv::with_config("[storage]\nmin_free_bytes = 1048576\n[watch]\nrescan_interval_s = 1\n");
    let _m = mount_tmpfs(&env.root, "8m");
    env.ensure_layout();
    env.start_daemon();
    let o = env.cli(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(storage_line(&o), "storage   ok", "{}", text(&o));

    let filler = fill_at_once(&env.root);

    // The daemon writes its own degraded state from the space it keeps in reserve.
    wait_until(LONG, "daemon.json itself to say degraded on a 100% full filesystem", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "degraded")
    });
    let o = env.cli(&["status"]);
    assert!(storage_line(&o).starts_with("storage   degraded"), "{}", text(&o));
    assert_eq!(o.status.code(), Some(4), "status exits 4 while storage is degraded\n{}", text(&o));
    let o = doctor(&env);
    assert!(
        text(&o).lines().any(|l| l.starts_with("fail") && l.contains("storage") && l.contains("degraded")),
        "{}",
        text(&o)
    );
    assert_eq!(o.status.code(), Some(1), "doctor exits 1 while storage is degraded\n{}", text(&o));

    // The CLI's own check: even a daemon.json that says `ok` (the state a
    // daemon without room to write leaves behind) does not hide a full disk.
    let pid = env.daemon_pid().unwrap();
    signal(pid, libc::SIGSTOP);
    let cont = Cont(pid);
    let mut d: Value = read_json(&env.daemon_json()).unwrap();
    d["storage"]["state"] = "ok".into();
    d["storage"].as_object_mut().unwrap().remove("reason");
    let faked_at = now_ms();
    d["updatedAt"] = faked_at.into();
    fs::write(env.daemon_json(), serde_json::to_vec(&d).unwrap()).unwrap();
    let o = env.cli(&["status"]);
    let line = storage_line(&o);
    assert!(line.starts_with("storage   degraded") && line.contains("min_free_bytes"), "{}", text(&o));
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let o = env.cli(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).expect("status --json prints JSON");
    assert_eq!(v["storage"]["state"], "degraded", "{v}");
    assert_eq!(o.status.code(), Some(4));
    let o = doctor(&env);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    drop(cont);

    // Space comes back: everything says ok again, and the reserve is back.
    for p in filler {
        fs::remove_file(p).unwrap();
    }
    wait_until(LONG, "daemon.json storage ok again, written by the daemon", || {
        read_json(&env.daemon_json())
            .is_some_and(|d| d["storage"]["state"] == "ok" && d["updatedAt"].as_i64().unwrap() > faked_at)
    });
    let o = env.cli(&["status"]);
    assert_eq!(storage_line(&o), "storage   ok", "{}", text(&o));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = doctor(&env);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    wait_until(LONG, "the storage reserve recreated", || env.root.join("runspool/storage-reserve").is_file());
    let (id, _) = env.submit(&request(Some("after-full"), &env.work, vec![sh_step("a", "exit 0")]));
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    assert!(env.term().success());
}

/// `storage.min_free_bytes = 0` sets no floor, but a filesystem with no
/// free byte at all is still degraded: nothing can be claimed there.
#[test]
fn full_filesystem_is_degraded_without_a_floor() {
    if !need_root("full_filesystem_is_degraded_without_a_floor") {
        return;
    }
    // No rescan for ten minutes and no spool event: the daemon looks at free space by itself.
    let mut env = TestEnv::with_config("[storage]\nmin_free_bytes = 0\n[watch]\nrescan_interval_s = 600\n");
    let _m = mount_tmpfs(&env.root, "8m");
    env.ensure_layout();
    env.start_daemon();
    let filler = fill_at_once(&env.root);
    wait_until(LONG, "daemon.json to say degraded with no byte free", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "degraded")
    });
    let o = env.cli(&["status"]);
    assert!(storage_line(&o).starts_with("storage   degraded"), "{}", text(&o));
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert_eq!(doctor(&env).status.code(), Some(1));
    for p in filler {
        fs::remove_file(p).unwrap();
    }
    wait_until(LONG, "status ok again", || env.cli(&["status"]).status.code() == Some(0));
    assert!(env.term().success());
}

fn free(p: &Path) -> (u64, u64) {
    let s = nix_statvfs(p);
    (s.0, s.1)
}

fn nix_statvfs(p: &Path) -> (u64, u64) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    (s.f_bavail * s.f_frsize, s.f_favail)
}

#[test]
fn frozen_daemon_is_reported_unresponsive() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let o = env.cli(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let pid = env.daemon_pid().unwrap();
    signal(pid, libc::SIGSTOP);
    let cont = Cont(pid);
    // Ten minutes pass: daemon.json is what the CLI reads, so age it.
    let mut d: Value = read_json(&env.daemon_json()).unwrap();
    d["updatedAt"] = (now_ms() - 600_000).into();
    let tmp = env.root.join("runspool/.aged.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(&d).unwrap()).unwrap();
    fs::rename(&tmp, env.daemon_json()).unwrap();
    // A run that stays running, so the daemon's counts change for good once it resumes.
    let gate = env.work.join("gate");
    let (id, _) = env.submit(&request(Some("while-frozen"), &env.work, vec![sh_step("a", &gate_wait(&gate))]));

    let o = env.cli(&["status"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(5), "status exits 5 for an unresponsive daemon\n{t}");
    assert!(t.contains("unresponsive") && t.contains("1 request"), "{t}");
    assert!(t.contains("kill -CONT") && t.contains("journalctl"), "the fix is named\n{t}");
    let o = env.cli(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).expect("status --json prints JSON");
    assert_eq!(v["responsive"], false, "{v}");
    assert!(v["staleMs"].as_i64().unwrap() >= 600_000, "{v}");
    assert_eq!(v["spoolWaiting"], 1, "{v}");
    let o = doctor(&env);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "doctor fails on an unresponsive daemon\n{t}");
    assert!(t.lines().any(|l| l.starts_with("fail") && l.contains("unresponsive")), "{t}");

    drop(cont);
    wait_until(LONG, "status healthy again after the daemon's next rewrite", || {
        env.cli(&["status"]).status.code() == Some(0)
    });
    let o = doctor(&env);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    open_gate(&gate);
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    assert!(env.term().success());
}

/// CPU ticks (utime + stime) the process has used, from /proc/<pid>/stat.
fn cpu_ticks(pid: i64) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// An idle daemon sleeps: after a run (its listing of the spool, its
/// runner's reads of control/) it does not wake itself. notify 8 reports
/// the opens of a watched directory, so a daemon that treated every event as
/// news listed the spool forever, at most of a core.
#[cfg(target_os = "linux")]
#[test]
fn an_idle_daemon_does_not_wake_itself() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    let (id, _) = env.submit(&request(Some("idle"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let before = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(3));
    let used = cpu_ticks(pid) - before;
    // A sleeping daemon uses next to nothing; a spinning one ~100 ticks a second.
    assert!(used < 60, "the idle daemon used {used} CPU ticks in 3 s: it keeps waking itself\n{}", env.log_tail(20));
}
