//! The CLI's use of the indexes: `list --recent N` reads the terminal index
//! newest first and never needs the older runs; `list --active` drops stale markers.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;

fn list_ids(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("list --json prints an array")
        .iter()
        .map(|s| s["runId"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[test]
fn recent_uses_terminal_index_newest_first() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("statuses corrupted and adversarial terminal markers, on purpose");
    let session = "sess-list";
    let base = now_ms() - 3_000_000;
    let n = 2000;
    for i in 0..n {
        env.fabricate_terminal_run(
            &format!("run-{i:04}"),
            session,
            base + (i as i64) * 1000,
            if i % 7 == 0 { "failed" } else { "complete" },
        );
    }
    // Corrupt every status but the newest 20: a reader that touches them fails or slows down.
    for i in 0..n - 20 {
        fs::write(env.run_dir(&format!("run-{i:04}")).join("status.json"), b"\x00garbage{{{").unwrap();
    }
    let sdir = env.terminal_dir().join(seg(session));
    // Adversarial markers that sort newer than everything: unparsable, other version,
    // disagreeing with the status, a run already seen, a missing run.
    let far = base + 10_000_000;
    let junk = sdir.join(format!("{:016}-junk.json", far));
    fs::write(&junk, b"not json").unwrap();
    let v2 = sdir.join(format!("{:016}-run-1999.json", far + 1));
    fs::write(&v2, json!({"version": 2, "runId": "run-1999", "sessionId": session, "endedAt": far + 1}).to_string())
        .unwrap();
    let disagree = sdir.join(format!("{:016}-run-1998.json", far + 2));
    fs::write(
        &disagree,
        json!({"version": 1, "runId": "run-1998", "sessionId": session, "endedAt": far + 2}).to_string(),
    )
    .unwrap();
    let missing = sdir.join(format!("{:016}-ghost.json", far + 3));
    fs::write(&missing, json!({"version": 1, "runId": "ghost", "sessionId": session, "endedAt": far + 3}).to_string())
        .unwrap();

    let o = env.cli(&["list", "--recent", "20", "--session", session, "--json"]);
    assert!(o.status.success(), "list --recent: {}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("list --json output is JSON ({e}): {}", describe(&o)));
    let want: Vec<String> = (n - 20..n).rev().map(|i| format!("run-{i:04}")).collect();
    assert_eq!(list_ids(&v), want, "the newest 20, newest first");
    for s in v.as_array().unwrap() {
        let id = s["runId"].as_str().unwrap();
        let disk = env.status(id).unwrap();
        for k in ["runId", "sessionId", "state", "endedAt", "exitCode", "mode"] {
            assert_eq!(s[k], disk[k], "list --json prints status objects: {k} of {id}");
        }
    }
    // Bad markers are removed by the reader; good ones stay.
    for p in [&junk, &v2, &disagree, &missing] {
        assert!(!p.exists(), "stale/invalid marker {} should be removed by the reader", p.display());
    }
    let good = sdir.join(terminal_marker_name(base + 1999 * 1000, "run-1999"));
    assert!(good.exists(), "a valid marker stays");

    // Without --session: across all sessions (only one here), same answer.
    let o = env.cli(&["list", "--recent", "20", "--json"]);
    assert!(o.status.success(), "list --recent 20 --json: {}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("JSON ({e}): {}", describe(&o)));
    assert_eq!(list_ids(&v), want, "the newest 20 without --session");

    // Smaller N and plain text output work too.
    let o = env.cli(&["list", "--recent", "3", "--session", session, "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list_ids(&v), vec!["run-1999", "run-1998", "run-1997"]);
    let o = env.cli(&["list", "--recent", "3", "--session", session]);
    assert!(o.status.success(), "{}", describe(&o));
    assert!(stdout_str(&o).contains("run-1999"), "{}", describe(&o));
}

#[test]
fn recent_filters_by_session() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the fabricated runs have no results");
    let base = now_ms() - 100_000;
    for i in 0..10 {
        let s = if i % 2 == 0 { "even/session" } else { "odd" };
        env.fabricate_terminal_run(&format!("s-{i}"), s, base + i * 10, "complete");
    }
    let o = env.cli(&["list", "--recent", "3", "--session", "even/session", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list_ids(&v), vec!["s-8", "s-6", "s-4"]);
    let o = env.cli(&["list", "--recent", "100", "--session", "odd", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list_ids(&v), vec!["s-9", "s-7", "s-5", "s-3", "s-1"]);
}

#[test]
fn active_ignores_and_removes_stale_markers() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("fabricated runs without results, and a marker of a run with no status yet");
    let now = now_ms();
    // A genuinely active (queued) run.
    let live = "live-queued";
    let dir = env.run_dir(live);
    mkdir_0700(&dir);
    let req = request(Some(live), &env.work, vec![cmd_step("a", &["true"])]);
    write_file_mode(&dir.join("request.json"), &serde_json::to_vec(&req).unwrap(), 0o600);
    let st = json!({
        "runId": live, "sessionId": "default", "mode": "single", "state": "queued",
        "startedAt": now, "lastUpdate": now, "timeoutMs": 1800000, "cwd": env.work.to_str().unwrap(),
        "queue": {"priority": 0, "claimedAt": now},
        "steps": [{"agent": "a", "status": "pending"}]
    });
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
    write_file_mode(&env.active_dir().join(live), b"", 0o600);

    // Stale: terminal run with a leftover marker.
    env.fabricate_terminal_run("done-run", "default", now - 1000, "complete");
    write_file_mode(&env.active_dir().join("done-run"), b"", 0o600);
    // Stale: marker without a run directory.
    write_file_mode(&env.active_dir().join("missing-run"), b"", 0o600);
    // Not stale: a run directory without status.json may be another host's
    // launch in progress (PROTOCOL §14); its marker is left alone.
    mkdir_0700(&env.run_dir("no-status"));
    write_file_mode(&env.active_dir().join("no-status"), b"", 0o600);

    let o = env.cli(&["list", "--active", "--json"]);
    assert!(o.status.success(), "list --active: {}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("JSON ({e}): {}", describe(&o)));
    assert_eq!(list_ids(&v), vec![live.to_string()]);
    assert_eq!(v[0]["state"], "queued");
    assert!(env.active_dir().join(live).exists(), "the live marker stays");
    for stale in ["done-run", "missing-run"] {
        assert!(!env.active_dir().join(stale).exists(), "stale marker {stale} removed");
    }
    assert!(env.active_dir().join("no-status").exists(), "a marker of a run without a status yet stays");
    assert!(env.run_dir("done-run").join("status.json").exists(), "the reader only removes markers, never runs");

    // Text output names the live run.
    let o = env.cli(&["list", "--active"]);
    assert!(o.status.success(), "{}", describe(&o));
    assert!(stdout_str(&o).contains(live), "{}", describe(&o));
}

/// `list --recent` caches the newest names of a quiet session directory
/// (runspool/recent-cache). The cache must never hide a run that ended after
/// it was written, show a removed one, or matter when it is garbage.
#[test]
fn recent_cache_never_goes_stale() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the fabricated runs have no results");
    mkdir_0700(&env.root.join("runspool"));
    let session = "sess-cache";
    let base = now_ms() - 3_000_000;
    for i in 0..300 {
        env.fabricate_terminal_run(&format!("c-{i:04}"), session, base + (i as i64) * 1000, "complete");
    }
    let sdir = env.terminal_dir().join(seg(session));
    let recent = |n: &str| -> Vec<String> {
        let o = env.cli(&["list", "--recent", n, "--session", session, "--json"]);
        assert!(o.status.success(), "{}", describe(&o));
        list_ids(&serde_json::from_slice(&o.stdout).unwrap())
    };
    // A quiet directory (unchanged for over 2 s) gets a cache.
    let quiet = || std::thread::sleep(std::time::Duration::from_millis(3100));
    quiet();
    assert_eq!(recent("3"), vec!["c-0299", "c-0298", "c-0297"]);
    let cache = env.root.join("runspool/recent-cache").join(seg(session));
    assert!(cache.exists(), "the first listing of a quiet directory writes the cache");
    assert_eq!(recent("3"), vec!["c-0299", "c-0298", "c-0297"], "served from the cache");

    // A run that ends later changes the directory: it shows up at once.
    env.fabricate_terminal_run("c-new", session, base + 400_000, "complete");
    assert_eq!(recent("2"), vec!["c-new", "c-0299"]);

    // A removed marker is gone at once, too.
    quiet();
    assert_eq!(recent("1"), vec!["c-new"]);
    fs::remove_file(sdir.join(terminal_marker_name(base + 400_000, "c-new"))).unwrap();
    assert_eq!(recent("1"), vec!["c-0299"]);

    // More than the cache holds, and a garbage cache: a full listing, same answer.
    quiet();
    assert_eq!(recent("250").len(), 250);
    fs::write(&cache, b"{ not json").unwrap();
    assert_eq!(recent("2"), vec!["c-0299", "c-0298"]);
    assert_eq!(recent("400").len(), 300);
}

#[test]
fn list_says_when_it_caps_and_when_nothing_is_active() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the fabricated runs have no results");
    let base = now_ms() - 100_000;
    for i in 0..25 {
        env.fabricate_terminal_run(&format!("cap-{i:02}"), "sess-cap", base + i * 1000, "complete");
    }
    let o = env.cli(&["list", "--active"]);
    assert!(o.status.success(), "{}", describe(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no active runs") && !err.contains("no runs under"), "list --active: {}", describe(&o));

    let o = env.cli(&["list"]);
    assert!(o.status.success(), "{}", describe(&o));
    let rows = String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("cap-")).count();
    assert_eq!(rows, 20, "{}", describe(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("showing the newest 20 finished runs; --recent N for more"), "{}", describe(&o));

    // --json keeps its shape: a bare array of the same 20, no note inside.
    let o = env.cli(&["list", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&o)));
    assert_eq!(list_ids(&v).len(), 20);

    // Not capped: no note.
    let o = env.cli(&["list", "--recent", "30"]);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("showing the newest"), "{}", describe(&o));
    let o = env.cli(&["list", "--recent", "5"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("showing the newest 5 finished runs"), "{}", describe(&o));
}
