//! A request is a run from the moment it is in the spool: `submit` prints the
//! id it wrote, and `status`, `wait`, `logs -f` and `stop` accept the id (or
//! the spool file name) of a request no daemon has claimed yet. `stop`
//! withdraws such a request under the claim's own lock, so it either never
//! runs or its run is stopped, never both, never neither.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::Value;

const POLL_CONFIG: &str = "max_running = 4\nretention_days = 30\n[watch]\nstrategy = \"poll\"\nrescan_interval_s = 5\n";

fn submit_id(env: &TestEnv, args: &[&str]) -> String {
    let mut all = vec!["submit", "--cwd", env.work.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = env.cli(&all);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let id = stdout_str(&o).trim().to_string();
    assert!(!id.is_empty() && !id.contains('\n'), "submit prints the one run id it wrote: {}", describe(&o));
    id
}

#[test]
fn submit_then_wait_never_races_on_the_poll_strategy() {
    let mut env = TestEnv::with_config(POLL_CONFIG);
    env.start_daemon();
    for i in 0..100 {
        let id = submit_id(&env, &["--", "true"]);
        let o = env.cli(&["wait", &id]);
        assert_eq!(o.status.code(), Some(0), "round {i}: `wait {id}` right after submit: {}", describe(&o));
    }
    env.check_consistency();
}

#[test]
fn a_pending_request_is_visible_to_status_wait_and_logs_with_the_daemon_down() {
    let mut env = TestEnv::new();
    let marker = env.work.join("ran");
    let id = submit_id(
        &env,
        &["--run-id", "ab12", "--", "sh", "-c", &format!("echo out-line; touch '{}'", marker.display())],
    );
    assert_eq!(id, "ab12");
    // A full id shorter than 8 characters, the spool file name and a long id's prefix all name it.
    for arg in ["ab12", "ab12.json"] {
        let o = env.cli(&["status", arg]);
        assert_eq!(o.status.code(), Some(0), "status {arg}: {}", describe(&o));
        let out = stdout_str(&o);
        assert!(out.contains("run       ab12") && out.contains("pending in spool (for "), "{out}");
        assert!(out.contains("not running"), "says no daemon claims it: {out}");
    }
    let o = env.cli(&["status", "--json", "ab12"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{}", describe(&o)));
    assert_eq!(v["state"], "pending", "{v}");
    assert_eq!(v["runId"], "ab12", "{v}");
    let long = submit_id(&env, &["--", "true"]);
    let o = env.cli(&["status", &long[..8]]);
    assert!(stdout_str(&o).contains(&format!("run       {long}")), "{}", describe(&o));

    // Without a daemon a wait gives up when told, saying why, with its own exit code.
    let o = env.cli(&["wait", "ab12", "--timeout", "1s"]);
    assert_eq!(o.status.code(), Some(3), "{}", describe(&o));
    assert!(stderr_str(&o).contains("no daemon runs under"), "{}", describe(&o));
    let o = env.cli(&["logs", "ab12"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(stderr_str(&o).contains("pending in the spool"), "{}", describe(&o));

    // Waiters started before the daemon see the claim and the end.
    let spawn = |args: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(args).arg("--root").arg(&env.root).stdout(Stdio::piped()).stderr(Stdio::piped());
        c.spawn().unwrap()
    };
    let waiter = spawn(&["wait", "ab12"]);
    let follower = spawn(&["logs", "-f", "ab12"]);
    std::thread::sleep(Duration::from_millis(300));
    env.start_daemon();
    let o = waiter.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let o = follower.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(stdout_str(&o).contains("out-line"), "logs -f follows the run once claimed: {}", describe(&o));
    assert!(marker.exists());
    // Claimed, the short full id names the run itself.
    let o = env.cli(&["status", "ab12"]);
    assert!(stdout_str(&o).contains("state     complete"), "{}", describe(&o));
    let o = env.cli(&["wait", &long]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    env.check_consistency();
}

#[test]
fn stop_withdraws_a_pending_request_and_it_never_runs() {
    let mut env = TestEnv::new();
    let marker = env.work.join("ran");
    let id = submit_id(&env, &["--", "sh", "-c", &format!("touch '{}'", marker.display())]);
    let o = env.cli(&["stop", &id, "--reason", "changed my mind"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(stderr_str(&o).contains("withdrew"), "{}", describe(&o));
    assert!(env.pending_spool().is_empty(), "{:?}", env.pending_spool());
    let err = read_json(&env.rejected().join(format!("{id}.error.json"))).expect("the withdrawal's error file");
    assert_eq!(err["code"], RejectionCode::Withdrawn.as_str(), "{err}");
    assert!(err["message"].as_str().unwrap().contains("changed my mind"), "{err}");
    assert!(env.rejected().join(format!("{id}.json")).exists(), "the request is kept in rejected/");
    // A waiter on the run id learns the outcome from a `rejected` run.
    let st = env.status(&id).expect("a rejected run for the withdrawn run id");
    assert_eq!(st["state"], "rejected", "{st}");
    assert!(st["error"].as_str().unwrap().starts_with("withdrawn: "), "{st}");
    assert!(!env.run_dir(&id).join("request.json").exists());

    env.start_daemon();
    let o = env.cli(&["wait", &id, "--timeout", "30s"]);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    assert!(stderr_str(&o).contains(RejectionCode::Withdrawn.as_str()), "{}", describe(&o));
    // A later request still runs: the daemon is not wedged on the withdrawn one.
    let later = submit_id(&env, &["--", "true"]);
    assert_eq!(env.wait_terminal(&later)["state"], "complete");
    assert!(!marker.exists(), "the withdrawn request never ran");
    assert_eq!(env.state(&id).as_deref(), Some("rejected"));
    let o = env.cli(&["status", &id]);
    assert!(stdout_str(&o).contains(RejectionCode::Withdrawn.as_str()), "{}", describe(&o));
    let o = env.cli(&["stop", &id]);
    assert_ne!(o.status.code(), Some(0), "nothing left to stop: {}", describe(&o));
    env.check_consistency();
}

#[test]
fn stop_of_a_pending_request_racing_a_starting_daemon_has_exactly_one_outcome() {
    let (mut withdrawn, mut stopped) = (0, 0);
    for i in 0..16 {
        let mut env = TestEnv::new();
        let marker = env.work.join("ran");
        let id = format!("race-{i}");
        env.submit(&request(
            Some(&id),
            &env.work,
            vec![sh_step("s", &format!("touch '{}'; sleep 60", marker.display()))],
        ));
        env.start_daemon_nowait();
        // Spread the stop over the daemon's start so both sides win sometimes.
        std::thread::sleep(Duration::from_millis((i % 8) * 40));
        let o = env.cli(&["stop", &id]);
        assert_eq!(o.status.code(), Some(0), "round {i}: {}", describe(&o));
        let st = env.wait_terminal(&id);
        let err_file = read_json(&env.rejected().join(format!("{id}.error.json")));
        let claimed = env.run_dir(&id).join("request.json").exists();
        match st["state"].as_str().unwrap() {
            "rejected" => {
                withdrawn += 1;
                assert_eq!(
                    err_file.as_ref().map(|e| e["code"].clone()),
                    Some(RejectionCode::Withdrawn.as_str().into()),
                    "round {i}"
                );
                assert!(!claimed, "round {i}: withdrawn yet claimed");
                assert!(stderr_str(&o).contains("withdrew"), "round {i}: {}", describe(&o));
            }
            "stopped" => {
                stopped += 1;
                assert!(err_file.is_none(), "round {i}: run and withdrawn: {err_file:?}");
                assert!(claimed, "round {i}");
            }
            other => panic!("round {i}: the run ended {other}: {st}\n{}", describe(&o)),
        }
        assert!(env.pending_spool().is_empty(), "round {i}: {:?}", env.pending_spool());
        // Give a late claim every chance to show up, then check it never ran after a withdrawal.
        let later = format!("later-{i}");
        env.submit(&request(Some(&later), &env.work, vec![sh_step("s", "true")]));
        env.wait_terminal(&later);
        if st["state"] == "rejected" {
            assert!(!marker.exists(), "round {i}: the withdrawn request ran");
            assert_eq!(env.state(&id).as_deref(), Some("rejected"), "round {i}");
        }
        env.check_consistency();
        env.term();
    }
    eprintln!("outcomes: {withdrawn} withdrawn, {stopped} claimed and stopped");
}

#[test]
fn stop_waits_for_a_held_request_lock_then_withdraws() {
    // The claim's lock is held (here by the test, standing in for a daemon
    // mid-claim or a writer at work): the withdrawal neither moves the file
    // nor gives up, and once the lock goes it withdraws the request.
    let env = TestEnv::new();
    let id = submit_id(&env, &["--", "true"]);
    let path = env.spool().join(format!("{id}.json"));
    let f = std::fs::File::open(&path).unwrap();
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let root = env.root.clone();
    let stopper =
        std::thread::spawn(move || Command::new(BIN).args(["stop", &id]).arg("--root").arg(&root).output().unwrap());
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    assert!(path.exists(), "a locked request is not moved");
    drop(f);
    let o = stopper.join().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(stderr_str(&o).contains("withdrew"), "{}", describe(&o));
    assert!(t0.elapsed() < Duration::from_secs(25));
    assert!(!path.exists());
}

/// What a `runspool stop` killed (or cut short) right after moving its
/// request to rejected/ leaves: the entry, no error file, and the intent
/// marker it wrote before the move (`.withdrawing-<inode>-<name>`, see
/// docs/protocol-notes.md). The request would touch `ran` if it ever ran.
fn withdrawal_cut_short_after_its_move(env: &TestEnv, id: &str, ran: &std::path::Path, intent: bool) {
    use std::os::unix::fs::MetadataExt;
    let body = request(Some(id), &env.work, vec![sh_step("s", &format!("touch '{}'", ran.display()))]);
    let entry = env.rejected().join(format!("{id}.json"));
    write_file_mode(&entry, &serde_json::to_vec_pretty(&body).unwrap(), 0o600);
    if !intent {
        return;
    }
    let md = std::fs::metadata(&entry).unwrap();
    let marker = serde_json::json!({
        "version": 1, "file": format!("{id}.json"), "message": format!("withdrawn by `runspool stop` before it was claimed: {id} no longer needed"),
        "dev": md.dev(), "ino": md.ino(), "size": md.len(),
        "mtimeNs": (md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128).to_string(), "writtenAt": now_ms(),
    });
    write_file_mode(
        &env.rejected().join(format!(".withdrawing-{}-{id}.json", md.ino())),
        marker.to_string().as_bytes(),
        0o600,
    );
}

/// The outcome every reader sees of a withdrawal finished by the daemon.
fn assert_withdrawn(env: &TestEnv, id: &str, ran: &std::path::Path) {
    let ef = env.rejected().join(format!("{id}.error.json"));
    wait_until(LONG, &format!("{} to be written\n{}", ef.display(), env.log_tail(30)), || ef.exists());
    let err = read_json(&ef).expect("the error file");
    assert_eq!(err["code"], RejectionCode::Withdrawn.as_str(), "a withdrawn request, never a duplicate run id: {err}");
    assert!(err["message"].as_str().unwrap().contains(&format!("{id} no longer needed")), "{err}");
    // The `rejected` run a waiter on the id learns the outcome from; nothing claimed, nothing ran.
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "rejected", "{st}");
    assert!(st["error"].as_str().unwrap().starts_with("withdrawn: "), "{st}");
    assert!(!env.run_dir(id).join("request.json").exists(), "the withdrawn request was never claimed");
    assert!(!ran.exists(), "the withdrawn request never ran");
    let o = env.cli(&["wait", id, "--timeout", "30s"]);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    assert!(stderr_str(&o).contains(RejectionCode::Withdrawn.as_str()), "{}", describe(&o));
    wait_until(LONG, "the settled withdrawal's intent marker to go", || {
        !list_names(&env.rejected()).iter().any(|n| n.starts_with(".withdrawing-"))
    });
}

#[test]
fn a_withdrawal_cut_short_after_its_move_is_finished_as_withdrawn() {
    let mut env = TestEnv::with_config("max_running = 4\n[watch]\nrescan_interval_s = 1\n");
    // Cut short before any daemon ran: the daemon's start finishes it.
    let ran = env.work.join("ran-before");
    withdrawal_cut_short_after_its_move(&env, "wd-before-start", &ran, true);
    // A client older than intent markers: the reason is lost, but a request
    // whose run id no run has was never a duplicate.
    withdrawal_cut_short_after_its_move(&env, "wd-no-intent", &env.work.join("ran-no-intent"), false);
    env.start_daemon();
    assert_withdrawn(&env, "wd-before-start", &ran);
    let ef = env.rejected().join("wd-no-intent.error.json");
    wait_until(LONG, "the lost reason's error file", || ef.exists());
    let err = read_json(&ef).unwrap();
    assert_ne!(err["code"], RejectionCode::DuplicateRunId.as_str(), "no run has the id wd-no-intent: {err}");
    assert_eq!(env.state("wd-no-intent").as_deref(), Some("rejected"), "a waiter on its id learns it ended");

    // Cut short while the daemon runs (a client that gave up on a full
    // disk, or was killed): its rescan finishes it.
    let ran = env.work.join("ran-while-up");
    withdrawal_cut_short_after_its_move(&env, "wd-while-up", &ran, true);
    assert_withdrawn(&env, "wd-while-up", &ran);
    let o = env.cli(&["status", "wd-while-up"]);
    assert!(stdout_str(&o).contains(RejectionCode::Withdrawn.as_str()), "{}", describe(&o));
    env.check_consistency();
}

#[test]
fn pending_requests_resolve_by_name_or_run_id_among_large_and_hostile_entries() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the requests stay in the spool");
    // 200 large requests named apart from their run ids, each runId after its ~900 KiB of steps.
    let big = "x".repeat(900 * 1024);
    for i in 0..200 {
        let mut body = request(None, &env.work, vec![sh_step("a", &format!("true #{big}"))]);
        body["runId"] = Value::from(format!("big-run-{i}"));
        write_file_mode(&env.spool().join(format!("big-{i}.json")), body.to_string().as_bytes(), 0o600);
    }
    // Entries no daemon would claim: a FIFO (a read would block), one over
    // the size limit, a directory, a symlink to the FIFO.
    let fifo = env.spool().join("fifo.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    write_file_mode(&env.spool().join("huge.json"), &vec![b' '; 2 << 20], 0o600);
    std::fs::create_dir(env.spool().join("dir.json")).unwrap();
    std::os::unix::fs::symlink(&fifo, env.spool().join("link.json")).unwrap();
    // A request still being written in place: its runId is there, its end is not yet.
    let half = format!(
        r#"{{"version":1,"runId":"half-run","cwd":"{}","steps":[{{"agent":"a","command":["sh","-c","{}"#,
        env.work.display(),
        "y".repeat(100 * 1024)
    );
    write_file_mode(&env.spool().join("half.json"), half.as_bytes(), 0o600);

    let t = Duration::from_secs(120);
    for (arg, id) in [
        ("big-run-137", "big-run-137"),
        ("big-137.json", "big-run-137"),
        ("big-137", "big-run-137"),
        ("half-run", "half-run"),
    ] {
        let o = env.cli_timeout(&["status", arg], t);
        assert_eq!(o.status.code(), Some(0), "status {arg}: {}", describe(&o));
        let out = stdout_str(&o);
        assert!(out.contains(&format!("run       {id}")) && out.contains("pending in spool"), "status {arg}: {out}");
    }
    let o = env.cli_timeout(&["wait", "big-run-3", "--timeout", "1s"], t);
    assert_eq!(o.status.code(), Some(3), "waits on the pending request, no daemon to claim it: {}", describe(&o));
    let o = env.cli_timeout(&["status", "no-such-run-id"], t);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    assert!(stderr_str(&o).contains("no run or pending request"), "{}", describe(&o));

    // Completion offers each claimable request by its spool name (never read
    // from the bodies), and every name it offers resolves.
    let o = env.cli_timeout(&["__complete-runs"], t);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let offered: Vec<String> = stdout_str(&o).lines().map(str::to_string).collect();
    for want in ["big-0", "big-199", "half"] {
        assert!(offered.iter().any(|n| n == want), "{want} offered: {offered:?}");
    }
    for never in ["fifo", "huge", "dir", "link"] {
        assert!(!offered.iter().any(|n| n == never), "{never} is no request to offer: {offered:?}");
    }
    let o = env.cli_timeout(&["status", "half"], t);
    assert!(stdout_str(&o).contains("run       half-run"), "{}", describe(&o));
}
