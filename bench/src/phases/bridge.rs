//! Bridge start latency: runs with one external-job step through a command
//! provider (the bench's own `__provider`), one at a time; from the runner's
//! request file (`<run>/external-job-requests/<id>.json`) appearing to the
//! provider's `start` beginning. The reference is `__ref-bridge`: inotify on a
//! requests directory, read, spawn the same provider.

use std::collections::HashMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use notify::{RecursiveMode, Watcher};
use serde_json::{json, Value};

use crate::fsops::{mkdirs, write_private};
use crate::pipelines::{drop_body, wait_for, Daemon, Env};
use crate::provider::{epoch_ns, log_name};
use crate::stats::Stats;

/// Request file → the instant a file event first showed it.
type Seen = Arc<Mutex<HashMap<PathBuf, SystemTime>>>;

/// Watches a tree for request files (`.../external-job-requests/<id>.json`).
struct Observer {
    _watcher: notify::RecommendedWatcher,
    seen: Seen,
}

impl Observer {
    fn new(tree: &Path) -> anyhow::Result<Observer> {
        let seen: Seen = Arc::default();
        let s = seen.clone();
        let mut watcher = notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
            let now = SystemTime::now();
            let Ok(ev) = r else { return };
            for p in ev.paths {
                let is_request = p.parent().and_then(Path::file_name).is_some_and(|d| d == "external-job-requests")
                    && p.file_name().is_some_and(|n| {
                        let n = n.to_string_lossy();
                        !n.starts_with('.') && n.ends_with(".json")
                    });
                if is_request {
                    s.lock().unwrap().entry(p).or_insert(now);
                }
            }
        })?;
        watcher.watch(tree, RecursiveMode::Recursive)?;
        Ok(Observer { _watcher: watcher, seen })
    }

    fn seen(&self, p: &Path) -> Option<SystemTime> {
        self.seen.lock().unwrap().get(p).copied()
    }
}

/// One pipeline's samples.
#[derive(Clone, Copy, Debug)]
pub struct BridgeSide {
    /// Request file → provider start, ms.
    pub start: Stats,
    /// Samples whose request file the observer missed (its directory was
    /// watched too late): timed from the step's `externalJob.startedAt`
    /// (runspool) or from the bench's rename (reference) instead.
    pub fallbacks: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct BridgeResult {
    pub n: usize,
    pub runspool: BridgeSide,
    pub reference: BridgeSide,
}

/// The provider's note of one start: when it began and which request it served.
fn provider_note(logdir: &Path, id: &str) -> Option<(u128, PathBuf)> {
    let v: Value = serde_json::from_slice(&fs::read(logdir.join(log_name(id))).ok()?).ok()?;
    let began = v["startNs"].as_str()?.parse().ok()?;
    let req = Path::new(v["runDir"].as_str()?)
        .join("external-job-requests")
        .join(format!("{}.json", v["requestId"].as_str()?));
    Some((began, req))
}

fn ms_between(from_ns: u128, to_ns: u128) -> f64 {
    (to_ns as f64 - from_ns as f64) / 1e6
}

/// The reference bridge on `dir`, stopped on drop.
fn start_ref_bridge(env: &Env, dir: &Path, logdir: &Path) -> anyhow::Result<Daemon> {
    let log = File::create(dir.with_extension("bridge.log"))?;
    let child = Command::new(&env.me)
        .arg("__ref-bridge")
        .arg(dir)
        .arg(logdir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?;
    let d = Daemon::from_child(child);
    let ready = dir.join("ready");
    wait_for("the reference bridge", Duration::from_secs(60), || ready.exists())?;
    Ok(d)
}

/// TOML basic string (JSON's escapes are TOML's).
fn toml_str(s: &Path) -> String {
    serde_json::to_string(&s.display().to_string()).unwrap()
}

/// `n` runs per pipeline, one at a time, alternating, after 2 warm-ups each.
pub fn measure(env: &Env, n: usize) -> anyhow::Result<BridgeResult> {
    let root = env.fresh_root("bridge-runspool")?;
    let logdir = env.fresh_root("bridge-provider-log")?;
    let refdir = env.fresh_root("bridge-reference")?;
    let reflog = env.fresh_root("bridge-reference-log")?;
    let runs = root.join("async-subagent-runs");
    mkdirs(&runs)?;
    let extra = format!(
        "[providers.bench]\ntype = \"command\"\ncommand = [{}, \"__provider\", {}]\ntimeout_ms = 30000\n",
        toml_str(&env.me),
        toml_str(&logdir)
    );
    let _d = env.start_runspool_with(&root, 4, "native", &extra)?;
    let _r = start_ref_bridge(env, &refdir, &reflog)?;
    let obs = Observer::new(&runs)?;
    let ref_obs = Observer::new(&refdir)?;
    let (mut rs, mut rf) = (Vec::new(), Vec::new());
    let (mut rs_fb, mut rf_fb) = (0, 0);
    for i in 0..n + 2 {
        // runspool: a one-step run whose step is an external job.
        let id = format!("bridge-{i:04}");
        let body = serde_json::to_vec(&json!({"version": 1, "runId": id, "cwd": "/", "steps": [
            {"agent": "bench", "externalJob": {"provider": "bench", "prompt": "true", "options": {}}}]}))?;
        drop_body(&root.join("spool"), &id, &body)?;
        wait_for(&format!("the provider's start of {id}"), Duration::from_secs(60), || {
            provider_note(&logdir, &id).is_some()
        })?;
        let result = root.join("async-subagent-results").join(format!("{id}.json"));
        wait_for(&format!("run {id} to end"), Duration::from_secs(120), || result.exists())?;
        let dir = runs.join(&id);
        let st: Value = serde_json::from_slice(&fs::read(dir.join("status.json"))?)?;
        if st["state"] != "complete" {
            anyhow::bail!("bridge: run {id} ended {}; see {}", st["state"], dir.display());
        }
        let (began, req) = provider_note(&logdir, &id).expect("noted above");
        let from = match obs.seen(&req) {
            Some(t) => epoch_ns(t),
            None => {
                rs_fb += usize::from(i >= 2);
                st["steps"][0]["externalJob"]["startedAt"].as_u64().unwrap_or(0) as u128 * 1_000_000
            }
        };
        if i >= 2 {
            rs.push(ms_between(from, began));
        }
        // The reference: the same provider, started by `__ref-bridge`.
        let rid = format!("ref-{i:04}");
        let reqdir = refdir.join("external-job-requests");
        let tmp = reqdir.join(format!(".{rid}.tmp"));
        let req = reqdir.join(format!("{rid}.json"));
        write_private(&tmp, &body)?;
        let renamed = epoch_ns(SystemTime::now());
        fs::rename(&tmp, &req)?;
        wait_for(&format!("the reference provider's start of {rid}"), Duration::from_secs(60), || {
            provider_note(&reflog, &rid).is_some()
        })?;
        let (began, _) = provider_note(&reflog, &rid).expect("noted above");
        let _ = wait_for("the observer", Duration::from_secs(1), || ref_obs.seen(&req).is_some());
        let from = match ref_obs.seen(&req) {
            Some(t) => epoch_ns(t),
            None => {
                rf_fb += usize::from(i >= 2);
                renamed
            }
        };
        if i >= 2 {
            rf.push(ms_between(from, began));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(BridgeResult {
        n,
        runspool: BridgeSide { start: Stats::of(rs), fallbacks: rs_fb },
        reference: BridgeSide { start: Stats::of(rf), fallbacks: rf_fb },
    })
}
