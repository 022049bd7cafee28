//! `runspool edit` of a held run (issue 21 item 1): the edited request runs
//! after release, with the scheduling it now asks for; a run that is not
//! held and an edit that fails the claim's validation are refused with the
//! request left as it was. And `runspool list --lane`. Real daemon, real
//! runners, an `$EDITOR` that rewrites the file with sed.

use crate::common;

use std::fs;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

/// `runspool edit <run>` with `editor` as $EDITOR; drafts go to the test's directory.
fn edit(env: &TestEnv, run: &str, editor: &str) -> Output {
    Command::new(BIN)
        .args(["edit", "--root"])
        .arg(&env.root)
        .arg(run)
        .env("EDITOR", editor)
        .env_remove("VISUAL")
        .env("TMPDIR", env.base())
        .env("XDG_CONFIG_HOME", env.base().join("xdg"))
        .stdin(Stdio::null())
        .output()
        .expect("run runspool edit")
}

fn ok(env: &TestEnv, args: &[&str]) -> String {
    let out = env.cli(args);
    assert!(out.status.success(), "`runspool {}` failed: {}\n{}", args.join(" "), describe(&out), env.log_tail(40));
    stdout_str(&out)
}

fn wait_held(env: &TestEnv, id: &str) {
    wait_until(Duration::from_secs(30), &format!("{id} queued and held"), || {
        env.status(id).is_some_and(|s| s["state"] == "queued" && s["held"] == true)
    });
}

fn request_bytes(env: &TestEnv, id: &str) -> Vec<u8> {
    fs::read(env.run_dir(id).join("request.json")).unwrap()
}

#[test]
fn an_edited_held_run_runs_the_new_command_in_its_new_lane_after_release() {
    let mut env = TestEnv::with_config("max_running = 4\n[lanes.solo]\nmax_running = 1\n");
    env.start_daemon();
    let work = env.work.to_str().unwrap().to_string();
    let base = env.base();
    let gate = base.join("gate");
    let blocker_started = base.join("blocker-started");
    let blocker = format!("touch '{}'; {}", blocker_started.display(), gate_wait(&gate));
    ok(&env, &["submit", "--run-id", "blocker", "--cwd", &work, "--lane", "solo", "--", "sh", "-c", &blocker]);
    env.wait_file(&blocker_started);
    let old = base.join("ran-old");
    let cmd = format!("touch '{}'", old.display());
    ok(&env, &["submit", "--run-id", "edited", "--cwd", &work, "--lane", "cpu", "--hold", "--", "sh", "-c", &cmd]);
    wait_held(&env, "edited");
    // The new command, and lane solo, whose one slot the blocker holds.
    let out = edit(&env, "edited", r#"sed -i -e 's/ran-old/ran-new/' -e 's/"cpu"/"solo"/'"#);
    assert!(out.status.success(), "{}", describe(&out));
    let req: Value = serde_json::from_slice(&request_bytes(&env, "edited")).unwrap();
    assert_eq!(req["lane"], "solo", "{req}");
    assert!(req.to_string().contains("ran-new"), "{req}");
    let s = env.status("edited").unwrap();
    assert_eq!(
        (s["state"].as_str(), s["held"].as_bool(), s["lane"].as_str()),
        (Some("queued"), Some(true), Some("solo"))
    );
    ok(&env, &["release", "edited"]);
    // It waits for its new lane's slot, not starting beside the blocker.
    wait_until(Duration::from_secs(30), "edited waits for lane solo", || {
        env.status("edited").is_some_and(|s| s["state"] == "queued" && s["waiting"] == "lane")
    });
    open_gate(&gate);
    assert_eq!(env.wait_terminal("blocker")["state"], "complete");
    assert_eq!(env.wait_terminal("edited")["state"], "complete");
    assert!(base.join("ran-new").exists(), "the edited command ran");
    assert!(!old.exists(), "the original command never ran");
    env.check_consistency();
}

#[test]
fn a_run_that_is_not_held_is_not_edited() {
    let mut env = TestEnv::with_config("max_running = 1\n");
    env.start_daemon();
    let work = env.work.to_str().unwrap().to_string();
    let gate = env.base().join("gate");
    let started = env.base().join("started");
    let script = format!("touch '{}'; {}", started.display(), gate_wait(&gate));
    ok(&env, &["submit", "--run-id", "running", "--cwd", &work, "--", "sh", "-c", &script]);
    env.wait_file(&started);
    ok(&env, &["submit", "--run-id", "queued", "--cwd", &work, "--", "sh", "-c", "echo original"]);
    wait_until(Duration::from_secs(30), "queued waits for max_running", || {
        env.status("queued").is_some_and(|s| s["waiting"] == "max_running")
    });
    let sed = "sed -i s/original/changed/";
    for (id, says) in [("running", "running, not queued and held"), ("queued", "queued but not held")] {
        let before = request_bytes(&env, id);
        let out = edit(&env, id, sed);
        assert_eq!(out.status.code(), Some(1), "{id}: {}", describe(&out));
        assert!(stderr_str(&out).contains(says), "{id}: {}", describe(&out));
        assert_eq!(request_bytes(&env, id), before, "{id}: request.json untouched");
    }
    open_gate(&gate);
    assert_eq!(env.wait_terminal("queued")["state"], "complete");
    assert_eq!(env.output_log("queued", 0).trim(), "original");
    env.check_consistency();
}

#[test]
fn an_invalid_edit_is_refused_and_the_original_kept() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let work = env.work.to_str().unwrap().to_string();
    ok(&env, &["submit", "--run-id", "held", "--cwd", &work, "--hold", "--", "sh", "-c", "echo original"]);
    wait_held(&env, "held");
    let before = request_bytes(&env, "held");
    let status_before = env.status("held").unwrap();
    let missing = env.base().join("no-such-dir");
    let cases = [
        (format!(r#"sed -i -e 's/original/changed/' -e 's|"cwd": *"[^"]*"|"cwd": "{}"|'"#, missing.display()), "cwd"),
        (r#"sed -i -e 's/original/changed/' -e 's/"held"/"other"/'"#.to_string(), "runId"),
        (r#"sh -c 'sed -i s/original/changed/ "$0" && echo "{" >> "$0"'"#.to_string(), "JSON"),
    ];
    for (editor, field) in cases {
        let out = edit(&env, "held", &editor);
        let err = stderr_str(&out);
        assert_eq!(out.status.code(), Some(1), "{editor}: {}", describe(&out));
        assert!(err.contains(field) && err.contains("unchanged"), "{editor}: {}", describe(&out));
        assert_eq!(request_bytes(&env, "held"), before, "{editor}: request.json untouched");
        // The edited text is kept in the file the message names.
        let draft = err.split("the edited text is in ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap();
        assert!(fs::read_to_string(draft).unwrap().contains("changed"), "{editor}: draft {draft}");
    }
    let s = env.status("held").unwrap();
    assert_eq!(s["steps"], status_before["steps"]);
    assert_eq!(s["held"], true);
    ok(&env, &["release", "held"]);
    assert_eq!(env.wait_terminal("held")["state"], "complete");
    assert_eq!(env.output_log("held", 0).trim(), "original");
    env.check_consistency();
}

#[test]
fn list_lane_shows_only_that_lanes_runs_and_requests() {
    let mut env = TestEnv::new();
    let work = env.work.to_str().unwrap().to_string();
    // Before any daemon runs, the requests wait in the spool.
    ok(&env, &["submit", "--run-id", "pending-gpu", "--cwd", &work, "--lane", "gpu", "--", "true"]);
    ok(&env, &["submit", "--run-id", "pending-cpu", "--cwd", &work, "--lane", "cpu", "--", "true"]);
    let listed = ok(&env, &["list", "--lane", "gpu", "--wide"]);
    assert!(listed.contains("pending-gpu") && !listed.contains("pending-cpu"), "{listed}");
    env.start_daemon();
    for id in ["pending-gpu", "pending-cpu"] {
        env.wait_terminal(id);
    }
    ok(&env, &["submit", "--run-id", "held-gpu", "--cwd", &work, "--lane", "gpu", "--hold", "--", "true"]);
    ok(&env, &["submit", "--run-id", "held-cpu", "--cwd", &work, "--lane", "cpu", "--hold", "--", "true"]);
    ok(&env, &["submit", "--run-id", "held-plain", "--cwd", &work, "--hold", "--", "true"]);
    for id in ["held-gpu", "held-cpu", "held-plain"] {
        wait_held(&env, id);
    }
    let ids = |args: &[&str]| -> Vec<String> {
        let rows: Value = serde_json::from_str(&ok(&env, args)).unwrap();
        let mut ids: Vec<String> =
            rows.as_array().unwrap().iter().map(|r| r["runId"].as_str().unwrap().into()).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&["list", "--lane", "gpu", "--json"]), ["held-gpu", "pending-gpu"]);
    assert_eq!(ids(&["list", "--lane", "gpu", "--active", "--json"]), ["held-gpu"]);
    assert_eq!(ids(&["list", "--lane", "default", "--json"]), ["held-plain"]);
    let table = ok(&env, &["list", "--lane", "cpu", "--wide"]);
    assert!(table.contains("held-cpu") && table.contains("pending-cpu"), "{table}");
    assert!(!table.contains("gpu") && !table.contains("held-plain"), "{table}");
    for id in ["held-gpu", "held-cpu", "held-plain"] {
        ok(&env, &["release", id]);
        env.wait_terminal(id);
    }
    env.check_consistency();
}
