//! Repair of runs whose runner died, and the end of runs that could not
//! start (PROTOCOL §12). The caller holds the run's `runner.lock`.

use std::io;

use crate::platform::child::{self, Signal};
use crate::protocol::status::{OpenSteps, State, StepState, Unfinished};
use crate::store::layout::RunPaths;
use crate::store::repaired::{ensure_repaired_event, runner_pid, REPAIRED_PREFIX, REPAIRED_SUFFIX};
use crate::store::{results, run, Layout, RunId, Writer};

/// End a queued run whose runner cannot be started: `failed`, every step
/// skipped, `message` (which names the errno and the runner) as its error.
/// The caller holds runner.lock.
pub fn fail_unstartable(w: &mut Writer, l: &Layout, run_id: &RunId, message: &str) -> io::Result<bool> {
    results::fail_queued(w, l, run_id, message, "skipped: the runner could not be started")
}

/// Repair an active run whose runner died (the caller holds runner.lock).
pub fn repair(w: &mut Writer, l: &Layout, run_id: &RunId) -> io::Result<()> {
    let dir = l.run_dir(run_id);
    let Some(cur) = run::read_status(&dir)? else { return Ok(()) };
    if !cur.state.is_active() {
        return Ok(());
    }
    // Kill what is left of the run's step process groups first.
    for st in &cur.steps {
        if let (StepState::Running, Some(pgid)) = (&st.status, st.pid) {
            if !crate::platform::run_processes_in_group(pgid, run_id).is_empty() {
                tracing::warn!(run_id = %run_id, pgid, "killing the step process group left by a dead runner");
                child::signal_group(pgid, Signal::SIGKILL);
            }
        }
    }
    let pid = runner_pid(&cur);
    let tail = results::tail(&RunPaths::runner_stderr_log(&dir), 2048);
    let lines: Vec<&str> = tail.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect();
    let mut message = format!("{REPAIRED_PREFIX}{pid}{REPAIRED_SUFFIX}");
    if !lines.is_empty() {
        message.push_str(": ");
        message.push_str(&lines.join("\n"));
    }
    let now = crate::now_ms();
    let s = results::write_terminal(w, l, run_id, move |cur| {
        let mut s = cur?;
        let open = OpenSteps { status: StepState::Failed, error: message.clone(), how: Unfinished::Cut };
        s.end(State::Failed, Some(message), &open, now).then_some(s)
    })?;
    if let Some(s) = s.filter(|s| s.state == State::Failed) {
        tracing::warn!(run_id = %run_id, runner_pid = pid, "repaired a run whose runner died");
        ensure_repaired_event(w, &dir, &s);
    }
    Ok(())
}
