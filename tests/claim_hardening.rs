//! Issue 12 hardening of the claim path and of start-up: a capacity error
//! after the commit, unvalidated bytes, spawn failures, a future mtime, a
//! lost queued event, a daemon lock held by a dead daemon's children.

mod common;

use std::fs;
use std::os::unix::io::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
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
    assert_eq!(v["code"], "invalid-json", "{v}");
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
