//! Nothing a run or a provider starts outlives what it belongs to (issue 12,
//! items 13, 15, 16): `setsid`'d grandchildren of a step die with their step,
//! provider processes die with their daemon, a dead runner's external job is
//! cancelled; and a spool swapped for a symlink is never claimed from.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn read_pid(p: &Path) -> i64 {
    fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

/// A step that starts a grandchild in a session of its own (`setsid`, so
/// neither its process group nor its session is the step's) and records its pid.
fn escaping_step(pidfile: &Path, tail: &str) -> Value {
    sh_step(
        "escaper",
        &format!(
            "setsid sh -c 'echo $$ > {p}.tmp; mv {p}.tmp {p}; exec sleep 1000' </dev/null >/dev/null 2>&1 & {tail}",
            p = pidfile.display()
        ),
    )
}

#[test]
fn setsid_grandchild_dies_when_the_run_is_stopped() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "escape-stop";
    let pidf = env.work.join("grandchild.pid");
    env.submit(&request(Some(id), &env.work, vec![escaping_step(&pidf, "exec sleep 600")]));
    env.wait_file(&pidf);
    let pid = read_pid(&pidf);
    assert!(process_alive(pid));
    env.wait_state(id, "running");
    let o = env.cli(&["stop", id]);
    assert!(o.status.success(), "runspool stop: {}", describe(&o));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st}");
    wait_until(LONG, "the setsid'd grandchild to be killed with its stopped run", || !process_alive(pid));
    assert_eq!(st["runner"]["containment"], "subreaper", "{st:#}");
    let shown = env.cli(&["status", id]);
    assert!(stdout_str(&shown).contains("subreaper"), "runspool status names the containment:\n{}", describe(&shown));
}

#[test]
fn setsid_grandchild_dies_when_its_step_completes() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "escape-complete";
    let pidf = env.work.join("grandchild.pid");
    let gate = env.work.join("gate");
    // The second step starts only after the first (and its escapee) ended:
    // the escapee belongs to step 0 and must be gone while step 1 runs.
    let probe = env.work.join("probe");
    env.submit(&request(
        Some(id),
        &env.work,
        vec![
            escaping_step(&pidf, &format!("while [ ! -s {} ]; do sleep 0.05; done", pidf.display())),
            sh_step(
                "after",
                &format!(
                    "if kill -0 $(cat {p}) 2>/dev/null; then echo alive > {probe}; else echo gone > {probe}; fi; {}",
                    gate_wait(&gate),
                    p = pidf.display(),
                    probe = probe.display()
                ),
            ),
        ],
    ));
    env.wait_file(&probe);
    let pid = read_pid(&pidf);
    open_gate(&gate);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}");
    assert_eq!(fs::read_to_string(&probe).unwrap().trim(), "gone", "the escapee of step 0 outlived its step");
    assert!(!process_alive(pid), "the escapee is not a zombie either");
}

#[test]
fn a_parallel_members_escapee_lives_as_long_as_its_member() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "escape-parallel";
    let (px, py) = (env.work.join("x.pid"), env.work.join("y.pid"));
    let gate = env.work.join("gate");
    let seen = env.work.join("y-saw-its-helper");
    // X leaves an escapee and ends at once; Y double-forks a helper (the
    // intermediate exits, so the helper is adopted by the runner while Y
    // still runs), checks that it is still alive after X ended, and waits.
    let y = format!(
        "(setsid sh -c 'echo $$ > {py}.tmp; mv {py}.tmp {py}; exec sleep 1000' </dev/null >/dev/null 2>&1 &); \
         while [ ! -s {py} ]; do sleep 0.05; done; {gate_wait}; \
         if kill -0 $(cat {py}) 2>/dev/null; then touch {seen}; fi",
        py = py.display(),
        gate_wait = gate_wait(&gate),
        seen = seen.display()
    );
    env.submit(&request(
        Some(id),
        &env.work,
        vec![parallel(
            vec![
                escaping_step(&px, &format!("while [ ! -s {} ]; do sleep 0.05; done", px.display())),
                sh_step("y", &y),
            ],
            None,
        )],
    ));
    env.wait_file(&px);
    env.wait_file(&py);
    let (x, yp) = (read_pid(&px), read_pid(&py));
    wait_until(LONG, "step 0 (x) to complete", || {
        env.status(id).is_some_and(|s| s["steps"][0]["status"] == "complete")
    });
    wait_until(LONG, "x's escapee to die with x", || !process_alive(x));
    assert!(process_alive(yp), "y's helper was killed while y still runs");
    open_gate(&gate);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}");
    assert!(seen.exists(), "y did not find its helper alive");
    wait_until(LONG, "y's helper to die with y", || !process_alive(yp));
}

#[test]
fn setsid_grandchild_dies_when_its_runner_dies() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "escape-dead-runner";
    let pidf = env.work.join("grandchild.pid");
    env.submit(&request(Some(id), &env.work, vec![escaping_step(&pidf, "exec sleep 600")]));
    env.wait_file(&pidf);
    let pid = read_pid(&pidf);
    let st = env.wait_state(id, "running");
    let runner = st["pid"].as_i64().unwrap();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st:#}");
    assert!(st["error"].as_str().unwrap_or("").contains("exited before recording a result"), "{st:#}");
    wait_until(LONG, "the escapee of a dead runner's step to be killed by the repair", || !process_alive(pid));
}

#[test]
fn spool_swapped_for_a_symlink_is_never_claimed_from() {
    let mut env = TestEnv::new();
    env.start_daemon();
    // A normal claim first, so the daemon has listed the real spool.
    env.submit(&request(Some("before-swap"), &env.work, vec![sh_step("a", "true")]));
    env.wait_terminal("before-swap");
    let elsewhere = env.base().join("elsewhere");
    mkdir_0700(&elsewhere);
    let req = request(Some("via-symlink"), &env.work, vec![sh_step("a", "true")]);
    write_file_mode(&elsewhere.join("evil.json"), &serde_json::to_vec(&req).unwrap(), 0o600);
    let kept = env.base().join("spool.kept");
    fs::rename(env.spool(), &kept).unwrap();
    std::os::unix::fs::symlink(&elsewhere, env.spool()).unwrap();
    // Two rescans (5 s each) and then some: nothing is claimed through the link,
    // and daemon.json says why.
    let claimed = poll_until(Duration::from_secs(12), || env.run_dir("via-symlink").exists());
    assert!(!claimed, "a request was claimed through the symlinked spool");
    let mut reported = Value::Null;
    let seen = poll_until(Duration::from_secs(30), || {
        reported = read_json(&env.daemon_json()).unwrap_or(Value::Null);
        reported["storage"]["state"] == "degraded"
            && reported["storage"]["reason"].as_str().is_some_and(|r| r.contains("symbolic link"))
    });
    assert!(seen, "daemon.json does not report the symlinked spool: {reported:#}\n{}", env.log_tail(30));
    assert!(elsewhere.join("evil.json").exists(), "the entry behind the link was touched");
    assert!(env.log_tail(200).contains(env.spool().to_str().unwrap()), "the log names the path");
    // Fixed: claiming resumes.
    fs::remove_file(env.spool()).unwrap();
    fs::rename(&kept, env.spool()).unwrap();
    env.submit(&request(Some("after-fix"), &env.work, vec![sh_step("a", "true")]));
    let st = env.wait_terminal("after-fix");
    assert_eq!(st["state"], "complete");
    assert!(!env.run_dir("via-symlink").exists());
    wait_until(LONG, "storage ok again", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "ok")
    });
}

/// A command provider that records its calls under `E`; `start` may sleep first.
const PROVIDER: &str = r#"#!/bin/sh
E='@DIR@'
op=$1
input=$(cat)
echo "$op" >> "$E/calls.log"
case "$op" in
start)
    [ -e "$E/slow-start" ] && sleep 3 && touch "$E/marker"
    echo '{"providerJobId":"job-1","state":"running"}'
    ;;
cancel)
    touch "$E/cancelled"
    echo '{"providerJobId":"job-1","state":"stopped"}'
    ;;
*)
    if [ -e "$E/cancelled" ]; then s=stopped; else s=running; fi
    echo "{\"providerJobId\":\"job-1\",\"state\":\"$s\"}"
    ;;
esac
"#;

fn env_with_provider() -> (TestEnv, PathBuf) {
    let env = TestEnv::new();
    let dir = env.base().join("provider");
    fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("provider.sh");
    fs::write(&exe, PROVIDER.replace("@DIR@", dir.to_str().unwrap())).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    env.write_config(&format!(
        "{DEFAULT_CONFIG}[providers.eng]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 30000\n",
        exe.display()
    ));
    (env, dir)
}

fn calls(dir: &Path) -> Vec<String> {
    fs::read_to_string(dir.join("calls.log")).unwrap_or_default().lines().map(str::to_string).collect()
}

fn ext_step() -> Value {
    json!({"agent": "remote", "externalJob": {"provider": "eng", "prompt": "echo hi", "options": {}}})
}

#[test]
fn provider_start_dies_with_its_daemon() {
    let (mut env, dir) = env_with_provider();
    fs::write(dir.join("slow-start"), b"").unwrap();
    env.start_daemon();
    let id = "slow-start";
    env.submit(&request(Some(id), &env.work, vec![ext_step()]));
    wait_until(LONG, "the provider's start to be running", || calls(&dir).contains(&"start".to_string()));
    env.kill9();
    env.start_daemon();
    let st = env.wait_terminal(id);
    // Give the orphaned provider, were it alive, time to finish its sleep.
    std::thread::sleep(Duration::from_secs(5));
    assert!(!dir.join("marker").exists(), "the provider's start outlived its daemon and finished");
    let step = &st["steps"][0];
    assert_eq!(st["state"], "failed", "{st:#}");
    assert!(
        step["externalJob"]["failureCode"] == "start-dispatch-abandoned"
            || step["error"].as_str().is_some_and(|e| e.contains("start-dispatch-abandoned")),
        "{st:#}"
    );
    assert_eq!(calls(&dir).iter().filter(|c| *c == "start").count(), 1, "a start is never dispatched twice");
}

#[test]
fn dead_runner_external_job_is_cancelled() {
    let (mut env, dir) = env_with_provider();
    env.start_daemon();
    let id = "ext-orphan";
    env.submit(&request(Some(id), &env.work, vec![ext_step()]));
    let mut runner = 0;
    wait_until(LONG, "the external job to be running", || {
        let s = env.status(id).unwrap_or(Value::Null);
        runner = s["pid"].as_i64().unwrap_or(0);
        s["steps"][0]["externalJob"]["state"] == "running" && s["steps"][0]["externalJob"]["providerJobId"] == "job-1"
    });
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st:#}");
    assert!(calls(&dir).contains(&"cancel".to_string()), "no cancel was sent: {:?}", calls(&dir));
    let ej = &st["steps"][0]["externalJob"];
    assert_ne!(ej["state"], "running", "the terminal status still says the job runs: {st:#}");
    assert_eq!(ej["state"], "stopped", "{st:#}");
}

#[test]
fn dead_runner_start_in_flight_is_cancelled_once_it_lands() {
    let (mut env, dir) = env_with_provider();
    fs::write(dir.join("slow-start"), b"").unwrap();
    env.start_daemon();
    let id = "ext-orphan-start";
    env.submit(&request(Some(id), &env.work, vec![ext_step()]));
    wait_until(LONG, "the provider's start to be running", || calls(&dir).contains(&"start".to_string()));
    let runner = env.status(id).unwrap()["pid"].as_i64().unwrap();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st:#}");
    assert!(dir.join("marker").exists(), "the daemon's own start was let finish");
    assert!(calls(&dir).contains(&"cancel".to_string()), "the job the start made was not cancelled: {:?}", calls(&dir));
    let ej = &st["steps"][0]["externalJob"];
    assert_eq!(ej["providerJobId"], "job-1", "{st:#}");
    assert_eq!(ej["state"], "stopped", "{st:#}");
}
