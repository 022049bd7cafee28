//! Stop requests in pi-subagents 0.67's form (PROTOCOL §9):
//! `control/stop-requests/<ts>-<uuid>.json`, consumed in `ts` order by the
//! runner, and by the daemon for a run still queued; `targetIndex` stops one
//! step, anything else the run.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::path::Path;

fn write_stop_request(env: &TestEnv, id: &str, ts: i64, body: Value) {
    let dir = env.run_dir(id).join("control/stop-requests");
    fs::create_dir_all(&dir).unwrap();
    let name = format!("{ts:013}-{}.json", unique("u"));
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, body.to_string()).unwrap();
    fs::rename(&tmp, dir.join(name)).unwrap();
}

fn pid_step(agent: &str, pidfile: &Path, tail: &str) -> Value {
    let p = pidfile.display();
    sh_step(agent, &format!("echo $$ > '{p}.tmp'; mv '{p}.tmp' '{p}'; {tail}"))
}

fn pid(p: &Path) -> i64 {
    fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

#[test]
fn a_stop_request_stops_a_running_run_with_its_reason() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pidf = env.work.join("p");
    env.submit(&request(Some("sr-run"), &env.work, vec![pid_step("s", &pidf, "exec sleep 60"), sh_step("b", "true")]));
    env.wait_file(&pidf);
    env.wait_state("sr-run", "running");
    // Not a stop request (wrong type): removed, ignored.
    write_stop_request(&env, "sr-run", 1, json!({"type": "steer", "message": "hi"}));
    write_stop_request(&env, "sr-run", now_ms(), json!({"type": "stop", "source": "pi-host", "reason": "user asked"}));
    let st = env.wait_terminal("sr-run");
    assert_eq!(st["state"], "stopped", "{st}");
    assert!(st["error"].as_str().unwrap().contains("stopped by pi-host: user asked"), "{st}");
    wait_until(LONG, "step process gone", || !process_alive(pid(&pidf)));
    wait_until(LONG, "inbox emptied", || list_names(&env.run_dir("sr-run").join("control/stop-requests")).is_empty());
    let ev = env.events("sr-run");
    assert!(ev.iter().any(|e| e["type"] == "subagent.run.stop_requested" && e["scope"] == "run"), "{ev:?}");
    env.check_consistency();
}

#[test]
fn target_index_stops_only_that_step() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let (pa, pb) = (env.work.join("a"), env.work.join("b"));
    let gate = env.work.join("gate");
    let members = vec![pid_step("a", &pa, "exec sleep 60"), pid_step("b", &pb, &gate_wait(&gate))];
    env.submit(&request(Some("sr-step"), &env.work, vec![parallel(members, None)]));
    env.wait_file(&pa);
    env.wait_file(&pb);
    write_stop_request(&env, "sr-step", now_ms(), json!({"type": "stop", "targetIndex": 0, "reason": "not needed"}));
    wait_until(LONG, "member 0 stopped", || {
        env.status("sr-step").is_some_and(|s| s["steps"][0]["status"] == "stopped")
    });
    assert!(env.status("sr-step").unwrap()["steps"][1]["status"] == "running", "the sibling runs on");
    open_gate(&gate);
    let st = env.wait_terminal("sr-step");
    assert_eq!(st["steps"][1]["status"], "complete", "{st}");
    assert_eq!(st["steps"][0]["stopped"], json!(true), "{st}");
    assert_eq!(st["state"], "failed", "a step stopped on its own fails the run, which was not asked to stop: {st}");
    let ev = env.events("sr-step");
    assert!(
        ev.iter().any(|e| e["type"] == "subagent.run.stop_requested" && e["scope"] == "step" && e["stepIndex"] == 0),
        "{ev:?}"
    );
    env.check_consistency();
}

#[test]
fn a_child_id_that_names_no_step_stops_the_run_and_says_so() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pidf = env.work.join("p");
    env.submit(&request(Some("sr-child"), &env.work, vec![pid_step("s", &pidf, "exec sleep 60")]));
    env.wait_file(&pidf);
    write_stop_request(&env, "sr-child", now_ms(), json!({"type": "stop", "childId": "worker-7"}));
    assert_eq!(env.wait_terminal("sr-child")["state"], "stopped");
    let ev = env.events("sr-child");
    let e = ev.iter().find(|e| e["type"] == "subagent.run.stop_requested").expect("stop event");
    assert!(e["message"].as_str().unwrap().contains("worker-7"), "{e}");
}

#[test]
fn a_stop_request_ends_a_queued_run_before_it_starts() {
    let mut env = TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 2\n");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("sr-blocker"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("sr-blocker", "running");
    let marker = env.work.join("ran");
    let step = sh_step("never", &format!("touch '{}'", marker.display()));
    env.submit(&request(Some("sr-queued"), &env.work, vec![step]));
    env.wait_state("sr-queued", "queued");
    write_stop_request(&env, "sr-queued", now_ms(), json!({"type": "stop", "source": "pi", "reason": "cancelled"}));
    let st = env.wait_terminal("sr-queued");
    assert_eq!(st["state"], "stopped", "{st}");
    assert!(st["error"].as_str().unwrap().contains("cancelled"), "{st}");
    open_gate(&gate);
    env.wait_terminal("sr-blocker");
    assert!(!marker.exists(), "the stopped run never ran");
    env.check_consistency();
}

#[test]
fn runspool_stop_writes_the_0_67_form() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let pidf = env.work.join("p");
    env.submit(&request(Some("sr-cli"), &env.work, vec![pid_step("s", &pidf, "exec sleep 60")]));
    env.wait_file(&pidf);
    // SIGSTOP nothing; the runner consumes at once, so look at what the CLI says it wrote.
    let o = env.cli(&["stop", "sr-cli", "--reason", "done here"]);
    assert!(o.status.success(), "{o:?}");
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(said.contains("control/stop-requests/"), "{said}");
    let st = env.wait_terminal("sr-cli");
    assert_eq!(st["state"], "stopped");
    assert!(st["error"].as_str().unwrap().contains("stopped by runspool-cli: done here"), "{st}");
}
