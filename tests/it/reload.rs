//! SIGHUP reports: a `root` set or changed in the config names the root
//! that wins (`--root`, `RUNSPOOL_ROOT`) instead of promising a change at
//! the next start that never comes.

use crate::common;

use common::*;
use std::fs;
use std::path::Path;
use std::process::Command;

/// The daemon's log from `from` on: the first reload report there.
fn reload_report(env: &TestEnv, from: usize) -> String {
    let mut line = String::new();
    wait_until(LONG, "the reload report in the daemon log", || {
        let t = fs::read_to_string(&env.log_path).unwrap_or_default();
        match t[from.min(t.len())..].lines().find(|l| l.contains("configuration reloaded")) {
            Some(l) => {
                line = l.to_string();
                true
            }
            None => false,
        }
    });
    line
}

fn log_len(env: &TestEnv) -> usize {
    fs::read_to_string(&env.log_path).unwrap_or_default().len()
}

fn hup(env: &TestEnv) {
    unsafe {
        libc::kill(env.daemon_pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
}

#[test]
fn sighup_root_change_names_the_root_that_wins() {
    let mut env = TestEnv::new();
    let elsewhere = env.base().join("elsewhere");
    let with_root = |root: &Path| format!("root = \"{}\"\n{DEFAULT_CONFIG}", root.display());

    // --root on the command line: the config's root is ignored, now and at every start.
    env.start_daemon();
    let from = log_len(&env);
    env.write_config(&with_root(&elsewhere));
    hup(&env);
    let r = reload_report(&env, from);
    assert!(r.contains("root (default) -> ") && r.contains("--root") && r.contains("wins"), "{r}");
    assert!(!r.contains("applies at the next daemon start"), "{r}");
    assert!(env.term().success());

    // RUNSPOOL_ROOT: the same, naming the variable.
    env.write_config(DEFAULT_CONFIG);
    let mut cmd = Command::new(BIN);
    cmd.arg("daemon")
        .arg("--config")
        .arg(&env.config_path)
        .env("RUNSPOOL_ROOT", &env.root)
        .env_remove("PI_SUBAGENTS_TEMP_ROOT")
        .env("XDG_CONFIG_HOME", env.base().join("xdg"))
        .stdin(std::process::Stdio::null());
    env.start_daemon_command(cmd);
    let from = log_len(&env);
    env.write_config(&with_root(&elsewhere));
    hup(&env);
    let r = reload_report(&env, from);
    assert!(r.contains("RUNSPOOL_ROOT") && r.contains("wins"), "{r}");
    assert!(!r.contains("applies at the next daemon start"), "{r}");
    assert!(env.term().success());

    // The root from the config file itself: a change applies at the next start.
    env.write_config(&with_root(&env.root));
    let mut cmd = Command::new(BIN);
    cmd.arg("daemon")
        .arg("--config")
        .arg(&env.config_path)
        .env_remove("RUNSPOOL_ROOT")
        .env_remove("PI_SUBAGENTS_TEMP_ROOT")
        .env("XDG_CONFIG_HOME", env.base().join("xdg"))
        .stdin(std::process::Stdio::null());
    env.start_daemon_command(cmd);
    let from = log_len(&env);
    env.write_config(&with_root(&elsewhere));
    hup(&env);
    let r = reload_report(&env, from);
    assert!(r.contains("(applies at the next daemon start)") && !r.contains("wins"), "{r}");
    assert!(env.term().success());
}

/// A SIGHUP as soon as the daemon has reported itself (daemon.json names its
/// pid) is a reload, never the default action of the signal (exit): the
/// test spins on daemon.json and signals the moment it appears.
#[test]
fn sighup_right_after_start_is_a_reload() {
    let mut env = TestEnv::new();
    for round in 0..5 {
        let _ = fs::remove_file(env.daemon_json());
        env.start_daemon_nowait();
        let pid = env.daemon_pid().unwrap();
        let deadline = std::time::Instant::now() + LONG;
        while read_json(&env.daemon_json()).is_none_or(|d| d["pid"].as_i64() != Some(pid)) {
            assert!(std::time::Instant::now() < deadline, "daemon.json never named pid {pid}");
        }
        let from = log_len(&env);
        hup(&env);
        let mut report = String::new();
        wait_until(LONG, "the reload report, or the daemon's death", || {
            let t = fs::read_to_string(&env.log_path).unwrap_or_default();
            if let Some(l) = t[from.min(t.len())..].lines().find(|l| l.contains("configuration reloaded")) {
                report = l.to_string();
            }
            !report.is_empty() || !process_alive(pid)
        });
        assert!(env.daemon_exited().is_none(), "round {round}: the daemon died of SIGHUP\n{}", env.log_tail(20));
        assert!(report.contains("nothing changed"), "round {round}: {report}");
        assert!(env.term().success());
    }
}
