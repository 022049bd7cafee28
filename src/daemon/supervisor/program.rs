//! The runner program and how it is started: `runspool-runner` next to the
//! daemon, else `runspool runner`, falling back to the daemon's own binary.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};

use crate::store::fsutil;

/// A runner this daemon started.
#[derive(Debug)]
pub enum Started {
    /// Exec'd by the daemon: its child.
    Child(Child),
    /// Forked by the fork server `server` (a generation number of this
    /// daemon's servers); its exit comes as a message from that server.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    Forked { server: u64, serial: u64, pid: u32 },
}

impl Started {
    pub fn id(&self) -> u32 {
        match self {
            Started::Child(c) => c.id(),
            Started::Forked { pid, .. } => *pid,
        }
    }
}

/// What the fork servers reported since the last look (`RunnerProgram::exits`).
#[derive(Default)]
pub struct Exits {
    /// (server, serial) of each forked runner that exited.
    pub exited: std::collections::HashMap<(u64, u64), ExitStatus>,
    /// The server whose runners are still reported; runners of any other
    /// are no longer reported and are watched by their lock instead.
    pub live_server: Option<u64>,
}

/// The program the daemon starts for each run: `runspool-runner` next to
/// the daemon's own binary (a smaller binary, quicker to start), else
/// `runspool runner`.
pub struct RunnerProgram {
    pub path: PathBuf,
    subcommand: bool,
    /// The daemon's own executable: `runspool runner` when the program above
    /// cannot be started (removed or replaced after the daemon started).
    daemon_exe: PathBuf,
    fork: ForkServer,
}

/// The fork server of `runspool-runner` (`platform::forkserver`), started
/// with the first runner, replaced when it dies, is stopped or its program
/// file is replaced, and given up after `MAX_FORK_SERVER_FAILURES` failures
/// in a row (exec from then on).
#[derive(Default)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
struct ForkServer {
    /// Wakes the loop when a forked runner exits; no fork server without it.
    wake: Option<std::sync::mpsc::Sender<crate::daemon::hint::Hint>>,
    #[cfg(target_os = "linux")]
    client: Option<(u64, crate::platform::forkserver::Client)>,
    generation: u64,
    /// Failures since the last runner it forked.
    failures: u32,
    /// When the server was last checked for being stopped.
    checked: Option<std::time::Instant>,
}

#[cfg(target_os = "linux")]
const MAX_FORK_SERVER_FAILURES: u32 = 3;

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
                RunnerProgram { path: sibling, subcommand: false, daemon_exe, fork: ForkServer::default() }
            }
            _ => RunnerProgram { path: daemon_exe.clone(), subcommand: true, daemon_exe, fork: ForkServer::default() },
        }
    }

    /// Fork runners from a fork server (Linux, `runspool-runner` only),
    /// whose reports of exited runners wake the loop through `tx`.
    pub fn forking(mut self, tx: std::sync::mpsc::Sender<crate::daemon::hint::Hint>) -> RunnerProgram {
        self.fork.wake = Some(tx);
        self
    }

    /// The forked runners that exited since the last call.
    pub fn exits(&mut self) -> Exits {
        #[cfg(target_os = "linux")]
        if let Some((_, c)) = self.fork.client.as_mut() {
            // A stopped server reports no exit, so the slots of its runners
            // would never free: once a second, a stopped one is replaced.
            let now = std::time::Instant::now();
            if self.fork.checked.is_none_or(|t| now.duration_since(t) >= std::time::Duration::from_secs(1)) {
                self.fork.checked = Some(now);
                if c.is_stopped() {
                    let why =
                        c.give_up("is stopped (SIGSTOP or a debugger); its runners are watched by their lock".into());
                    tracing::warn!("{why}");
                }
            }
        }
        #[cfg(target_os = "linux")]
        if let Some((generation, c)) = &self.fork.client {
            let exited = c.take_exits().into_iter().map(|(serial, st)| ((*generation, serial), st)).collect();
            if !c.is_dead() {
                return Exits { exited, live_server: Some(*generation) };
            }
            // Reaped now (`Client`'s drop), not at the next start.
            self.fork.client = None;
            return Exits { exited, live_server: None };
        }
        Exits::default()
    }

    /// The command line, for messages: `/usr/bin/runspool runner` or `.../runspool-runner`.
    pub fn describe(&self) -> String {
        describe(&self.path, self.subcommand)
    }

    /// Start the runner for `run_dir`. When the program cannot be executed
    /// because it is gone or no longer executable, the daemon's own binary is
    /// used instead (`runspool runner`; on Linux `/proc/self/exe` when even
    /// that path is gone), and from then on.
    pub fn start(&mut self, run_dir: &Path) -> Result<Started, SpawnError> {
        #[cfg(target_os = "linux")]
        if let Some(started) = self.fork(run_dir)? {
            return Ok(started);
        }
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
                    return Ok(Started::Child(child));
                }
                Err(e) if program_unusable(&e, &path) => {
                    missing.push(format!("{}: {}", describe(&path, subcommand), errno_text(&e)))
                }
                Err(e) => {
                    let runner = describe(&path, subcommand);
                    return Err(start_error(
                        e,
                        &runner,
                        run_dir,
                        "check the runspool installation and the run directory",
                    ));
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

#[cfg(target_os = "linux")]
impl RunnerProgram {
    /// A runner forked by the fork server, or None when this run is
    /// exec'd instead (no server wanted or usable; see `platform::forkserver`).
    fn fork(&mut self, run_dir: &Path) -> Result<Option<Started>, SpawnError> {
        use crate::platform::forkserver::{Client, StartError};
        let f = &mut self.fork;
        let Some(tx) = f.wake.as_ref() else { return Ok(None) };
        if self.subcommand || f.failures >= MAX_FORK_SERVER_FAILURES {
            return Ok(None);
        }
        if f.client.as_ref().is_some_and(|(_, c)| !c.is_current(&self.path)) {
            // Dead, or its program file was replaced: the next one runs the new file.
            f.client = None;
        }
        if f.client.is_none() {
            let tx = tx.clone();
            let wake = Box::new(move || {
                let _ = tx.send(crate::daemon::hint::Hint::RunnerExited);
            });
            match Client::spawn(&self.path, wake) {
                Ok(c) => {
                    f.generation += 1;
                    f.client = Some((f.generation, c));
                }
                Err(e) => {
                    // A transient shortage (EAGAIN, ENOMEM) does not count against the server.
                    if !is_transient_spawn(&e) {
                        f.failures += 1;
                    }
                    let then = if f.failures >= MAX_FORK_SERVER_FAILURES {
                        "exec'ing runners from now on (restart the daemon to try again)"
                    } else {
                        "exec'ing this runner instead"
                    };
                    tracing::warn!(runner = %self.path.display(), error = %errno_text(&e), "cannot start the runner fork server `{} --fork-server`; {then}", self.path.display());
                    return Ok(None);
                }
            }
        }
        let Some((generation, c)) = f.client.as_mut() else { return Ok(None) };
        if !c.fits(run_dir) {
            return Ok(None);
        }
        match c.start(run_dir) {
            Ok(forked) => {
                f.failures = 0;
                Ok(Some(Started::Forked { server: *generation, serial: forked.serial, pid: forked.pid }))
            }
            Err(StartError::Os(e)) => {
                Err(start_error(e, &self.path.display().to_string(), run_dir, "check the run directory"))
            }
            Err(StartError::Server(why)) => {
                f.failures += 1;
                f.client = None;
                if f.failures >= MAX_FORK_SERVER_FAILURES {
                    tracing::warn!("{why}; {} failures in a row: exec'ing runners from now on (restart the daemon to try the fork server again)", f.failures);
                } else {
                    tracing::warn!("{why}; exec'ing this runner and starting a new server for the next");
                }
                Ok(None)
            }
        }
    }
}

/// A runner start that failed with `e`: retried later when the error is
/// transient, else the run fails with a message naming the errno, the
/// runner and `fix`.
fn start_error(e: io::Error, runner: &str, run_dir: &Path, fix: &str) -> SpawnError {
    let message = format!("cannot start the runner `{runner} {}`: {}", run_dir.display(), errno_text(&e));
    if is_transient_spawn(&e) {
        SpawnError::Transient { error: e, message }
    } else {
        SpawnError::Permanent { message: format!("{message}; {fix}") }
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

/// Start the runner for `run_dir` detached: stdio on /dev/null until it
/// opens its logs, none of the service manager's variables.
fn spawn_runner_program(program: &Path, subcommand: bool, run_dir: &Path) -> io::Result<Child> {
    use crate::platform::exec::{command, Detach};
    // The runner makes its own session (its first act, runner::main).
    let mut cmd = command(program, Detach::default());
    if subcommand {
        cmd.arg("runner");
    }
    // Perf: stdio is /dev/null here; the runner opens runner.stdout.log and
    // runner.stderr.log itself after its `running` write (runner::open_logs),
    // so two file creations leave the path from drop to runner.
    cmd.arg(run_dir).current_dir(run_dir).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // Perf: no pre_exec hook, so std can use posix_spawn (vfork) instead of fork.
    cmd.spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runner_that_cannot_start_is_reported_with_errno_and_path() {
        let d = tempfile::tempdir().unwrap();
        let gone = d.path().join("gone");
        let mut r = RunnerProgram {
            path: gone.join("runspool-runner"),
            subcommand: false,
            daemon_exe: gone.join("runspool"),
            fork: ForkServer::default(),
        };
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
