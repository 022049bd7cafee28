//! Runner liveness, spawning, repair of dead runs (PROTOCOL §12).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::json;

use crate::protocol::status::{State, Status, StepState};
use crate::store::fsutil;
use crate::store::layout::RunPaths;
use crate::store::{index, results, run, Layout, Writer};

/// The program the daemon starts for each run: `runspool-runner` next to
/// the daemon's own binary (a smaller binary, quicker to start), else
/// `runspool runner`.
pub struct RunnerProgram {
    pub path: PathBuf,
    subcommand: bool,
}

impl RunnerProgram {
    pub fn find(daemon_exe: &Path) -> RunnerProgram {
        use std::os::unix::fs::PermissionsExt;
        let sibling = daemon_exe.with_file_name("runspool-runner");
        match std::fs::metadata(&sibling) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {
                RunnerProgram { path: sibling, subcommand: false }
            }
            _ => RunnerProgram { path: daemon_exe.to_path_buf(), subcommand: true },
        }
    }
}

/// Start the runner for `run_dir` detached: its own session (it calls
/// setsid), stdio on /dev/null until it opens its logs, none of the service
/// manager's variables.
pub fn spawn_runner(runner: &RunnerProgram, run_dir: &Path) -> io::Result<Child> {
    let mut cmd = Command::new(&runner.path);
    if runner.subcommand {
        cmd.arg("runner");
    }
    // Perf: stdio is /dev/null here; the runner opens runner.stdout.log and
    // runner.stderr.log itself after its `running` write (runner::open_logs),
    // so two file creations leave the path from drop to runner.
    cmd.arg(run_dir).current_dir(run_dir).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // The daemon removed these from its own environment at start-up
    // (`report::take_service_env`); removing them here too would copy the
    // whole environment for every runner.
    for k in crate::runner::SCRUBBED_ENV.iter().filter(|k| std::env::var_os(k).is_some()) {
        cmd.env_remove(k);
    }
    // Perf: no pre_exec hook, so std can use posix_spawn (vfork) instead of fork; the
    // runner calls setsid() itself as its first act (runner::main).
    cmd.spawn()
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
    let tail = results::tail(&dir.join("runner.stderr.log"), 2048);
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
        if !s.state.is_active() {
            return None;
        }
        for st in s.steps.iter_mut().filter(|st| matches!(st.status, StepState::Running | StepState::Pending)) {
            st.status = StepState::Failed;
            st.exit_code = Some(1);
            st.error = Some(msg.clone());
            st.ended_at = Some(now);
            if st.duration_ms.is_none() {
                st.duration_ms = Some(st.started_at.map(|t| now - t).unwrap_or(0));
            }
        }
        s.state = State::Failed;
        s.ended_at = Some(now);
        s.error = Some(msg);
        s.exit_code = Some(s.terminal_exit_code());
        Some(s)
    })?;
    if s.is_some_and(|s| s.state == State::Failed) {
        tracing::warn!(run_id, runner_pid = pid, "repaired a run whose runner died");
        run::event(w, &dir, run_id, "subagent.run.repaired_stale", json!({"pid": pid, "message": message}));
    }
    Ok(())
}

/// A terminal run whose publication may have been cut short (the runner or
/// the daemon died between the status and the indexes): finish it again.
pub fn ensure_published(w: &mut Writer, l: &Layout, run_id: &str) -> io::Result<()> {
    let Some(s) = run::read_status(&l.run_dir(run_id))? else { return Ok(()) };
    ensure_published_status(w, l, &s)
}

/// `ensure_published` for a status the caller has just read (perf: start-up
/// reads each of many terminal runs once, not twice).
pub fn ensure_published_status(w: &mut Writer, l: &Layout, s: &Status) -> io::Result<()> {
    if s.state.is_active() {
        return Ok(());
    }
    let marker = index::terminal_marker_path(l, s);
    if !marker.exists() || l.active().join(&s.run_id).exists() {
        results::finish_terminal(w, l, s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_program_prefers_the_executable_sibling() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let exe = d.path().join("runspool");
        std::fs::write(&exe, b"").unwrap();
        let r = RunnerProgram::find(&exe);
        assert!(r.subcommand && r.path == exe, "no sibling: `runspool runner`");
        let sibling = d.path().join("runspool-runner");
        std::fs::write(&sibling, b"").unwrap();
        assert!(RunnerProgram::find(&exe).subcommand, "a sibling that is not executable is not used");
        std::fs::set_permissions(&sibling, std::fs::Permissions::from_mode(0o755)).unwrap();
        let r = RunnerProgram::find(&exe);
        assert!(!r.subcommand && r.path == sibling, "the executable sibling is used");
    }
}
