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
    /// The daemon's own executable: `runspool runner` when the program above
    /// cannot be started (removed or replaced after the daemon started).
    daemon_exe: PathBuf,
}

/// Why a runner could not be started.
#[derive(Debug)]
pub enum SpawnError {
    /// Worth retrying: EAGAIN (RLIMIT_NPROC, no pid free), ENOMEM, ETXTBSY,
    /// EINTR, or a capacity error. The run stays queued.
    Transient { error: io::Error, message: String },
    /// Retrying cannot help: the run fails with `message`.
    Permanent { message: String },
}

impl RunnerProgram {
    pub fn find(daemon_exe: &Path) -> RunnerProgram {
        use std::os::unix::fs::PermissionsExt;
        let sibling = daemon_exe.with_file_name("runspool-runner");
        let daemon_exe = daemon_exe.to_path_buf();
        match std::fs::metadata(&sibling) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {
                RunnerProgram { path: sibling, subcommand: false, daemon_exe }
            }
            _ => RunnerProgram { path: daemon_exe.clone(), subcommand: true, daemon_exe },
        }
    }

    /// The command line, for messages: `/usr/bin/runspool runner` or `.../runspool-runner`.
    pub fn describe(&self) -> String {
        describe(&self.path, self.subcommand)
    }

    /// Start the runner for `run_dir`. When the program cannot be executed
    /// because it is gone or no longer executable, the daemon's own binary is
    /// used instead (`runspool runner`; on Linux `/proc/self/exe` when even
    /// that path is gone), and from then on.
    pub fn start(&mut self, run_dir: &Path) -> Result<Child, SpawnError> {
        let mut candidates = vec![(self.path.clone(), self.subcommand)];
        if self.path != self.daemon_exe {
            candidates.push((self.daemon_exe.clone(), true));
        }
        #[cfg(target_os = "linux")]
        candidates.push((PathBuf::from("/proc/self/exe"), true));
        let mut missing = Vec::new();
        for (path, subcommand) in candidates {
            match spawn_runner_program(&path, subcommand, run_dir) {
                Ok(child) => {
                    if path != self.path {
                        tracing::warn!(
                            runner = %describe(&path, subcommand),
                            unusable = %missing.join("; "),
                            "the runner program cannot be started; using the daemon's own binary from now on"
                        );
                        (self.path, self.subcommand) = (path, subcommand);
                    }
                    return Ok(child);
                }
                Err(e) if program_unusable(&e, &path) => {
                    missing.push(format!("{}: {}", describe(&path, subcommand), errno_text(&e)))
                }
                Err(e) => {
                    let message = format!(
                        "cannot start the runner `{} {}`: {}",
                        describe(&path, subcommand),
                        run_dir.display(),
                        errno_text(&e)
                    );
                    return Err(if is_transient_spawn(&e) {
                        SpawnError::Transient { error: e, message }
                    } else {
                        SpawnError::Permanent {
                            message: format!("{message}; check the runspool installation and the run directory"),
                        }
                    });
                }
            }
        }
        Err(SpawnError::Permanent {
            message: format!(
                "cannot start a runner for {}: {}; reinstall runspool (the daemon's own binary is gone too) and restart the daemon",
                run_dir.display(),
                missing.join("; ")
            ),
        })
    }
}

fn describe(path: &Path, subcommand: bool) -> String {
    if subcommand {
        format!("{} runner", path.display())
    } else {
        path.display().to_string()
    }
}

/// `<strerror> (<ERRNO>)`, e.g. `Resource temporarily unavailable (os error 11) (EAGAIN)`.
pub fn errno_text(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => format!("{e} ({:?})", nix::errno::Errno::from_raw(n)),
        None => e.to_string(),
    }
}

fn is_transient_spawn(e: &io::Error) -> bool {
    fsutil::is_capacity(e)
        || matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::ENOMEM) | Some(libc::ETXTBSY) | Some(libc::EINTR))
}

/// Did exec fail because `path` itself is missing or not executable (as
/// opposed to, say, the run directory that the child changes into)?
fn program_unusable(e: &io::Error, path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let exec_error =
        matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EACCES) | Some(libc::ENOEXEC) | Some(libc::ENOTDIR));
    exec_error
        && !std::fs::metadata(path).is_ok_and(|m| {
            m.is_file() && m.permissions().mode() & 0o111 != 0 && e.raw_os_error() != Some(libc::ENOEXEC)
        })
}

/// Start the runner for `run_dir` detached: its own session (it calls
/// setsid), stdio on /dev/null until it opens its logs, none of the service
/// manager's variables.
pub fn spawn_runner(runner: &RunnerProgram, run_dir: &Path) -> io::Result<Child> {
    spawn_runner_program(&runner.path, runner.subcommand, run_dir)
}

fn spawn_runner_program(program: &Path, subcommand: bool, run_dir: &Path) -> io::Result<Child> {
    let mut cmd = Command::new(program);
    if subcommand {
        cmd.arg("runner");
    }
    // Perf: stdio is /dev/null here; the runner opens runner.stdout.log and
    // runner.stderr.log itself after its `running` write (runner::open_logs),
    // so two file creations leave the path from drop to runner.
    cmd.arg(run_dir).current_dir(run_dir).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // The daemon removed these from its own environment at start-up
    // (`report::take_service_env`); removing them here too would copy the
    // whole environment for every runner.
    for k in crate::platform::SCRUBBED_ENV.iter().filter(|k| std::env::var_os(k).is_some()) {
        cmd.env_remove(k);
    }
    // Perf: no pre_exec hook, so std can use posix_spawn (vfork) instead of fork; the
    // runner calls setsid() itself as its first act (runner::main).
    cmd.spawn()
}

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
    fn a_runner_that_cannot_start_is_reported_with_errno_and_path() {
        let d = tempfile::tempdir().unwrap();
        let gone = d.path().join("gone");
        let mut r =
            RunnerProgram { path: gone.join("runspool-runner"), subcommand: false, daemon_exe: gone.join("runspool") };
        // A run directory that does not exist: the program is fine, the chdir fails.
        let err = r.start(&d.path().join("no-such-run")).unwrap_err();
        let SpawnError::Permanent { message } = err else { panic!("ENOENT is permanent: {err:?}") };
        assert!(message.contains("ENOENT"), "{message}");
        assert!(!message.contains("runner process 0"), "{message}");
        let e = io::Error::from_raw_os_error(libc::EAGAIN);
        assert!(is_transient_spawn(&e) && errno_text(&e).contains("EAGAIN"));
        assert!(!is_transient_spawn(&io::Error::from_raw_os_error(libc::EPERM)));
    }

    #[test]
    fn runner_program_prefers_the_executable_sibling() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let exe = d.path().join("runspool");
        std::fs::write(&exe, b"").unwrap();
        let r = RunnerProgram::find(&exe);
        assert!(r.subcommand && r.path == exe, "no sibling: `runspool runner`");
        assert_eq!(r.describe(), format!("{} runner", exe.display()));
        let sibling = d.path().join("runspool-runner");
        std::fs::write(&sibling, b"").unwrap();
        assert!(RunnerProgram::find(&exe).subcommand, "a sibling that is not executable is not used");
        std::fs::set_permissions(&sibling, std::fs::Permissions::from_mode(0o755)).unwrap();
        let r = RunnerProgram::find(&exe);
        assert!(!r.subcommand && r.path == sibling, "the executable sibling is used");
    }
}
