//! A run is its directory (DESIGN principle 9, SECURITY.md): no id read
//! from a file ever becomes a path. A status whose `runId` is not the name of
//! its directory (a crafted file, or a plain `cp -r run run.bak`) and a run
//! directory that is a symbolic link are reported and left alone by
//! recovery, rescans, repairs, result publishing, `rm`, `clean` and the bridge.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const FAST: &str = "max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 1\n";

/// The names directly in `dir` (a listing of what exists beside the root).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
    v.sort();
    v
}

/// A run directory of runspool's shape (request.json, status.json, active
/// marker when active) whose status says `status_run_id` in state `state`.
fn crafted_run(env: &TestEnv, dir_name: &str, status_run_id: &str, state: &str) -> PathBuf {
    let dir = env.run_dir(dir_name);
    mkdir_0700(&dir);
    let req = request(Some(dir_name), &env.work, vec![sh_step("a", "echo crafted > crafted-ran")]);
    write_file_mode(&dir.join("request.json"), serde_json::to_vec(&req).unwrap().as_slice(), 0o600);
    let now = now_ms();
    let mut st = json!({
        "runId": status_run_id, "sessionId": "s", "mode": "single", "state": state,
        "startedAt": now - 5000, "lastUpdate": now - 4000, "timeoutMs": 0, "pid": 999_999,
        "runner": {"pid": 999_999, "hostname": "localhost", "processInstanceId": "x"},
        "cwd": env.work, "currentStep": 0, "chainStepCount": 1,
        "queue": {"priority": 0, "claimedAt": now - 5000},
        "steps": [{"agent": "a", "status": if state == "running" { "running" } else { "pending" }}]
    });
    if !is_active_state(state) {
        st["endedAt"] = json!(now - 4000);
        st["exitCode"] = json!(1);
    }
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
    if is_active_state(state) {
        write_file_mode(&env.active_dir().join(dir_name), b"", 0o600);
    }
    dir
}

/// A directory outside the root that a traversing id would land on, holding
/// a valid queued run (so that a daemon that joined the id would act there).
fn decoy(env: &TestEnv, name: &str) -> PathBuf {
    let d = env.base().join(name);
    mkdir_0700(&d);
    let req = request(Some(name), &env.work, vec![sh_step("a", "echo decoy > decoy-ran")]);
    write_file_mode(&d.join("request.json"), serde_json::to_vec(&req).unwrap().as_slice(), 0o600);
    let st = json!({"runId": name, "sessionId": "s", "mode": "single", "state": "queued",
        "startedAt": now_ms(), "lastUpdate": now_ms(), "cwd": env.work, "steps": [{"agent": "a", "status": "pending"}]});
    write_file_mode(&d.join("status.json"), st.to_string().as_bytes(), 0o600);
    d
}

#[test]
fn ids_read_from_files_never_steer_the_daemon_outside_its_root() {
    let mut env = TestEnv::with_config(FAST);
    env.leaves_root_inconsistent("statuses that name hostile run ids, planted on purpose");
    // Ids that climb out of the runs root (<base>/root/async-subagent-runs).
    let victim = env.base().join("victim.txt");
    fs::write(&victim, b"do not touch").unwrap();
    let outq = decoy(&env, "outq");
    let outrun = decoy(&env, "outsiderun");
    let crafted = [
        crafted_run(&env, "evil-running", "../../../victim.txt", "running"),
        crafted_run(&env, "evil-queued", "../../outq", "queued"),
        crafted_run(&env, "evil-rescan", "../../outsiderun", "running"),
        crafted_run(&env, "evil-ended", "../../ended-victim", "failed"),
        crafted_run(&env, "evil-empty", "", "running"),
    ];
    let before_crafted = tree_snapshot(&crafted);
    let before_outside = tree_snapshot(&[outq.clone(), outrun.clone(), victim.clone()]);
    let before_names = names(&env.base());
    env.start_daemon();
    // A run of its own still goes through while the crafted ones sit there.
    let (id, _) = env.submit(&request(Some("plain-run"), &env.work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    // Start-up, the slices of every run directory, and several rescans.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(tree_snapshot(&crafted), before_crafted, "a crafted run directory was changed");
    assert_eq!(
        tree_snapshot(&[outq.clone(), outrun.clone(), victim.clone()]),
        before_outside,
        "a path outside the root was changed"
    );
    let mut now_names = names(&env.base());
    now_names.retain(|n| n != "daemon.log");
    let mut was = before_names.clone();
    was.retain(|n| n != "daemon.log");
    assert_eq!(now_names, was, "a file appeared or vanished beside the root");
    assert!(!outq.join("decoy-ran").exists() && !outrun.join("decoy-ran").exists(), "a runner ran outside the root");
    assert!(!env.work.join("crafted-ran").exists(), "a crafted run's step ran");
    for evil in ["evil-running", "evil-queued", "evil-rescan"] {
        assert!(env.active_dir().join(evil).exists(), "the marker of {evil} was removed");
    }
    assert!(!env.results().join("..").join("..").join("ended-victim.json").exists());
    // Reported: in the log, and by `status`, naming the directory and the fix.
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    assert!(log.contains("not this run's own"), "no report in the daemon log:\n{}", env.log_tail(40));
    let o = env.cli(&["status", "evil-running"]);
    assert!(!o.status.success(), "status of a mismatched run: {}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("evil-running") && err.contains("a run is its directory"), "{err}");
    let o = env.cli(&["doctor", "--json"]);
    let checks: Value = serde_json::from_str(stdout_str(&o).trim()).unwrap_or(Value::Null);
    let identity = checks["checks"].as_array().and_then(|a| a.iter().find(|c| c["check"] == "run identity")).cloned();
    let detail = identity.as_ref().map(|c| c["detail"].to_string()).unwrap_or_default();
    assert!(
        identity.is_some_and(|c| c["level"] == "warn") && detail.contains("evil-queued"),
        "doctor does not report the mismatched runs: {}",
        describe(&o)
    );
}

#[test]
fn a_copied_running_run_is_not_mistaken_for_its_original() {
    let mut env = TestEnv::with_config(FAST);
    env.leaves_root_inconsistent("orig.bak is a copy of a run directory, its status naming orig");
    env.start_daemon();
    let gate = env.work.join("gate");
    let (id, _) = env.submit(&request(Some("orig"), &env.work, vec![sh_step("a", &gate_wait(&gate))]));
    env.wait_state(&id, "running");
    env.kill9();
    // What a user does to keep a copy: cp -r run run.bak (the copy's lock is not held).
    let copy = env.run_dir("orig.bak");
    let o = std::process::Command::new("cp").arg("-a").arg(env.run_dir(&id)).arg(&copy).output().unwrap();
    assert!(o.status.success());
    let before_copy = tree_snapshot(std::slice::from_ref(&copy));
    env.restart();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(env.state(&id).as_deref(), Some("running"), "the original was ended by its copy");
    assert!(env.active_dir().join(&id).exists(), "the original's active marker was removed while it runs");
    assert!(!env.result_path(&id).exists(), "a result was published for a run that still runs");
    assert_eq!(tree_snapshot(std::slice::from_ref(&copy)), before_copy, "the copy was changed");
    open_gate(&gate);
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    assert_eq!(env.result(&id).unwrap()["state"], "complete");
    assert_eq!(tree_snapshot(std::slice::from_ref(&copy)), before_copy, "the copy was changed");
}

#[test]
fn rm_and_clean_remove_only_the_directory_named() {
    let env = TestEnv::with_config(FAST);
    env.leaves_root_inconsistent("statuses that name other runs, planted on purpose");
    let ended = now_ms() - 3_600_000;
    env.fabricate_terminal_run("kept", "s", ended, "complete");
    env.fabricate_result("kept");
    // A copy of `kept` under another name: its status names `kept`.
    let o =
        std::process::Command::new("cp").arg("-a").arg(env.run_dir("kept")).arg(env.run_dir("copy")).output().unwrap();
    assert!(o.status.success());
    // A run whose status names a directory outside the root.
    let outside = env.base().join("outside");
    mkdir_0700(&outside);
    fs::write(outside.join("precious"), b"x").unwrap();
    env.fabricate_terminal_run("climber", "s", ended, "complete");
    let st_path = env.run_dir("climber").join("status.json");
    let mut st: Value = serde_json::from_slice(&fs::read(&st_path).unwrap()).unwrap();
    st["runId"] = json!("../../outside");
    fs::write(&st_path, st.to_string()).unwrap();
    // A run directory that is a symbolic link to a finished run kept elsewhere.
    let elsewhere = env.base().join("elsewhere");
    let o = std::process::Command::new("cp").arg("-a").arg(env.run_dir("kept")).arg(&elsewhere).output().unwrap();
    assert!(o.status.success());
    let st_path = elsewhere.join("status.json");
    let mut st: Value = serde_json::from_slice(&fs::read(&st_path).unwrap()).unwrap();
    st["runId"] = json!("linked");
    fs::write(&st_path, st.to_string()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, env.run_dir("linked")).unwrap();
    let before = tree_snapshot(&[env.run_dir("kept"), outside.clone(), elsewhere.clone()]);
    let before_elsewhere = tree_snapshot(std::slice::from_ref(&elsewhere));
    for target in ["copy", "climber", "linked"] {
        let o = env.cli(&["rm", target]);
        assert!(!o.status.success(), "rm {target} succeeded: {}", describe(&o));
        let err = stderr_str(&o);
        assert!(err.contains("nothing was removed") || err.contains("no run"), "{}", describe(&o));
        assert_eq!(
            tree_snapshot(&[env.run_dir("kept"), outside.clone(), elsewhere.clone()]),
            before,
            "rm {target} harmed another run"
        );
    }
    assert!(env.run_dir("copy").is_dir() && env.run_dir("climber").is_dir());
    assert!(fs::symlink_metadata(env.run_dir("linked")).unwrap().file_type().is_symlink());
    // clean: only `kept` is a finished run of runspool's whose status is its own.
    let o = env.cli(&["clean", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_str(stdout_str(&o).trim()).unwrap();
    assert_eq!(v["removed"], json!(["kept"]), "{v}");
    assert!(env.run_dir("copy").is_dir() && env.run_dir("climber").is_dir());
    assert!(outside.join("precious").exists());
    assert_eq!(
        tree_snapshot(std::slice::from_ref(&elsewhere)),
        before_elsewhere,
        "clean followed a symlinked run directory"
    );
    // `rm` of the run itself works.
    env.fabricate_terminal_run("mine", "s", ended, "failed");
    let o = env.cli(&["rm", "mine"]);
    assert!(o.status.success(), "{}", describe(&o));
    assert!(!env.run_dir("mine").exists());
}

/// A provider that records each call; a call at all is the failure here.
const PROVIDER: &str =
    "#!/bin/sh\necho \"$1\" >> '@LOG@'\nprintf '%s\\n' '{\"providerJobId\":\"job-1\",\"state\":\"queued\"}'\n";

#[test]
fn the_bridge_never_follows_a_symlinked_run_directory() {
    let env = TestEnv::new();
    let calls = env.base().join("calls.log");
    let exe = env.base().join("provider.sh");
    fs::write(&exe, PROVIDER.replace("@LOG@", calls.to_str().unwrap())).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    env.write_config(&format!(
        "{FAST}[providers.p]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 60000\n",
        exe.display()
    ));
    // A pi run (no request.json) kept outside the root, linked into the runs root.
    let outside = env.base().join("pi-outside");
    mkdir_0700(&outside);
    let now = now_ms();
    let st = json!({"runId": "pirun", "sessionId": "pi", "mode": "single", "state": "running",
        "startedAt": now, "lastUpdate": now, "pid": std::process::id(), "cwd": "/",
        "steps": [{"agent": "x", "status": "running"}]});
    write_file_mode(&outside.join("status.json"), st.to_string().as_bytes(), 0o644);
    mkdir_0700(&outside.join("external-job-requests"));
    mkdir_0700(&outside.join("external-job-responses"));
    let prompt = "echo hi";
    let req = json!({"id": "r1", "operation": "status", "provider": "p", "providerJobId": "job-1", "createdAt": now,
        "start": {"prompt": prompt, "promptDigest": sha256_hex(prompt.as_bytes()), "cwd": "/", "runId": "pirun",
                  "stepIndex": 0, "agent": "x", "options": {}}});
    write_file_mode(&outside.join("external-job-requests/r1.json"), req.to_string().as_bytes(), 0o600);
    std::os::unix::fs::symlink(&outside, env.run_dir("pirun")).unwrap();
    write_file_mode(&env.active_dir().join("pirun"), b"", 0o600);
    let before = tree_snapshot(std::slice::from_ref(&outside));
    let mut env = env;
    env.start_daemon();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        tree_snapshot(std::slice::from_ref(&outside)),
        before,
        "the bridge wrote through a symlinked run directory"
    );
    assert!(!calls.exists(), "the provider ran for a request outside the root: {:?}", fs::read_to_string(&calls));
    assert!(fs::symlink_metadata(env.run_dir("pirun")).unwrap().file_type().is_symlink());
    assert!(env.active_dir().join("pirun").exists(), "another host's marker was removed");
}
