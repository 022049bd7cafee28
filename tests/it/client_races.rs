//! No window in which a run is invisible: from the moment `submit` returns,
//! `status`, `logs -f`, `wait`, `stop` and `submit --follow` handle every
//! stage the run can be at (pending in the spool, claimed without its
//! status.json yet, queued, running, ended), on both watch strategies,
//! while another client floods the spool.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use runspool::client::{Client, Publish};
use serde_json::json;

const ITERATIONS: usize = 200;
const BURST: usize = 500;

fn config(strategy: &str) -> String {
    format!("max_running = 8\nretention_days = 30\n[watch]\nstrategy = \"{strategy}\"\npoll_interval_ms = 100\nrescan_interval_s = 5\n")
}

fn submit(env: &TestEnv, args: &[&str]) -> String {
    // Ahead of the burst in the queue: the iterations need not wait for it to drain.
    let mut all = vec!["submit", "--priority", "10", "--cwd", env.work.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = env.cli(&all);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    stdout_str(&o).lines().next().unwrap_or_default().to_string()
}

fn every_stage_right_after_submit(strategy: &str) {
    let mut env = TestEnv::with_config(&config(strategy));
    env.start_daemon();
    let client = Client::new(Some(env.root.clone()));
    let done = AtomicBool::new(false);
    let burst_sent = AtomicUsize::new(0);
    let mut stops = Vec::new();
    let mut burst_ids = Vec::new();
    std::thread::scope(|s| {
        let burst = s.spawn(|| {
            // Spread over the iterations, so claims of the burst overlap every kind of them.
            let mut ids = Vec::new();
            for n in 0..BURST {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let id = format!("burst-{n}");
                let req = json!({"version": 1, "runId": id, "cwd": env.work, "steps": [{"command": ["true"]}]});
                let how = if n.is_multiple_of(2) { Publish::Rename } else { Publish::Flock };
                client.publish(&serde_json::to_vec(&req).unwrap(), &id, how).expect("publish a burst request");
                burst_sent.fetch_add(1, Ordering::Relaxed);
                ids.push(id);
                std::thread::sleep(Duration::from_millis(15));
            }
            ids
        });
        for i in 0..ITERATIONS {
            match i % 5 {
                0 => {
                    let id = submit(&env, &["--", "true"]);
                    let o = env.cli(&["status", &id]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: status {id}: {}", describe(&o));
                    assert!(stdout_str(&o).contains(&format!("run       {id}")), "{}", describe(&o));
                    let o = env.cli(&["status", "--json", &id]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: status --json: {}", describe(&o));
                    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status --json is JSON");
                    assert_eq!(v["runId"], id.as_str(), "{v}");
                }
                1 => {
                    let id = submit(&env, &["--", "echo", "x"]);
                    let o = env.cli(&["logs", "-f", &id]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: logs -f {id}: {}", describe(&o));
                    assert_eq!(stdout_str(&o), "x\n", "{strategy} round {i}: {}", describe(&o));
                }
                2 => {
                    let id = submit(&env, &["--", "true"]);
                    let o = env.cli(&["wait", &id]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: wait {id}: {}", describe(&o));
                }
                3 => {
                    let id = submit(&env, &["--", "sleep", "30"]);
                    let o = env.cli(&["stop", &id]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: stop {id}: {}", describe(&o));
                    stops.push(id);
                }
                _ => {
                    let o = env.cli(&[
                        "submit",
                        "--priority",
                        "10",
                        "--cwd",
                        env.work.to_str().unwrap(),
                        "--follow",
                        "--",
                        "echo",
                        "y",
                    ]);
                    assert_eq!(o.status.code(), Some(0), "{strategy} round {i}: submit --follow: {}", describe(&o));
                    let out = stdout_str(&o);
                    assert_eq!(out.lines().nth(1), Some("y"), "{strategy} round {i}: {}", describe(&o));
                }
            }
        }
        assert!(burst_sent.load(Ordering::Relaxed) > 0, "the burst overlapped the iterations");
        done.store(true, Ordering::Relaxed);
        burst_ids = burst.join().unwrap();
    });
    report(&format!("{strategy}: {ITERATIONS} rounds alongside a burst of {} requests", burst_ids.len()));
    for id in &stops {
        let st = env.wait_terminal_for(id, LONG);
        match st["state"].as_str() {
            Some("stopped") => {}
            Some("rejected") => assert!(st["error"].as_str().unwrap_or("").starts_with("withdrawn: "), "{id}: {st}"),
            _ => panic!("{strategy}: {id} was neither stopped nor withdrawn: {st}"),
        }
    }
    for id in &burst_ids {
        assert_eq!(env.wait_terminal_for(id, LONG)["state"], "complete", "{strategy}: {id}");
    }
    env.check_consistency();
}

#[test]
fn every_stage_is_visible_right_after_submit_on_the_poll_strategy() {
    every_stage_right_after_submit("poll");
}

#[test]
fn every_stage_is_visible_right_after_submit_on_the_native_strategy() {
    every_stage_right_after_submit("native");
}
