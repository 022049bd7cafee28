//! Recovery: dead runners are repaired, daemon restarts never stop runs,
//! half-claimed runs are finished, unsafe roots are refused.

use crate::common;

use common::*;
use serde_json::json;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

fn step_pid_script(pidfile: &Path, tail: &str) -> String {
    format!("echo $$ > '{p}.tmp'; mv '{p}.tmp' '{p}'; {tail}", p = pidfile.display())
}

fn read_pid(p: &Path) -> i64 {
    fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

const FAST_RESCAN: &str = "max_running = 8\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n";

#[test]
fn killed_runner_is_repaired() {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "victim";
    let pidf = env.work.join("victim-step.pid");
    let mut req = request(
        Some(id),
        &env.work,
        vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60")), sh_step("next", "true")],
    );
    req["sessionId"] = json!("rec-sess");
    req["toolCallId"] = json!("tool-1");
    env.submit(&req);
    env.wait_file(&pidf);
    let step_pid = read_pid(&pidf);
    let st = env.wait_state(id, "running");
    let runner = st["pid"].as_i64().expect("runner pid");
    assert!(process_alive(runner));
    assert_ne!(runner, step_pid);

    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    let err = st["error"].as_str().unwrap_or("");
    let want = format!("runner process {runner} exited before recording a result");
    assert!(err.starts_with(&want), "error {err:?} should start with {want:?}");
    assert_eq!(st["exitCode"], 1, "{st}");
    assert_eq!(st["steps"][0]["status"], "failed");
    assert_eq!(st["steps"][0]["exitCode"], 1);
    assert_eq!(st["steps"][1]["status"], "failed", "pending steps fail too: {st}");
    assert!(st["endedAt"].as_i64().is_some());

    // the step's process group was killed first
    wait_until(LONG, "step process gone", || !process_alive(step_pid));
    assert!(!process_group_alive(step_pid), "step process group still has members");

    let evs = env.events(id);
    let rep = evs.iter().find(|e| e["type"] == "subagent.run.repaired_stale").expect("repaired_stale event");
    assert_eq!(rep["pid"].as_i64(), Some(runner));
    assert!(rep["message"].as_str().unwrap_or("").starts_with(&want));

    wait_until(LONG, "active marker removed", || !env.active_dir().join(id).exists());
    assert!(!env.active_dir().join("tool-calls").join("tool-1").join(id).exists());
    let ended = st["endedAt"].as_i64().unwrap();
    assert!(env.terminal_dir().join(seg("rec-sess")).join(terminal_marker_name(ended, id)).is_file());
    let r = env.result(id).expect("result for the repaired run");
    assert_eq!(r["state"], "failed");
    assert_eq!(r["success"], json!(false));
    env.check_consistency();
}

#[test]
fn runner_killed_while_daemon_down_is_repaired_at_start() {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "victim-offline";
    let pidf = env.work.join("offline-step.pid");
    env.submit(&request(Some(id), &env.work, vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60"))]));
    env.wait_file(&pidf);
    let step_pid = read_pid(&pidf);
    let runner = env.wait_state(id, "running")["pid"].as_i64().unwrap();
    env.kill9();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    wait_until(LONG, "runner gone", || !process_alive(runner));
    // Nobody is watching: the status still says running, the step still lives.
    assert_eq!(env.state(id).as_deref(), Some("running"));
    env.start_daemon();
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert!(
        st["error"]
            .as_str()
            .unwrap_or("")
            .starts_with(&format!("runner process {runner} exited before recording a result")),
        "{st}"
    );
    wait_until(LONG, "orphaned step killed", || !process_alive(step_pid));
    env.check_consistency();
}

fn five_runs_survive(kill_with_term: bool) {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let codes = [0i64, 11, 12, 13, 14];
    let gate = env.work.join("gate");
    for (i, k) in codes.iter().enumerate() {
        let started = env.work.join(format!("started-{i}"));
        let script = format!(
            "touch '{}'; while [ ! -e '{}' ]; do sleep 0.05; done; sleep 3; exit {k}",
            started.display(),
            gate.display()
        );
        env.submit(&request(Some(&format!("survive-{i}")), &env.work, vec![sh_step("s", &script)]));
    }
    for i in 0..codes.len() {
        env.wait_file(&env.work.join(format!("started-{i}")));
        env.wait_state(&format!("survive-{i}"), "running");
    }
    let runners: Vec<i64> =
        (0..codes.len()).map(|i| env.status(&format!("survive-{i}")).unwrap()["pid"].as_i64().unwrap()).collect();
    fs::write(&gate, b"go").unwrap(); // every step is now mid-step (sleep 3)
    if kill_with_term {
        let st = env.term();
        assert_eq!(st.code(), Some(0), "daemon exits 0 on SIGTERM");
        for r in &runners {
            assert!(process_alive(*r), "runner {r} survives daemon SIGTERM");
        }
        // Runs finish with no daemon at all: the runner records everything itself.
        for (i, k) in codes.iter().enumerate() {
            let st = env.wait_terminal(&format!("survive-{i}"));
            assert_eq!(st["exitCode"].as_i64(), Some(*k), "{st}");
        }
        env.start_daemon();
    } else {
        env.kill9();
        for r in &runners {
            assert!(process_alive(*r), "runner {r} survives daemon SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(300));
        env.start_daemon();
    }
    for (i, k) in codes.iter().enumerate() {
        let id = format!("survive-{i}");
        let st = env.wait_terminal(&id);
        assert_eq!(st["exitCode"].as_i64(), Some(*k), "{id}: {st}");
        assert_eq!(st["state"], if *k == 0 { "complete" } else { "failed" }, "{id}: {st}");
        assert!(
            st["error"].as_str().map(|e| !e.contains("exited before recording")).unwrap_or(true),
            "{id} repaired: {st}"
        );
        assert!(
            !env.event_types(&id).contains(&"subagent.run.repaired_stale".to_string()),
            "{id} must not be repaired"
        );
        assert_eq!(st["pid"].as_i64(), Some(runners[i]), "{id}: the original runner finished it");
    }
    std::thread::sleep(Duration::from_secs(1));
    env.check_consistency();
}

#[test]
fn runs_survive_daemon_sigkill() {
    five_runs_survive(false);
}

#[test]
fn runs_survive_daemon_sigterm() {
    five_runs_survive(true);
}

#[test]
fn queued_runs_are_requeued_after_restart() {
    let mut env = TestEnv::with_config("max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    env.start_daemon();
    let gate = env.work.join("gate-q");
    env.submit(&request(
        Some("q-block"),
        &env.work,
        vec![sh_step("b", &format!("while [ ! -e '{}' ]; do sleep 0.05; done", gate.display()))],
    ));
    env.wait_state("q-block", "running");
    for i in 0..3 {
        env.submit(&request(Some(&format!("q-{i}")), &env.work, vec![sh_step("q", &format!("exit {}", i + 1))]));
        env.wait_state(&format!("q-{i}"), "queued");
    }
    env.kill9();
    fs::write(&gate, b"go").unwrap();
    env.wait_terminal("q-block");
    env.start_daemon();
    for i in 0..3 {
        let st = env.wait_terminal(&format!("q-{i}"));
        assert_eq!(st["exitCode"].as_i64(), Some(i + 1), "{st}");
    }
    env.check_consistency();
}

#[test]
fn half_claimed_run_is_finished_at_start() {
    let mut env = TestEnv::new();
    // Daemon not running: a claim that stopped right after the commit rename.
    let id = "half-1";
    let req = request(Some(id), &env.work, vec![sh_step("h", "echo finished-half")]);
    let bytes = serde_json::to_vec(&req).unwrap();
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    write_file_mode(&dir.join("request.json"), &bytes, 0o600);
    // A claim that stopped right after step 6 (empty run dir, request still in the spool).
    let id2 = "half-2";
    mkdir_0700(&env.run_dir(id2));
    let (_, bytes2) = env.submit(&request(Some(id2), &env.work, vec![sh_step("h", "exit 5")]));

    env.start_daemon();
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    assert!(env.output_log(id, 0).contains("finished-half"));
    assert_eq!(file_bytes(&dir.join("request.json")), bytes);
    assert!(env.event_types(id).contains(&"subagent.run.queued".to_string()));

    let st = env.wait_terminal(id2);
    assert_eq!(st["state"], "failed", "an empty run dir is the trace of this same claim, not a duplicate: {st}");
    assert_eq!(st["exitCode"], 5);
    assert_eq!(file_bytes(&env.run_dir(id2).join("request.json")), bytes2);
    assert!(!env.rejected().join(format!("{id2}.json")).exists());
    env.check_consistency();
}

#[test]
fn refuses_group_writable_root() {
    let env = TestEnv::new();
    fs::set_permissions(&env.root, fs::Permissions::from_mode(0o770)).unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "daemon must refuse a group-writable root: {out}");
    assert!(out.contains(env.root.to_str().unwrap()), "message names the root path: {out}");
    fs::set_permissions(&env.root, fs::Permissions::from_mode(0o700)).unwrap();
}

#[test]
fn refuses_world_writable_runs_root() {
    let env = TestEnv::new();
    fs::set_permissions(env.runs(), fs::Permissions::from_mode(0o707)).unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "daemon must refuse a world-writable runs root: {out}");
    assert!(out.contains(env.runs().to_str().unwrap()), "message names the runs root: {out}");
}

#[test]
fn refuses_symlinked_spool_and_root() {
    let env = TestEnv::new();
    let real = env.base().join("real-spool");
    mkdir_0700(&real);
    fs::remove_dir_all(env.spool()).unwrap();
    std::os::unix::fs::symlink(&real, env.spool()).unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "daemon must refuse a symlinked spool: {out}");
    assert!(out.contains(env.spool().to_str().unwrap()), "message names the spool path: {out}");

    // the root itself a symlink
    let link_root = env.base().join("root-link");
    std::os::unix::fs::symlink(&env.root, &link_root).unwrap();
    fs::remove_file(env.spool()).unwrap();
    mkdir_0700(&env.spool());
    let (st, out) = env.run_daemon_expect_exit(&link_root, Duration::from_secs(30));
    assert!(!st.success(), "daemon must refuse a symlinked root: {out}");
    assert!(out.contains(link_root.to_str().unwrap()), "message names the root: {out}");

    // the runs root a symlink
    let real_runs = env.base().join("real-runs");
    mkdir_0700(&real_runs);
    fs::remove_dir_all(env.runs()).unwrap();
    std::os::unix::fs::symlink(&real_runs, env.runs()).unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "daemon must refuse a symlinked runs root: {out}");
    assert!(out.contains(env.runs().to_str().unwrap()), "message names the runs root: {out}");
}

#[test]
fn refuses_root_owned_by_another_user() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let env = TestEnv::new();
    std::os::unix::fs::chown(&env.root, Some(65534), Some(65534)).unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    std::os::unix::fs::chown(&env.root, Some(0), Some(0)).unwrap();
    assert!(!st.success(), "daemon must refuse a root owned by another uid: {out}");
    assert!(out.contains(env.root.to_str().unwrap()), "message names the root: {out}");
}

#[test]
fn creates_missing_layout_with_0700() {
    let mut env = TestEnv::new();
    fs::remove_dir_all(&env.root).unwrap();
    env.start_daemon();
    for d in [env.root.clone(), env.spool(), env.rejected(), env.runs(), env.results(), env.root.join("runspool")] {
        wait_until(LONG, &format!("{} created", d.display()), || d.is_dir());
        assert_eq!(mode_of(&d), 0o700, "{} mode", d.display());
    }
    let d = read_json(&env.daemon_json()).expect("daemon.json");
    assert_eq!(d["version"], 1);
    assert_eq!(d["pid"].as_i64(), env.daemon_pid());
    assert!(d["watch"]["strategy"].is_string(), "{d}");
    assert!(d["storage"]["state"] == "ok", "{d}");
    assert!(d["runs"]["queued"].is_number() && d["runs"]["running"].is_number(), "{d}");
}

#[test]
fn second_daemon_fails_naming_the_pid() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "a second daemon must fail: {out}");
    assert!(out.contains(&pid.to_string()), "message names the live daemon's pid {pid}: {out}");
    assert!(env.daemon_exited().is_none(), "the first daemon keeps running");
    // and it still works
    env.submit(&request(Some("after-second"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal("after-second")["state"], "complete");
    // after it dies a new one may start
    env.kill9();
    env.start_daemon();
}

#[test]
fn stop_of_queued_run_written_while_daemon_down() {
    let mut env = TestEnv::with_config("max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    env.start_daemon();
    let gate = env.work.join("gate-sq");
    env.submit(&request(
        Some("sq-block"),
        &env.work,
        vec![sh_step("b", &format!("while [ ! -e '{}' ]; do sleep 0.05; done", gate.display()))],
    ));
    env.wait_state("sq-block", "running");
    env.submit(&request(Some("sq-victim"), &env.work, vec![sh_step("v", "touch ran-sq-victim")]));
    env.wait_state("sq-victim", "queued");
    env.kill9();
    env.write_control("sq-victim", "stop");
    fs::write(&gate, b"go").unwrap();
    env.wait_terminal("sq-block");
    env.start_daemon();
    let st = env.wait_terminal("sq-victim");
    assert_eq!(st["state"], "stopped", "{st}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!env.work.join("ran-sq-victim").exists(), "a stopped queued run never starts");
    env.check_consistency();
}

#[test]
fn bad_config_is_refused_naming_the_key() {
    let env = TestEnv::with_config("max_running = 2\nmax_runing = 3\n");
    let (st, out) = env.run_daemon_expect_exit(&env.root, Duration::from_secs(30));
    assert!(!st.success(), "unknown config key must be refused: {out}");
    assert!(out.contains("max_runing"), "message names the unknown key: {out}");

    // a missing --config file is an error too
    let mut env2 = TestEnv::new();
    env2.config_path = env2.base().join("does-not-exist.toml");
    let (st, out) = env2.run_daemon_expect_exit(&env2.root, Duration::from_secs(30));
    assert!(!st.success(), "a missing --config file is an error: {out}");
}

#[test]
fn retention_removes_old_terminal_runs_but_keeps_paused() {
    let mut env = TestEnv::with_config("max_running = 2\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    let day = 86_400_000i64;
    let now = now_ms();
    env.fabricate_terminal_run("old-complete", "default", now - 40 * day, "complete");
    env.fabricate_result("old-complete");
    env.fabricate_terminal_run("old-paused", "default", now - 40 * day, "paused");
    env.fabricate_result("old-paused");
    env.fabricate_terminal_run("recent", "default", now - 2 * day, "complete");
    env.fabricate_result("recent");
    env.start_daemon();
    wait_until(Duration::from_secs(120), "old run removed by retention", || !env.run_dir("old-complete").exists());
    wait_until(LONG, "old result removed", || !env.result_path("old-complete").exists());
    assert!(env.run_dir("old-paused").join("status.json").exists(), "paused runs are kept");
    assert!(env.result_path("old-paused").exists());
    assert!(env.run_dir("recent").join("status.json").exists(), "recent runs are kept");
    assert!(env.result_path("recent").exists());
    // The run directory is renamed to a tombstone first, then removed: wait for the second half.
    wait_until(LONG, "tombstone dirs are removed", || {
        !list_names(&env.runs()).iter().any(|n| n.starts_with(".runspool-deleting-"))
    });
}

/// Retention also empties spool/rejected/: an entry rejected more than
/// `retention_days` ago goes with its error file (its age is the error file's
/// `rejectedAt`, whatever the entry's mtime), a recent one and an entry
/// without its error file stay, and an old error file without its entry goes.
#[test]
fn retention_removes_old_rejected_entries_and_their_error_files() {
    let mut env = TestEnv::with_config("max_running = 2\nretention_days = 30\n[watch]\nrescan_interval_s = 3\n");
    let day = 86_400_000i64;
    let now = now_ms();
    let rej = env.rejected();
    fs::create_dir_all(&rej).unwrap();
    let error = |name: &str, at: i64| {
        let v = json!({"version": 1, "file": format!("{name}.json"), "code": "invalid-json", "message": "m", "rejectedAt": at});
        write_file_mode(&rej.join(format!("{name}.error.json")), v.to_string().as_bytes(), 0o600);
    };
    for name in ["old", "recent", "fresh-mtime-old-reject", "unsettled"] {
        write_file_mode(&rej.join(format!("{name}.json")), b"{", 0o600);
    }
    error("old", now - 40 * day);
    set_mtime_ago(&rej.join("old.json"), 40 * 86_400);
    error("recent", now - 2 * day);
    set_mtime_ago(&rej.join("recent.json"), 40 * 86_400); // the error file's rejectedAt decides, not this
    error("fresh-mtime-old-reject", now - 31 * day);
    set_mtime_ago(&rej.join("unsettled.json"), 40 * 86_400);
    error("orphan", now - 40 * day);
    env.start_daemon();
    wait_until(Duration::from_secs(120), "old rejected entries removed by retention", || {
        !rej.join("old.json").exists() && !rej.join("fresh-mtime-old-reject.json").exists()
    });
    let left = list_names(&rej);
    for gone in ["old.error.json", "fresh-mtime-old-reject.error.json", "orphan.error.json"] {
        assert!(!left.iter().any(|n| n == gone), "{gone} kept: {left:?}");
    }
    for kept in ["recent.json", "recent.error.json", "unsettled.json"] {
        assert!(left.iter().any(|n| n == kept), "{kept} removed: {left:?}");
    }
}

#[test]
fn killed_runner_in_parallel_group_kills_all_members() {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "victim-par";
    let pids: Vec<_> = (0..3).map(|i| env.work.join(format!("vp-{i}.pid"))).collect();
    let members =
        pids.iter().enumerate().map(|(i, p)| sh_step(&format!("m{i}"), &step_pid_script(p, "exec sleep 60"))).collect();
    env.submit(&request(Some(id), &env.work, vec![parallel(members, None)]));
    for p in &pids {
        env.wait_file(p);
    }
    let runner = env.wait_state(id, "running")["pid"].as_i64().unwrap();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert!(st["error"]
        .as_str()
        .unwrap_or("")
        .starts_with(&format!("runner process {runner} exited before recording a result")));
    for p in &pids {
        let pid = read_pid(p);
        wait_until(LONG, "every member's process group killed", || !process_alive(pid) && !process_group_alive(pid));
    }
    for i in 0..3 {
        assert_eq!(st["steps"][i]["status"], "failed", "{st}");
        assert_eq!(st["steps"][i]["exitCode"], 1, "{st}");
    }
    env.check_consistency();
}

#[test]
fn runner_obeys_stop_while_daemon_is_down() {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "stop-no-daemon";
    let pidf = env.work.join("snd.pid");
    env.submit(&request(Some(id), &env.work, vec![sh_step("s", &step_pid_script(&pidf, "exec sleep 60"))]));
    env.wait_file(&pidf);
    env.wait_state(id, "running");
    env.kill9();
    env.write_control(id, "stop");
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "the runner acts on its inbox without a daemon: {st}");
    let pid = read_pid(&pidf);
    wait_until(LONG, "step gone", || !process_alive(pid));
    env.start_daemon();
    env.check_consistency();
}

/// Issue 18: the daemon died between a repair's terminal status and its
/// `subagent.run.repaired_stale` event. The next daemon writes the event,
/// once: a restart after that adds none.
#[test]
fn repair_event_lost_with_the_daemon_is_written_once_at_the_next_start() {
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "victim-event";
    let pidf = env.work.join("event-step.pid");
    env.submit(&request(Some(id), &env.work, vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60"))]));
    env.wait_file(&pidf);
    let runner = env.wait_state(id, "running")["pid"].as_i64().unwrap();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    assert_eq!(env.wait_terminal(id)["state"], "failed");
    let repaired = |env: &TestEnv| env.event_types(id).iter().filter(|t| *t == "subagent.run.repaired_stale").count();
    wait_until(LONG, "the repair event", || repaired(&env) == 1);
    wait_until(LONG, "the repaired run published", || !env.active_dir().join(id).exists());
    // The state a daemon killed right after the status write leaves: no event.
    env.kill9();
    let events = env.run_dir(id).join("events.jsonl");
    let kept: String = fs::read_to_string(&events)
        .unwrap()
        .lines()
        .filter(|l| !l.contains("subagent.run.repaired_stale"))
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(&events, kept).unwrap();
    assert_eq!(repaired(&env), 0);
    // A run submitted after each start is done only after the start-up
    // check of every run directory (the first loop turns).
    let done_after_start = |env: &TestEnv, n: &str| {
        let probe = format!("probe-{n}");
        env.submit(&request(Some(&probe), &env.work, vec![cmd_step("t", &["true"])]));
        assert_eq!(env.wait_terminal(&probe)["state"], "complete");
    };
    env.start_daemon();
    done_after_start(&env, "1");
    wait_until(LONG, "the lost repair event written again", || repaired(&env) >= 1);
    let ev = env.events(id).into_iter().find(|e| e["type"] == "subagent.run.repaired_stale").unwrap();
    assert_eq!(ev["pid"].as_i64(), Some(runner), "{ev}");
    assert!(ev["message"].as_str().unwrap().starts_with(&format!("runner process {runner} exited")), "{ev}");
    env.restart();
    done_after_start(&env, "2");
    assert_eq!(repaired(&env), 1, "{:?}", env.event_types(id));
    assert_eq!(env.state(id).as_deref(), Some("failed"));
    env.check_consistency();
}
