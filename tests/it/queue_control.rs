//! Queue control (issue 13 item 3): `runspool pause`/`resume` and
//! `runspool max-running` through `<root>/runspool/queue.json`, honoured by
//! the daemon at once and across restarts, reported in daemon.json `queue`.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::*;

fn queue_report(env: &TestEnv) -> serde_json::Value {
    read_json(&env.daemon_json()).map(|d| d["queue"].clone()).unwrap_or_default()
}

fn ok(env: &TestEnv, args: &[&str]) -> String {
    let out = env.cli(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "`runspool {}` failed: {stdout}{}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr),
        env.log_tail(40)
    );
    stdout
}

/// A run whose step marks that it started, then waits for `gate`.
fn gated(env: &TestEnv, id: &str, gate: &Path) -> serde_json::Value {
    let marker = env.base().join(format!("started-{id}"));
    let script = format!("touch '{}'; {}", marker.display(), gate_wait(gate));
    request(Some(id), &env.work, vec![sh_step("gated", &script)])
}

fn started(env: &TestEnv, ids: &[String]) -> usize {
    ids.iter().filter(|id| env.base().join(format!("started-{id}")).exists()).count()
}

#[test]
fn pause_keeps_requests_in_the_spool_until_resume() {
    let mut env = TestEnv::new();
    env.start_daemon();
    ok(&env, &["pause", "--reason", "maintenance"]);
    wait_until(Duration::from_secs(20), "daemon.json reports the queue paused", || {
        queue_report(&env)["paused"] == true
    });
    let q = queue_report(&env);
    assert_eq!(q["reason"], "maintenance", "{q}");
    assert!(q["since"].as_i64().is_some_and(|s| s > 0), "{q}");

    let id = unique("paused");
    env.submit(&request(Some(&id), &env.work, vec![cmd_step("t", &["true"])]));
    let spooled = env.spool().join(format!("{id}.json"));
    std::thread::sleep(Duration::from_secs(3));
    assert!(spooled.exists(), "a paused daemon claimed {id}\n{}", env.log_tail(40));
    assert_eq!(env.state(&id), None, "a paused daemon started {id}");
    let status = ok(&env, &["status"]);
    assert!(status.contains("paused") && status.contains("maintenance"), "status: {status}");

    ok(&env, &["resume"]);
    wait_until(Duration::from_secs(30), "the run completes after resume", || {
        env.state(&id).as_deref() == Some("complete")
    });
    assert_eq!(queue_report(&env)["paused"], false);
    assert!(ok(&env, &["status"]).contains("accepting"));
}

#[test]
fn pause_survives_a_daemon_restart() {
    let mut env = TestEnv::new();
    env.start_daemon();
    ok(&env, &["pause"]);
    wait_until(Duration::from_secs(20), "paused", || queue_report(&env)["paused"] == true);
    env.kill9();
    // Without a daemon (exit code 3), status says what will apply.
    let out = env.cli(&["status"]);
    assert_eq!(out.status.code(), Some(3));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("paused") && stdout.contains("applies when the daemon starts"), "{stdout}");
    let id = unique("restart");
    env.submit(&request(Some(&id), &env.work, vec![cmd_step("t", &["true"])]));
    env.start_daemon();
    wait_until(Duration::from_secs(20), "the new daemon reports the pause", || {
        read_json(&env.daemon_json())
            .is_some_and(|d| d["pid"].as_i64() == env.daemon_pid() && d["queue"]["paused"] == true)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(env.spool().join(format!("{id}.json")).exists(), "claimed while paused\n{}", env.log_tail(40));
    ok(&env, &["resume"]);
    wait_until(Duration::from_secs(30), "the run completes after resume", || {
        env.state(&id).as_deref() == Some("complete")
    });
}

#[test]
fn max_running_changes_at_run_time_and_survives_a_reload() {
    let mut env = TestEnv::with_config("max_running = 4\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    ok(&env, &["max-running", "1"]);
    wait_until(Duration::from_secs(20), "daemon.json reports max-running 1", || queue_report(&env)["maxRunning"] == 1);
    // A SIGHUP re-reading a config with another max_running does not undo the override.
    env.write_config("max_running = 5\n[watch]\nrescan_interval_s = 5\n");
    unsafe {
        libc::kill(env.daemon_pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    let gate = env.base().join("gate");
    let ids: Vec<String> = (0..3).map(|i| unique(&format!("mr{i}"))).collect();
    for id in &ids {
        env.submit(&gated(&env, id, &gate));
    }
    wait_until(Duration::from_secs(30), "one run starts", || started(&env, &ids) == 1);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(started(&env, &ids), 1, "more than one run at max-running 1\n{}", env.runs_summary(5));
    let q = queue_report(&env);
    assert_eq!(q["maxRunning"], 1, "{q}");
    assert_eq!(q["maxRunningOverride"], 1, "{q}");
    assert!(ok(&env, &["status"]).contains("max-running 1 (override"));

    ok(&env, &["max-running", "3"]);
    wait_until(Duration::from_secs(30), "all three run", || started(&env, &ids) == 3);
    open_gate(&gate);
    for id in &ids {
        wait_until(Duration::from_secs(30), "each run completes", || env.state(id).as_deref() == Some("complete"));
    }
    ok(&env, &["max-running", "--clear"]);
    wait_until(Duration::from_secs(20), "the reloaded config's max_running applies again", || {
        let q = queue_report(&env);
        q["maxRunning"] == 5 && q.get("maxRunningOverride").is_none()
    });
    assert!(!env.cli(&["max-running", "0"]).status.success(), "max-running 0 accepted");
}

#[test]
fn a_fifo_as_the_queue_file_does_not_hang_the_daemon() {
    let mut env = TestEnv::new();
    let dir = env.root.join("runspool");
    mkdir_0700(&dir);
    let fifo = dir.join("queue.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    env.start_daemon();
    let id = unique("fifo");
    env.submit(&request(Some(&id), &env.work, vec![cmd_step("t", &["true"])]));
    wait_until(Duration::from_secs(30), "the run completes", || env.state(&id).as_deref() == Some("complete"));
    let q = queue_report(&env);
    assert_eq!(q["paused"], false, "{q}");
    assert!(q["error"].as_str().is_some_and(|e| e.contains("FIFO") && e.contains("queue.json")), "{q}");
    assert!(env.log_tail(200).contains("queue file ignored"), "{}", env.log_tail(40));
    // The CLI neither hangs on it nor writes through it; --reset replaces it.
    let out = env.cli_timeout(&["pause"], Duration::from_secs(20));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("FIFO"), "{}", String::from_utf8_lossy(&out.stderr));
    ok(&env, &["resume", "--reset"]);
    ok(&env, &["pause"]);
    wait_until(Duration::from_secs(20), "paused through the replaced file", || queue_report(&env)["paused"] == true);
}

/// On the poll strategy too, a pause and a resume reach an idle daemon.
#[test]
fn pause_and_resume_on_the_poll_strategy() {
    let mut env = TestEnv::with_config(
        "max_running = 4\n[watch]\nstrategy = \"poll\"\npoll_interval_ms = 100\nrescan_interval_s = 3600\n",
    );
    env.start_daemon();
    ok(&env, &["pause"]);
    wait_until(Duration::from_secs(20), "paused", || queue_report(&env)["paused"] == true);
    let id = unique("poll");
    env.submit(&request(Some(&id), &env.work, vec![cmd_step("t", &["true"])]));
    std::thread::sleep(Duration::from_secs(2));
    assert!(env.spool().join(format!("{id}.json")).exists(), "claimed while paused\n{}", env.log_tail(40));
    let doctor = env.cli(&["doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(text.lines().any(|l| l.starts_with("warn") && l.contains("queue") && l.contains("paused")), "{text}");
    ok(&env, &["resume"]);
    wait_until(Duration::from_secs(30), "the run completes after resume", || {
        env.state(&id).as_deref() == Some("complete")
    });
}

/// Issue 18: a client that writes a big queue.json in pieces (not atomically)
/// does not get a warning for every piece the daemon happens to see; the
/// finished file applies, and a file that stays invalid is warned about once.
#[test]
fn a_queue_file_written_in_pieces_is_not_warned_about_piece_by_piece() {
    use std::io::Write;
    let mut env = TestEnv::new();
    env.start_daemon();
    let dir = env.root.join("runspool");
    mkdir_0700(&dir);
    let path = dir.join("queue.json");
    let reason = "r".repeat(40 * 1024);
    let body = format!(r#"{{"version":1,"paused":true,"reason":"{reason}","updatedAt":{}}}"#, now_ms());
    let mut f = std::fs::File::create(&path).unwrap();
    for piece in body.as_bytes().chunks(body.len() / 100 + 1) {
        f.write_all(piece).unwrap();
        f.flush().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(f);
    wait_until(Duration::from_secs(30), "daemon.json reports the queue paused", || {
        queue_report(&env)["paused"] == true
    });
    assert_eq!(queue_report(&env)["reason"].as_str().map(str::len), Some(reason.len()));
    let warnings = |env: &TestEnv| {
        std::fs::read_to_string(&env.log_path).unwrap().lines().filter(|l| l.contains("queue file ignored")).count()
    };
    assert!(warnings(&env) <= 1, "{} warnings for one file written in pieces:\n{}", warnings(&env), env.log_tail(40));
    // A file that stays invalid: ignored (not paused), and said once.
    let before = warnings(&env);
    let tmp = dir.join(".queue.json.tmp");
    std::fs::write(&tmp, b"{\"version\":1,\"paused\":tru").unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    wait_until(Duration::from_secs(30), "daemon.json reports the queue file's error", || {
        queue_report(&env)["error"].as_str().is_some_and(|e| e.contains("queue.json"))
    });
    assert_eq!(queue_report(&env)["paused"], false);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(warnings(&env) - before, 1, "{}", env.log_tail(40));
}
