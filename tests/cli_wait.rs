//! `runspool wait`: a live progress line on a terminal, plain lines when
//! piped, `--json` with the final status, and its exit codes.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

#[test]
fn plain_lines_when_piped_and_json_final_status() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-w");
    env.submit(&request(
        Some("w-plain"),
        &env.work,
        vec![sh_step("first", &gate_wait(&gate)), sh_step("second", "exit 5")],
    ));
    env.wait_state("w-plain", "running");
    let root = env.root.clone();
    let waiter = std::thread::spawn(move || {
        Command::new(BIN).args(["--root", root.to_str().unwrap(), "wait", "w-plain", "--json"]).output().unwrap()
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    open_gate(&gate);
    let o = waiter.join().unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("w-plain running · 0/2 steps done · running step 0 (first)"), "{err}");
    assert!(err.contains("w-plain failed (exit 5)"), "{err}");
    assert!(!err.contains('\r'), "no terminal control codes when not a terminal: {err:?}");
    // Each distinct state is printed once, not once per poll.
    assert_eq!(err.matches("running step 0 (first)").count(), 1, "{err}");
    let v: Value = serde_json::from_slice(&o.stdout).expect("--json prints the final status");
    assert_eq!(v["runId"], "w-plain");
    assert_eq!(v["state"], "failed");
    assert_eq!(v["exitCode"], 5);
}

#[test]
fn live_line_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!(
            "SKIP live_line_on_a_terminal: `script` (util-linux) is not installed, so no pseudo-terminal is available"
        );
        return;
    }
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("w-tty"), &env.work, vec![sh_step("sleepy", "sleep 1.5")]));
    env.wait_state("w-tty", "running");
    let cmd = format!("{BIN} --root '{}' wait w-tty", env.root.display());
    // `script` gives the command a pseudo-terminal and copies what it printed.
    let o = Command::new("script").args(["-qec", &cmd, "/dev/null"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("\r\x1b[K"), "the line is redrawn in place: {out:?}");
    assert!(out.contains("w-tty running · 0/1 steps done · running step 0 (sleepy) · 00:0"), "{out:?}");
    assert!(out.contains("w-tty complete (exit 0)"), "{out:?}");
}

#[test]
fn timeout_exits_124_and_the_run_goes_on() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-t");
    env.submit(&request(Some("w-slow"), &env.work, vec![sh_step("s", &gate_wait(&gate))]));
    env.wait_state("w-slow", "running");
    let o = env.cli(&["wait", "w-slow", "--timeout", "300ms"]);
    assert_eq!(o.status.code(), Some(124), "{}", describe(&o));
    assert!(stderr_str(&o).contains("gave up waiting for w-slow"), "{}", describe(&o));
    assert_eq!(env.state("w-slow").as_deref(), Some("running"));
    open_gate(&gate);
    assert_eq!(env.wait_terminal("w-slow")["state"], "complete");
}

/// Every read command speaks JSON: `logs --json` here (status, list, wait,
/// doctor, providers, config check and service status have their own tests).
#[test]
fn logs_and_doctor_json() {
    let mut env = TestEnv::new();
    let cfg = format!("{DEFAULT_CONFIG}[hooks]\non_failure = [\"/nonexistent/hook-prog\"]\n");
    env.write_config(&cfg);
    env.start_daemon();
    env.submit(&request(
        Some("lj"),
        &env.work,
        vec![sh_step("one", "echo first-out"), sh_step("two", "echo second-out; exit 4")],
    ));
    env.wait_terminal("lj");
    let o = env.cli(&["logs", "lj", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("logs --json prints JSON");
    assert_eq!(v[0]["agent"], "one");
    assert!(v[0]["output"].as_str().unwrap().contains("first-out"), "{v}");
    assert_eq!(v[1]["exitCode"], 4);
    assert_eq!(v[1]["status"], "failed");
    let o = env.cli(&["logs", "lj", "--json", "--follow"]);
    assert!(!o.status.success(), "--json with --follow is refused: {}", describe(&o));

    let o = env.cli(&["doctor", "--json", "--config", env.config_path.to_str().unwrap()]);
    let d: Value = serde_json::from_slice(&o.stdout).expect("doctor --json prints JSON");
    let hook = d["checks"].as_array().unwrap().iter().find(|c| c["check"] == "hook").cloned().expect("a hook check");
    assert_eq!(hook["level"], "warn", "{hook}");
    assert!(hook["detail"].as_str().unwrap().contains("/nonexistent/hook-prog"), "{hook}");
}

/// Ctrl-C ends the wait, not the run, and says so (exit 130).
#[test]
fn ctrl_c_ends_the_wait_not_the_run_and_says_so() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("w-int"), &env.work, vec![sh_step("s", &gate_wait(&gate))]));
    env.wait_state("w-int", "running");
    let child = Command::new(BIN)
        .args(["--root", env.root.to_str().unwrap(), "wait", "w-int"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(700));
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("w-int goes on"), "{}", describe(&out));
    assert_eq!(env.state("w-int").as_deref(), Some("running"), "the run goes on");
    open_gate(&gate);
    assert_eq!(env.wait_terminal("w-int")["state"], "complete");
}
