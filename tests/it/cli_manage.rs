//! `restart`, `rm`, `clean` and run-id completion: runspool manages only its
//! own finished runs (PROTOCOL §14), through the spool and the indexes.

use crate::common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::{json, Value};

/// A finished run of another host: no request.json, its own status and marker.
fn write_foreign_run(env: &TestEnv, id: &str, ended: i64) {
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    let st = json!({
        "runId": id, "sessionId": "pi-session", "mode": "single", "state": "complete",
        "startedAt": ended - 1000, "lastUpdate": ended, "endedAt": ended, "cwd": "/", "exitCode": 0,
        "steps": [{"agent": "a", "status": "complete"}]
    });
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o644);
    let sdir = env.terminal_dir().join(seg("pi-session"));
    fs::create_dir_all(&sdir).unwrap();
    let m = json!({"version": 1, "runId": id, "sessionId": "pi-session", "endedAt": ended});
    write_file_mode(&sdir.join(terminal_marker_name(ended, id)), m.to_string().as_bytes(), 0o644);
}

/// Every path under `dir`, for before/after comparisons.
fn tree(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = walk_all(dir).into_iter().map(|p| p.display().to_string()).collect();
    v.sort();
    v
}

fn marker_exists(env: &TestEnv, session: &str, id: &str) -> bool {
    list_names(&env.terminal_dir().join(seg(session))).iter().any(|n| n.ends_with(&format!("-{}.json", seg(id))))
}

#[test]
fn restart_of_a_finished_run_is_a_new_linked_run_with_the_same_steps() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let mut req = request(Some("rs-old"), &env.work, vec![sh_step("first", "echo one"), sh_step("second", "echo two")]);
    req["toolCallId"] = json!("call-7");
    req["completionOwnerId"] = json!("window-1");
    env.submit(&req);
    assert_eq!(env.wait_terminal("rs-old")["state"], "complete");
    let o = env.cli(&["restart", "rs-old"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let new_id = stdout_str(&o).trim().to_string();
    assert!(!new_id.is_empty() && new_id != "rs-old", "prints the new run id: {new_id:?}");
    let st = env.wait_terminal(&new_id);
    assert_eq!(st["state"], "complete", "{}", env.runs_summary(5));
    assert_eq!(st["restartOf"], "rs-old", "the link is in the new run's status: {st}");
    let shown = env.cli(&["status", &new_id]);
    assert!(
        stdout_str(&shown).lines().any(|l| l == "restart   of rs-old"),
        "status names the old run: {}",
        describe(&shown)
    );
    let req: Value = read_json(&env.run_dir(&new_id).join("request.json")).unwrap();
    let old: Value = read_json(&env.run_dir("rs-old").join("request.json")).unwrap();
    assert_eq!(req["steps"], old["steps"], "same steps");
    assert_eq!(req["restartOf"], "rs-old");
    assert!(req.get("toolCallId").is_none() && req.get("completionOwnerId").is_none(), "no host waits for it: {req}");
    assert_eq!(fs::read_to_string(env.run_dir(&new_id).join("output-1.log")).unwrap().trim(), "two");
    // The old run is untouched.
    assert_eq!(env.status("rs-old").unwrap()["state"], "complete");
}

#[test]
fn restart_is_refused_for_another_hosts_run_and_an_active_run() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("own-live is fabricated running without an active marker");
    write_foreign_run(&env, "pi-done", now_ms() - 1000);
    let o = env.cli(&["restart", "pi-done"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr_str(&o).contains("only runs runspool launched can be restarted"), "{}", describe(&o));
    assert!(list_names(&env.spool()).iter().all(|n| !n.ends_with(".json")), "nothing was submitted");

    env.fabricate_terminal_run("own-live", "default", now_ms(), "complete");
    let dir = env.run_dir("own-live");
    let mut st: Value = read_json(&dir.join("status.json")).unwrap();
    st["state"] = json!("running");
    st["endedAt"] = Value::Null;
    fs::write(dir.join("status.json"), st.to_string()).unwrap();
    let o = env.cli(&["restart", "own-live"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr_str(&o).contains("is still running"), "{}", describe(&o));
}

#[test]
fn rm_removes_a_finished_run_its_result_and_markers() {
    let env = TestEnv::new();
    let ended = now_ms() - 5000;
    env.fabricate_terminal_run("rm-done", "default", ended, "complete");
    env.fabricate_result("rm-done");
    assert!(marker_exists(&env, "default", "rm-done"));
    let o = env.cli(&["rm", "rm-done", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["removed"], json!(["rm-done"]));
    assert!(!env.run_dir("rm-done").exists(), "the run directory is gone");
    assert!(!env.result_path("rm-done").exists(), "the result is gone");
    assert!(!marker_exists(&env, "default", "rm-done"), "the terminal marker is gone");
    assert!(list_names(&env.runs()).iter().all(|n| !n.starts_with(".runspool-deleting-")), "no tombstone left");
}

/// The runner of a finished run holds its lock for a moment after the
/// terminal status and the result appear (its last writes, its exit), so
/// `runspool wait ID && runspool rm ID` could meet it: `rm` waits for it.
#[test]
fn rm_waits_for_the_runner_of_a_finished_run_to_exit() {
    let env = TestEnv::new();
    env.fabricate_terminal_run("finishing", "default", now_ms() - 1000, "complete");
    let lock = fs::File::create(env.run_dir("finishing").join("runner.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) }, 0);
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(700));
        drop(lock);
    });
    let o = env.cli(&["rm", "finishing"]);
    release.join().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(!env.run_dir("finishing").exists(), "the run directory is gone");
}

#[test]
fn rm_refuses_an_active_run_and_another_hosts_run_and_changes_nothing() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("own-live is fabricated running without an active marker");
    write_foreign_run(&env, "pi-done", now_ms() - 1000);
    env.fabricate_terminal_run("own-done", "default", now_ms() - 1000, "complete");
    env.fabricate_terminal_run("own-live", "default", now_ms(), "complete");
    let live = env.run_dir("own-live");
    let mut st: Value = read_json(&live.join("status.json")).unwrap();
    st["state"] = json!("running");
    fs::write(live.join("status.json"), st.to_string()).unwrap();
    let before = tree(&env.root);
    for (args, why) in [
        (vec!["rm", "pi-done"], "launched by another host"),
        (vec!["rm", "own-live"], "is still running"),
        // One refusal and nothing is removed, not even the removable one.
        (vec!["rm", "own-done", "pi-done"], "launched by another host"),
    ] {
        let o = env.cli(&args);
        assert_ne!(o.status.code(), Some(0), "{args:?}: {}", describe(&o));
        assert!(stderr_str(&o).contains(why), "{args:?}: {}", describe(&o));
        assert_eq!(before, tree(&env.root), "{args:?} changed nothing");
    }
    // A finished run whose runner still holds its lock is not removed either.
    let lock = fs::File::create(env.run_dir("own-done").join("runner.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) }, 0);
    let before = tree(&env.root);
    let o = env.cli(&["rm", "own-done"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr_str(&o).contains("runner still holds"), "{}", describe(&o));
    assert_eq!(before, tree(&env.root), "a held runner lock changes nothing");
    drop(lock);
    // clean skips both as well.
    let o = env.cli(&["clean", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["removed"], json!(["own-done"]));
    assert!(env.run_dir("pi-done").join("status.json").exists() && live.join("status.json").exists());
    assert!(marker_exists(&env, "pi-session", "pi-done"), "another host's marker stays");
}

#[test]
fn clean_older_than_keeps_young_runs_and_dry_run_removes_nothing() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the fabricated young run has no result");
    let day = 86_400_000;
    env.fabricate_terminal_run("cl-old", "default", now_ms() - 3 * day, "failed");
    env.fabricate_result("cl-old");
    env.fabricate_terminal_run("cl-young", "default", now_ms() - 1000, "complete");
    let before = tree(&env.root);
    let o = env.cli(&["clean", "--older-than", "1d", "--dry-run"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(stdout_str(&o).trim(), "would remove cl-old");
    assert_eq!(before, tree(&env.root), "--dry-run removes nothing");
    let o = env.cli(&["clean", "--older-than", "1d"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(stdout_str(&o).trim(), "removed cl-old");
    assert!(!env.run_dir("cl-old").exists() && !env.result_path("cl-old").exists());
    assert!(env.run_dir("cl-young").join("status.json").exists(), "the young run stays");
    let o = env.cli(&["clean", "--state", "failed", "--json"]);
    assert_eq!(serde_json::from_slice::<Value>(&o.stdout).unwrap()["removed"], json!([]));
    assert!(env.run_dir("cl-young").exists(), "--state failed keeps a complete run");
}

#[test]
fn completion_lists_run_ids_and_pending_requests() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the request stays in the spool, the fabricated run has no result");
    env.fabricate_terminal_run("cmp-done-1", "default", now_ms() - 1000, "complete");
    env.drop_bytes(
        "cmp-pend",
        request(Some("cmp-pend"), &env.work, vec![cmd_step("a", &["true"])]).to_string().as_bytes(),
    );
    let o = env.cli(&["__complete-runs"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let ids: Vec<String> = stdout_str(&o).lines().map(str::to_string).collect();
    assert!(ids.contains(&"cmp-done-1".to_string()) && ids.contains(&"cmp-pend".to_string()), "{ids:?}");

    // The bash script offers them for a run argument.
    let script = env.cli(&["completions", "bash"]);
    let script_path = env.work.join("runspool.bash");
    fs::write(&script_path, &script.stdout).unwrap();
    let bin_dir = Path::new(BIN).parent().unwrap();
    let probe = format!(
        "source '{}'; COMP_WORDS=(runspool rm cmp-d); COMP_CWORD=2; _runspool_with_run_ids runspool cmp-d rm; \
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script_path.display()
    );
    let o = Command::new("bash")
        .args(["--norc", "-c", &probe])
        .env("PATH", format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default()))
        .env("RUNSPOOL_ROOT", &env.root)
        .output()
        .unwrap();
    assert_eq!(stdout_str(&o).trim(), "cmp-done-1", "{}", describe(&o));

    for shell in ["zsh", "fish"] {
        let s = stdout_str(&env.cli(&["completions", shell]));
        assert!(s.contains("runspool __complete-runs"), "{shell} script completes run ids:\n{s}");
    }
}
