//! `runspool runner <runDir>`: one run. Holds runner.lock for its whole life,
//! runs the steps in their own process groups, enforces timeouts, obeys the
//! control inbox, and records every outcome in status.json.
//!
//! The runner is made of parts, as the daemon is; each owns its state in its
//! own file, does its work in a call, and says what happened as a value the
//! `Runner` (this file) hands to the part it concerns. No part calls another:
//!
//! - `steps`: the group loop, command steps through the child supervisor
//!   (`platform::child`), their timeouts and kill ladders, containment;
//! - `control`: the control inbox and its watcher, stop requests, the halt,
//!   the run's deadline;
//! - `record`: every write the run makes (status.json, events, the steps'
//!   "runspool:" lines, the heartbeat, indexes and result), the one owner of
//!   the `Status` and the `Writer`;
//! - `external`: external-job steps and their driver threads.

mod control;
mod external;
mod post;
mod record;
mod steps;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::outcome::{Exit, StepEnd};
use crate::protocol::request::{self, Context, Rejection, Request, MAX_REQUEST_BYTES};
use crate::store::fsutil;
use crate::store::layout::{RunId, RunPaths};
use crate::store::{Layout, Writer};
use control::Control;
use external::External;
use post::{Msg, Post, Report};
use record::Record;
use steps::{Effect, Steps, View};

pub struct Runner {
    post: Post,
    rx: Receiver<Msg>,
    /// The read end of the wake socket (see `Post`).
    wake: UnixStream,
    record: Record,
    control: Control,
    steps: Steps,
    external: External,
}

/// What the steps read of the others: the status, the halt, the stops.
macro_rules! view {
    ($r:ident) => {
        View { status: $r.record.status(), halt: $r.control.halt(), stops: $r.control.step_stops() }
    };
}

/// Entry point. Returns the process exit code.
pub fn main(run_dir: &Path) -> i32 {
    // Detach into a session of our own (the daemon spawns us without a pre_exec hook).
    let _ = nix::unistd::setsid();
    // Nothing the runner was started with beyond stdio reaches its steps.
    crate::platform::close_inherited_fds();
    // Whatever the runner prints lands in its logs, a panic included: the
    // logs are opened before the first line is written (`open_logs`).
    let _ = LOG_DIR.set(run_dir.to_path_buf());
    crate::logging::before_stderr(open_logs_once);
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        open_logs_once();
        default_hook(info);
    }));
    match run(run_dir) {
        Ok(code) => code,
        Err(e) => {
            open_logs(run_dir);
            crate::note!("runspool runner {}: {e:#}", run_dir.display());
            1
        }
    }
}

/// The run directory whose logs `open_logs_once` opens.
static LOG_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn open_logs_once() {
    if let Some(dir) = LOG_DIR.get() {
        open_logs(dir);
    }
}

/// Point stdout and stderr at `runner.stdout.log` and `runner.stderr.log`
/// (PROTOCOL §3), created 0600 if missing. Perf: the daemon starts the runner
/// on /dev/null and the runner opens its logs only before its first line
/// (`crate::note!`, a log event, a panic: `logging::before_stderr`), so a
/// clean run creates neither file. Nothing else writes to the runner's
/// stdio: its steps get their own log as stdout and stderr. On a full disk
/// the runner carries on without them.
fn open_logs(dir: &Path) {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        type Dup2 = fn(&std::fs::File) -> nix::Result<()>;
        let targets: [(PathBuf, Dup2); 2] = [
            (RunPaths::runner_stdout_log(dir), |f| nix::unistd::dup2_stdout(f)),
            (RunPaths::runner_stderr_log(dir), |f| nix::unistd::dup2_stderr(f)),
        ];
        for (path, dup2) in targets {
            // A FIFO or link a step planted in place of a log is refused without blocking.
            if let Ok(f) = fsutil::open_append(&path) {
                // dup2 clears O_CLOEXEC on the new descriptor: it is our stdio from now on.
                let _ = dup2(&f);
            }
        }
    });
}

/// The run directory as an absolute path. Perf: the daemon passes an
/// absolute path without `.` or `..` (its root joined with the run's id);
/// that path is taken as it is unless the directory itself is a symlink, and
/// anything else is canonicalized (a lookup of every component).
fn run_dir_path(run_dir: &Path) -> std::io::Result<PathBuf> {
    use std::path::Component;
    let plain = run_dir.is_absolute()
        && run_dir.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && std::fs::symlink_metadata(run_dir).is_ok_and(|m| m.is_dir());
    if plain {
        return Ok(run_dir.to_path_buf());
    }
    std::fs::canonicalize(run_dir)
}

fn run(run_dir: &Path) -> anyhow::Result<i32> {
    let dir = run_dir_path(run_dir)?;
    let runs = dir.parent().ok_or_else(|| anyhow::anyhow!("run directory has no parent"))?;
    let layout = Layout::new(runs.parent().ok_or_else(|| anyhow::anyhow!("runs root has no parent"))?);
    // A run is its directory: its name is its id.
    let id = RunId::of_dir(&dir)
        .ok_or_else(|| anyhow::anyhow!("{} is not a run directory: its name is not a run id", dir.display()))?;
    let lock_path = RunPaths::runner_lock(&dir);
    let Some(_lock) = fsutil::wait_out_capacity(&lock_path, || {
        let r = fsutil::lock(&lock_path, true);
        if r.as_ref().is_err_and(fsutil::is_capacity) {
            open_logs(&dir); // so the wait is reported, if there is room for the logs
        }
        r
    })?
    else {
        open_logs(&dir);
        crate::note!("another runner holds {}; leaving the run to it", RunPaths::runner_lock(&dir).display());
        return Ok(0);
    };
    let raw = fsutil::read_nofollow(&RunPaths::request(&dir), 2 * 1024 * 1024).map_err(|e| {
        anyhow::anyhow!(
            "cannot read {}: {e}; the daemon starts a runner only for a claimed run",
            RunPaths::request(&dir).display()
        )
    })?;
    let mut w = Writer::new();
    // Before any step exists: every orphan among the steps' descendants (a
    // `setsid`'d or double-forked grandchild) is re-parented to us, so it can
    // be found and killed when its step ends (`Steps::contain`).
    let containment = if crate::platform::child::become_subreaper() { "subreaper" } else { "process-group" };
    // G4: run only bytes that pass the claim's own validator, read once here.
    let req = match validate_request(&raw) {
        Ok(req) => req,
        Err(r) => {
            let message = format!(
                "{} fails validation, so nothing was run: {}: {}; submit a new, valid request",
                RunPaths::request(&dir).display(),
                r.code,
                r.message
            );
            open_logs(&dir);
            crate::note!("{message}");
            record::fail_unvalidated(&mut w, &layout, &id, &message)?;
            return Ok(1);
        }
    };
    let pid = std::process::id();
    let started = record::mark_running(&mut w, &dir, pid, containment)?;
    let Some(status) = started else {
        crate::note!("run {} is not queued; nothing to do", dir.display());
        return Ok(0);
    };
    let mut r = Runner::new(Record::new(layout, id, dir.clone(), status, w), dir, req)?;
    r.record.run_started(pid);
    r.execute();
    // Whatever escaped its step and is still around ends with the run.
    r.steps.contain_at_end();
    r.control.unwatch();
    r.record.finish(r.control.halt(), r.control.halt_reason(), r.steps.step_timed_out());
    Ok(0)
}

impl Runner {
    /// The runner of a run whose `running` status is written. The loop's
    /// wake socket is set up here: off the path from drop to runner started,
    /// and before the first step exists.
    fn new(record: Record, dir: PathBuf, req: Request) -> std::io::Result<Runner> {
        let (tx, rx) = channel();
        let (wake, waker) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        waker.set_nonblocking(true)?;
        signal_hook::low_level::pipe::register(libc::SIGCHLD, waker.try_clone()?)?;
        let post = Post { tx, wake: Arc::new(waker) };
        let status = record.status();
        let control = Control::new(dir.clone(), status);
        let external = External::new(dir.clone(), req.cwd.clone());
        let steps = Steps::new(dir, status.run_id.clone(), req);
        Ok(Runner { post, rx, wake, record, control, steps, external })
    }

    /// The loop: start what can start, sleep until something happens, then
    /// hear the drivers, reap the steps, read the inbox, signal the steps.
    fn execute(&mut self) {
        let stops = self.control.check(self.record.status());
        self.stop_requested(stops);
        loop {
            while let Some(fx) = self.steps.advance(&view!(self)) {
                self.apply(fx);
            }
            if self.steps.done() {
                break;
            }
            self.sleep(self.next_wake().saturating_duration_since(Instant::now()));
            while let Ok(m) = self.rx.try_recv() {
                self.message(m);
            }
            let fx = self.steps.reap();
            self.apply(fx);
            self.steps.contain();
            let stops = self.control.turn(Instant::now(), &self.post, self.record.status(), self.steps.running());
            self.stop_requested(stops);
            let now = Instant::now();
            self.record.heartbeat(now);
            let fx = self.steps.signal(now, &view!(self));
            self.apply(fx);
        }
    }

    /// When the loop wakes next: the nearest deadline, at most 1 s away (the
    /// control inbox is re-checked at least that often).
    fn next_wake(&self) -> Instant {
        let soon = Instant::now() + Duration::from_secs(1);
        [Some(soon), self.control.next_wake(), self.steps.next_wake()].into_iter().flatten().min().unwrap_or(soon)
    }

    fn stop_requested(&mut self, events: Vec<serde_json::Value>) {
        for e in events {
            self.record.ev("subagent.run.stop_requested", e);
        }
    }

    /// Hand what the steps did to the part it concerns.
    fn apply(&mut self, fx: Vec<Effect>) {
        for e in fx {
            match e {
                Effect::GroupStarted { ti, members, parallel } => self.record.group_started(ti, &members, parallel),
                Effect::GroupEnded { ti, ok, parallel } => self.record.group_ended(ti, ok, parallel),
                Effect::Skip { i, why } => self.record.step_skipped(i, &why),
                Effect::Starting { i, at } => self.record.step_starting(i, at),
                Effect::Started { i, pid } => self.record.step_started(i, pid),
                Effect::Unstarted { i, msg } => self.record.step_unstarted(i, 127, msg, None),
                Effect::External { i, step, job } => {
                    match self.external.prepare(i, &step, &job, self.record.status(), &self.post) {
                        Ok(ej) => {
                            self.record.external_started(i, ej);
                            if !self.external.launch(i) {
                                self.steps.forget(i);
                            }
                        }
                        Err((msg, ej)) => {
                            self.record.step_unstarted(i, 1, msg, Some(ej));
                            self.steps.forget(i);
                        }
                    }
                }
                Effect::Exited { i, code, signal, timed_out, duration_ms, save_now } => {
                    let end = StepEnd {
                        exit: Exit::Process { code, signal },
                        timed_out,
                        halt: self.control.halt(),
                        stopped_alone: self.control.step_stops().get(&i).map(String::as_str),
                        duration_ms,
                    };
                    self.record.step_exited(i, end, code, save_now);
                }
                Effect::SignalExternal { i, sig } => self.external.signal(i, sig),
            }
        }
    }

    /// A message from another thread: a driver's news, or the inbox changed
    /// (read in the turn that follows).
    fn message(&mut self, m: Msg) {
        match m {
            Msg::External(i, Report::Update { job, line }) => self.record.external_updated(i, job, line),
            Msg::External(i, Report::Done { completed, note, job, output_file }) => {
                let Some((duration_ms, timed_out)) = self.steps.external_ended(i) else { return };
                self.external.ended(i);
                let end = StepEnd {
                    exit: Exit::Job { completed, note },
                    timed_out,
                    halt: self.control.halt(),
                    // A targeted stop cancels the job; the step then ends as failed.
                    stopped_alone: None,
                    duration_ms,
                };
                self.record.external_ended(i, end, job, output_file);
            }
            Msg::Control => {}
        }
    }

    /// Sleep until a step exits (SIGCHLD), another thread posts a message, or
    /// `d` has passed; then empty the wake socket.
    fn sleep(&self, d: Duration) {
        use std::io::Read as _;
        use std::os::fd::AsFd as _;
        let ms = u16::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(self.wake.as_fd(), nix::poll::PollFlags::POLLIN)];
        // EINTR means a signal arrived, which is as good as a byte.
        let _ = nix::poll::poll(&mut fds, ms);
        let mut buf = [0u8; 64];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// What the validator may check again at run time: the shape and limits of
/// the request. The claim-time facts (the `cwd`s existed, the provider was
/// configured in the daemon) are the claim's; a step whose cwd went away
/// since fails on its own, and the bridge answers for providers.
struct RunTime;
impl Context for RunTime {
    fn provider_configured(&self, _: &str) -> bool {
        true
    }
    fn is_dir(&self, _: &str) -> bool {
        true
    }
}

fn validate_request(raw: &[u8]) -> Result<Request, Rejection> {
    if raw.len() as u64 > MAX_REQUEST_BYTES {
        return Err(Rejection::new(request::RejectionCode::TooLarge, format!("it is over {MAX_REQUEST_BYTES} bytes")));
    }
    request::parse(raw).and_then(|v| request::validate(raw, &v, &RunTime))
}
