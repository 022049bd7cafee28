//! The harness's own checks must be able to fail: `consistency_errors` is run
//! against fabricated roots with one known defect each (no daemon involved).

use crate::common;

use common::*;
use serde_json::json;
use std::fs;

fn clean_env() -> TestEnv {
    let env = TestEnv::new();
    let now = now_ms();
    env.fabricate_terminal_run("good-1", "sess", now - 1000, "complete");
    env.fabricate_result("good-1");
    env.fabricate_terminal_run("good-2", "call/a+b=", now - 500, "failed");
    env.fabricate_result("good-2");
    env
}

fn assert_detects(env: &TestEnv, needle: &str) {
    env.leaves_root_inconsistent("a defect planted to see the check find it");
    let errs = consistency_errors(env);
    assert!(errs.iter().any(|e| e.contains(needle)), "expected a problem mentioning {needle:?}, got {errs:?}");
}

#[test]
fn clean_root_is_consistent() {
    let env = clean_env();
    assert_eq!(consistency_errors(&env), Vec::<String>::new());
}

#[test]
fn detects_pending_spool_entry() {
    let env = clean_env();
    env.drop_bytes("waiting", b"{}");
    assert_detects(&env, "spool still holds");
}

#[test]
fn detects_temp_file() {
    let env = clean_env();
    fs::write(env.run_dir("good-1").join(".status.json.1.2.abc.tmp"), b"x").unwrap();
    assert_detects(&env, "leftover temp file");
}

#[test]
fn detects_run_without_status_or_request() {
    let env = clean_env();
    mkdir_0700(&env.run_dir("half"));
    write_file_mode(&env.run_dir("half").join("request.json"), b"{}", 0o600);
    assert_detects(&env, "run half has no (parsable) status.json");
    // A run whose status says runspool launched it lost its request.json.
    let mut st = env.status("good-1").unwrap();
    st["launchedBy"] = json!("runspool");
    write_file_mode(&env.run_dir("good-1").join("status.json"), st.to_string().as_bytes(), 0o600);
    fs::remove_file(env.run_dir("good-1").join("request.json")).unwrap();
    assert_detects(&env, "run good-1 (complete) has no request.json");
}

#[test]
fn detects_active_marker_problems() {
    let env = clean_env();
    write_file_mode(&env.active_dir().join("good-1"), b"", 0o600);
    assert_detects(&env, "active marker for run good-1 in terminal state");
    write_file_mode(&env.active_dir().join("nobody"), b"", 0o600);
    assert_detects(&env, "active marker nobody has no run");
    // an active run without a marker
    let mut st = env.status("good-2").unwrap();
    st["state"] = json!("running");
    write_file_mode(&env.run_dir("good-2").join("status.json"), st.to_string().as_bytes(), 0o600);
    assert_detects(&env, "active run good-2 (running) has no active marker");
    assert_detects(&env, "terminal marker for active run good-2");
}

#[test]
fn detects_terminal_marker_problems() {
    let env = clean_env();
    let st = env.status("good-1").unwrap();
    let e = st["endedAt"].as_i64().unwrap();
    let dir = env.terminal_dir().join(seg("sess"));
    // a second marker for the same run
    let m = json!({"version": 1, "runId": "good-1", "sessionId": "sess", "endedAt": e + 1});
    write_file_mode(&dir.join(terminal_marker_name(e + 1, "good-1")), m.to_string().as_bytes(), 0o600);
    assert_detects(&env, "terminal run good-1 (complete) has 2 terminal markers");
    fs::remove_file(dir.join(terminal_marker_name(e + 1, "good-1"))).unwrap();
    // wrong content
    let m = json!({"version": 1, "runId": "good-1", "sessionId": "sess", "endedAt": e - 7});
    write_file_mode(&dir.join(terminal_marker_name(e, "good-1")), m.to_string().as_bytes(), 0o600);
    assert_detects(&env, "terminal marker of good-1: endedAt");
    // no marker at all
    fs::remove_file(dir.join(terminal_marker_name(e, "good-1"))).unwrap();
    assert_detects(&env, "terminal run good-1 (complete) has 0 terminal markers");
}

#[test]
fn detects_marker_under_wrong_session_segment() {
    let env = clean_env();
    let st = env.status("good-2").unwrap();
    let e = st["endedAt"].as_i64().unwrap();
    let right = env.terminal_dir().join(seg("call/a+b=")).join(terminal_marker_name(e, "good-2"));
    assert!(right.exists(), "seg(\"call/a+b=\") directory is call%2Fa%2Bb%3D");
    let wrong_dir = env.terminal_dir().join("call");
    mkdir_0700(&wrong_dir);
    fs::rename(&right, wrong_dir.join(terminal_marker_name(e, "good-2"))).unwrap();
    assert_detects(&env, "terminal marker of good-2 is call/");
}

#[test]
fn detects_missing_or_wrong_result() {
    let env = clean_env();
    fs::remove_file(env.result_path("good-1")).unwrap();
    assert_detects(&env, "terminal run good-1 (complete) has no result file");
    let mut r = read_json(&env.result_path("good-2")).unwrap();
    r["exitCode"] = json!(0);
    write_file_mode(&env.result_path("good-2"), r.to_string().as_bytes(), 0o600);
    assert_detects(&env, "result of good-2 exitCode");
}

#[test]
fn detects_stale_tool_call_alias() {
    let env = clean_env();
    let d = env.active_dir().join("tool-calls").join(seg("t1"));
    mkdir_0700(&d);
    write_file_mode(&d.join("good-1"), b"", 0o600);
    assert_detects(&env, "tool-call alias");
}

/// Runs runspool did not launch (PROTOCOL §14: no request.json, a status not
/// marked `launchedBy: "runspool"`, or none) are left alone, so not checked.
#[test]
fn runs_of_another_launcher_are_not_checked() {
    let env = clean_env();
    let now = now_ms();
    let pi = env.run_dir("pi-run");
    mkdir_0700(&pi);
    let st = json!({"runId": "pi-run", "sessionId": "s", "mode": "single", "state": "complete", "endedAt": now});
    write_file_mode(&pi.join("status.json"), st.to_string().as_bytes(), 0o600);
    write_file_mode(&pi.join(".status.json.1.tmp"), b"", 0o600);
    write_file_mode(&env.active_dir().join("pi-run"), b"", 0o600);
    mkdir_0700(&env.run_dir("pi-no-status-yet"));
    assert_eq!(consistency_errors(&env), Vec::<String>::new());
}

/// The check that ends every test fails a test whose root is left
/// inconsistent without saying why (here: a request nobody claimed).
#[test]
#[should_panic(expected = "the root is inconsistent at the end of the test (1 problems")]
fn a_root_left_inconsistent_fails_the_test_at_its_end() {
    let env = clean_env();
    env.drop_bytes("never-claimed", b"{}");
}

/// A test that says why it leaves its root inconsistent is not failed for it.
#[test]
fn a_root_left_inconsistent_on_purpose_passes() {
    let env = clean_env();
    env.drop_bytes("never-claimed", b"{}");
    env.leaves_root_inconsistent("the spool entry stays: no daemon runs in this test");
}

#[test]
fn process_helpers_see_life_and_death() {
    let mut c = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let pid = c.id() as i64;
    assert!(process_alive(pid));
    c.kill().unwrap();
    c.wait().unwrap();
    assert!(!process_alive(pid));
}
