//! The control inbox (PROTOCOL §9) is written by clients and steps, so it is
//! hostile: a symlinked `control/` or `control/stop-requests/` is never
//! followed (the files it points at are neither read nor removed), a legacy
//! control file that is not a regular file is no request to either the
//! runner or the daemon, and `runspool stop` racing the claim is never lost.

use crate::common;

use common::*;
use serde_json::json;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A directory outside the root that looks like an inbox: a valid stop
/// request, an invalid one, and a legacy stop.json. Returns it and its listing.
fn outside_inbox(env: &TestEnv, tag: &str) -> (PathBuf, Vec<String>) {
    let d = env.work.join(format!("outside-{tag}"));
    fs::create_dir_all(d.join("stop-requests")).unwrap();
    let stop = json!({"type": "stop", "ts": 1, "source": "outside"}).to_string();
    for p in [d.join("x.json"), d.join("stop.json"), d.join("stop-requests/x.json")] {
        fs::write(p, &stop).unwrap();
    }
    fs::write(d.join("y.json"), b"not a request").unwrap();
    let listing = listing(&d);
    (d, listing)
}

fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        walk_all(d).iter().map(|p| p.strip_prefix(d).unwrap().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Replace `<run>/control/stop-requests` (or `<run>/control`) with a symlink to `target`.
fn plant_symlink(env: &TestEnv, id: &str, what: &str, target: &Path) -> PathBuf {
    let control = env.run_dir(id).join("control");
    let at = if what == "control" { control } else { control.join("stop-requests") };
    if let Some(parent) = at.parent() {
        let _ = fs::create_dir_all(parent);
    }
    // A runner or the daemon may create the directory between the removal and the link.
    wait_until(LONG, "planting the symlink", || {
        let _ = fs::remove_dir_all(&at);
        std::os::unix::fs::symlink(target, &at).is_ok()
    });
    at
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

fn runner_log(env: &TestEnv, id: &str) -> String {
    fs::read_to_string(env.run_dir(id).join("runner.stderr.log")).unwrap_or_default()
}

fn daemon_log(env: &TestEnv) -> String {
    fs::read_to_string(&env.log_path).unwrap_or_default()
}

#[test]
fn the_runner_never_follows_a_symlinked_inbox() {
    let mut env = TestEnv::new();
    env.start_daemon();
    for what in ["stop-requests", "control"] {
        let id = format!("sym-run-{what}");
        let gate = env.work.join(format!("gate-{what}"));
        env.submit(&request(Some(&id), &env.work, vec![sh_step("s", &gate_wait(&gate))]));
        env.wait_state(&id, "running");
        let (outside, before) = outside_inbox(&env, &format!("run-{what}"));
        let link = plant_symlink(&env, &id, what, &outside);
        // The runner looks at its inbox every second and says once that it refused the link.
        let seen = poll_until(LONG, || {
            runner_log(&env, &id).contains(&*link.to_string_lossy()) || listing(&outside) != before
        });
        assert!(seen, "the runner never reported {}:\n{}", link.display(), runner_log(&env, &id));
        assert_eq!(
            listing(&outside),
            before,
            "the runner followed {} and changed {}",
            link.display(),
            outside.display()
        );
        assert_eq!(env.state(&id).as_deref(), Some("running"), "a request behind a symlink stops nothing");
        // `runspool stop` refuses to write through the link, naming it.
        let o = env.cli(&["stop", &id]);
        assert!(!o.status.success(), "{}", describe(&o));
        assert!(stderr_str(&o).contains(&*link.to_string_lossy()), "{}", describe(&o));
        assert_eq!(listing(&outside), before, "`runspool stop` wrote through {}", link.display());
        // Without the link, the inbox works again.
        fs::remove_file(&link).unwrap();
        let o = env.cli(&["stop", &id]);
        assert!(o.status.success(), "{}", describe(&o));
        assert_eq!(env.wait_terminal(&id)["state"], "stopped");
        assert_eq!(listing(&outside), before);
    }
    env.check_consistency();
}

#[test]
fn the_daemon_never_follows_a_symlinked_inbox_of_a_queued_run() {
    let mut env = TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 2\n");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("sym-blocker"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("sym-blocker", "running");
    let mut planted = Vec::new();
    for what in ["stop-requests", "control"] {
        let id = format!("sym-queued-{what}");
        let marker = env.work.join(format!("ran-{what}"));
        env.submit(&request(Some(&id), &env.work, vec![sh_step("q", &format!("touch '{}'", marker.display()))]));
        env.wait_state(&id, "queued");
        let (outside, before) = outside_inbox(&env, &format!("queued-{what}"));
        let link = plant_symlink(&env, &id, what, &outside);
        planted.push((id, link, outside, before, marker));
    }
    for (id, link, outside, before, _) in &planted {
        let seen =
            poll_until(LONG, || daemon_log(&env).contains(&*link.to_string_lossy()) || listing(outside) != *before);
        assert!(seen, "the daemon never reported {}:\n{}", link.display(), env.log_tail(40));
        assert_eq!(listing(outside), *before, "the daemon followed {}", link.display());
        assert_eq!(env.state(id).as_deref(), Some("queued"), "a request behind a symlink stops nothing");
    }
    // Its other chances: the 1 s polls, the watch after 5 s, the 2 s rescans.
    let changed = poll_until(Duration::from_secs(7), || planted.iter().any(|(_, _, o, b, _)| listing(o) != *b));
    assert!(!changed, "the daemon changed a directory outside the root through a symlinked inbox");
    for (id, link, outside, before, _) in &planted {
        assert_eq!(env.state(id).as_deref(), Some("queued"));
        fs::remove_file(link).unwrap();
        let o = env.cli(&["stop", id]);
        assert!(o.status.success(), "{}", describe(&o));
        assert_eq!(env.wait_terminal(id)["state"], "stopped");
        assert_eq!(listing(outside), *before);
    }
    open_gate(&gate);
    assert_eq!(env.wait_terminal("sym-blocker")["state"], "complete");
    for (.., marker) in &planted {
        assert!(!marker.exists(), "a stopped queued run never ran");
    }
    env.check_consistency();
}

/// Plant a FIFO as stop.json, a directory as timeout.json, and a symlink to a
/// valid interrupt file outside the root as interrupt.json. Returns the paths.
fn plant_odd_legacy_files(env: &TestEnv, id: &str) -> Vec<PathBuf> {
    let control = env.run_dir(id).join("control");
    fs::create_dir_all(&control).unwrap();
    let outside = env.work.join(format!("interrupt-{id}.json"));
    fs::write(&outside, json!({"type": "interrupt", "source": "outside"}).to_string()).unwrap();
    let (stop, timeout, interrupt) =
        (control.join("stop.json"), control.join("timeout.json"), control.join("interrupt.json"));
    mkfifo(&stop);
    // Built aside and renamed into place: the runner may remove a directory
    // named timeout.json between a mkdir of it and a mkdir inside it.
    let staging = env.run_dir(id).join(".timeout-json-staging");
    fs::create_dir_all(staging.join("inner")).unwrap();
    fs::rename(&staging, &timeout).unwrap();
    std::os::unix::fs::symlink(&outside, &interrupt).unwrap();
    vec![stop, timeout, interrupt]
}

#[test]
fn a_legacy_control_file_that_is_not_a_regular_file_is_no_request_to_either_side() {
    let mut env = TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 2\n");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("odd-running"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("odd-running", "running");
    let marker = env.work.join("queued-ran");
    env.submit(&request(Some("odd-queued"), &env.work, vec![sh_step("q", &format!("touch '{}'", marker.display()))]));
    env.wait_state("odd-queued", "queued");
    let mut planted = plant_odd_legacy_files(&env, "odd-running");
    planted.extend(plant_odd_legacy_files(&env, "odd-queued"));
    // Both sides remove what is no request (never opening the FIFO, never
    // following the link), and neither acts on it.
    let gone = poll_until(Duration::from_secs(30), || planted.iter().all(|p| fs::symlink_metadata(p).is_err()));
    let left: Vec<_> = planted.iter().filter(|p| fs::symlink_metadata(p).is_ok()).collect();
    assert!(gone, "not removed: {left:?}\nrunner:\n{}\ndaemon:\n{}", runner_log(&env, "odd-running"), env.log_tail(40));
    assert_eq!(env.state("odd-running").as_deref(), Some("running"), "{}", runner_log(&env, "odd-running"));
    assert_eq!(env.state("odd-queued").as_deref(), Some("queued"), "{}", env.log_tail(40));
    for id in ["odd-running", "odd-queued"] {
        assert!(env.work.join(format!("interrupt-{id}.json")).exists(), "a symlink's target is never removed");
    }
    open_gate(&gate);
    assert_eq!(env.wait_terminal("odd-running")["state"], "complete");
    assert_eq!(env.wait_terminal("odd-queued")["state"], "complete");
    assert!(marker.exists());
    env.check_consistency();
}

fn queue_paused(env: &TestEnv) -> bool {
    read_json(&env.daemon_json()).is_some_and(|d| d["queue"]["paused"] == true)
}

/// `runspool stop` issued at any moment (request in the spool, mid-claim,
/// queued, running), by run id or by the request's spool file name: every
/// request is either withdrawn (never runs, code `withdrawn`) or its run
/// ends `stopped`, and every stop command succeeds.
#[test]
fn a_stop_racing_the_claim_is_never_lost() {
    let mut env = TestEnv::with_config("max_running = 4\n[watch]\nrescan_interval_s = 2\n");
    env.start_daemon();
    let mut rng = Rng::new(0x005e_ed18);
    let (batches, per_batch) = (8, 8);
    let mut ids = Vec::new();
    for b in 0..batches {
        // Every other batch waits in a paused queue, and the resume races the stops.
        let paused = b % 2 == 1;
        if paused {
            let o = env.cli(&["pause"]);
            assert!(o.status.success(), "{}", describe(&o));
            wait_until(LONG, "the queue paused", || queue_paused(&env));
        }
        let batch: Vec<(String, u64)> = (0..per_batch)
            .map(|i| {
                let id = format!("race-{b}-{i}");
                env.submit(&request(Some(&id), &env.work, vec![cmd_step("s", &["sleep", "30"])]));
                (id, rng.below(40))
            })
            .collect();
        let resume_after = rng.below(40);
        std::thread::scope(|s| {
            if paused {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(resume_after));
                    let o = env.cli(&["resume"]);
                    assert!(o.status.success(), "{}", describe(&o));
                });
            }
            for (i, (id, delay)) in batch.iter().enumerate() {
                let env = &env;
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(*delay));
                    // By run id, or by the request's file name in the spool.
                    let arg = if i % 2 == 0 { id.clone() } else { format!("{id}.json") };
                    let o = env.cli(&["stop", &arg]);
                    assert!(o.status.success(), "`runspool stop {arg}` failed: {}", describe(&o));
                });
            }
        });
        ids.extend(batch.into_iter().map(|(id, _)| id));
    }
    let (mut stopped, mut withdrawn) = (0, 0);
    for id in &ids {
        let st = env.wait_terminal_for(id, LONG);
        match st["state"].as_str() {
            Some("stopped") => stopped += 1,
            Some("rejected") => {
                let e = read_json(&env.rejected().join(format!("{id}.error.json"))).unwrap_or_default();
                assert_eq!(e["code"], "withdrawn", "{id}: {st} {e}");
                assert!(!env.run_dir(id).join("request.json").exists(), "{id} was withdrawn and claimed");
                withdrawn += 1;
            }
            _ => panic!("{id} was not stopped: {st}"),
        }
    }
    report(&format!("stop racing the claim: {stopped} stopped, {withdrawn} withdrawn of {}", ids.len()));
    assert!(env.active_markers().is_empty(), "{:?}", env.active_markers());
    env.check_consistency();
}
