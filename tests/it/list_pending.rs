//! Pending requests are runs in every view: `list` (and `--active`,
//! `--json`) shows them in state `pending`, `status` counts them and says
//! when a paused queue holds them, `list --recent N` keeps the active runs,
//! and the table fits the terminal (short ids unique in the root, `--wide`
//! for full ones).

use crate::common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

/// `runspool <args>` with `$COLUMNS` set (stdout piped, as in a script).
fn cli_columns(env: &TestEnv, args: &[&str], columns: Option<&str>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg(args[0]).arg("--root").arg(&env.root).args(&args[1..]);
    cmd.env("XDG_CONFIG_HOME", env.base().join("xdg")).env_remove("COLUMNS").stdin(Stdio::null());
    if let Some(c) = columns {
        cmd.env("COLUMNS", c);
    }
    cmd.output().expect("spawn runspool")
}

fn submit(env: &TestEnv, args: &[&str]) -> String {
    let mut a = vec!["submit", "--cwd", env.work.to_str().unwrap()];
    a.extend_from_slice(args);
    let o = env.cli(&a);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    stdout_str(&o).trim().to_string()
}

fn json_rows(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "{}", describe(o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("JSON ({e}): {}", describe(o)));
    v.as_array().expect("an array").clone()
}

#[test]
fn a_pending_request_is_listed_with_state_pending_without_a_daemon() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the request stays in the spool");
    let id = submit(&env, &["--session", "s-pend", "--", "echo", "waiting-marker"]);
    for args in [&["list"][..], &["list", "--active"], &["list", "--recent", "3"], &["list", "--session", "s-pend"]] {
        let o = env.cli(args);
        assert!(o.status.success(), "{}", describe(&o));
        let out = stdout_str(&o);
        let row = out.lines().find(|l| id.starts_with(l.split(' ').next().unwrap())).unwrap_or_else(|| {
            panic!("`runspool {}` lists the pending request {id}: {}", args.join(" "), describe(&o))
        });
        assert!(row.contains(" pending ") && row.contains("echo waiting-marker"), "{row}");
    }
    let o = env.cli(&["list", "--session", "another"]);
    assert!(!stdout_str(&o).contains("pending"), "another session's list: {}", describe(&o));
    for args in [&["list", "--json"][..], &["list", "--active", "--json"]] {
        let rows = json_rows(&env.cli(args));
        let row = rows.iter().find(|r| r["runId"] == id.as_str()).unwrap_or_else(|| panic!("{id} in {rows:?}"));
        assert_eq!(row["state"], "pending", "{row}");
        assert_eq!(row["sessionId"], "s-pend", "{row}");
    }
    let o = env.cli(&["status"]);
    assert!(stdout_str(&o).contains("1 pending"), "the daemon summary counts it: {}", describe(&o));
}

#[test]
fn a_paused_queue_is_the_reason_a_request_waits_and_is_counted() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let o = env.cli(&["pause", "--reason", "disk-maintenance"]);
    assert!(o.status.success(), "{}", describe(&o));
    wait_until(Duration::from_secs(30), "daemon.json reports the queue paused", || {
        read_json(&env.root.join("runspool").join("daemon.json")).is_some_and(|d| d["queue"]["paused"] == true)
    });
    let id = submit(&env, &["--", "true"]);
    let o = env.cli(&["status", &id]);
    let out = stdout_str(&o);
    assert!(out.contains("pending"), "{}", describe(&o));
    assert!(out.contains("paused") && out.contains("disk-maintenance") && out.contains("runspool resume"), "{out}");
    assert!(!out.contains("claims the request in turn"), "not while the queue is paused: {out}");
    let o = env.cli(&["status"]);
    let out = stdout_str(&o);
    assert!(out.contains("1 pending") && !out.contains("0 pending"), "{}", describe(&o));
    let rows = json_rows(&env.cli(&["list", "--json"]));
    assert!(rows.iter().any(|r| r["runId"] == id.as_str() && r["state"] == "pending"), "{rows:?}");

    let o = env.cli(&["resume"]);
    assert!(o.status.success(), "{}", describe(&o));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "complete", "{st}");
    let rows = json_rows(&env.cli(&["list", "--json"]));
    assert_eq!(rows.iter().filter(|r| r["runId"] == id.as_str()).count(), 1, "listed once: {rows:?}");
    assert!(rows.iter().all(|r| r["state"] != "pending"), "{rows:?}");
}

#[test]
fn recent_keeps_active_runs_and_rows_fit_80_columns_with_short_ids() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let done: Vec<String> = (0..3).map(|_| submit(&env, &["--", "true"])).collect();
    for id in &done {
        env.wait_terminal(id);
    }
    let gate = env.work.join("gate-live");
    let long = "a-long-argument-".repeat(8);
    let live = submit(&env, &["--session", "a-rather-long-session", "--", "sh", "-c", &gate_wait(&gate), &long]);
    env.wait_state(&live, "running");

    // --recent 1: the running run, and the newest finished one.
    let rows = json_rows(&env.cli(&["list", "--recent", "1", "--json"]));
    let ids: Vec<&str> = rows.iter().map(|r| r["runId"].as_str().unwrap_or("?")).collect();
    assert_eq!(ids, vec![live.as_str(), done[2].as_str()], "{rows:?}");
    let out = stdout_str(&env.cli(&["list", "--recent", "1"]));
    assert!(out.contains("running"), "the running run stays: {out}");

    // At 80 columns every row fits, with ids cut to a prefix unique in the root.
    let o = cli_columns(&env, &["list"], Some("80"));
    assert!(o.status.success(), "{}", describe(&o));
    let out = stdout_str(&o);
    assert!(out.lines().count() >= 5, "{out}");
    for l in out.lines() {
        assert!(l.chars().count() <= 80, "{} columns: {l:?}\n{out}", l.chars().count());
    }
    for id in done.iter().chain([&live]) {
        let short = out
            .lines()
            .filter_map(|l| l.split(' ').next())
            .find(|s| id.starts_with(*s) && s.len() >= 8)
            .unwrap_or_else(|| panic!("{id} listed by a prefix: {out}"));
        assert!(short.len() < id.len(), "{short} is shorter than {id}");
        let o = env.cli(&["status", short, "--json"]);
        assert!(o.status.success(), "`status {short}` resolves: {}", describe(&o));
        let st: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(st["runId"], id.as_str(), "{short} names {id}");
    }
    assert!(out.lines().any(|l| l.contains("running") && l.ends_with('…')), "the long command is cut: {out}");

    // --wide: the full ids and the whole command.
    let o = cli_columns(&env, &["list", "--wide"], Some("80"));
    let out = stdout_str(&o);
    for id in done.iter().chain([&live]) {
        assert!(out.lines().any(|l| l.starts_with(&format!("{id} "))), "{id} in full: {out}");
    }
    assert!(out.contains(&long), "{out}");
    open_gate(&gate);
    env.wait_terminal(&live);
}
