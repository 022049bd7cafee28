//! `runspool runner <runDir>`: one run. Holds runner.lock for its whole life,
//! runs the steps in their own process groups, enforces timeouts, obeys the
//! control inbox, and records every outcome in status.json.

mod control;
mod external;
mod finish;
mod steps;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;

use crate::protocol::outcome::Halt;
use crate::protocol::request::{self, Context, Rejection, Request, MAX_REQUEST_BYTES};
use crate::protocol::status::{RunnerInfo, State, Status};
use crate::store::fsutil;
use crate::store::layout::{RunId, RunPaths};
use crate::store::run::{event, update_status};
use crate::store::{results, Layout, Writer};

/// The run "deadline" of a run without a time limit (`timeoutMs` 0): ten years.
const NO_LIMIT_MS: u64 = 10 * 365 * 86_400_000;

enum Msg {
    External(usize, external::Event),
    Control,
}

/// The loop's mailbox for other threads (external-job drivers, the control
/// inbox watcher): a message, then a byte on the wake socket, which SIGCHLD
/// also writes to. Perf: the loop sleeps in poll(2) on that socket and reaps
/// its steps with `try_wait`, so a step costs no waiter thread (a clone, a
/// stack and a malloc arena in every runner).
#[derive(Clone)]
struct Post {
    tx: Sender<Msg>,
    wake: Arc<UnixStream>,
}

impl Post {
    fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
        // A full socket already holds a wake-up.
        let _ = (&*self.wake).write(&[1]);
    }
}

struct Running {
    pid: u32,
    /// The step's process (None for an external-job step).
    child: Option<Child>,
    started: Instant,
    deadline: Option<Instant>,
    /// Pending escalation: the next signal and when to send it.
    escalate: Option<(Instant, Signal)>,
    timed_out: bool,
    /// Set for an external-job step (pid 0): signals become cancel or detach.
    external: Option<external::Control>,
}

pub struct Runner {
    layout: Layout,
    /// The run: its directory's name (`dir`'s last component).
    id: RunId,
    dir: PathBuf,
    req: Request,
    status: Status,
    w: Writer,
    post: Post,
    rx: Receiver<Msg>,
    /// The read end of the wake socket (see `Post`).
    wake: UnixStream,
    halt: Option<Halt>,
    halt_reason: String,
    /// When a running run's status is rewritten next only to refresh
    /// `lastUpdate` (see `HEARTBEAT`).
    next_heartbeat: Instant,
    /// Steps a stop request named by `targetIndex` (0.67): reason, and
    /// whether the step's processes were signalled already.
    step_stop: BTreeMap<usize, (String, bool)>,
    run_deadline: Instant,
    step_timed_out: bool,
    previous_output: Option<String>,
    _watcher: Option<notify::RecommendedWatcher>,
    /// When to start watching the control inbox (None: started or given up).
    watch_at: Option<Instant>,
}

/// Entry point. Returns the process exit code.
pub fn main(run_dir: &Path) -> i32 {
    // Detach into a session of our own (the daemon spawns us without a pre_exec hook).
    let _ = nix::unistd::setsid();
    // Nothing the runner was started with beyond stdio reaches its steps.
    crate::platform::close_inherited_fds();
    // Whatever the runner prints lands in its logs, a panic before `open_logs` included.
    let dir = run_dir.to_path_buf();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        open_logs(&dir);
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

/// Point stdout and stderr at `runner.stdout.log` and `runner.stderr.log`
/// (PROTOCOL §3), created 0600 if missing. Perf: the daemon starts the runner
/// on /dev/null and the runner opens its logs itself once its `running` status
/// is written (or before its first complaint), so their creation is not on the
/// path from drop to runner. On a full disk the runner carries on without them.
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

fn run(run_dir: &Path) -> anyhow::Result<i32> {
    let dir = std::fs::canonicalize(run_dir)?;
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
    // be found and killed when its step ends (`contain`).
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
            fail_unvalidated(&mut w, &layout, &id, &message)?;
            return Ok(1);
        }
    };
    let pid = std::process::id();
    let started = mark_running(&mut w, &dir, pid, containment)?;
    open_logs(&dir);
    let Some(status) = started else {
        crate::note!("run {} is not queued; nothing to do", dir.display());
        return Ok(0);
    };
    let mut r = Runner::new(layout, id, dir, req, status, w)?;
    r.ev("subagent.run.started", json!({"mode": r.status.mode, "cwd": r.status.cwd, "pid": pid}));
    r.execute();
    // Whatever escaped its step and is still around ends with the run.
    r.contain(&[], &BTreeMap::new());
    // Perf: drop the inotify watch before the terminal writes; closing an inotify fd that still
    // has a watch waits for an RCU grace period (~10 ms) at exit, delaying the daemon's reaping.
    if let Some(w) = r._watcher.as_mut() {
        use notify::Watcher;
        let _ = w.unwatch(&RunPaths::control(&r.dir));
    }
    r.finish();
    Ok(0)
}

/// The `running` status: this runner's pid, identity and containment, the
/// run's deadline. None when the run is no longer queued.
fn mark_running(w: &mut Writer, dir: &Path, pid: u32, containment: &str) -> std::io::Result<Option<Status>> {
    let now = crate::now_ms();
    let mut started = None;
    update_status(w, dir, |cur| {
        let mut s = cur?;
        if s.state != State::Queued {
            return None;
        }
        s.state = State::Running;
        s.started_at = now;
        // Why it waited is over (PROTOCOL §15); `notBefore` and `after` stay as asked.
        s.set_waiting(None, &[]);
        // timeoutMs 0: no run time limit (config `default_timeout_ms = 0`).
        s.deadline_at = (s.timeout_ms > 0).then(|| now + s.timeout_ms as i64);
        s.pid = Some(pid);
        s.runner = Some(RunnerInfo {
            pid,
            hostname: crate::platform::hostname(),
            start_identity: crate::platform::start_identity(pid),
            process_instance_id: uuid::Uuid::new_v4().to_string(),
            containment: Some(containment.to_string()),
        });
        started = Some(s.clone());
        Some(s)
    })?;
    Ok(started)
}

impl Runner {
    /// The runner of a run whose `running` status is written. The loop's
    /// wake socket is set up here: off the path from drop to runner started,
    /// and before the first step exists.
    fn new(
        layout: Layout,
        id: RunId,
        dir: PathBuf,
        req: Request,
        status: Status,
        w: Writer,
    ) -> std::io::Result<Runner> {
        let (tx, rx) = channel();
        let (wake, waker) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        waker.set_nonblocking(true)?;
        signal_hook::low_level::pipe::register(libc::SIGCHLD, waker.try_clone()?)?;
        let post = Post { tx, wake: Arc::new(waker) };
        let limit = if status.timeout_ms > 0 { status.timeout_ms } else { NO_LIMIT_MS };
        Ok(Runner {
            layout,
            id,
            dir,
            req,
            status,
            w,
            post,
            rx,
            wake,
            halt: None,
            halt_reason: String::new(),
            next_heartbeat: Instant::now() + heartbeat(),
            step_stop: BTreeMap::new(),
            run_deadline: Instant::now() + Duration::from_millis(limit),
            step_timed_out: false,
            previous_output: None,
            _watcher: None,
            // Perf: the inbox is polled for the first 50 ms and watched after that, so a
            // short run never pays for the watcher thread and the slow inotify close at exit.
            watch_at: Some(Instant::now() + Duration::from_millis(50)),
        })
    }

    fn ev(&mut self, kind: &str, fields: serde_json::Value) {
        event(&mut self.w, &self.dir, &self.status.run_id.clone(), kind, fields);
    }

    fn save(&mut self) {
        let snap = self.status.clone();
        let res = update_status(&mut self.w, &self.dir, move |cur| {
            let mut s = snap;
            if let Some(c) = cur {
                for (k, v) in c.extra {
                    s.extra.entry(k).or_insert(v);
                }
            }
            Some(s)
        });
        match res {
            Ok(Some(s)) => self.status.last_update = s.last_update,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, "status read-merge failed; writing the runner's own copy");
                let bytes = serde_json::to_vec_pretty(&self.status).unwrap_or_default();
                let durable = !self.status.state.is_active();
                if let Err(e) = self.w.write(&RunPaths::status(&self.dir), bytes, durable) {
                    crate::note!("cannot write status.json: {e}");
                }
            }
        }
    }
}

/// How often a running run's `lastUpdate` is refreshed when nothing else
/// writes its status: hourly, far inside pi-subagents 0.67's 24 h stale-run
/// rule and far from a cost (one small write an hour).
/// `RUNSPOOL_STATUS_HEARTBEAT_MS` changes it (tests, or a stricter reader).
const HEARTBEAT: Duration = Duration::from_secs(3600);

fn heartbeat() -> Duration {
    std::env::var("RUNSPOOL_STATUS_HEARTBEAT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms >= 100)
        .map(Duration::from_millis)
        .unwrap_or(HEARTBEAT)
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

/// End a queued run whose request.json fails validation: `failed`, every step
/// skipped, the reason in `error`, indexes and result published.
fn fail_unvalidated(w: &mut Writer, l: &Layout, run_id: &RunId, message: &str) -> anyhow::Result<()> {
    results::fail_queued(w, l, run_id, message, "skipped: request.json fails validation")?;
    while !w.flush() {
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(())
}

fn signal_group(pgid: u32, sig: Signal) {
    crate::platform::child::signal_group(pgid, sig);
}
