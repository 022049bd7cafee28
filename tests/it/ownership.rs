//! PROTOCOL §14: runs that runspool did not launch (a pi-subagents host's)
//! are never written, locked, repaired, indexed or deleted by runspool, and a
//! terminal marker is a hint, never a path: retention removes only
//! runspool's own old runs directly under the runs root.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const FAST: &str = "max_running = 2\nretention_days = 30\n[watch]\nrescan_interval_s = 1\n";

/// A run as a pi-subagents 0.67 host writes it: no request.json, its own fields.
fn write_pi_run(env: &TestEnv, id: &str, status: Value, marker: bool) -> PathBuf {
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    write_file_mode(&dir.join("status.json"), serde_json::to_vec_pretty(&status).unwrap().as_slice(), 0o644);
    write_file_mode(&dir.join("events.jsonl"), b"{\"type\":\"subagent.run.started\"}\n", 0o644);
    write_file_mode(&dir.join("output-0.log"), b"pi output\n", 0o644);
    if marker {
        let state = status["state"].as_str().unwrap();
        if is_active_state(state) {
            write_file_mode(&env.active_dir().join(id), b"", 0o644);
            let alias = env.active_dir().join("tool-calls").join(seg("call-1"));
            fs::create_dir_all(&alias).unwrap();
            write_file_mode(&alias.join(id), b"", 0o644);
        } else {
            let ended = status["endedAt"].as_i64().unwrap();
            let session = status["sessionId"].as_str().unwrap();
            let sdir = env.terminal_dir().join(seg(session));
            fs::create_dir_all(&sdir).unwrap();
            let m = json!({"version": 1, "runId": id, "sessionId": session, "endedAt": ended});
            write_file_mode(&sdir.join(terminal_marker_name(ended, id)), m.to_string().as_bytes(), 0o644);
        }
    }
    dir
}

fn pi_status(id: &str, state: &str, mode: &str, pid: Option<u32>, ended: Option<i64>) -> Value {
    let now = now_ms();
    let mut s = json!({
        "runId": id, "sessionId": "pi-session", "toolCallId": "call-1", "completionOwnerId": "pi-window-1",
        "mode": mode, "state": state, "startedAt": now - 60_000, "lastUpdate": now - 1000,
        "lifecycleArtifactVersion": 3, "cwd": "/",
        "steps": [
            {"agent": "scout", "status": if is_active_state(state) { "running" } else { "completed" }},
            {"agent": "critic", "status": "rejected", "exitCode": null}
        ],
        "workflowGraph": {"nodes": [], "edges": []}
    });
    if let Some(p) = pid {
        s["pid"] = json!(p);
    }
    if let Some(e) = ended {
        s["endedAt"] = json!(e);
    }
    s
}

/// A live process standing for a pi runner; killed when dropped (also on a failed assertion).
struct Sleeper(Child);

impl Sleeper {
    fn new() -> Sleeper {
        let c = Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Sleeper(c)
    }
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Let the daemon (rescan_interval_s = 1) go through several rescans.
/// daemon.json is rewritten only on changes, so there is no file to wait on.
fn let_rescans_pass(n: u64) {
    std::thread::sleep(Duration::from_secs(n + 1));
}

#[test]
fn runs_of_another_host_are_left_byte_for_byte_alone() {
    // `pi-dead` is a run the steward reconciles, as pi-subagents 0.67 would,
    // 30 s after it first sees it (tests/it/steward.rs): off here, so that a
    // slow machine cannot turn this test into a test of the steward.
    let mut env = TestEnv::with_config(&format!("steward = false\n{FAST}"));
    let live = Sleeper::new();
    let day = 86_400_000i64;
    let old = now_ms() - 40 * day;
    let runs = [
        ("pi-live", pi_status("pi-live", "running", "single", Some(live.id()), None)),
        ("pi-dead", pi_status("pi-dead", "running", "chain", Some(999_999), None)),
        ("pi-queued", pi_status("pi-queued", "queued", "single", None, None)),
        ("pi-partial", pi_status("pi-partial", "partial", "parallel", None, Some(old))),
        ("pi-workflow", pi_status("pi-workflow", "complete", "workflow", None, Some(old))),
        ("pi-paused", pi_status("pi-paused", "paused", "single", None, Some(now_ms() - 5000))),
    ];
    for (id, st) in &runs {
        write_pi_run(&env, id, st.clone(), true);
    }
    // A status no reader can parse, with an active marker.
    let broken = write_pi_run(&env, "pi-broken", pi_status("pi-broken", "running", "single", None, None), true);
    fs::write(broken.join("status.json"), b"{\"runId\": \"pi-broken\", \"state\": ").unwrap();
    // pi's result of its own finished run.
    write_file_mode(&env.result_path("pi-partial"), b"{\"runId\":\"pi-partial\",\"state\":\"partial\"}", 0o644);
    let watched = vec![env.runs(), env.results()];
    let before = tree_snapshot(&watched);

    env.start_daemon();
    let_rescans_pass(3);
    // A run of our own goes through meanwhile: runspool keeps working beside pi's runs.
    let (own, _) = env.submit(&request(Some("own-1"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal(&own)["state"], "complete");
    env.restart();
    let_rescans_pass(3);

    let mut after = tree_snapshot(&watched);
    // Only runspool's own run may have changed the trees: drop its entries.
    let ours = |l: &String| {
        l.contains("own-1") || l.contains(&format!("{}", env.terminal_dir().join(seg("default")).display()))
    };
    after.retain(|l| !ours(l));
    let mut before_f = before.clone();
    before_f.retain(|l| !ours(l));
    // The index and results directories' own mtimes change with our run's files.
    let dirs_only = |v: &mut Vec<String>| {
        v.retain(|l| {
            let p = l.split(' ').next().unwrap();
            let p = Path::new(p);
            !(p == env.runs()
                || p == env.results()
                || p == env.active_dir()
                || p == env.terminal_dir()
                || p.starts_with(env.results().join("result-index"))
                || p.starts_with(env.results().join("result-pending")))
        })
    };
    dirs_only(&mut after);
    dirs_only(&mut before_f);
    assert_eq!(before_f, after, "another host's runs, markers and results are unchanged\n{}", env.log_tail(40));
    assert!(process_alive(live.id() as i64), "the live pi runner was not signalled");

    // The CLI shows them, read-only.
    let out = env.cli(&["list", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    for id in ["pi-live", "pi-queued", "pi-partial", "pi-workflow", "pi-broken"] {
        let row = rows.iter().find(|r| r["runId"] == id).unwrap_or_else(|| panic!("{id} listed: {rows:?}"));
        assert_eq!(row["launchedBy"], "other", "{row}");
    }
    let mine = rows.iter().find(|r| r["runId"] == "own-1").unwrap();
    assert_eq!(mine["launchedBy"], "runspool");
    let out = env.cli(&["status", "pi-partial"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("partial") && text.contains("another host"), "{text}");
    let out = env.cli(&["status", "pi-broken"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("unreadable"), "{out:?}");
    let out = env.cli(&["stop", "pi-live"]);
    assert!(!out.status.success(), "stop of another host's run is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("another host"), "{out:?}");
    let mut again = tree_snapshot(&watched);
    again.retain(|l| !ours(l));
    dirs_only(&mut again);
    assert_eq!(before_f, again, "the CLI changed nothing either");
    drop(live);
}

#[test]
fn retention_never_follows_a_marker_outside_runspools_own_runs() {
    let mut env = TestEnv::with_config("retention_days = 1\n[watch]\nrescan_interval_s = 1\n");
    env.leaves_root_inconsistent("terminal markers that name paths outside the runs root, planted on purpose");
    let day = 86_400_000i64;
    let old = now_ms() - 40 * day;
    // Victims: a directory outside the root, one inside the runs root without
    // a status, and an old finished run of another host.
    let outside = env.work.join("precious");
    fs::create_dir_all(outside.join("sub")).unwrap();
    fs::write(outside.join("sub/file"), b"keep me").unwrap();
    let bare = env.run_dir("bare-dir");
    fs::create_dir_all(&bare).unwrap();
    fs::write(bare.join("notes"), b"keep me").unwrap();
    write_pi_run(&env, "pi-old", pi_status("pi-old", "complete", "single", None, Some(old)), true);
    let sdir = env.terminal_dir().join("evil");
    fs::create_dir_all(&sdir).unwrap();
    let rel = "../../work/precious".to_string();
    let targets = [rel.as_str(), outside.to_str().unwrap(), "bare-dir", "..", "."];
    for (i, t) in targets.iter().enumerate() {
        let m = json!({"version": 1, "runId": t, "sessionId": "evil", "endedAt": old + i as i64});
        fs::write(sdir.join(format!("{:016}-x{i}.json", old + i as i64)), m.to_string()).unwrap();
    }
    // And runspool's own old run, which retention must remove.
    env.fabricate_terminal_run("own-old", "default", old, "complete");
    env.fabricate_result("own-old");
    let before = tree_snapshot(&[outside.clone(), bare.clone(), env.run_dir("pi-old")]);
    env.start_daemon();
    wait_until(Duration::from_secs(60), "runspool's own old run removed", || !env.run_dir("own-old").exists());
    assert!(!env.result_path("own-old").exists(), "its result went with it");
    assert_eq!(
        before,
        tree_snapshot(&[outside.clone(), bare.clone(), env.run_dir("pi-old")]),
        "nothing else was removed"
    );
    assert!(outside.join("sub/file").exists() && env.runs().exists() && env.root.exists());
    assert!(list_names(&env.terminal_dir().join(seg("pi-session"))).len() == 1, "another host's marker stays");
}

/// `.active-runs/tool-calls` that is not a directory (ENOTDIR for every
/// alias) must never keep a run's own active marker in place.
#[test]
fn a_broken_tool_call_alias_root_never_strands_the_active_marker() {
    let mut env = TestEnv::with_config(FAST);
    env.start_daemon();
    // A symlink to a file: every path through it fails with ENOTDIR, and no
    // index reader takes it for a marker of its own (only regular files are).
    let target = env.work.join("not-a-directory");
    fs::write(&target, b"not a directory").unwrap();
    std::os::unix::fs::symlink(&target, env.active_dir().join("tool-calls")).unwrap();
    let mut req = request(Some("alias-1"), &env.work, vec![cmd_step("a", &["true"])]);
    req["toolCallId"] = json!("call/with+odd=chars");
    env.submit(&req);
    assert_eq!(env.wait_terminal("alias-1")["state"], "complete");
    wait_until(Duration::from_secs(30), "active marker removed", || !env.active_dir().join("alias-1").exists());
    assert!(env.result_path("alias-1").exists());
    assert_eq!(fs::read(env.active_dir().join("tool-calls")).unwrap(), b"not a directory", "left as it was");
}

/// A long step keeps its run's `lastUpdate` fresh, so pi-subagents 0.67's
/// stale-run rule (live pid, lastUpdate over 24 h old) never fails it. The
/// hourly refresh is shortened here through RUNSPOOL_STATUS_HEARTBEAT_MS.
#[test]
fn a_long_step_keeps_last_update_fresh() {
    let mut env = TestEnv::with_config(FAST);
    env.extra_env.push(("RUNSPOOL_STATUS_HEARTBEAT_MS".into(), "300".into()));
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("hb-1"), &env.work, vec![sh_step("long", &gate_wait(&gate))]));
    let first = env.wait_state("hb-1", "running")["lastUpdate"].as_i64().unwrap();
    let mut seen = vec![first];
    wait_until(Duration::from_secs(60), "lastUpdate refreshed twice while the step runs", || {
        let cur = env.status("hb-1").and_then(|s| s["lastUpdate"].as_i64()).unwrap_or(0);
        if cur > *seen.last().unwrap() {
            seen.push(cur);
        }
        seen.len() >= 3
    });
    assert_eq!(env.status("hb-1").unwrap()["steps"][0]["status"], "running");
    open_gate(&gate);
    assert_eq!(env.wait_terminal("hb-1")["state"], "complete");
}

/// PROTOCOL §10: daemon.json is rewritten on every change of its fields,
/// `lastRescanAt` included, so a client can tell that a rescan happened.
#[test]
fn daemon_json_shows_each_rescan() {
    let mut env = TestEnv::with_config(FAST);
    env.start_daemon();
    let at = |env: &TestEnv| read_json(&env.daemon_json()).and_then(|d| d["lastRescanAt"].as_i64()).unwrap_or(0);
    for _ in 0..3 {
        let before = at(&env);
        wait_until(Duration::from_secs(30), "lastRescanAt advances", || at(&env) > before);
    }
}

/// pi-subagents 0.67's retention tombstones (`.deleting-run-*`, kept 24 h and
/// possibly renamed back into a run) and its tombstone markers are pi's:
/// runspool's start-up and retention sweeps never remove them (PROTOCOL §12).
#[test]
fn pi_retention_tombstones_are_left_alone() {
    let mut env = TestEnv::with_config(FAST);
    let tomb = env.runs().join(".deleting-run-0b9c5d1e");
    mkdir_0700(&tomb);
    write_file_mode(&tomb.join("status.json"), br#"{"runId":"kept-by-pi","state":"complete"}"#, 0o644);
    let markers = env.root.join("async-retention-run-tombstones");
    mkdir_0700(&markers);
    write_file_mode(&markers.join("0b9c5d1e.json"), br#"{"version":1}"#, 0o644);
    let before = tree_snapshot(&[tomb.clone(), markers.clone()]);
    env.start_daemon();
    let (id, _) = env.submit(&request(Some("after-tombs"), &env.work, vec![cmd_step("a", &["true"])]));
    env.wait_terminal(&id);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(tree_snapshot(&[tomb, markers]), before, "a pi tombstone was touched");
}

/// Every pi-subagents 0.67 host removes finished runs older than 30 days
/// under the root, runspool's included: `runspool doctor` warns when
/// `retention_days` asks for more (or for 0, keep everything) on a root
/// that pi hosts use (it holds a run one launched), and only then.
#[test]
fn doctor_warns_that_pi_hosts_remove_runs_older_than_30_days() {
    for (days, pi_run, want) in
        [(0, true, "warn"), (90, true, "warn"), (30, true, "ok"), (7, true, "ok"), (0, false, "ok")]
    {
        let env = TestEnv::with_config(&format!("retention_days = {days}\n"));
        env.leaves_root_inconsistent("no daemon runs: the fabricated runs have no markers or results");
        // One of runspool's own runs is there in every case: it is not a pi host's.
        let own = env.run_dir("rs-own");
        mkdir_0700(&own);
        write_file_mode(&own.join("request.json"), b"{}", 0o600);
        let status = pi_status("rs-own", "complete", "chain", None, Some(now_ms()));
        write_file_mode(&own.join("status.json"), status.to_string().as_bytes(), 0o600);
        if pi_run {
            write_pi_run(&env, "pi-kept", pi_status("pi-kept", "complete", "chain", None, Some(now_ms())), false);
        }
        let config = env.config_path.to_str().unwrap().to_string();
        let o = env.cli(&["doctor", "--json", "--config", &config]);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&o)));
        let check = v["checks"].as_array().and_then(|a| a.iter().find(|c| c["check"] == "retention")).cloned();
        let check = check.unwrap_or_else(|| panic!("no retention check: {}", describe(&o)));
        assert_eq!(check["level"], want, "retention_days = {days}, pi run {pi_run}: {check}");
        let detail = check["detail"].as_str().unwrap_or("");
        if want == "warn" {
            for needle in ["pi-kept", "30 days", "retention_days"] {
                assert!(detail.contains(needle), "the warning does not say {needle:?}: {detail}");
            }
            assert!(!detail.contains("rs-own"), "runspool's own run was taken for a pi host's: {detail}");
        }
    }
}
