//! What a service owner watches (issue 21 item 5): one `run ended` log line
//! per run end with its id, state, exit code and duration as fields, and the
//! Prometheus text file of `metrics_file`, parsed with a real text-format
//! parser (Python's prometheus_client, installed into `target/py-venv` by
//! scripts/pyenv.sh; without python3, its venv module or pip the metrics
//! test prints a SKIPPED line and passes). Real daemon, real runners.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const PROMETHEUS_CLIENT: &str = "prometheus-client==0.26.0";

fn with(mut req: Value, fields: Value) -> Value {
    for (k, v) in fields.as_object().unwrap() {
        req[k] = v.clone();
    }
    req
}

fn ok(env: &TestEnv, args: &[&str]) {
    let out = env.cli(args);
    assert!(out.status.success(), "`runspool {}` failed: {}\n{}", args.join(" "), describe(&out), env.log_tail(40));
}

fn sighup(env: &TestEnv) {
    unsafe {
        libc::kill(env.daemon_pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
}

/// The daemon log's `run ended` lines, one list per daemon started (the
/// harness marks each start), each line as its `key=value` fields (string
/// values unquoted) and whether it says it was found at start.
fn run_end_lines(env: &TestEnv) -> Vec<Vec<BTreeMap<String, String>>> {
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    let mut out: Vec<Vec<BTreeMap<String, String>>> = Vec::new();
    for line in log.lines() {
        if line.starts_with("---- harness: starting daemon") {
            out.push(Vec::new());
        }
        if !line.contains(" run ended: ") {
            continue;
        }
        let mut fields: BTreeMap<String, String> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
            .collect();
        fields.insert("found_at_start".into(), line.contains("(found at daemon start;").to_string());
        out.last_mut().expect("a daemon start before any line").push(fields);
    }
    out
}

/// The lines about `id`, per daemon.
fn lines_of(all: &[Vec<BTreeMap<String, String>>], id: &str) -> Vec<Vec<BTreeMap<String, String>>> {
    all.iter()
        .map(|d| d.iter().filter(|f| f.get("run_id").map(String::as_str) == Some(id)).cloned().collect())
        .collect()
}

#[test]
fn each_run_end_is_logged_once_with_its_outcome() {
    // Rescans every second: a rescan must not log an end again.
    let mut env = TestEnv::with_config("max_running = 8\n[watch]\nrescan_interval_s = 1\n");
    env.start_daemon();
    let stop_gate = env.base().join("stop-gate");
    env.submit(&request(Some("ends-ok"), &env.work, vec![sh_step("ok", "true")]));
    env.submit(&request(Some("ends-three"), &env.work, vec![sh_step("three", "exit 3")]));
    env.submit(&with(
        request(Some("ends-slow"), &env.work, vec![sh_step("slow", "sleep 60")]),
        json!({"timeoutMs": 1000}),
    ));
    env.submit(&request(Some("ends-stopped"), &env.work, vec![sh_step("gated", &gate_wait(&stop_gate))]));
    env.submit(&with(request(Some("ends-held"), &env.work, vec![sh_step("never", "true")]), json!({"hold": true})));
    env.submit(&with(
        request(Some("ends-dependent"), &env.work, vec![sh_step("never", "true")]),
        json!({"after": ["ends-three"]}),
    ));
    env.wait_state("ends-stopped", "running");
    ok(&env, &["stop", "ends-stopped"]);
    env.wait_state("ends-held", "queued");
    ok(&env, &["stop", "ends-held"]);
    let first = ["ends-ok", "ends-three", "ends-slow", "ends-stopped", "ends-held", "ends-dependent"];
    let mut statuses: BTreeMap<&str, Value> = first.iter().map(|id| (*id, env.wait_terminal(id))).collect();
    wait_until(LONG, "a `run ended` line for every run", || {
        first.iter().all(|id| lines_of(&run_end_lines(&env), id).concat().len() == 1)
    });
    // Rescans (every second) log nothing again.
    std::thread::sleep(Duration::from_secs(3));

    // One run ends under the next daemon (adopted), one while no daemon runs.
    let (gate, unseen_gate) = (env.base().join("gate"), env.base().join("unseen-gate"));
    env.submit(&request(Some("ends-adopted"), &env.work, vec![sh_step("gated", &gate_wait(&gate))]));
    env.submit(&request(Some("ends-unseen"), &env.work, vec![sh_step("gated", &gate_wait(&unseen_gate))]));
    env.wait_state("ends-adopted", "running");
    env.wait_state("ends-unseen", "running");
    env.kill9();
    open_gate(&unseen_gate);
    statuses.insert("ends-unseen", env.wait_terminal("ends-unseen"));
    env.start_daemon();
    open_gate(&gate);
    statuses.insert("ends-adopted", env.wait_terminal("ends-adopted"));
    wait_until(LONG, "the `run ended` lines of the second daemon", || {
        let all = run_end_lines(&env);
        ["ends-adopted", "ends-unseen"].iter().all(|id| lines_of(&all, id).concat().len() == 1)
    });
    // A clean stop and a new start log nothing again.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(env.term().code(), Some(0), "{}", env.log_tail(40));
    env.start_daemon();
    std::thread::sleep(Duration::from_secs(3));

    let all = run_end_lines(&env);
    assert_eq!(all.len(), 3, "three daemons");
    for (id, st) in &statuses {
        let per_daemon = lines_of(&all, id);
        let got = per_daemon.concat();
        assert_eq!(got.len(), 1, "{id} ended once, logged once: {per_daemon:#?}\n{}", env.log_tail(80));
        let f = &got[0];
        assert_eq!(f.get("state").map(String::as_str), st["state"].as_str(), "{id}: {f:?} vs {st}");
        assert_eq!(f.get("exit_code").cloned(), st["exitCode"].as_i64().map(|c| c.to_string()), "{id}: {f:?} vs {st}");
        let duration: i64 = f.get("duration_ms").and_then(|d| d.parse().ok()).unwrap_or(-1);
        let want = st["endedAt"].as_i64().unwrap() - st["startedAt"].as_i64().unwrap();
        assert_eq!(duration, want, "{id}: duration_ms is endedAt - startedAt: {f:?} vs {st}");
        let (daemon, found) = (per_daemon.iter().position(|d| !d.is_empty()).unwrap(), &f["found_at_start"]);
        let (want_daemon, want_found) = match *id {
            "ends-adopted" => (1, "false"),
            "ends-unseen" => (1, "true"),
            _ => (0, "false"),
        };
        assert_eq!((daemon, found.as_str()), (want_daemon, want_found), "{id}: logged by daemon {daemon}: {f:?}");
    }
    let line = |id: &str| lines_of(&all, id).concat().remove(0);
    let outcome = |id: &str| {
        let f = line(id);
        (f["state"].clone(), f.get("exit_code").cloned().unwrap_or_default(), f["timed_out"].clone())
    };
    let o = |s: &str, c: &str, t: &str| (s.to_string(), c.to_string(), t.to_string());
    assert_eq!(outcome("ends-ok"), o("complete", "0", "false"));
    assert_eq!(outcome("ends-three"), o("failed", "3", "false"));
    assert_eq!(outcome("ends-slow").0, "failed");
    assert_eq!(outcome("ends-slow").2, "true", "the timed-out run says so");
    assert_eq!(outcome("ends-stopped").0, "stopped");
    assert_eq!(outcome("ends-held").0, "stopped", "stopped while queued");
    assert_eq!(outcome("ends-dependent").0, "failed", "its dependency failed");
    assert_eq!(outcome("ends-adopted"), o("complete", "0", "false"));
    assert_eq!(outcome("ends-unseen"), o("complete", "0", "false"));
    let others: Vec<&BTreeMap<String, String>> =
        all.iter().flatten().filter(|f| !statuses.contains_key(f["run_id"].as_str())).collect();
    assert!(others.is_empty(), "`run ended` lines for no run of the test: {others:?}");
}

/// The venv's python with prometheus_client; None (reported as SKIPPED) when
/// python3, its venv module or pip is unavailable.
fn python() -> Option<PathBuf> {
    python_with(PROMETHEUS_CLIENT, "the metrics file")
}

/// Parse the text with prometheus_client's text-format parser; print the
/// families as JSON.
const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
text = open(sys.argv[1]).read()
out = []
for f in text_string_to_metric_families(text):
    out.append({"name": f.name, "type": f.type, "help": f.documentation,
                "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]})
print(json.dumps(out))
"#;

/// The metrics file as parsed: family name -> (type, samples as (name, labels, value)).
struct Parsed(BTreeMap<String, (String, Vec<Sample>)>);

/// A sample: its name, labels and value.
type Sample = (String, BTreeMap<String, String>, f64);

impl Parsed {
    fn of(py: &Path, file: &Path) -> Result<Parsed, String> {
        let copy = file.with_file_name("parsed-copy.txt");
        fs::copy(file, &copy).map_err(|e| format!("{}: {e}", file.display()))?;
        let out = Command::new(py).arg("-c").arg(PARSE).arg(&copy).output().expect("run python");
        if !out.status.success() {
            return Err(format!("the parser refused {}: {}", file.display(), describe(&out)));
        }
        let v: Vec<Value> = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
        let mut m = BTreeMap::new();
        for f in v {
            let samples = f["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    let labels = s["labels"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                        .collect();
                    (s["name"].as_str().unwrap().to_string(), labels, s["value"].as_f64().unwrap())
                })
                .collect();
            assert!(!f["help"].as_str().unwrap_or("").is_empty(), "every family has a HELP: {f}");
            m.insert(f["name"].as_str().unwrap().to_string(), (f["type"].as_str().unwrap().to_string(), samples));
        }
        Ok(Parsed(m))
    }

    fn family(&self, name: &str, kind: &str) -> &[Sample] {
        let (t, s) = self.0.get(name).unwrap_or_else(|| panic!("no family {name}; families: {:?}", self.0.keys()));
        assert_eq!(t, kind, "{name} is a {kind}");
        s
    }

    /// The value of the sample `name` with exactly these labels.
    fn value(&self, family: &str, kind: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.family(family, kind).iter().find(|(n, l, _)| n == name && *l == want).map(|(_, _, v)| *v)
    }

    /// Sum of a family's samples by the value of `label`.
    fn by(&self, family: &str, kind: &str, label: &str) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for (_, l, v) in self.family(family, kind) {
            *m.entry(l[label].clone()).or_insert(0) += *v as u64;
        }
        m
    }

    fn ended(&self, state: &str) -> u64 {
        self.value("runspool_runs_ended", "counter", "runspool_runs_ended_total", &[("state", state)]).unwrap_or(0.0)
            as u64
    }
}

fn counts(v: &Value) -> BTreeMap<String, u64> {
    v.as_object().map(|o| o.iter().map(|(k, n)| (k.clone(), n.as_u64().unwrap())).collect()).unwrap_or_default()
}

/// What the parsed file and daemon.json disagree on (empty: they agree).
fn disagreement(p: &Parsed, d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for state in ["queued", "running"] {
        let m = p.value("runspool_runs", "gauge", "runspool_runs", &[("state", state)]);
        if m != d["runs"][state].as_f64() {
            out.push(format!("runs {state}: file {m:?}, daemon.json {}", d["runs"][state]));
        }
    }
    for (family, label, key) in [
        ("runspool_queue_depth", "lane", "byLane"),
        ("runspool_queue_depth", "reason", "byReason"),
        ("runspool_lane_running", "lane", "runningByLane"),
    ] {
        let (m, j) = (p.by(family, "gauge", label), counts(&d["queue"][key]));
        if m != j {
            out.push(format!("{family} by {label}: file {m:?}, daemon.json queue.{key} {j:?}"));
        }
    }
    out
}

#[test]
fn the_metrics_file_parses_and_matches_daemon_json() {
    let Some(py) = python() else { return };
    let mut env =
        TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 5\n[lanes.gpu]\nmax_running = 1\n");
    let dir = env.base().join("textfile");
    mkdir_0700(&dir);
    let prom = dir.join("runspool.prom");
    env.start_daemon();

    // Ended before the file is configured: counted since the daemon's start all the same.
    env.submit(&request(Some("m-ok"), &env.work, vec![sh_step("ok", "true")]));
    env.submit(&request(Some("m-three"), &env.work, vec![sh_step("three", "exit 3")]));
    env.wait_terminal("m-ok");
    env.wait_terminal("m-three");
    assert!(!prom.exists(), "no metrics file without metrics_file");

    // SIGHUP applies metrics_file.
    env.write_config(&format!(
        "max_running = 1\nmetrics_file = \"{}\"\n[watch]\nrescan_interval_s = 5\n[lanes.gpu]\nmax_running = 1\n",
        prom.display()
    ));
    sighup(&env);
    wait_until(Duration::from_secs(30), "the metrics file after SIGHUP", || prom.exists());
    assert_eq!(fs::metadata(&prom).unwrap().mode() & 0o777, 0o644, "readable by node_exporter");
    let mut p = None;
    wait_until(Duration::from_secs(30), "both ended runs counted", || {
        p = Parsed::of(&py, &prom).ok();
        p.as_ref().is_some_and(|p| p.ended("complete") == 1 && p.ended("failed") == 1)
    });
    let p = p.unwrap();
    assert_eq!(p.ended("stopped"), 0);
    assert_eq!(p.value("runspool_up", "gauge", "runspool_up", &[]), Some(1.0));
    let d = read_json(&env.daemon_json()).unwrap();
    let started = p.value("runspool_daemon_start_time_seconds", "gauge", "runspool_daemon_start_time_seconds", &[]);
    assert_eq!(started.map(|s| (s * 1000.0).round() as i64), d["startedAt"].as_i64(), "the daemon's startedAt");
    assert_eq!(p.value("runspool_storage_degraded", "gauge", "runspool_storage_degraded", &[]), Some(0.0));
    let watch = p.family("runspool_watch_info", "gauge");
    assert_eq!(watch.len(), 1);
    assert_eq!(watch[0].1["backend"], d["watch"]["backend"].as_str().unwrap(), "{watch:?}");
    assert_eq!(watch[0].1["strategy"], d["watch"]["strategy"].as_str().unwrap(), "{watch:?}");
    assert_eq!(
        p.value("runspool_lane_max_running", "gauge", "runspool_lane_max_running", &[("lane", "gpu")]),
        Some(1.0)
    );

    // A reader that never sees a partial file, and counts the rewrites it sees.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, prom) = (stop.clone(), prom.clone());
        std::thread::spawn(move || {
            let (mut torn, mut versions, mut reads) = (Vec::new(), HashSet::new(), 0u64);
            let began = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(md) = fs::metadata(&prom) {
                    versions.insert((md.ino(), md.mtime(), md.mtime_nsec()));
                }
                if let Ok(text) = fs::read_to_string(&prom) {
                    reads += 1;
                    let last = text.lines().last().unwrap_or("");
                    if !text.starts_with("# HELP runspool_up ") || !last.starts_with("runspool_watch_info{") {
                        torn.push(text);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (torn, versions.len(), reads, began.elapsed())
        })
    };

    // One running, two queued behind max_running = 1, one of them in lane gpu.
    let gate = env.base().join("gate");
    env.submit(&request(Some("m-block"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("m-block", "running");
    env.submit(&request(Some("m-q1"), &env.work, vec![sh_step("q", "true")]));
    env.submit(&with(request(Some("m-q2"), &env.work, vec![sh_step("q", "true")]), json!({"lane": "gpu"})));
    env.wait_state("m-q1", "queued");
    env.wait_state("m-q2", "queued");
    let mut last = String::new();
    let agreed = poll_until(Duration::from_secs(60), || {
        let (Ok(p), Some(d)) = (Parsed::of(&py, &prom), read_json(&env.daemon_json())) else { return false };
        let diff = disagreement(&p, &d);
        last = format!("{diff:?}; daemon.json runs {} queue {}", d["runs"], d["queue"]);
        diff.is_empty() && d["runs"]["queued"] == 2 && d["runs"]["running"] == 1 && d["queue"]["byLane"]["gpu"] == 1
    });
    assert!(agreed, "the metrics file never agreed with daemon.json: {last}\n{}", env.log_tail(40));
    let p = Parsed::of(&py, &prom).unwrap();
    assert_eq!(
        p.by("runspool_queue_depth", "gauge", "lane"),
        BTreeMap::from([("default".to_string(), 1), ("gpu".to_string(), 1)])
    );
    // Three claims since the file was configured: a histogram of three.
    let hist = p.family("runspool_claim_latency_seconds", "histogram");
    let count = p.value("runspool_claim_latency_seconds", "histogram", "runspool_claim_latency_seconds_count", &[]);
    assert_eq!(count, Some(3.0), "{hist:?}");
    let buckets: Vec<f64> =
        hist.iter().filter(|(n, _, _)| n.ends_with("_bucket")).map(|(_, _, v)| *v).collect::<Vec<_>>();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "cumulative buckets: {hist:?}");
    assert_eq!(buckets.last(), Some(&3.0), "+Inf counts every claim: {hist:?}");

    open_gate(&gate);
    for id in ["m-block", "m-q1", "m-q2"] {
        env.wait_terminal(id);
    }
    let mut last = String::new();
    let settled = poll_until(Duration::from_secs(60), || {
        let Ok(p) = Parsed::of(&py, &prom) else { return false };
        let runs = |s| p.value("runspool_runs", "gauge", "runspool_runs", &[("state", s)]);
        last = format!(
            "ended {:?}, runs {:?}",
            p.by("runspool_runs_ended", "counter", "state"),
            (runs("queued"), runs("running"))
        );
        p.ended("complete") == 4
            && p.ended("failed") == 1
            && runs("queued") == Some(0.0)
            && runs("running") == Some(0.0)
    });
    assert!(settled, "the metrics file never counted the ends: {last}\n{}", env.log_tail(40));

    stop.store(true, Ordering::Relaxed);
    let (torn, versions, reads, watched) = reader.join().unwrap();
    assert!(torn.is_empty(), "{} of {reads} reads saw a partial file: {:?}", torn.len(), torn.first());
    assert!(reads > 0);
    // At most one rewrite a second (plus the one in progress at each end of the watch).
    assert!(
        versions as u64 <= watched.as_secs() + 2,
        "{versions} versions of the file in {watched:?}: rewritten more than once a second"
    );

    // A clean stop says so, and leaves no temporary file behind.
    assert_eq!(env.term().code(), Some(0), "{}", env.log_tail(40));
    let p = Parsed::of(&py, &prom).unwrap();
    assert_eq!(p.value("runspool_up", "gauge", "runspool_up", &[]), Some(0.0));
    let left: Vec<String> =
        list_names(&dir).into_iter().filter(|n| n != "runspool.prom" && n != "parsed-copy.txt").collect();
    assert!(left.is_empty(), "only the metrics file in its directory: {left:?}");
}
