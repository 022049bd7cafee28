//! `submit`'s two limits kept apart: `--run-timeout` (the run's time limit)
//! and `--wait-timeout` (how long `--wait` waits); the old `--timeout` still
//! sets the run's limit, with a deprecation message; and the default run
//! limit comes from the daemon's config (`default_timeout_ms`, 0: none).

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::Value;

fn spooled(env: &TestEnv, id: &str) -> Value {
    read_json(&env.spool().join(format!("{id}.json"))).expect("the published request")
}

#[test]
fn submit_wait_timeout_without_a_daemon_returns_with_its_own_exit_code() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the request stays in the spool");
    // Generous: the wait gives up after 3 s; the harness kills it at 60 s.
    let o = env.cli_timeout(
        &["submit", "--cwd", env.work.to_str().unwrap(), "--wait", "--wait-timeout", "3s", "--", "true"],
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(3), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("gave up waiting") && err.contains("no daemon runs under"), "{err}");
    assert!(err.contains("runspool daemon") && err.contains("runspool stop"), "says how to go on: {err}");
    let id = stdout_str(&o).trim().to_string();
    assert!(spooled(&env, &id).get("timeoutMs").is_none(), "--wait-timeout is not the run's limit");
}

#[test]
fn run_timeout_sets_the_run_limit_and_timeout_is_deprecated() {
    let env = TestEnv::new();
    env.leaves_root_inconsistent("no daemon runs: the requests stay in the spool");
    let cwd = env.work.to_str().unwrap().to_string();
    let o = env.cli(&["submit", "--cwd", &cwd, "--run-id", "rt-new", "--run-timeout", "7s", "--", "true"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert!(!stderr_str(&o).contains("deprecated"), "{}", describe(&o));
    assert_eq!(spooled(&env, "rt-new")["timeoutMs"], 7000);

    let o = env.cli(&["submit", "--cwd", &cwd, "--run-id", "rt-old", "--timeout", "5m", "--", "true"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("deprecated") && err.contains("--run-timeout") && err.contains("--wait-timeout"), "{err}");
    assert_eq!(spooled(&env, "rt-old")["timeoutMs"], 300_000);

    // --wait-timeout belongs to --wait.
    let o = env.cli(&["submit", "--cwd", &cwd, "--wait-timeout", "3s", "--", "true"]);
    assert_eq!(o.status.code(), Some(2), "{}", describe(&o));

    let o = env.cli(&["submit", "--help"]);
    let help = stdout_str(&o);
    assert!(help.contains("--run-timeout") && help.contains("--wait-timeout"), "{help}");
    assert!(!help.contains("--wait --timeout"), "the help no longer invites the ambiguous form: {help}");
}

#[test]
fn default_timeout_ms_sets_the_limit_of_runs_without_one() {
    let mut env = TestEnv::new();
    env.write_config(&format!("default_timeout_ms = 1500\n{DEFAULT_CONFIG}"));
    env.start_daemon();
    env.submit(&request(Some("dt-1"), &env.work, vec![sh_step("s", "sleep 60")]));
    let st = env.wait_terminal("dt-1");
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["timedOut"], true, "{st}");
    assert_eq!(st["timeoutMs"], 1500, "{st}");
    // A request's own timeoutMs wins.
    let mut req = request(Some("dt-own"), &env.work, vec![sh_step("s", "true")]);
    req["timeoutMs"] = 600_000.into();
    env.submit(&req);
    assert_eq!(env.wait_terminal("dt-own")["timeoutMs"], 600_000);
}

#[test]
fn default_timeout_ms_zero_means_no_limit() {
    let mut env = TestEnv::new();
    env.write_config(&format!("default_timeout_ms = 0\n{DEFAULT_CONFIG}"));
    env.start_daemon();
    env.submit(&request(Some("dt-0"), &env.work, vec![sh_step("s", "sleep 1")]));
    let st = env.wait_terminal("dt-0");
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["timeoutMs"], 0, "{st}");
    assert!(st["deadlineAt"].is_null(), "no deadline without a limit: {st}");
    env.check_consistency();
}

/// PROTOCOL §2.2: a run whose request sets no limit has none unless the
/// daemon is configured with one (a long build is never killed by a default).
#[test]
fn no_run_limit_unless_configured() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("dt-none"), &env.work, vec![sh_step("s", "true")]));
    let st = env.wait_terminal("dt-none");
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["timeoutMs"], 0, "{st}");
    assert!(st["deadlineAt"].is_null(), "no deadline without a limit: {st}");
}

#[test]
fn default_timeout_ms_out_of_range_is_refused_by_name() {
    let env = TestEnv::new();
    env.write_config(&format!("default_timeout_ms = 604800001\n{DEFAULT_CONFIG}"));
    let o = env.cli(&["config", "check", "--config", env.config_path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    let text = format!("{}{}", stdout_str(&o), stderr_str(&o));
    assert!(text.contains("default_timeout_ms is 604800001") && text.contains("0 for no limit"), "{text}");
}
