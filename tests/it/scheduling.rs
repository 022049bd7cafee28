//! Scheduling (PROTOCOL §15, issue 21 item 1): lanes and their limits,
//! dependencies between runs (`after`, `afterPolicy`), `notBefore`, holds,
//! the `waiting` reason of queued runs, daemon.json's queue counts, and the
//! `unknown-dependency` rejection. Real daemon, real runners, real files.

use crate::common;

use std::fs;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn ok(env: &TestEnv, args: &[&str]) -> String {
    let out = env.cli(args);
    assert!(out.status.success(), "`runspool {}` failed: {}\n{}", args.join(" "), describe(&out), env.log_tail(40));
    stdout_str(&out)
}

fn with(mut req: Value, fields: Value) -> Value {
    for (k, v) in fields.as_object().unwrap() {
        req[k] = v.clone();
    }
    req
}

/// A run whose step marks that it started (`started-<id>` in the test's
/// base directory), then waits for `gate`.
fn gated(env: &TestEnv, id: &str, gate: &std::path::Path) -> Value {
    let script = format!("touch '{}'; {}", started_marker(env, id).display(), gate_wait(gate));
    request(Some(id), &env.work, vec![sh_step("gated", &script)])
}

fn started_marker(env: &TestEnv, id: &str) -> std::path::PathBuf {
    env.base().join(format!("started-{id}"))
}

fn queue_report(env: &TestEnv) -> Value {
    read_json(&env.daemon_json()).map(|d| d["queue"].clone()).unwrap_or_default()
}

fn waiting(env: &TestEnv, id: &str) -> Option<String> {
    env.status(id).and_then(|s| s["waiting"].as_str().map(String::from))
}

fn wait_waiting(env: &TestEnv, id: &str, reason: &str) {
    wait_until(Duration::from_secs(30), &format!("{id} queued with waiting = {reason}"), || {
        env.status(id).is_some_and(|s| s["state"] == "queued" && s["waiting"] == reason)
    });
}

#[test]
fn a_lane_of_one_never_has_two_live_runners_while_other_lanes_run() {
    let mut env =
        TestEnv::with_config("max_running = 8\n[watch]\nrescan_interval_s = 5\n[lanes.solo]\nmax_running = 1\n");
    env.start_daemon();
    // Each solo step takes a directory as a lock: a second solo step running
    // at the same time finds it taken and says so.
    let lock = env.base().join("solo.lock");
    let overlap = env.base().join("overlap");
    let script = format!(
        "mkdir '{l}' || echo overlap >> '{o}'; sleep 0.5; rmdir '{l}'",
        l = lock.display(),
        o = overlap.display()
    );
    let gate = env.base().join("gate");
    let solo: Vec<String> = (0..5).map(|i| format!("solo-{i}")).collect();
    let others: Vec<String> = (0..3).map(|i| format!("other-{i}")).collect();
    for id in &solo {
        env.submit(&with(request(Some(id), &env.work, vec![sh_step("solo", &script)]), json!({"lane": "solo"})));
    }
    for id in &others {
        env.submit(&gated(&env, id, &gate));
    }
    // The other lane's runs all run at once while the solo lane works
    // through its runs one at a time: a full lane holds back no other.
    let mut others_ran_beside_waiting_solo = false;
    let mut max_live_solo = 0;
    let deadline = Instant::now() + LONG;
    while !solo.iter().all(|id| env.state(id).is_some_and(|s| is_terminal_state(&s))) {
        assert!(Instant::now() < deadline, "solo runs did not finish\n{}", env.runs_summary(20));
        let live = solo
            .iter()
            .filter_map(|id| env.status(id))
            .filter(|s| s["state"] == "running" && s["pid"].as_i64().is_some_and(process_alive))
            .count();
        max_live_solo = max_live_solo.max(live);
        let others_running = others.iter().filter(|id| started_marker(&env, id).exists()).count();
        let solo_waiting = solo.iter().filter(|id| waiting(&env, id).as_deref() == Some("lane")).count();
        if others_running == others.len() && solo_waiting > 0 {
            others_ran_beside_waiting_solo = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    open_gate(&gate);
    for id in solo.iter().chain(&others) {
        assert_eq!(env.wait_terminal(id)["state"], "complete", "{id}");
    }
    assert!(max_live_solo <= 1, "{max_live_solo} solo runs had a live runner at once");
    assert!(!overlap.exists(), "two solo steps ran at the same time: {:?}", fs::read_to_string(&overlap));
    assert!(
        others_ran_beside_waiting_solo,
        "the default lane's runs did not all run while solo runs waited for their lane"
    );
    let starts: Vec<i64> = solo.iter().map(|id| env.status(id).unwrap()["startedAt"].as_i64().unwrap()).collect();
    let ends: Vec<i64> = solo.iter().map(|id| env.status(id).unwrap()["endedAt"].as_i64().unwrap()).collect();
    for i in 0..solo.len() {
        for j in 0..solo.len() {
            assert!(i == j || ends[i] <= starts[j] || ends[j] <= starts[i], "solo runs {i} and {j} overlapped");
        }
    }
    env.check_consistency();
}

#[test]
fn fifty_runs_chained_by_after_run_in_order() {
    let mut env = TestEnv::new();
    let order = env.base().join("order");
    let ids: Vec<String> = (0..50).map(|i| format!("chain-{i:02}")).collect();
    // Published last first, and later ones with a higher priority: only
    // `after` can make them run in index order. The daemon starts with
    // them all in the spool, so each names a request still pending.
    for (i, id) in ids.iter().enumerate().rev() {
        let step = sh_step("append", &format!("echo {i} >> '{}'", order.display()));
        let mut req = with(request(Some(id), &env.work, vec![step]), json!({"priority": i as i64}));
        if i > 0 {
            req["after"] = json!([ids[i - 1]]);
        }
        env.submit(&req);
    }
    env.start_daemon();
    for id in &ids {
        assert_eq!(env.wait_terminal(id)["state"], "complete", "{id}");
    }
    let got: Vec<usize> = fs::read_to_string(&order).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got, (0..50).collect::<Vec<_>>(), "the chain ran out of order");
    env.check_consistency();
}

#[test]
fn a_failed_dependency_fails_its_dependents_without_starting_them() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.base().join("gate");
    let marker = |id: &str| env.base().join(format!("ran-{id}"));
    let touch = |id: &str| sh_step("touch", &format!("touch '{}'", marker(id).display()));
    // The dependency fails once its dependents are queued behind it.
    env.submit(&request(Some("dep"), &env.work, vec![sh_step("fails", &format!("{}; exit 3", gate_wait(&gate)))]));
    env.submit(&with(
        request(Some("child"), &env.work, vec![touch("child"), touch("child-2")]),
        json!({"after": ["dep"]}),
    ));
    env.submit(&with(request(Some("grandchild"), &env.work, vec![touch("grandchild")]), json!({"after": ["child"]})));
    let any = with(
        request(Some("regardless"), &env.work, vec![touch("regardless")]),
        json!({"after": ["dep"], "afterPolicy": "any"}),
    );
    env.submit(&any);
    for id in ["child", "grandchild", "regardless"] {
        wait_waiting(&env, id, "dependencies");
    }
    assert_eq!(env.status("child").unwrap()["waitingFor"], json!(["dep"]));
    open_gate(&gate);
    assert_eq!(env.wait_terminal("dep")["state"], "failed");

    let child = env.wait_terminal("child");
    assert_eq!(child["state"], "failed", "{child}");
    let error = child["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("`dep`") && error.contains("failed"),
        "the error names the dependency and its state: {error}"
    );
    for st in child["steps"].as_array().unwrap() {
        assert_eq!((st["status"].as_str(), st["exitCode"].as_i64()), (Some("failed"), Some(-1)), "{child}");
    }
    assert!(child.get("waiting").is_none() && child.get("waitingFor").is_none(), "{child}");
    assert!(!child["runner"].is_object(), "no runner ever started for child: {child}");
    let grandchild = env.wait_terminal("grandchild");
    assert_eq!(grandchild["state"], "failed");
    assert!(grandchild["error"].as_str().unwrap().contains("`child`"), "{grandchild}");
    assert_eq!(env.wait_terminal("regardless")["state"], "complete", "afterPolicy any starts regardless");
    assert!(marker("regardless").exists());
    for id in ["child", "child-2", "grandchild"] {
        assert!(!marker(id).exists(), "a step of a failed dependent ran ({id})");
    }
    let result = env.result("child").expect("child has a result");
    assert_eq!(result["success"], false);
    assert!(env.event_types("child").contains(&"subagent.run.completed".to_string()));
    env.check_consistency();
}

#[test]
fn not_before_is_honoured() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let out =
        ok(&env, &["submit", "--run-id", "later", "--cwd", env.work.to_str().unwrap(), "--delay", "4s", "--", "true"]);
    assert_eq!(out.trim(), "later");
    wait_waiting(&env, "later", "not-before");
    let s = env.status("later").unwrap();
    let not_before = s["notBefore"].as_i64().expect("notBefore in the status");
    let s = env.wait_terminal("later");
    assert_eq!(s["state"], "complete");
    let started = s["startedAt"].as_i64().unwrap();
    assert!(started >= not_before, "started at {started}, before notBefore {not_before}");
    assert!(started < not_before + 15_000, "started {} ms after notBefore", started - not_before);
    // --at in RFC 3339 and in ms both land in the request.
    let out = env.cli(&[
        "submit",
        "--run-id",
        "at",
        "--cwd",
        env.work.to_str().unwrap(),
        "--at",
        "2001-09-09T01:46:40Z",
        "--",
        "true",
    ]);
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(env.wait_terminal("at")["notBefore"], 1_000_000_000_000i64, "a past notBefore starts at once");
}

#[test]
fn a_held_run_never_starts_until_released_across_a_daemon_sigkill() {
    let mut env = TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let gate = env.base().join("gate");
    env.submit(&gated(&env, "blocker", &gate));
    env.wait_file(&started_marker(&env, "blocker"));
    let work = env.work.to_str().unwrap().to_string();
    let base = env.base();
    let marker = |id: &str| base.join(format!("ran-{id}"));
    let touch = |id: &str| format!("touch '{}'", marker(id).display());
    ok(
        &env,
        &["submit", "--run-id", "held-at-submit", "--cwd", &work, "--hold", "--", "sh", "-c", &touch("held-at-submit")],
    );
    ok(&env, &["submit", "--run-id", "held-later", "--cwd", &work, "--", "sh", "-c", &touch("held-later")]);
    wait_waiting(&env, "held-at-submit", "held");
    assert_eq!(env.status("held-at-submit").unwrap()["held"], true);
    wait_waiting(&env, "held-later", "max_running");
    ok(&env, &["hold", "held-later"]);
    wait_until(Duration::from_secs(30), "held-later held", || {
        env.status("held-later").is_some_and(|s| s["held"] == true && s["waiting"] == "held")
    });
    assert!(!env.run_dir("held-later").join("control/hold.json").exists(), "the daemon consumed hold.json");
    // A slot frees up: the held runs still do not start.
    open_gate(&gate);
    assert_eq!(env.wait_terminal("blocker")["state"], "complete");
    std::thread::sleep(Duration::from_secs(2));
    env.restart();
    std::thread::sleep(Duration::from_secs(3));
    for id in ["held-at-submit", "held-later"] {
        let s = env.status(id).unwrap();
        assert_eq!((s["state"].as_str(), s["held"].as_bool()), (Some("queued"), Some(true)), "{id}: {s}");
        assert!(!marker(id).exists(), "held run {id} started");
    }
    wait_until(Duration::from_secs(30), "daemon.json counts two held runs", || {
        queue_report(&env)["byReason"]["held"] == 2
    });
    // Released while the daemon is down, the hold ends at its next start.
    env.kill9();
    let release = json!({"type": "release", "ts": now_ms()});
    let control = env.run_dir("held-later").join("control");
    fs::create_dir_all(&control).unwrap();
    fs::write(control.join(".release.tmp"), release.to_string()).unwrap();
    fs::rename(control.join(".release.tmp"), control.join("release.json")).unwrap();
    env.start_daemon();
    assert_eq!(env.wait_terminal("held-later")["state"], "complete");
    assert!(marker("held-later").exists());
    assert_eq!(env.state("held-at-submit").as_deref(), Some("queued"));
    ok(&env, &["release", "held-at-submit"]);
    let s = env.wait_terminal("held-at-submit");
    assert_eq!(s["state"], "complete");
    assert!(s.get("held").is_none() && s.get("waiting").is_none(), "{s}");
    let refused = env.cli(&["hold", "held-at-submit"]);
    assert!(!refused.status.success() && stderr_str(&refused).contains("not queued"), "{}", describe(&refused));
    env.check_consistency();
}

#[test]
fn waiting_reasons_and_daemon_json_counts() {
    let mut env =
        TestEnv::with_config("max_running = 3\n[watch]\nrescan_interval_s = 5\n[lanes.gpu]\nmax_running = 1\n");
    env.start_daemon();
    let gate = env.base().join("gate");
    env.submit(&with(gated(&env, "gpu-running", &gate), json!({"lane": "gpu"})));
    env.wait_file(&started_marker(&env, "gpu-running"));
    let t = |id: &str| request(Some(id), &env.work, vec![cmd_step("t", &["true"])]);
    env.submit(&with(t("gpu-waiting"), json!({"lane": "gpu"})));
    env.submit(&with(t("held"), json!({"hold": true})));
    env.submit(&with(t("dependent"), json!({"after": ["gpu-running"]})));
    env.submit(&with(t("future"), json!({"notBefore": now_ms() + 3_600_000})));
    wait_waiting(&env, "gpu-waiting", "lane");
    wait_waiting(&env, "held", "held");
    wait_waiting(&env, "dependent", "dependencies");
    wait_waiting(&env, "future", "not-before");
    assert_eq!(env.status("dependent").unwrap()["waitingFor"], json!(["gpu-running"]));
    // Fill the global limit: the next default run waits for max_running.
    env.submit(&gated(&env, "filler-1", &gate));
    env.submit(&gated(&env, "filler-2", &gate));
    env.wait_file(&started_marker(&env, "filler-1"));
    env.wait_file(&started_marker(&env, "filler-2"));
    env.submit(&t("crowded"));
    wait_waiting(&env, "crowded", "max_running");
    wait_until(Duration::from_secs(30), "daemon.json counts by lane and reason", || {
        let q = queue_report(&env);
        q["byLane"] == json!({"default": 4, "gpu": 1})
            && q["byReason"] == json!({"dependencies": 1, "held": 1, "lane": 1, "max_running": 1, "not-before": 1})
            && q["runningByLane"] == json!({"default": 2, "gpu": 1})
    });
    let d = read_json(&env.daemon_json()).unwrap();
    assert_eq!(d["runs"]["queued"], 5, "existing fields stay: {d}");
    ok(&env, &["pause"]);
    wait_waiting(&env, "crowded", "paused");
    wait_waiting(&env, "gpu-waiting", "paused");
    wait_waiting(&env, "held", "held");
    ok(&env, &["resume"]);
    open_gate(&gate);
    for id in ["gpu-running", "gpu-waiting", "dependent", "filler-1", "filler-2", "crowded"] {
        let s = env.wait_terminal(id);
        assert_eq!(s["state"], "complete", "{id}");
        assert!(s.get("waiting").is_none(), "a run that started no longer says it waits: {s}");
    }
    wait_until(Duration::from_secs(30), "daemon.json counts what is left", || {
        queue_report(&env)["byReason"] == json!({"held": 1, "not-before": 1})
    });
}

#[test]
fn an_unknown_dependency_is_rejected_and_a_pending_one_is_not() {
    let mut env = TestEnv::new();
    // `waits` names `first`, still a request in the spool when `waits` is claimed.
    let waits = with(request(Some("waits"), &env.work, vec![cmd_step("t", &["true"])]), json!({"after": ["first"]}));
    env.submit(&waits);
    std::thread::sleep(Duration::from_millis(20));
    env.submit(&request(Some("first"), &env.work, vec![cmd_step("t", &["true"])]));
    env.submit(&with(
        request(Some("orphan"), &env.work, vec![cmd_step("t", &["true"])]),
        json!({"after": ["no-such-run"]}),
    ));
    env.start_daemon();
    let e = env.wait_rejection("orphan");
    assert_eq!(e["code"], "unknown-dependency", "{e}");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("after[0]") && msg.contains("no-such-run"), "{msg}");
    let s = env.wait_terminal("orphan");
    assert_eq!(s["state"], "rejected");
    assert_eq!(env.wait_terminal("first")["state"], "complete");
    let s = env.wait_terminal("waits");
    assert_eq!(s["state"], "complete");
    assert!(
        s["startedAt"].as_i64() >= env.status("first").unwrap()["endedAt"].as_i64(),
        "waits started before first ended"
    );
    assert!(!env.rejected().join("waits.error.json").exists());
    env.check_consistency();
}
