//! Repair of runs whose runner died, and the end of runs that could not
//! start (PROTOCOL §12). The caller holds the run's `runner.lock`.

use std::fs::File;
use std::io;
use std::path::Path;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::json;

use crate::protocol::status::{OpenSteps, State, Status, StepState, Unfinished};
use crate::store::fsutil;
use crate::store::layout::RunPaths;
use crate::store::{index, results, run, Layout, Writer};

/// End a queued run whose runner cannot be started: `failed`, every step
/// skipped, `message` (which names the errno and the runner) as its error.
/// The caller holds runner.lock.
pub fn fail_unstartable(w: &mut Writer, l: &Layout, run_id: &str, message: &str) -> io::Result<bool> {
    results::fail_queued(w, l, run_id, message, "skipped: the runner could not be started")
}

/// Take `runner.lock` if no live runner holds it. Holding it proves the
/// runner is gone and keeps a new one from starting while we repair.
pub fn take_runner_lock(run_dir: &Path) -> io::Result<Option<File>> {
    fsutil::lock(&RunPaths::runner_lock(run_dir), true)
}

/// Repair an active run whose runner died (the caller holds runner.lock).
pub fn repair(w: &mut Writer, l: &Layout, run_id: &str) -> io::Result<()> {
    let dir = l.run_dir(run_id);
    let Some(cur) = run::read_status(&dir)? else { return Ok(()) };
    if !cur.state.is_active() {
        return Ok(());
    }
    // Kill what is left of the run's step process groups first.
    for st in &cur.steps {
        if let (StepState::Running, Some(pgid)) = (&st.status, st.pid) {
            if !crate::platform::run_processes_in_group(pgid, run_id).is_empty() {
                tracing::warn!(run_id, pgid, "killing the step process group left by a dead runner");
                let _ = killpg(Pid::from_raw(pgid as i32), Signal::SIGKILL);
            }
        }
    }
    let pid = cur.pid.or(cur.runner.as_ref().map(|r| r.pid)).unwrap_or(0);
    let tail = results::tail(&RunPaths::runner_stderr_log(&dir), 2048);
    let lines: Vec<&str> = tail.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect();
    let mut message = format!("runner process {pid} exited before recording a result");
    if !lines.is_empty() {
        message.push_str(": ");
        message.push_str(&lines.join("\n"));
    }
    let now = crate::now_ms();
    let msg = message.clone();
    let s = results::write_terminal(w, l, run_id, move |cur| {
        let mut s = cur?;
        let open = OpenSteps { status: StepState::Failed, error: msg.clone(), how: Unfinished::Cut };
        s.end(State::Failed, Some(msg), &open, now).then_some(s)
    })?;
    if s.is_some_and(|s| s.state == State::Failed) {
        tracing::warn!(run_id, runner_pid = pid, "repaired a run whose runner died");
        run::event(w, &dir, run_id, "subagent.run.repaired_stale", json!({"pid": pid, "message": message}));
    }
    Ok(())
}

/// A terminal run whose publication may have been cut short (the runner or
/// the daemon died between the status and the indexes): finish it again.
pub fn ensure_published_status(w: &mut Writer, l: &Layout, s: &Status) -> io::Result<()> {
    if s.state.is_active() {
        return Ok(());
    }
    let marker = index::terminal_marker_path(l, s);
    // The marker is written without fsync: one a power loss left empty or
    // zero-filled counts as missing, so the publication is done again.
    let marker_ok = fsutil::read_nofollow(&marker, 64 * 1024)
        .is_ok_and(|b| serde_json::from_slice::<crate::protocol::status::TerminalMarker>(&b).is_ok());
    if !marker_ok || l.active().join(&s.run_id).exists() {
        results::finish_terminal(w, l, s)?;
    }
    Ok(())
}
