//! `runspool wait`: a live progress line on a terminal, plain lines when
//! piped, `--json` with the final status, and its exit codes.

use crate::common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

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

/// Bytes a terminal acts on: ESC, BEL, and C1's CSI (U+009B) in UTF-8.
fn terminal_controls(bytes: &[u8]) -> bool {
    bytes.contains(&0x1b) || bytes.contains(&0x07) || bytes.windows(2).any(|w| w == [0xc2, 0x9b])
}

#[test]
fn escapes_from_files_are_printed_visibly_never_sent_to_the_terminal() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the fabricated hostile run has no result");
    let hostile = "\u{1b}]0;pwned\u{7}\u{1b}[2J\u{9b}31m";
    // A run whose status.json (anyone's to write) carries escapes in its error and step names.
    env.fabricate_terminal_run("esc-run", "s", now_ms() - 1000, "failed");
    let dir = env.run_dir("esc-run");
    let mut st: Value = read_json(&dir.join("status.json")).unwrap();
    st["error"] = Value::from(format!("boom {hostile}"));
    let step = st["steps"][0].clone();
    st["steps"] = serde_json::json!([step.clone(), step]);
    st["steps"][0]["agent"] = Value::from(format!("agent {hostile}"));
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
    for i in 0..2 {
        write_file_mode(&dir.join(format!("output-{i}.log")), format!("out {i}\n").as_bytes(), 0o600);
    }
    // A request refused before it ran, its error file's message as hostile.
    write_file_mode(&env.rejected().join("esc-rej.json"), b"{}", 0o600);
    let err = serde_json::json!({"version": 1, "file": "esc-rej.json", "code": "invalid-field",
                                 "message": format!("bad {hostile}"), "rejectedAt": now_ms()});
    write_file_mode(&env.rejected().join("esc-rej.error.json"), err.to_string().as_bytes(), 0o600);

    // (command, whether it prints the hostile field itself)
    for (args, shows) in [
        (&["wait", "esc-run"][..], true),
        (&["stop", "esc-run"], false),
        (&["status", "esc-run"], true),
        (&["list"], false),
        (&["logs", "esc-run"], false),
        (&["wait", "esc-rej"], true),
        (&["stop", "esc-rej"], true),
        (&["status", "esc-rej"], true),
        (&["logs", "esc-rej"], true),
    ] {
        let o = env.cli(args);
        let all = [o.stdout.as_slice(), o.stderr.as_slice()].concat();
        assert!(!terminal_controls(&all), "`runspool {}` printed a terminal control: {}", args.join(" "), describe(&o));
        let text = String::from_utf8_lossy(&all);
        assert!(
            !shows || text.contains("\\x1b]0;pwned\\x07"),
            "`runspool {}` shows the escape: {text}",
            args.join(" ")
        );
    }
    let o = env.cli(&["logs", "esc-run"]);
    assert!(stdout_str(&o).contains("==> step 0 (agent \\x1b]0;pwned"), "{}", describe(&o));
}

/// The documented exit-code rule of `wait` and `logs -f` (`runspool wait
/// --help`): a stopped run exits 1, a timed-out one 143 (its step's SIGTERM),
/// a request refused before it ran 2 — also for `logs` without `-f`, which
/// says why on stderr instead of printing nothing.
#[test]
fn exit_codes_of_stopped_timed_out_and_rejected_runs() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-x");
    env.submit(&request(Some("x-stop"), &env.work, vec![sh_step("s", &gate_wait(&gate))]));
    env.wait_state("x-stop", "running");
    let o = env.cli(&["stop", "x-stop"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    for args in [vec!["wait", "x-stop"], vec!["logs", "-f", "x-stop"]] {
        let o = env.cli(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?} of a stopped run: {}", describe(&o));
    }
    assert_eq!(env.state("x-stop").as_deref(), Some("stopped"));

    let mut req = request(Some("x-late"), &env.work, vec![sh_step("s", "exec sleep 30")]);
    req["timeoutMs"] = json!(1000);
    env.submit(&req);
    for args in [vec!["wait", "x-late"], vec!["logs", "-f", "x-late"]] {
        let o = env.cli(&args);
        assert_eq!(o.status.code(), Some(143), "{args:?} of a timed-out run: {}", describe(&o));
    }
    assert_eq!(env.status("x-late").unwrap()["timedOut"], json!(true));

    let mut req = request(Some("x-bad"), &env.work, vec![sh_step("s", "true")]);
    req["priority"] = json!("high");
    env.submit(&req);
    assert_eq!(env.wait_terminal("x-bad")["state"], "rejected");
    for args in [vec!["wait", "x-bad"], vec!["logs", "-f", "x-bad"], vec!["logs", "x-bad"]] {
        let o = env.cli(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?} of a rejected run: {}", describe(&o));
        assert!(stderr_str(&o).contains("invalid-field"), "{args:?} says why: {}", describe(&o));
    }
    let o = env.cli(&["logs", "x-bad"]);
    assert!(stdout_str(&o).is_empty(), "{}", describe(&o));
}
