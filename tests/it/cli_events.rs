//! `runspool events`: every run's events as one stream of JSON lines, each
//! line of each run's events.jsonl exactly once, while runs are created,
//! run, end and are removed concurrently with the reading.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use runspool::client::{Client, Publish};
use serde_json::{json, Value};

const RUNS: usize = 1000;

/// Every line of every run's events.jsonl now, by run id.
fn lines_on_disk(env: &TestEnv) -> BTreeMap<String, Vec<String>> {
    env.run_ids()
        .into_iter()
        .map(|id| {
            let text = std::fs::read_to_string(env.run_dir(&id).join("events.jsonl")).unwrap_or_default();
            (id, text.lines().map(str::to_string).collect())
        })
        .collect()
}

fn publish(client: &Client, env: &TestEnv, id: &str, argv: &[&str], n: usize) {
    let req = json!({"version": 1, "runId": id, "cwd": env.work, "steps": [{"command": argv}]});
    let how = if n.is_multiple_of(2) { Publish::Rename } else { Publish::Flock };
    client.publish(&serde_json::to_vec(&req).unwrap(), id, how).expect("publish");
}

#[test]
fn events_follow_prints_every_event_of_every_run_exactly_once() {
    let mut env = TestEnv::with_config("max_running = 8\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let client = Client::new(Some(env.root.clone()));
    // A run that ended before the follow starts: none of its events are news.
    publish(&client, &env, "before", &["true"], 0);
    env.wait_terminal("before");
    let since = now_ms() + 1;
    std::thread::sleep(Duration::from_millis(5));

    let mut child = Command::new(BIN)
        .args(["events", "--follow", "--since", &since.to_string(), "--root"])
        .arg(&env.root)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let printed = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = {
        let printed = printed.clone();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                printed.lock().unwrap().push(line.unwrap());
            }
        })
    };

    // 1,000 runs published by four clients at once, some of several steps
    // (events written over time), while the follow reads; some removed mid-way.
    std::thread::scope(|s| {
        for t in 0..4 {
            let (client, env) = (&client, &env);
            s.spawn(move || {
                for n in (t..RUNS).step_by(4) {
                    let id = format!("ev-{n}");
                    if n % 10 == 0 {
                        publish(client, env, &id, &["sh", "-c", "echo a; sleep 0.2; echo b"], n);
                    } else {
                        publish(client, env, &id, &["true"], n);
                    }
                }
            });
        }
    });
    // Removed while the follow reads: what they had is read at most once, then they just stop.
    let removed: Vec<String> = (0..20).map(|n| format!("ev-{}", n * 7 + 1)).collect();
    let mut removed_lines = BTreeMap::new();
    for id in &removed {
        env.wait_terminal_for(id, LONG);
        let text = std::fs::read_to_string(env.run_dir(id).join("events.jsonl")).unwrap_or_default();
        removed_lines.insert(id.clone(), text.lines().map(str::to_string).collect::<BTreeSet<_>>());
        let o = env.cli(&["rm", id]);
        assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    }
    let started = Instant::now();
    for id in (0..RUNS).map(|n| format!("ev-{n}")).filter(|id| !removed.contains(id)) {
        env.wait_terminal_for(&id, Duration::from_secs(300));
    }
    report(&format!("{RUNS} runs ended {:?} after the last removal", started.elapsed()));

    // Every line of every run still there, printed once: wait for the count, then compare.
    let disk = lines_on_disk(&env);
    let want: usize = disk.iter().filter(|(id, _)| id.as_str() != "before").map(|(_, l)| l.len()).sum();
    let count_kept =
        || printed.lock().unwrap().iter().filter(|l| !removed.iter().any(|r| l.contains(&format!("\"{r}\"")))).count();
    let deadline = Instant::now() + Duration::from_secs(120);
    while count_kept() < want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // A little longer: a repeat would show up after the count is reached.
    std::thread::sleep(Duration::from_millis(1500));
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let printed = printed.lock().unwrap().clone();

    let mut by_run: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in &printed {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let id = v["runId"].as_str().unwrap_or_else(|| panic!("no runId: {line}")).to_string();
        by_run.entry(id).or_default().push(line.clone());
    }
    assert!(!by_run.contains_key("before"), "events from before --since were printed: {:?}", by_run.get("before"));
    for (id, lines) in &disk {
        if id == "before" {
            continue;
        }
        let got = by_run.get(id).cloned().unwrap_or_default();
        assert_eq!(&got, lines, "run {id}: printed (left) against its events.jsonl (right), in order, once each");
    }
    for (id, had) in &removed_lines {
        let got = by_run.get(id).cloned().unwrap_or_default();
        let unique: BTreeSet<_> = got.iter().cloned().collect();
        assert_eq!(unique.len(), got.len(), "removed run {id}: a line printed twice: {got:?}");
        assert!(unique.is_subset(had), "removed run {id}: printed lines it never had: {got:?}");
    }
    let unknown: Vec<_> =
        by_run.keys().filter(|id| !disk.contains_key(*id) && !removed_lines.contains_key(*id)).collect();
    assert!(unknown.is_empty(), "events of runs that never were: {unknown:?}");
    report(&format!(
        "events --follow: {} lines of {} runs, each once ({} runs removed mid-way); exit {status}",
        printed.len(),
        by_run.len(),
        removed.len()
    ));
}

/// Without --follow, `events` prints what exists (each line once, `--since`
/// honoured); a follow from now skips what runs already hold and reads
/// runs created after it from their first line.
#[test]
fn events_prints_what_exists_and_a_follow_starts_now() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let client = Client::new(Some(env.root.clone()));
    for n in 0..5 {
        publish(&client, &env, &format!("old-{n}"), &["true"], n);
    }
    for n in 0..5 {
        env.wait_terminal(&format!("old-{n}"));
    }
    let disk = lines_on_disk(&env);
    let o = env.cli(&["events"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let mut got: Vec<String> = stdout_str(&o).lines().map(str::to_string).collect();
    let mut want: Vec<String> = disk.values().flatten().cloned().collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "`runspool events` prints every line that exists, once");
    let o = env.cli(&["events", "--since", &(now_ms() + 60_000).to_string()]);
    assert_eq!(stdout_str(&o), "", "nothing is from the future: {}", describe(&o));
    let o = env.cli(&["events", "--since", "1h"]);
    assert_eq!(stdout_str(&o).lines().count(), want.len(), "{}", describe(&o));
    let o = env.cli(&["events", "--since", "soon"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr_str(&o).contains("--since"), "{}", describe(&o));

    // From now: the iterator has looked at every run once it is made.
    let follow = client.events(None, true).until(Instant::now() + Duration::from_secs(60));
    publish(&client, &env, "new-0", &["echo", "hi"], 0);
    env.wait_terminal("new-0");
    let new_lines = lines_on_disk(&env).remove("new-0").unwrap();
    let mut seen = Vec::new();
    for e in follow {
        let e = e.unwrap();
        assert_eq!(e.run_id.as_str(), "new-0", "only the new run's events are news: {}", e.line);
        seen.push(e.line);
        if seen.len() == new_lines.len() {
            break;
        }
    }
    assert_eq!(seen, new_lines);
}
