//! Issue 12 hardening of the claim path and of start-up: a capacity error
//! after the commit, unvalidated bytes, spawn failures, a future mtime, a
//! lost queued event, a daemon lock held by a dead daemon's children.

use crate::common;

use std::fs;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::json;

/// The pid of a process that has exited (and been reaped).
fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// Item 12: a busy daemon.lock whose recorded daemon is dead (a child of a
/// SIGKILLed daemon still shares the lock between fork and exec) is waited
/// for, not refused.
#[test]
fn lock_held_by_a_dead_daemons_child_is_waited_for() {
    let mut env = TestEnv::new();
    let dir = env.root.join("runspool");
    mkdir_0700(&dir);
    let dead = dead_pid();
    write_file_mode(
        &dir.join("daemon.json"),
        serde_json::to_vec(&json!({"version": 1, "pid": dead, "hostname": "h", "startedAt": 1, "updatedAt": 1}))
            .unwrap()
            .as_slice(),
        0o600,
    );
    // Stands for the child: it holds the lock for a second after the daemon died.
    let lock = fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("daemon.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    env.start_daemon_nowait();
    std::thread::sleep(Duration::from_millis(1000));
    if let Some(st) = env.daemon_exited() {
        panic!("a lock held for the dead pid {dead} was refused ({st:?})\n{}", env.log_tail(20));
    }
    drop(lock);
    wait_until(LONG, "the daemon starts once the lock is free", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["pid"].as_i64() == env.daemon_pid())
    });
    env.submit(&request(Some("after-lock"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal("after-lock")["state"], "complete");
}

/// Item 12: a lock held by the live daemon daemon.json names is still refused at once.
#[test]
fn lock_held_by_a_live_daemon_is_refused_at_once() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    let t = Instant::now();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success() && out.contains(&pid.to_string()), "{out}");
    assert!(t.elapsed() < Duration::from_secs(4), "a live holder is refused without the dead-holder wait: {out}");
}

/// Item 12: SIGKILL and an immediate restart, with runners being spawned
/// all the while, is never refused.
#[test]
fn restart_right_after_sigkill_is_never_refused() {
    let mut env = TestEnv::with_config("max_running = 16\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let mut ids = Vec::new();
    for i in 0..50 {
        for j in 0..4 {
            let id = format!("k{i}-{j}");
            env.submit(&request(Some(&id), &env.work, vec![cmd_step("t", &["true"])]));
            ids.push(id);
        }
        // Let the daemon claim and start some runners, then kill it mid-burst.
        std::thread::sleep(Duration::from_millis(20 + (i % 5) * 10));
        env.kill9();
        env.start_daemon();
    }
    for id in &ids {
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "complete", "{id}: {st}");
    }
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    assert!(!log.contains("another runspool daemon"), "a restart was refused:\n{}", env.log_tail(40));
}

/// Set a path's mtime (not following symlinks) to `secs` seconds and `nsec` nanoseconds.
fn set_mtime(p: &std::path::Path, secs: i64, nsec: i64) {
    use std::os::unix::ffi::OsStrExt;
    let ts = [
        libc::timespec { tv_sec: secs as libc::time_t, tv_nsec: nsec as _ },
        libc::timespec { tv_sec: secs as libc::time_t, tv_nsec: nsec as _ },
    ];
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
    assert_eq!(r, 0, "utimensat {}: {}", p.display(), std::io::Error::last_os_error());
}

/// Item 8: an unparsable request whose mtime lies in the future is rejected
/// (`invalid-json`) 2 s after the daemon first saw it, not reread forever.
#[test]
fn unparsable_request_with_a_future_mtime_is_rejected() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let tmp = env.spool().join(".future-tmp");
    write_file_mode(&tmp, b"{\"version\": 1, \"cwd\": ", 0o600);
    set_mtime(&tmp, now_ms() / 1000 + 3600, 0);
    fs::rename(&tmp, env.spool().join("future.json")).unwrap();
    let p = env.rejected().join("future.error.json");
    let ok = poll_until(Duration::from_secs(30), || p.exists());
    assert!(ok, "not rejected after 30 s; spool: {:?}\n{}", env.pending_spool(), env.log_tail(20));
    let v = read_json(&p).unwrap();
    assert_eq!(v["code"], RejectionCode::InvalidJson.as_str(), "{v}");
    // A parsable request still waits for nothing.
    env.submit(&request(Some("after-future"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal("after-future")["state"], "complete");
}

fn count_events(env: &TestEnv, id: &str, kind: &str) -> usize {
    env.event_types(id).iter().filter(|t| t.as_str() == kind).count()
}

/// Item 9: a daemon killed between a run's queued status and its queued
/// event leaves a run without `subagent.run.queued`; the next start writes
/// it, once, and never a second one for runs that have it.
#[test]
fn missing_queued_event_is_written_at_start_and_never_twice() {
    let mut env = TestEnv::with_config("max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("block"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("block", "running");
    for id in ["lost-event", "kept-event"] {
        env.submit(&request(Some(id), &env.work, vec![cmd_step("q", &["true"])]));
        env.wait_state(id, "queued");
    }
    wait_until(LONG, "queued events and markers written", || {
        ["lost-event", "kept-event"]
            .iter()
            .all(|id| count_events(&env, id, "subagent.run.queued") == 1 && env.active_dir().join(id).exists())
    });
    env.kill9();
    // The state a kill between the status write and the event leaves: the
    // status, no event, and no active marker (it follows the event).
    fs::remove_file(env.run_dir("lost-event").join("events.jsonl")).unwrap();
    fs::remove_file(env.active_dir().join("lost-event")).unwrap();
    env.start_daemon();
    open_gate(&gate);
    for id in ["block", "lost-event", "kept-event"] {
        assert_eq!(env.wait_terminal(id)["state"], "complete", "{id}");
    }
    for id in ["lost-event", "kept-event"] {
        let types = env.event_types(id);
        assert_eq!(count_events(&env, id, "subagent.run.queued"), 1, "{id}: exactly one queued event: {types:?}");
        let q = types.iter().position(|t| t == "subagent.run.queued").unwrap();
        let s = types.iter().position(|t| t == "subagent.run.started").unwrap();
        assert!(q < s, "{id}: queued before started: {types:?}");
    }
    env.check_consistency();
}

/// A valid request and an invalid one (priority out of range, which serde
/// alone accepts) that creates `marker`, padded to the same length.
fn valid_and_invalid_pair(env: &TestEnv, id: &str, marker: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    let good = request(Some(id), &env.work, vec![cmd_step("g", &["true"])]);
    let mut bad = request(Some(id), &env.work, vec![cmd_step("b", &["touch", marker.to_str().unwrap()])]);
    bad["priority"] = json!(5000);
    let (mut a, mut b) = (serde_json::to_vec(&good).unwrap(), serde_json::to_vec(&bad).unwrap());
    let n = a.len().max(b.len());
    a.resize(n, b' ');
    b.resize(n, b' ');
    (a, b)
}

/// Item 4 (G4): a request renamed over a just-published one, with the same
/// size and the same mtime to the nanosecond, is never run: every run owns
/// the bytes the claim validated.
#[cfg(target_os = "linux")]
#[test]
fn replaced_request_with_same_size_and_mtime_is_never_run() {
    let mut env = TestEnv::with_config("max_running = 8\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let fds = format!("/proc/{}/fd", env.daemon_pid().unwrap());
    let marker = env.work.join("replacement-ran");
    let stamp = now_ms() / 1000 - 10;
    let n = 100;
    for i in 0..n {
        let id = format!("g4-{i}");
        let (a, b) = valid_and_invalid_pair(&env, &id, &marker);
        let (ta, tb) = (env.spool().join(format!(".a-{i}")), env.spool().join(format!(".b-{i}")));
        write_file_mode(&ta, &a, 0o600);
        write_file_mode(&tb, &b, 0o600);
        set_mtime(&ta, stamp, 123_456_789);
        set_mtime(&tb, stamp, 123_456_789);
        let dst = env.spool().join(format!("{id}.json"));
        fs::rename(&ta, &dst).unwrap();
        // Land the replacement while the daemon holds the entry open (it
        // reads, validates and commits it then): watch its descriptors.
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline && dst.exists() {
            let open = fs::read_dir(&fds)
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| fs::read_link(e.path()).is_ok_and(|t| t == dst));
            if open {
                break;
            }
        }
        fs::rename(&tb, &dst).unwrap();
    }
    wait_until(LONG, "the spool is drained", || env.pending_spool().is_empty());
    let mut ran = 0;
    for id in env.run_ids() {
        let req = read_json(&env.run_dir(&id).join("request.json"));
        if let Some(req) = req {
            assert_ne!(req["priority"], 5000, "{id} owns the unvalidated replacement: {req}");
            ran += 1;
            let st = env.wait_terminal(&id);
            assert_eq!(st["state"], "complete", "{id}: {st}");
        }
    }
    assert!(!marker.exists(), "the replacement's command ran");
    eprintln!("{ran} of {n} runs claimed the validated request; the rest were rejected replacements");
}

/// Item 4 (G4): the runner validates request.json with the claim's validator
/// before running anything, and fails the run with a clear error otherwise.
#[test]
fn runner_refuses_a_request_that_fails_validation() {
    let mut env = TestEnv::with_config("max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("block"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("block", "running");
    env.submit(&request(Some("swapped"), &env.work, vec![cmd_step("q", &["true"])]));
    env.wait_state("swapped", "queued");
    env.kill9();
    // A request.json changed after its claim: the runner must not trust it.
    let marker = env.work.join("unvalidated-ran");
    let (_, bad) = valid_and_invalid_pair(&env, "swapped", &marker);
    write_file_mode(&env.run_dir("swapped").join("request.json"), &bad, 0o600);
    env.start_daemon();
    open_gate(&gate);
    let st = env.wait_terminal("swapped");
    assert_eq!(st["state"], "failed", "{st}");
    let err = st["error"].as_str().unwrap_or("");
    assert!(err.contains("request.json") && err.contains("priority"), "the error names the file and field: {st}");
    assert!(!marker.exists(), "the unvalidated request ran");
    assert!(env.result("swapped").is_some(), "the failure is published");
    env.check_consistency();
}

/// Item 4 (G4): recovery of a half-claimed run (request.json, no status)
/// validates the request; one that fails becomes a rejected run with its code.
#[test]
fn half_claimed_request_that_fails_validation_becomes_rejected() {
    let mut env = TestEnv::new();
    let marker = env.work.join("half-claim-ran");
    let (_, bad) = valid_and_invalid_pair(&env, "half-bad", &marker);
    mkdir_0700(&env.run_dir("half-bad"));
    write_file_mode(&env.run_dir("half-bad").join("request.json"), &bad, 0o600);
    // And a good one next to it is still finished and run.
    let good = serde_json::to_vec(&request(Some("half-good"), &env.work, vec![cmd_step("g", &["true"])])).unwrap();
    mkdir_0700(&env.run_dir("half-good"));
    write_file_mode(&env.run_dir("half-good").join("request.json"), &good, 0o600);
    env.start_daemon();
    let st = env.wait_terminal("half-bad");
    assert_eq!(st["state"], "rejected", "{st}");
    let err = st["error"].as_str().unwrap_or("");
    assert!(err.starts_with(RejectionCode::InvalidField.as_str()) && err.contains("priority"), "{st}");
    assert!(env.event_types("half-bad").contains(&"subagent.run.rejected".to_string()));
    assert_eq!(env.wait_terminal("half-good")["state"], "complete");
    std::thread::sleep(Duration::from_millis(500));
    assert!(!marker.exists(), "the unvalidated request ran");
    env.check_consistency();
}

/// Open descriptor numbers of `pid`.
#[cfg(target_os = "linux")]
fn open_fds(pid: i64) -> Vec<i64> {
    let mut v: Vec<i64> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    v.sort();
    v
}

/// Set the soft RLIMIT_NOFILE of `pid` (the hard one stays); returns the old soft limit.
#[cfg(target_os = "linux")]
fn set_nofile(pid: i64, soft: libc::rlim_t) -> libc::rlim_t {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
    let new = libc::rlimit { rlim_cur: soft, rlim_max: old.rlim_max };
    let r = unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    old.rlim_cur
}

/// Item 3: a capacity error (here EMFILE, from a real RLIMIT_NOFILE on the
/// daemon) after the commit rename never strands the claimed run: the daemon
/// remembers its run directory and finishes it (queued status, queued event,
/// active marker) once descriptors are back.
#[cfg(target_os = "linux")]
#[test]
fn emfile_after_the_commit_never_strands_the_run() {
    let mut env = TestEnv::with_config("max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 3600\n");
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    env.submit(&request(Some("warm-up"), &env.work, vec![cmd_step("w", &["true"])]));
    assert_eq!(env.wait_terminal("warm-up")["state"], "complete");
    std::thread::sleep(Duration::from_millis(1500));
    // As few free descriptors as let the claim reach its commit: the claim's
    // open of the spool entry is dropped right after the commit, and the
    // status lock plus the status read after it need one more than that.
    // Raised one at a time until the commit happens; the entry waits in the
    // spool (a capacity error before the commit) while the limit is too low.
    let fds = open_fds(pid);
    let first_hole = (0..).find(|n| !fds.contains(n)).unwrap() as libc::rlim_t;
    let mut free = 1;
    let old = set_nofile(pid, first_hole + free);
    env.submit(&request(Some("after-commit"), &env.work, vec![cmd_step("a", &["true"])]));
    let dir = env.run_dir("after-commit");
    let faulted = loop {
        std::thread::sleep(Duration::from_millis(1500));
        if dir.join("request.json").exists() {
            std::thread::sleep(Duration::from_millis(1000));
            break !dir.join("status.json").exists();
        }
        free += 1;
        if free > 8 {
            break false;
        }
        set_nofile(pid, first_hole + free);
    };
    set_nofile(pid, old);
    assert!(faulted, "no limit ({free} free descriptors) made the post-commit work fail alone\n{}", env.log_tail(30));
    let st = env.wait_terminal("after-commit");
    assert_eq!(st["state"], "complete", "{st}");
    let types = env.event_types("after-commit");
    assert_eq!(types.iter().filter(|t| *t == "subagent.run.queued").count(), 1, "{types:?}");
    // Claiming resumed.
    env.submit(&request(Some("after-recovery"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal("after-recovery")["state"], "complete");
    env.check_consistency();
}

/// Item 5: `runspool-runner` removed after the daemon started: runs fall back
/// to `runspool runner`, and with the daemon's own binary gone too, to the
/// running daemon's image; never "runner process 0 exited".
#[cfg(target_os = "linux")]
#[test]
fn missing_runner_binary_falls_back_to_the_daemons_own() {
    let parent = "tr '\\0' ' ' < /proc/$PPID/cmdline";
    let mut env = TestEnv::new();
    let pair = env.base().join("pair");
    fs::create_dir_all(&pair).unwrap();
    let (bin, runner) = (pair.join("runspool"), pair.join("runspool-runner"));
    install_program(std::path::Path::new(BIN), &bin);
    install_program(&runner_bin(), &runner);
    let cmd = env.daemon_command_for(&bin, &env.root);
    env.start_daemon_command(cmd);
    env.submit(&request(Some("sibling"), &env.work, vec![sh_step("p", parent)]));
    assert_eq!(env.wait_terminal("sibling")["state"], "complete");
    assert!(env.output_log("sibling", 0).contains("pair/runspool-runner "));

    fs::remove_file(&runner).unwrap();
    env.submit(&request(Some("no-sibling"), &env.work, vec![sh_step("p", parent)]));
    let st = env.wait_terminal("no-sibling");
    assert_eq!(st["state"], "complete", "{st}\n{}", env.log_tail(20));
    let out = env.output_log("no-sibling", 0);
    assert!(out.contains("runner ") && out.contains("no-sibling"), "parent of the step: {out}");

    fs::remove_file(&bin).unwrap();
    env.submit(&request(Some("no-binary"), &env.work, vec![cmd_step("t", &["true"])]));
    let st = env.wait_terminal("no-binary");
    assert_eq!(st["state"], "complete", "{st}\n{}", env.log_tail(20));
    env.check_consistency();
}

/// The second-user tests' unprivileged user (scripts/ci-user.sh), created on first use.
#[cfg(target_os = "linux")]
fn test_user() -> (u32, u32) {
    let name = std::env::var("RUNSPOOL_TEST_USER").unwrap_or_else(|_| "runspool-ci".into());
    let lookup = |flag: &str| -> Option<u32> {
        let o = std::process::Command::new("id").arg(flag).arg(&name).output().ok()?;
        String::from_utf8_lossy(&o.stdout).trim().parse().ok().filter(|_| o.status.success())
    };
    if lookup("-u").is_none() {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ci-user.sh");
        let o = std::process::Command::new("bash").arg(&script).output().expect("run scripts/ci-user.sh");
        assert!(o.status.success(), "scripts/ci-user.sh failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    (lookup("-u").expect("test user uid"), lookup("-g").expect("test user gid"))
}

/// The soft RLIMIT_NPROC of `pid`, from /proc (readable without CAP_SYS_RESOURCE).
#[cfg(target_os = "linux")]
fn soft_nproc(pid: i64) -> libc::rlim_t {
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max processes")).unwrap();
    match line.split_whitespace().nth(2).unwrap() {
        "unlimited" => libc::RLIM_INFINITY,
        n => n.parse().unwrap(),
    }
}

/// Set the soft RLIMIT_NPROC of `pid` from a child running as its owner:
/// prlimit(2) on another uid's process needs CAP_SYS_RESOURCE, which root
/// may lack in a container.
#[cfg(target_os = "linux")]
fn set_nproc_as(uid: u32, gid: u32, pid: i64, soft: libc::rlim_t) {
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        // Only async-signal-safe calls between fork and _exit.
        unsafe {
            let mut cur = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            let ok = libc::setgid(gid) == 0
                && libc::setuid(uid) == 0
                && libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NPROC, std::ptr::null(), &mut cur) == 0
                && {
                    let new = libc::rlimit { rlim_cur: soft.min(cur.rlim_max), rlim_max: cur.rlim_max };
                    libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NPROC, &new, std::ptr::null_mut()) == 0
                };
            libc::_exit(if ok { 0 } else { 1 });
        }
    }
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "prlimit as uid {uid} failed");
}

/// Item 5: a runner start that fails with EAGAIN (RLIMIT_NPROC, which binds
/// only a non-root daemon) keeps the run queued, names the errno and the
/// runner in the log, and is retried until it succeeds.
#[cfg(target_os = "linux")]
#[test]
fn eagain_on_runner_start_keeps_the_run_queued_and_retries() {
    eagain_on_runner_start("eagain_on_runner_start_keeps_the_run_queued_and_retries", false);
}

/// The same when the fork server's fork fails with EAGAIN: the server
/// answers the errno, and the run stays queued until a retry succeeds.
#[cfg(target_os = "linux")]
#[test]
fn eagain_in_the_fork_server_keeps_the_run_queued_and_retries() {
    eagain_on_runner_start("eagain_in_the_fork_server_keeps_the_run_queued_and_retries", true);
}

/// A daemon run as the second test user, its runner exec'd (`runspool`
/// alone) or forked (`runspool-runner` beside it, after a first run started
/// the fork server), whose runner start meets RLIMIT_NPROC = 1.
#[cfg(target_os = "linux")]
fn eagain_on_runner_start(name: &str, fork_server: bool) {
    use std::os::unix::process::CommandExt;
    if !is_root() {
        report(&format!(
            "{name}: skipped: needs root (RLIMIT_NPROC binds only a non-root daemon, started as the second test user)"
        ));
        return;
    }
    let (uid, gid) = test_user();
    let mut env = TestEnv::new();
    let bin = env.base().join("runspool");
    let runner = env.base().join("runspool-runner");
    install_program(std::path::Path::new(BIN), &bin);
    if fork_server {
        install_program(&runner_bin(), &runner);
    }
    std::os::unix::fs::lchown(env.base(), Some(uid), Some(gid)).unwrap();
    for p in walk_all(&env.base()) {
        std::os::unix::fs::lchown(&p, Some(uid), Some(gid)).unwrap();
    }
    let mut cmd = env.daemon_command_for(&bin, &env.root);
    cmd.uid(uid).gid(gid).env("HOME", env.base()).current_dir(env.base());
    env.start_daemon_command(cmd);
    let drop_as_user = |env: &TestEnv, id: &str| {
        let tmp = env.spool().join(format!(".{id}"));
        write_file_mode(
            &tmp,
            &serde_json::to_vec(&request(Some(id), &env.work, vec![cmd_step("t", &["true"])])).unwrap(),
            0o600,
        );
        std::os::unix::fs::lchown(&tmp, Some(uid), Some(gid)).unwrap();
        fs::rename(&tmp, env.spool().join(format!("{id}.json"))).unwrap();
    };
    // The process whose fork meets the limit: the daemon, or its fork server.
    let pid = if fork_server {
        drop_as_user(&env, "warm-up");
        assert_eq!(env.wait_terminal("warm-up")["state"], "complete");
        let daemon = env.daemon_pid().unwrap();
        let children = fs::read_to_string(format!("/proc/{daemon}/task/{daemon}/children")).unwrap_or_default();
        children
            .split_whitespace()
            .filter_map(|p| p.parse::<i64>().ok())
            .find(|p| {
                fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.windows(13).any(|w| w == b"--fork-server"))
            })
            .expect("the fork server, a child of the daemon, after the first run")
    } else {
        env.daemon_pid().unwrap()
    };
    let old = soft_nproc(pid);
    set_nproc_as(uid, gid, pid, 1);
    drop_as_user(&env, "nproc");
    wait_until(LONG, "a failed start", || {
        fs::read_to_string(&env.log_path).unwrap_or_default().contains("os error 11")
            || env.state("nproc").is_some_and(|s| is_terminal_state(&s))
    });
    std::thread::sleep(Duration::from_millis(1500));
    let st = env.status("nproc").unwrap();
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    set_nproc_as(uid, gid, pid, old);
    assert_eq!(st["state"], "queued", "a transient start failure keeps the run queued: {st}");
    let line = log.lines().find(|l| l.contains("os error 11")).unwrap();
    let program = if fork_server { &runner } else { &bin };
    assert!(
        line.contains("EAGAIN") && line.contains(&program.display().to_string()),
        "the log names errno and runner: {line}"
    );
    let st = env.wait_terminal("nproc");
    assert_eq!(st["state"], "complete", "{st}");
}

/// Item 3: the spool cannot even be listed (EMFILE, no descriptor free): the
/// listing is retried, so the request is claimed once descriptors are back,
/// without waiting for another file event or the periodic rescan.
#[cfg(target_os = "linux")]
#[test]
fn emfile_while_listing_the_spool_is_retried() {
    let mut env = TestEnv::with_config("max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 3600\n");
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    env.submit(&request(Some("warm-up"), &env.work, vec![cmd_step("w", &["true"])]));
    assert_eq!(env.wait_terminal("warm-up")["state"], "complete");
    std::thread::sleep(Duration::from_millis(1500));
    let fds = open_fds(pid);
    let first_hole = (0..).find(|n| !fds.contains(n)).unwrap();
    let old = set_nofile(pid, first_hole as libc::rlim_t);
    env.submit(&request(Some("unlisted"), &env.work, vec![cmd_step("a", &["true"])]));
    std::thread::sleep(Duration::from_millis(1500));
    let claimed = env.run_dir("unlisted").exists();
    set_nofile(pid, old);
    assert!(!claimed, "claimed without a free descriptor: the fault missed\n{}", env.log_tail(20));
    let st = env.wait_terminal_for("unlisted", Duration::from_secs(60));
    assert_eq!(st["state"], "complete", "{st}");
}
