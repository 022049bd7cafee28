//! Fabricated runs on disk, as runspool leaves them (PROTOCOL.md), for the
//! idle, scale and start-up phases.

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use serde_json::json;

use crate::fsops::{mkdirs, now_ms, write_private};
use crate::pipelines::request_body;

/// A terminal marker's file name (PROTOCOL §6.3): the end time, then the
/// run id's index segment, which for the benchmark's plain ids (letters,
/// digits, `-`) is the id itself.
fn terminal_marker_name(ended_at: i64, run_id: &str) -> String {
    format!("{:016}-{run_id}.json", ended_at.max(0))
}

/// `n` terminal runs as a runner leaves them (status, terminal marker, result),
/// ended one millisecond apart in the last hour.
pub fn terminal(root: &Path, n: usize) -> anyhow::Result<Vec<String>> {
    let runs = root.join("async-subagent-runs");
    let term = runs.join(".terminal-runs/default");
    let results = root.join("async-subagent-results");
    for d in [root.join("spool"), runs.join(".active-runs"), term.clone(), results.clone()] {
        mkdirs(&d)?;
    }
    let base = now_ms() - 3_600_000;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("term-{i:07}");
        let ended = base + i as i64;
        let dir = runs.join(&id);
        fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let status = json!({
            "runId": id, "sessionId": "default", "mode": "single", "state": "complete",
            "startedAt": ended - 5, "lastUpdate": ended, "endedAt": ended, "timeoutMs": 1_800_000,
            "exitCode": 0, "pid": 1, "cwd": "/", "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": ended - 6},
            "steps": [{"agent": "bench", "status": "complete", "startedAt": ended - 4, "endedAt": ended,
                       "durationMs": 4, "exitCode": 0, "outputFile": dir.join("output-0.log")}],
        });
        write_private(&dir.join("status.json"), &serde_json::to_vec_pretty(&status)?)?;
        let marker = json!({"version": 1, "runId": id, "sessionId": "default", "endedAt": ended});
        write_private(&term.join(terminal_marker_name(ended, &id)), &serde_json::to_vec(&marker)?)?;
        let result = json!({"id": id, "runId": id, "sessionId": "default", "mode": "single", "state": "complete",
            "success": true, "exitCode": 0, "summary": "", "results": [], "durationMs": 5, "timestamp": ended,
            "asyncDir": dir, "cwd": "/"});
        write_private(&results.join(format!("{id}.json")), &serde_json::to_vec(&result)?)?;
        ids.push(id);
    }
    Ok(ids)
}

/// `n` runs in state `running` with active markers; the caller may hold
/// their runner locks to play live runners (liveness is the lock, PROTOCOL §12).
pub fn active(root: &Path, n: usize) -> anyhow::Result<Vec<String>> {
    let runs = root.join("async-subagent-runs");
    mkdirs(&runs.join(".active-runs"))?;
    mkdirs(&root.join("spool"))?;
    let now = now_ms();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("act-{i:06}");
        let dir = runs.join(&id);
        fs::DirBuilder::new().mode(0o700).create(&dir)?;
        mkdirs(&dir.join("control"))?;
        let status = json!({
            "runId": id, "sessionId": "default", "mode": "single", "state": "running",
            "startedAt": now, "lastUpdate": now, "timeoutMs": 604_800_000u64, "deadlineAt": now + 604_800_000i64,
            "pid": std::process::id(), "cwd": "/", "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": now - 1},
            "steps": [{"agent": "bench", "status": "running", "startedAt": now}],
        });
        write_private(&dir.join("request.json"), &request_body(&id))?;
        write_private(&dir.join("status.json"), &serde_json::to_vec_pretty(&status)?)?;
        write_private(&runs.join(".active-runs").join(&id), b"")?;
        ids.push(id);
    }
    Ok(ids)
}
