//! What a queue user reaches for: `list`/`status` as a table with the
//! command, duration and state colours (none when piped or with NO_COLOR),
//! `logs -n`, `logs -f` and `submit --follow` exiting with the run's code.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn logs_lines_prints_only_the_last_lines() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("t-tail"), &env.work, vec![sh_step("a", "seq 1 10000")]));
    env.wait_terminal("t-tail");
    let o = env.cli(&["logs", "-n", "2", "t-tail"]);
    assert!(o.status.success(), "{}", describe(&o));
    assert_eq!(stdout_str(&o), "9999\n10000\n", "{}", describe(&o));
    let o = env.cli(&["logs", "--lines", "1", "t-tail"]);
    assert_eq!(stdout_str(&o), "10000\n", "{}", describe(&o));
    let o = env.cli(&["logs", "-n", "20000", "t-tail"]);
    assert_eq!(stdout_str(&o).lines().count(), 10000, "more lines than there are: all of them");
}

#[test]
fn logs_follow_exits_with_the_runs_code() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-f");
    let script = format!("echo before; {}; echo after; exit 7", gate_wait(&gate));
    env.submit(&request(Some("t-fail"), &env.work, vec![sh_step("a", &script)]));
    env.wait_state("t-fail", "running");
    let root = env.root.clone();
    let follower = std::thread::spawn(move || {
        Command::new(BIN).args(["--root", root.to_str().unwrap(), "logs", "-f", "t-fail"]).output().unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    open_gate(&gate);
    let o = follower.join().unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", describe(&o));
    assert_eq!(stdout_str(&o), "before\nafter\n", "{}", describe(&o));
    // A complete run: 0.
    env.submit(&request(Some("t-ok"), &env.work, vec![sh_step("a", "echo ok")]));
    env.wait_terminal("t-ok");
    let o = env.cli(&["logs", "-f", "t-ok"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
}

#[test]
fn submit_follow_prints_the_output_and_exits_with_its_code() {
    let mut env = TestEnv::new();
    // Submitted before the daemon starts: the request waits in the spool and --follow waits for its claim.
    let root = env.root.clone();
    let work = env.work.clone();
    env.ensure_layout();
    let submitter = std::thread::spawn(move || {
        Command::new(BIN)
            .args(["--root", root.to_str().unwrap(), "submit", "--cwd", work.to_str().unwrap(), "--follow"])
            .args(["--", "sh", "-c", "echo hi; exit 3"])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(500));
    env.start_daemon();
    let o = submitter.join().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", describe(&o));
    let out = stdout_str(&o);
    let mut lines = out.lines();
    let id = lines.next().unwrap_or_default().to_string();
    assert_eq!(env.state(&id).as_deref(), Some("failed"), "{}", describe(&o));
    assert_eq!(lines.collect::<Vec<_>>(), vec!["hi"], "{}", describe(&o));
}
