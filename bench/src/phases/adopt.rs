//! Phase 5, daemon start-up: re-adoption of live runs.

use std::fs::{self, File};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::fabricate;
use crate::fsops;
use crate::pipelines::{wait_for, Env};

#[derive(Clone, Copy, Debug)]
pub struct AdoptResult {
    pub terminal: usize,
    pub active: usize,
    pub secs: f64,
}

/// Daemon start-up with `active` live runs (their runner locks held by this
/// process) and `terminal` finished runs: from spawn until daemon.json
/// reports every active run as running.
pub fn measure(env: &Env, active: usize, terminal: usize) -> anyhow::Result<AdoptResult> {
    let root = env.fresh_root(&format!("adopt-{active}-{terminal}"))?;
    if terminal > 0 {
        fabricate::terminal(&root, terminal)?;
    }
    let ids = fabricate::active(&root, active)?;
    let runs = root.join("async-subagent-runs");
    let locks: Vec<File> = ids
        .iter()
        .map(|id| {
            fsops::lock(&runs.join(id).join("runner.lock"), true)?.ok_or_else(|| std::io::Error::other("lock busy"))
        })
        .collect::<std::io::Result<_>>()?;
    let dj = root.join("runspool/daemon.json");
    let t0 = Instant::now();
    let d = env.start_runspool(&root, 4, "native")?;
    wait_for("re-adoption", Duration::from_secs(600), || {
        fs::read(&dj)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["runs"]["running"].as_u64() == Some(active as u64))
    })?;
    let secs = t0.elapsed().as_secs_f64();
    drop(d); // stop the daemon before the "runners" die, or it would repair them
    drop(locks);
    Ok(AdoptResult { terminal, active, secs })
}
