//! Completion hooks (`[hooks]`): the right hook per outcome with the result
//! on stdin, exactly once across daemon kills, `max_parallel`, the time limit,
//! and a broken hook that never stalls the daemon.

use crate::common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn hooks_config(work: &Path, extra: &str) -> String {
    let w = work.display();
    format!(
        "{DEFAULT_CONFIG}[hooks]\n\
         on_complete = [\"sh\", \"-c\", \"cat > '{w}/in-'$RUNSPOOL_RUN_ID.json; echo \\\"$RUNSPOOL_RUN_ID $RUNSPOOL_STATE $RUNSPOOL_EXIT_CODE ok\\\" >> '{w}/fired.log'\"]\n\
         on_failure = [\"sh\", \"-c\", \"cat > '{w}/in-'$RUNSPOOL_RUN_ID.json; echo \\\"$RUNSPOOL_RUN_ID $RUNSPOOL_STATE $RUNSPOOL_EXIT_CODE fail\\\" >> '{w}/fired.log'\"]\n\
         {extra}"
    )
}

fn fired(work: &Path) -> Vec<String> {
    fs::read_to_string(work.join("fired.log")).unwrap_or_default().lines().map(str::to_string).collect()
}

fn hook_record(env: &TestEnv, id: &str) -> Option<Value> {
    read_json(&env.run_dir(id).join("hook.json"))
}

/// Wait until the run's hook.json records an outcome.
fn wait_hook_done(env: &TestEnv, id: &str) -> Value {
    let mut last = None;
    wait_until(LONG, &format!("hook of {id} finished"), || {
        last = hook_record(env, id);
        last.as_ref().is_some_and(|r| r.get("endedAt").is_some())
    });
    last.unwrap()
}

#[test]
fn right_hook_with_result_on_stdin_and_env() {
    let mut env = TestEnv::new();
    env.write_config(&hooks_config(&env.work, ""));
    env.start_daemon();
    env.submit(&request(Some("hk-ok"), &env.work, vec![sh_step("a", "echo all good")]));
    env.submit(&request(Some("hk-bad"), &env.work, vec![sh_step("a", "exit 3")]));
    for id in ["hk-ok", "hk-bad"] {
        env.wait_terminal(id);
        let r = wait_hook_done(&env, id);
        assert_eq!(r["exitCode"], 0, "hook of {id}: {r}");
    }
    let ok = hook_record(&env, "hk-ok").unwrap();
    assert_eq!(ok["hook"], "on_complete");
    assert_eq!(ok["state"], "complete");
    let bad = hook_record(&env, "hk-bad").unwrap();
    assert_eq!(bad["hook"], "on_failure");
    assert_eq!(bad["state"], "failed");

    let mut lines = fired(&env.work);
    lines.sort();
    assert_eq!(lines, vec!["hk-bad failed 3 fail".to_string(), "hk-ok complete 0 ok".to_string()]);

    // stdin carries the run's result (PROTOCOL §7 shape).
    let input: Value = serde_json::from_slice(&fs::read(env.work.join("in-hk-ok.json")).unwrap()).unwrap();
    assert_eq!(input["runId"], "hk-ok");
    assert_eq!(input["state"], "complete");
    assert_eq!(input["success"], true);
    assert!(input["summary"].as_str().unwrap().contains("all good"), "{input}");
    let input: Value = serde_json::from_slice(&fs::read(env.work.join("in-hk-bad.json")).unwrap()).unwrap();
    assert_eq!(input["exitCode"], 3);
    assert_eq!(input["success"], false);
    env.check_consistency();
}

#[test]
fn fires_exactly_once_across_daemon_kills() {
    let mut env = TestEnv::new();
    env.write_config(&hooks_config(&env.work, ""));
    env.start_daemon();
    // Ends while the daemon is up.
    env.submit(&request(Some("once-up"), &env.work, vec![sh_step("a", "true")]));
    env.wait_terminal("once-up");
    wait_hook_done(&env, "once-up");
    // Ends while no daemon runs: the next daemon owes it its hook.
    let gate = env.work.join("gate-once");
    env.submit(&request(Some("once-down"), &env.work, vec![sh_step("a", &format!("{}; exit 4", gate_wait(&gate)))]));
    env.wait_state("once-down", "running");
    env.kill9();
    open_gate(&gate);
    wait_until(LONG, "the run ends with no daemon", || env.state("once-down").as_deref() == Some("failed"));
    assert!(hook_record(&env, "once-down").is_none(), "no daemon, no hook yet");
    env.start_daemon();
    let r = wait_hook_done(&env, "once-down");
    assert_eq!(r["hook"], "on_failure");
    // Two more restarts: nothing fires again.
    env.restart();
    env.restart();
    env.submit(&request(Some("once-last"), &env.work, vec![sh_step("a", "true")]));
    env.wait_terminal("once-last");
    wait_hook_done(&env, "once-last");
    let mut lines = fired(&env.work);
    lines.sort();
    assert_eq!(
        lines,
        vec!["once-down failed 4 fail".to_string(), "once-last complete 0 ok".into(), "once-up complete 0 ok".into()],
        "each run's hook fired exactly once"
    );
    let pending = env.root.join("runspool/hooks-pending");
    wait_until(LONG, "no hook is left pending", || fs::read_dir(&pending).map(|d| d.count() == 0).unwrap_or(true));
    env.check_consistency();
}

#[test]
fn max_parallel_and_time_limit() {
    let mut env = TestEnv::new();
    let w = env.work.display().to_string();
    // A hook that fails with 9 if another hook is running at the same time.
    let cfg = format!(
        "{DEFAULT_CONFIG}[hooks]\nmax_parallel = 1\ntimeout_s = 2\n\
         on_complete = [\"sh\", \"-c\", \"mkdir '{w}/hook-busy' || exit 9; sleep 0.3; rmdir '{w}/hook-busy'\"]\n\
         on_failure = [\"sh\", \"-c\", \"trap '' TERM; sleep 60\"]\n"
    );
    env.write_config(&cfg);
    env.start_daemon();
    let ids: Vec<String> = (0..5).map(|i| format!("par-{i}")).collect();
    for id in &ids {
        env.submit(&request(Some(id), &env.work, vec![sh_step("a", "true")]));
    }
    for id in &ids {
        env.wait_terminal(id);
        let r = wait_hook_done(&env, id);
        assert_eq!(r["exitCode"], 0, "hooks never overlap with max_parallel = 1: {r}");
    }
    // A hook that ignores SIGTERM is killed after timeout_s plus the grace period.
    env.submit(&request(Some("slow-hook"), &env.work, vec![sh_step("a", "exit 1")]));
    let r = wait_hook_done(&env, "slow-hook");
    assert_eq!(r["timedOut"], true, "{r}");
    assert_eq!(r["signal"], 9, "{r}");
    assert!(r["error"].as_str().unwrap().contains("timed out"), "{r}");
    assert!(env.log_tail(200).contains("slow-hook"), "the failure is logged with the run id");
    env.check_consistency();
}

#[test]
fn broken_hook_is_recorded_and_the_daemon_goes_on() {
    let mut env = TestEnv::new();
    let cfg = format!("{DEFAULT_CONFIG}[hooks]\non_complete = [\"/nonexistent/runspool-hook\"]\n");
    env.write_config(&cfg);
    env.start_daemon();
    env.submit(&request(Some("brk-1"), &env.work, vec![sh_step("a", "true")]));
    let r = wait_hook_done(&env, "brk-1");
    let err = r["error"].as_str().unwrap_or_default();
    assert!(err.contains("/nonexistent/runspool-hook") && err.contains("hooks.on_complete"), "{r}");
    assert!(r.get("exitCode").is_none());
    // The daemon keeps claiming and running.
    env.submit(&request(Some("brk-2"), &env.work, vec![sh_step("a", "true")]));
    assert_eq!(env.wait_terminal("brk-2")["state"], "complete");
    wait_hook_done(&env, "brk-2");
    let log = env.log_tail(200);
    assert!(log.contains("hook could not start") && log.contains("brk-1"), "{log}");
    std::thread::sleep(Duration::from_millis(200));
    env.check_consistency();
}

#[test]
fn config_refuses_bad_hooks() {
    let env = TestEnv::new();
    let bad = env.work.join("bad.toml");
    for (body, key) in [
        ("[hooks]\nmax_parallel = 0\n", "hooks.max_parallel"),
        ("[hooks]\non_complete = [\"\"]\n", "hooks.on_complete"),
        ("[hooks]\ntimeout = 5\n", "timeout"),
    ] {
        fs::write(&bad, body).unwrap();
        let o = env.cli(&["config", "check", "--config", bad.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{body}: {}", describe(&o));
        assert!(stderr_str(&o).contains(key), "{body}: the error names {key}: {}", describe(&o));
    }
}
