//! Result files (PROTOCOL §7), the whole terminal publication sequence, and
//! its inverse: the removal of a finished run (retention, `rm`, `clean`).

use std::io;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::fsutil;
use super::layout::{Layout, RunId, RunPaths};
use super::{index, Writer};
use crate::protocol::seg::{seg, seg250};
use crate::protocol::status::{RunResult, State, Status, StepResult, StepState};

const SUMMARY_BYTES: u64 = 4096;

/// Build the result of a terminal status.
pub fn build_result(l: &Layout, id: &RunId, s: &Status) -> RunResult {
    let run_dir = l.run_dir(id);
    let last_output = s.steps.iter().rev().find_map(|st| st.output_file.clone());
    let summary = last_output.map(|p| tail(&PathBuf::from(p), SUMMARY_BYTES)).unwrap_or_default();
    let ended = s.ended_at.unwrap_or(s.last_update);
    RunResult {
        id: id.to_string(),
        run_id: id.to_string(),
        session_id: s.session_id.clone(),
        tool_call_id: s.tool_call_id.clone().filter(|t| !t.is_empty()),
        completion_owner_id: s.completion_owner_id.clone(),
        // PROTOCOL §7: the first step's agent (0.67's reconciler falls back
        // to "subagent" when a run has no steps; so does runspool).
        agent: s.steps.first().map(|st| st.agent.clone()).unwrap_or_else(|| "subagent".into()),
        mode: s.mode.clone(),
        state: s.state.clone(),
        success: s.state == State::Complete,
        exit_code: s.exit_code.unwrap_or(1),
        summary,
        results: s
            .steps
            .iter()
            .map(|st| StepResult {
                agent: st.agent.clone(),
                exit_code: st.exit_code.unwrap_or(-1),
                success: st.status == StepState::Complete,
                output_file: st.output_file.clone(),
                error: st.error.clone(),
            })
            .collect(),
        duration_ms: (ended - s.started_at).max(0),
        timestamp: ended,
        async_dir: run_dir.display().to_string(),
        cwd: s.cwd.clone(),
    }
}

/// The last `max` bytes of a file, as text (lossy at the cut).
pub fn tail(path: &std::path::Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Never follow a symlink or block on a FIFO a step put in place of its log.
    let Ok(mut f) = fsutil::open_read(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Where a run's result is indexed (PROTOCOL §7), as pi-subagents 0.67's
/// `writeResultIndexForData` writes it: by session
/// (`result-index/sessions/<seg(sessionId)>/<seg250(runId)>.json`), by run
/// (`result-index/runs/<seg250(runId)>.json`) and, when the run has a
/// `toolCallId`, by tool call
/// (`result-index/tool-calls/<seg(toolCallId)>/<seg250(runId)>.json`).
pub fn result_index_paths(l: &Layout, id: &RunId, session_id: &str, tool_call_id: Option<&str>) -> Vec<PathBuf> {
    let name = format!("{}.json", seg250(id));
    let mut out = vec![l.result_index_sessions().join(seg(session_id)).join(&name), l.result_index_runs().join(&name)];
    if let Some(t) = tool_call_id.filter(|t| !t.is_empty()) {
        out.push(l.result_index_tool_calls().join(seg(t)).join(&name));
    }
    out
}

/// Stage, index and promote the result file, in 0.67's order: the pending
/// file, the index entries (same content in each), then the rename to the
/// public name.
pub fn publish_result(l: &Layout, id: &RunId, s: &Status) -> io::Result<()> {
    let r = build_result(l, id, s);
    let public = l.result_file(id);
    let pending_dir = l.result_pending().join(seg(&s.session_id));
    let pending = pending_dir.join(format!("{}.json", seg250(id)));
    fsutil::write_atomic_mkdir(&pending, &serde_json::to_vec_pretty(&r).map_err(io::Error::other)?, true)?;
    // `file` is the bare name: pi-subagents 0.67's lookups
    // (resultPayloadPathForSessionRun, resultFilesForToolCall, ...) refuse
    // anything else.
    let idx = json!({
        "version": 1, "runId": id.as_str(), "sessionId": s.session_id,
        "file": format!("{id}.json"), "writtenAt": crate::now_ms(),
        "asyncDir": r.async_dir,
    });
    let idx = serde_json::to_vec(&idx).map_err(io::Error::other)?;
    for (i, path) in result_index_paths(l, id, &s.session_id, r.tool_call_id.as_deref()).into_iter().enumerate() {
        match fsutil::write_atomic_mkdir(&path, &idx, false) {
            Ok(()) => {}
            // The session index is the one every reader uses: without it the
            // publication is retried. The run and tool-call indexes are
            // optional in 0.67 too (a failure is logged there); only a
            // capacity error, which passes, is worth a retry.
            Err(e) if i == 0 || fsutil::is_capacity(&e) => return Err(e),
            Err(e) => {
                tracing::warn!(run_id = %id, path = %path.display(), error = %e, "cannot write a result index entry; pi-subagents finds the result by its session index")
            }
        }
    }
    std::fs::rename(&pending, &public)?;
    // Barrier: the public name is durable before the terminal marker that
    // follows, whose presence tells a restart the result is out (a marker
    // that reached the disk without the rename would strand the result in
    // result-pending/ for good). The pending file itself was fsynced above.
    fsutil::fsync_dir(&l.results())?;
    Ok(())
}

/// After a terminal status write: indexes, then the result, each idempotent,
/// queued behind the status if the disk is full.
pub fn finish_terminal(w: &mut Writer, l: &Layout, id: &RunId, s: &Status) -> io::Result<()> {
    let (l, id, s) = (l.clone(), id.clone(), s.clone());
    w.then(
        format!("finish {id}"),
        // The result first, then the terminal marker (its presence tells a
        // restart the result was published), and the active marker last, so a
        // terminal run is never missing from both indexes.
        Box::new(move || {
            // Under the run's status lock, and only while the run still
            // exists: `rm`, `clean` and retention remove a run holding that
            // lock, so a publication that comes late (the daemon settling a
            // runner that just exited) never brings back the result and
            // markers of a run removed meanwhile.
            let dir = l.run_dir(&id);
            let _lock = match fsutil::lock(&super::layout::RunPaths::status_lock(&dir), false) {
                Ok(lock) => lock,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            };
            if std::fs::symlink_metadata(super::layout::RunPaths::status(&dir)).is_err() {
                return Ok(());
            }
            publish_result(&l, &id, &s)?;
            index::mark_terminal(&l, &s)?;
            index::unmark_active(&l, &id, s.tool_call_id.as_deref())
        }),
    )
}

/// Write a terminal status for a run through the full sequence (status,
/// event, indexes, result). Used by the daemon for repairs, stops of queued
/// runs and rejections. `f` turns the current status into the terminal one.
pub fn write_terminal(
    w: &mut Writer,
    l: &Layout,
    run_id: &RunId,
    f: impl FnOnce(Option<Status>) -> Option<Status>,
) -> io::Result<Option<Status>> {
    let dir = l.run_dir(run_id);
    let s = super::run::update_status(w, &dir, f)?;
    if let Some(s) = &s {
        if !s.state.is_active() {
            finish_terminal(w, l, run_id, s)?;
        }
    }
    Ok(s)
}

/// End a run that is still `queued` as `failed` before any step ran (its
/// runner cannot start, or its request.json fails validation): every step
/// skipped with `skip`, `message` as the run's error, exit code 1, the
/// `subagent.run.completed` event, indexes and result. True when this call
/// ended it (a run no longer queued is left as it is).
pub fn fail_queued(w: &mut Writer, l: &Layout, run_id: &RunId, message: &str, skip: &str) -> io::Result<bool> {
    use crate::protocol::status::{OpenSteps, State, StepState};
    let now = crate::now_ms();
    let (msg, skip) = (message.to_string(), skip.to_string());
    let s = write_terminal(w, l, run_id, move |cur| {
        let mut s = cur?;
        if s.state != State::Queued {
            return None;
        }
        s.end(State::Failed, Some(msg), &OpenSteps::skipped(StepState::Failed, &skip), now);
        Some(s)
    })?;
    let failed = s.is_some_and(|s| s.state == State::Failed);
    if failed {
        super::run::event(
            w,
            &l.run_dir(run_id),
            run_id,
            "subagent.run.completed",
            json!({"status": "failed", "durationMs": 0, "exitCode": 1}),
        );
    }
    Ok(failed)
}

/// runspool's own tombstones (PROTOCOL §12); pi-subagents 0.67 uses `.deleting-run-`.
pub const TOMBSTONE_PREFIX: &str = ".runspool-deleting-";

/// Results and index entries first, then the marker, then the directory: a
/// crash in between leaves a terminal run without its marker, which the next
/// start publishes again and the next sweep removes.
pub fn remove_run(l: &Layout, id: &RunId, s: &Status, marker: &Path) {
    // Held until the directory is gone: a publication of this run
    // (`results::finish_terminal`) waits for it, then finds no status.
    let _lock = fsutil::lock(&RunPaths::status_lock(&l.run_dir(id)), false);
    let _ = fsutil::remove_if_exists(&l.result_file(id));
    for path in result_index_paths(l, id, &s.session_id, s.tool_call_id.as_deref()) {
        let _ = fsutil::remove_if_exists(&path);
        // A tool call's index directory holds its runs' entries: removed once empty.
        if path.parent().and_then(Path::parent).is_some_and(|p| p.ends_with("result-index/tool-calls")) {
            let _ = path.parent().map(std::fs::remove_dir);
        }
    }
    let _ = index::unmark_active(l, id, s.tool_call_id.as_deref());
    let _ = fsutil::remove_if_exists(marker);
    let tomb = l.runs().join(format!("{TOMBSTONE_PREFIX}{}", uuid::Uuid::new_v4()));
    if std::fs::rename(l.run_dir(id), &tomb).is_ok() {
        let _ = std::fs::remove_dir_all(&tomb);
    }
    tracing::info!(run_id = %id, "removed a run");
}
