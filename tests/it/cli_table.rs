//! What a queue user reaches for: `list`/`status` as a table with the
//! command, duration and state colours (none when piped or with NO_COLOR),
//! `logs -n`, `logs -f` and `submit --follow` exiting with the run's code.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn list_and_status_show_command_state_and_duration() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("t-done"), &env.work, vec![cmd_step("a", &["echo", "finished-marker"])]));
    env.wait_terminal("t-done");
    let gate = env.work.join("gate-t");
    env.submit(&request(Some("t-live"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("t-live", "running");

    // Another host's run (no runspool request.json) stays marked, shown by its agent names.
    env.fabricate_terminal_run("t-other", "sess-o", now_ms() - 5000, "complete");
    std::fs::remove_file(env.run_dir("t-other").join("request.json")).unwrap();
    // Its status may hold terminal escapes: the table never prints them.
    let st = env.run_dir("t-other").join("status.json");
    let text = std::fs::read_to_string(&st)
        .unwrap()
        .replace(r#""agent":"a""#, r#""agent":"a\u001b]0;pwned\u0007""#)
        .replace(r#""sessionId":"sess-o""#, r#""sessionId":"sess\u001b[2J-o""#);
    std::fs::write(&st, text).unwrap();

    let o = env.cli(&["list"]);
    assert!(o.status.success(), "{}", describe(&o));
    let out = stdout_str(&o);
    let other = out.lines().find(|l| l.starts_with("t-other")).unwrap_or_else(|| panic!("t-other listed: {out}"));
    // Shown escaped, visibly: nothing a terminal acts on, nothing hidden either.
    assert!(other.contains(" other ") && other.trim_end().ends_with(r" a\x1b]0;pwned\x07"), "{other:?}");
    assert!(other.contains(r" sess\x1b[2J-o "), "{other:?}");
    assert!(out.lines().next().unwrap_or_default().contains("COMMAND"), "a COMMAND column: {out}");
    let done = out.lines().find(|l| l.starts_with("t-done")).unwrap_or_else(|| panic!("t-done listed: {out}"));
    assert!(done.contains("complete") && done.contains("echo finished-marker"), "{done}");
    assert!(done.contains("took "), "the duration of a finished run: {done}");
    let live = out.lines().find(|l| l.starts_with("t-live")).unwrap_or_else(|| panic!("t-live listed: {out}"));
    assert!(live.contains("running") && live.contains("sh -c"), "{live}");
    assert!(live.contains("for "), "how long a running run has run: {live}");
    assert!(!out.contains('\x1b'), "no escape codes when piped: {out:?}");

    let o = env.cli(&["status", "t-other"]);
    assert!(stdout_str(&o).contains(r"session   sess\x1b[2J-o"), "{}", describe(&o));
    assert!(!stdout_str(&o).contains('\x1b'), "{}", describe(&o));
    let o = env.cli(&["status", "t-done"]);
    let out = stdout_str(&o);
    assert!(out.contains("command   echo finished-marker"), "{}", describe(&o));
    assert!(out.contains("mode      single"), "{}", describe(&o));
    assert!(!out.contains('\x1b'), "{out:?}");
    open_gate(&gate);
    env.wait_terminal("t-live");
}

/// On a terminal the state is coloured, unless NO_COLOR is set (no-color.org).
#[test]
fn colours_on_a_terminal_only_without_no_color() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("SKIP colours_on_a_terminal_only_without_no_color: `script` (util-linux) is not installed");
        return;
    }
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("t-col"), &env.work, vec![sh_step("a", "exit 4")]));
    env.wait_terminal("t-col");
    let cmd = format!("{BIN} --root '{}' list", env.root.display());
    let tty = |no_color: bool| {
        let mut c = Command::new("script");
        c.args(["-qec", &cmd, "/dev/null"]).env_remove("NO_COLOR");
        if no_color {
            c.env("NO_COLOR", "1");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", describe(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let coloured = tty(false);
    assert!(coloured.contains("\x1b[31mfailed"), "failed in red on a terminal: {coloured:?}");
    let plain = tty(true);
    assert!(plain.contains("failed") && !plain.contains('\x1b'), "NO_COLOR: {plain:?}");
}

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
    assert!(stderr_str(&o).contains("t-fail failed (exit 7)"), "the end is said on stderr: {}", describe(&o));
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
