//! `runspool runner <runDir>`: one run. Holds runner.lock for its whole life,
//! runs the steps in their own process groups, enforces timeouts, obeys the
//! control inbox, and records every outcome in status.json.

mod external;

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read as _, Write as _};
use std::os::fd::AsFd as _;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::json;

use crate::protocol::request::{self, Context, Item, Rejection, Request, Step, MAX_REQUEST_BYTES};
use crate::protocol::status::{RunnerInfo, State, Status, StepState};
use crate::store::fsutil;
use crate::store::layout::RunPaths;
use crate::store::run::{event, update_status};
use crate::store::{results, Layout, Writer};

/// The run "deadline" of a run without a time limit (`timeoutMs` 0): ten years.
const NO_LIMIT_MS: u64 = 10 * 365 * 86_400_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Halt {
    Interrupt,
    Timeout,
    Stop,
}

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
        let targets: [(&str, Dup2); 2] = [
            ("runner.stdout.log", |f| nix::unistd::dup2_stdout(f)),
            ("runner.stderr.log", |f| nix::unistd::dup2_stderr(f)),
        ];
        for (name, dup2) in targets {
            // A FIFO or link a step planted in place of a log is refused without blocking.
            if let Ok(f) = fsutil::open_append(&dir.join(name)) {
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
    let containment = if crate::platform::procs::become_subreaper() { "subreaper" } else { "process-group" };
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
            fail_unvalidated(&mut w, &layout, &dir, &message)?;
            return Ok(1);
        }
    };
    let now = crate::now_ms();
    let pid = std::process::id();
    let mut started = None;
    update_status(&mut w, &dir, |cur| {
        let mut s = cur?;
        if s.state != State::Queued {
            return None;
        }
        s.state = State::Running;
        s.started_at = now;
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
    open_logs(&dir);
    let Some(status) = started else {
        crate::note!("run {} is not queued; nothing to do", dir.display());
        return Ok(0);
    };
    // The loop's wake socket, set up after the `running` write (off the path
    // from drop to runner started) and before the first step exists.
    let (tx, rx) = channel();
    let (wake, waker) = UnixStream::pair()?;
    wake.set_nonblocking(true)?;
    waker.set_nonblocking(true)?;
    signal_hook::low_level::pipe::register(libc::SIGCHLD, waker.try_clone()?)?;
    let post = Post { tx, wake: Arc::new(waker) };
    let run_deadline =
        Instant::now() + Duration::from_millis(if status.timeout_ms > 0 { status.timeout_ms } else { NO_LIMIT_MS });
    let mut r = Runner {
        layout,
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
        run_deadline,
        step_timed_out: false,
        previous_output: None,
        _watcher: None,
        // Perf: the inbox is polled for the first 50 ms and watched after that, so a
        // short run never pays for the watcher thread and the slow inotify close at exit.
        watch_at: Some(Instant::now() + Duration::from_millis(50)),
    };
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

impl Runner {
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

    fn watch_control(&mut self) {
        use notify::Watcher;
        let control = RunPaths::control(&self.dir);
        let _ = fsutil::mkdir_private(&control);
        let post = self.post.clone();
        let watcher = notify::recommended_watcher(move |_res: notify::Result<notify::Event>| {
            post.send(Msg::Control);
        });
        match watcher {
            // Recursive: 0.67's stop requests land in control/stop-requests/.
            Ok(mut wt) => match wt.watch(&control, notify::RecursiveMode::Recursive) {
                Ok(()) => self._watcher = Some(wt),
                Err(e) => crate::note!("watching {} failed ({e}); checking it every second", control.display()),
            },
            Err(e) => crate::note!("no file watcher ({e}); checking the control inbox every second"),
        }
    }

    /// Consume control files: pi-subagents 0.67's stop requests in `ts`
    /// order, then the legacy `stop.json`, `timeout.json`, `interrupt.json`.
    fn check_control(&mut self) {
        for r in crate::store::run::take_stop_requests(&self.dir) {
            self.on_stop_request(r);
        }
        let control = RunPaths::control(&self.dir);
        for (name, kind) in
            [("stop.json", Halt::Stop), ("timeout.json", Halt::Timeout), ("interrupt.json", Halt::Interrupt)]
        {
            let p = control.join(name);
            let Ok(bytes) = fsutil::read_nofollow(&p, 64 * 1024) else { continue };
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(json!({}));
            let reason = body.get("reason").and_then(|v| v.as_str()).map(str::to_string);
            let source = body.get("source").and_then(|v| v.as_str()).unwrap_or("control inbox").to_string();
            let msg = match kind {
                Halt::Stop => format!("stopped by {source}"),
                Halt::Timeout => format!("timed out by {source}"),
                Halt::Interrupt => format!("interrupted by {source}"),
            };
            let msg = match reason {
                Some(r) => format!("{msg}: {r}"),
                None => msg,
            };
            self.request_halt(kind, msg);
            let _ = std::fs::remove_file(&p);
        }
    }

    /// A stop request stops the step `targetIndex` names when that step has
    /// not ended yet, else the whole run; the event says which. A `childId`
    /// names none of runspool's steps (they carry no child ids).
    fn on_stop_request(&mut self, r: crate::protocol::control::StopRequest) {
        let msg = crate::protocol::control::describe(&r, "a stop request");
        let n = self.status.steps.len();
        let step = r.target_index.map(|t| t as usize).filter(|&t| t < n);
        let open = |s: &StepState| matches!(s, StepState::Pending | StepState::Running);
        let (scope, note) = match (step, &r.child_id) {
            (Some(i), _) if open(&self.status.steps[i].status) => {
                self.step_stop.entry(i).or_insert((msg.clone(), false));
                ("step", format!("stopping step {i}"))
            }
            (Some(i), _) => ("none", format!("step {i} already ended; nothing to stop")),
            (None, _) if r.target_index.is_some() => (
                "run",
                format!(
                    "targetIndex {} names no step of this run ({n} steps); stopping the run",
                    r.target_index.unwrap_or(0)
                ),
            ),
            (None, Some(c)) => ("run", format!("childId `{c}` names no step of this run; stopping the run")),
            (None, None) => ("run", "stopping the run".to_string()),
        };
        self.ev(
            "subagent.run.stop_requested",
            json!({"scope": scope, "stepIndex": step, "targetIndex": r.target_index, "childId": r.child_id,
                   "source": r.source, "reason": r.reason, "message": note}),
        );
        if scope == "run" {
            self.request_halt(Halt::Stop, msg);
        }
    }

    fn request_halt(&mut self, kind: Halt, reason: String) {
        if self.halt.is_some_and(|h| h >= kind) {
            return;
        }
        tracing::info!(run_id = %self.status.run_id, "halting: {reason}");
        self.halt = Some(kind);
        self.halt_reason = reason;
    }

    fn execute(&mut self) {
        self.check_control();
        let items = self.req.steps.clone();
        let mut flat = 0;
        for (ti, item) in items.iter().enumerate() {
            let members: Vec<usize> = match item {
                Item::Step(_) => vec![flat],
                Item::Parallel(p) => (flat..flat + p.parallel.len()).collect(),
            };
            flat += members.len();
            if self.halt.is_some() || self.any_failed() {
                break;
            }
            self.status.current_step = ti;
            let ok = match item {
                Item::Step(_) => self.run_group(&members, 1),
                Item::Parallel(p) => {
                    let agents: Vec<String> = members.iter().map(|&i| self.status.steps[i].agent.clone()).collect();
                    self.ev(
                        "subagent.parallel.started",
                        json!({"stepIndex": ti, "agents": agents, "count": members.len()}),
                    );
                    let conc = p.concurrency.map(|c| c as usize).unwrap_or(members.len()).max(1);
                    let ok = self.run_group(&members, conc);
                    self.ev("subagent.parallel.completed", json!({"stepIndex": ti, "success": ok}));
                    ok
                }
            };
            self.previous_output = members.last().and_then(|&i| self.status.steps[i].output_file.clone());
            if !ok {
                break;
            }
        }
    }

    /// A failed step, or one stopped on its own by a targeted stop request:
    /// either ends a chain, and the run is `failed` unless it was halted.
    fn any_failed(&self) -> bool {
        self.status.steps.iter().any(|s| matches!(s.status, StepState::Failed | StepState::Stopped))
    }

    /// A pending step a stop request named: it never starts.
    fn skip_stopped(&mut self, i: usize, why: String) {
        let agent = self.status.steps[i].agent.clone();
        let st = &mut self.status.steps[i];
        st.status = StepState::Stopped;
        st.stopped = Some(true);
        st.exit_code = Some(-1);
        st.duration_ms = Some(0);
        st.error = Some(format!("{why} before it started"));
        self.save();
        self.ev("subagent.step.stopped", json!({"stepIndex": i, "agent": agent, "exitCode": -1, "durationMs": 0}));
    }

    /// Run the given flat steps with at most `conc` at once. True if all complete.
    fn run_group(&mut self, members: &[usize], conc: usize) -> bool {
        let mut queue: VecDeque<usize> = members.iter().copied().collect();
        let mut running: BTreeMap<usize, Running> = BTreeMap::new();
        let steps: Vec<Step> = self.req.flat_steps().into_iter().cloned().collect();
        loop {
            while self.halt.is_none() && running.len() < conc {
                let Some(i) = queue.pop_front() else { break };
                if let Some((why, _)) = self.step_stop.get(&i).cloned() {
                    self.skip_stopped(i, why);
                    continue;
                }
                if let Some(r) = self.spawn(i, &steps[i]) {
                    running.insert(i, r);
                }
            }
            if running.is_empty() {
                break;
            }
            // Sleep until the next message or the nearest deadline, at most 1 s
            // (the control inbox is re-checked at least that often).
            let now = Instant::now();
            let mut wake = now + Duration::from_secs(1);
            if self.halt.is_none() {
                wake = wake.min(self.run_deadline);
            }
            if let Some(t) = self.watch_at {
                wake = wake.min(t);
            }
            for r in running.values() {
                if let Some(d) = r.deadline {
                    wake = wake.min(d);
                }
                if let Some((t, _)) = r.escalate {
                    wake = wake.min(t);
                }
            }
            self.sleep(wake.saturating_duration_since(now));
            while let Ok(m) = self.rx.try_recv() {
                match m {
                    Msg::External(i, ev) => self.on_external(i, ev, &mut running),
                    Msg::Control => {}
                }
            }
            let exited: Vec<(usize, std::io::Result<ExitStatus>)> = running
                .iter_mut()
                .filter_map(|(&i, r)| match r.child.as_mut()?.try_wait() {
                    Ok(None) => None,
                    Ok(Some(st)) => Some((i, Ok(st))),
                    Err(e) => Some((i, Err(e))),
                })
                .collect();
            let ended: Vec<(usize, u32)> =
                exited.iter().filter_map(|(i, _)| running.get(i).map(|r| (*i, r.pid))).collect();
            for (i, res) in exited {
                if let Some(r) = running.remove(&i) {
                    // Perf: with nothing else running, the next status write (the
                    // next step's start, or the terminal status) follows at once
                    // and carries this exit too: one write and one inode fewer per
                    // step. A member whose siblings still run is saved now.
                    let save_now = !running.is_empty();
                    self.record_exit(i, r, res, save_now);
                }
            }
            // Escapees of the steps that ended go with them; orphans that
            // exited on their own are reaped (they are our children now).
            self.contain(&ended, &running);
            if self.watch_at.is_some_and(|t| Instant::now() >= t) {
                self.watch_at = None;
                self.watch_control(); // the check_control below sees what landed before the watch
            }
            let before = self.halt;
            self.check_control();
            let now = Instant::now();
            if now >= self.next_heartbeat {
                // pi-subagents 0.67 fails a run whose pid lives but whose
                // lastUpdate is over 24 h old; a long step must not look stale.
                self.next_heartbeat = now + heartbeat();
                self.save();
            }
            if self.halt.is_none() && now >= self.run_deadline {
                let msg = format!("run timed out after {} ms", self.status.timeout_ms);
                self.request_halt(Halt::Timeout, msg);
            }
            for (i, r) in running.iter_mut() {
                if let Some((_, sent)) = self.step_stop.get_mut(i) {
                    if !*sent {
                        *sent = true;
                        r.signal(Signal::SIGTERM);
                        r.escalate = Some((now + Duration::from_secs(3), Signal::SIGKILL));
                    }
                }
            }
            if self.halt != before {
                let first = match self.halt {
                    Some(Halt::Interrupt) => (Signal::SIGINT, Duration::from_secs(1), Signal::SIGTERM),
                    _ => (Signal::SIGTERM, Duration::from_secs(3), Signal::SIGKILL),
                };
                for r in running.values_mut() {
                    r.signal(first.0);
                    r.escalate = Some((now + first.1, first.2));
                }
            }
            for r in running.values_mut() {
                if r.deadline.is_some_and(|d| now >= d) && !r.timed_out {
                    r.timed_out = true;
                    r.deadline = None;
                    r.signal(Signal::SIGTERM);
                    r.escalate = Some((now + Duration::from_secs(3), Signal::SIGKILL));
                }
                if let Some((t, sig)) = r.escalate {
                    if now >= t {
                        r.signal(sig);
                        // After SIGTERM (interrupt ladder) comes SIGKILL; after SIGKILL, nothing.
                        r.escalate = (sig == Signal::SIGTERM).then(|| (now + Duration::from_secs(3), Signal::SIGKILL));
                    }
                }
            }
        }
        members.iter().all(|&i| self.status.steps[i].status == StepState::Complete)
    }

    fn spawn(&mut self, i: usize, step: &Step) -> Option<Running> {
        let out_path = RunPaths::output(&self.dir, i);
        let now_ms = crate::now_ms();
        let agent = self.status.steps[i].agent.clone();
        {
            let st = &mut self.status.steps[i];
            st.status = StepState::Running;
            st.started_at = Some(now_ms);
            st.output_file = Some(out_path.display().to_string());
        }
        self.status.output_file = Some(out_path.display().to_string());
        let started = Instant::now();
        let result = match (&step.command, &step.external_job) {
            (Some(argv), _) => self.start_command(i, step, argv, &out_path),
            (None, Some(j)) => return self.spawn_external(i, step, j, started),
            (None, None) => Err("the step has no command".to_string()),
        };
        match result {
            Ok(child) => {
                let pid = child.id();
                self.status.steps[i].pid = Some(pid);
                self.save();
                self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
                let deadline = step.timeout_ms.map(|t| started + Duration::from_millis(t));
                Some(Running {
                    pid,
                    child: Some(child),
                    started,
                    deadline,
                    escalate: None,
                    timed_out: false,
                    external: None,
                })
            }
            Err(msg) => {
                self.fail_unstarted(i, &agent, &out_path, 127, msg, None);
                None
            }
        }
    }

    /// A step that could not start: its reason goes to its log and status,
    /// with `code` as its exit code (and the external job's record, if any).
    pub(crate) fn fail_unstarted(
        &mut self,
        i: usize,
        agent: &str,
        out: &Path,
        code: i32,
        msg: String,
        job: Option<serde_json::Value>,
    ) {
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
        let _ = fsutil::append_line(out, format!("runspool: {msg}").as_bytes());
        let st = &mut self.status.steps[i];
        st.status = StepState::Failed;
        st.exit_code = Some(code);
        st.error = Some(msg);
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(0);
        if job.is_some() {
            st.external_job = job.clone();
        }
        self.save();
        if let Some(job) = job {
            self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
        }
        self.ev("subagent.step.failed", json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": 0}));
    }

    fn start_command(&mut self, i: usize, step: &Step, argv: &[String], out: &Path) -> Result<Child, String> {
        // A full disk (or fd table) is waited out here rather than failing the
        // step; a stop request is seen once the file exists.
        let (file, err) = fsutil::wait_out_capacity(out, || {
            // An earlier step may have planted a FIFO here: refused, never waited on.
            let f = fsutil::open_append(out)?;
            let e = f.try_clone()?;
            Ok((f, e))
        })
        .map_err(|e| format!("cannot open {}: {e}", out.display()))?;
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .current_dir(step.cwd.as_deref().unwrap_or(&self.req.cwd))
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .process_group(0);
        for k in crate::platform::SCRUBBED_ENV {
            cmd.env_remove(k);
        }
        cmd.envs(&self.req.env).envs(&step.env);
        cmd.env("RUNSPOOL_RUN_ID", &self.status.run_id)
            .env("RUNSPOOL_RUN_DIR", &self.dir)
            .env("RUNSPOOL_STEP_INDEX", i.to_string())
            .env("RUNSPOOL_PREVIOUS_OUTPUT", self.previous_output.as_deref().unwrap_or(""));
        cmd.spawn().map_err(|e| format!("cannot start `{}`: {e}", argv[0]))
    }

    /// Sleep until a step exits (SIGCHLD), another thread posts a message, or
    /// `d` has passed; then empty the wake socket.
    fn sleep(&self, d: Duration) {
        let ms = u16::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(self.wake.as_fd(), nix::poll::PollFlags::POLLIN)];
        // EINTR means a signal arrived, which is as good as a byte.
        let _ = nix::poll::poll(&mut fds, ms);
        let mut buf = [0u8; 64];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }

    fn record_exit(&mut self, i: usize, r: Running, res: std::io::Result<ExitStatus>, save_now: bool) {
        let (code, signal) = match res {
            Ok(st) => match (st.code(), st.signal()) {
                (Some(c), _) => (c, None),
                (None, Some(s)) => (128 + s, Some(crate::platform::signal_name(s))),
                _ => (1, None),
            },
            Err(_) => (1, None),
        };
        // The group may have members left after its leader exited.
        signal_group(r.pid, Signal::SIGKILL);
        let ended = crate::now_ms();
        let dur = r.started.elapsed().as_millis() as i64;
        let halt = self.halt;
        let agent = self.status.steps[i].agent.clone();
        let st = &mut self.status.steps[i];
        st.exit_code = Some(code);
        st.signal = signal;
        st.ended_at = Some(ended);
        st.duration_ms = Some(dur);
        let kind = if r.timed_out {
            st.status = StepState::Failed;
            st.timed_out = Some(true);
            st.error = Some(format!("step timed out after {} ms", dur));
            self.step_timed_out = true;
            "failed"
        } else if code == 0 && halt.is_none() {
            st.status = StepState::Complete;
            "completed"
        } else if let (None, Some((why, _))) = (halt, self.step_stop.get(&i)) {
            st.status = StepState::Stopped;
            st.stopped = Some(true);
            st.error = Some(why.clone());
            "stopped"
        } else {
            match halt {
                Some(Halt::Stop) => {
                    st.status = StepState::Stopped;
                    st.stopped = Some(true);
                    "stopped"
                }
                Some(Halt::Interrupt) => {
                    st.status = StepState::Paused;
                    "paused"
                }
                Some(Halt::Timeout) => {
                    st.status = StepState::Failed;
                    st.timed_out = Some(true);
                    "failed"
                }
                None => {
                    st.status = StepState::Failed;
                    st.error = Some(format!("exited with code {code}"));
                    "failed"
                }
            }
        };
        if save_now {
            self.save();
        }
        self.ev(
            &format!("subagent.step.{kind}"),
            json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": dur}),
        );
    }

    fn finish(&mut self) {
        let now = crate::now_ms();
        let (state, skip_status, skip_msg) = match self.halt {
            Some(Halt::Stop) => (State::Stopped, StepState::Stopped, "skipped: the run was stopped"),
            Some(Halt::Interrupt) => (State::Paused, StepState::Paused, "skipped: the run was interrupted"),
            Some(Halt::Timeout) => (State::Failed, StepState::Failed, "skipped: the run timed out"),
            None if self.any_failed() => (State::Failed, StepState::Failed, "skipped: an earlier step failed"),
            None => (State::Complete, StepState::Complete, ""),
        };
        for st in self.status.steps.iter_mut().filter(|s| matches!(s.status, StepState::Pending | StepState::Running)) {
            st.status = skip_status.clone();
            st.exit_code = Some(-1);
            st.duration_ms = Some(0);
            st.error = Some(skip_msg.to_string());
        }
        let s = &mut self.status;
        s.state = state.clone();
        s.ended_at = Some(now);
        s.timed_out = self.halt == Some(Halt::Timeout) || self.step_timed_out;
        s.stopped = self.halt == Some(Halt::Stop);
        s.exit_code = Some(s.terminal_exit_code());
        if state != State::Complete {
            s.error = Some(match self.halt {
                Some(_) => self.halt_reason.clone(),
                None => first_error(s),
            });
        }
        let duration = now - self.status.started_at;
        match self.halt {
            Some(Halt::Stop) => self.ev("subagent.run.stopped", json!({"message": self.halt_reason})),
            Some(Halt::Timeout) => self.ev(
                "subagent.run.timed_out",
                json!({"timeoutMs": self.status.timeout_ms, "deadlineAt": self.status.deadline_at, "message": self.halt_reason}),
            ),
            Some(Halt::Interrupt) => self.ev("subagent.run.paused", json!({"message": self.halt_reason})),
            None => {}
        }
        // The event goes first: a reader that sees the terminal status finds the whole story.
        self.ev(
            "subagent.run.completed",
            json!({"status": state.as_str(), "durationMs": duration, "exitCode": self.status.exit_code}),
        );
        self.save();
        if let Err(e) = results::finish_terminal(&mut self.w, &self.layout, &self.status) {
            crate::note!("publishing the run's indexes and result failed: {e}");
        }
        // A runner with pending terminal writes does not exit (PROTOCOL §11).
        let mut waited = 0u64;
        while !self.w.flush() {
            if waited.is_multiple_of(60) {
                crate::note!(
                    "storage full: the terminal status is kept in memory and retried every second ({waited} s so far)"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
            waited += 1;
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

impl Runner {
    /// Reap the orphans this subreaper adopted that exited, and kill (then
    /// reap) what the steps in `ended` (index, process group) left behind:
    /// every adopted process in one of their process groups, or started with
    /// one of their `RUNSPOOL_STEP_INDEX` values in this run. With no step
    /// running (between steps, at the run's end) every adopted process goes,
    /// whatever its environment says. Killing one may orphan its own
    /// children to us: repeat until nothing is left (bounded).
    fn contain(&mut self, ended: &[(usize, u32)], running: &BTreeMap<usize, Running>) {
        use crate::platform::procs;
        // Step processes are reaped by their `Child` (try_wait), never here.
        let steps: std::collections::HashSet<u32> =
            running.values().filter(|r| r.child.is_some()).map(|r| r.pid).collect();
        let all = running.is_empty();
        let adopted = || procs::children().into_iter().filter(|p| !steps.contains(p)).filter(|&p| !reap(p));
        if ended.is_empty() && !all {
            adopted().for_each(drop);
            return;
        }
        let run_dir = self.dir.as_os_str().as_encoded_bytes().to_vec();
        let left_by_ended = |pid: u32| -> bool {
            let pgrp = procs::stat(pid).map(|s| s.pgrp);
            let ours = procs::environ_var(pid, "RUNSPOOL_RUN_DIR").is_some_and(|d| d == run_dir);
            let index = procs::environ_var(pid, "RUNSPOOL_STEP_INDEX").filter(|_| ours);
            ended.iter().any(|(i, pg)| pgrp == Some(*pg) || index.as_deref() == Some(i.to_string().as_bytes()))
        };
        let until = Instant::now() + Duration::from_secs(5);
        // A `children` file read while the list changes may miss an entry:
        // done after two clean reads in a row.
        let mut clean = 0;
        loop {
            let targets: Vec<u32> = adopted().filter(|&p| all || left_by_ended(p)).collect();
            if targets.is_empty() {
                clean += 1;
                if clean == 2 {
                    return;
                }
                continue;
            }
            clean = 0;
            if Instant::now() >= until {
                crate::note!(
                    "processes {targets:?} left by the steps of {} survive SIGKILL (uninterruptible?); giving up on them",
                    self.dir.display()
                );
                return;
            }
            for &pid in &targets {
                tracing::info!(run_id = %self.status.run_id, pid, "killing a process that escaped its step");
                procs::kill_with_group(pid);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Reap `pid` if it has exited. True when it is gone (reaped now, or not our child).
fn reap(pid: u32) -> bool {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    match waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) => false,
        Ok(_) => true,
        Err(_) => true,
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

/// End a queued run whose request.json fails validation: `failed`, every step
/// skipped, the reason in `error`, indexes and result published.
fn fail_unvalidated(w: &mut Writer, l: &Layout, dir: &Path, message: &str) -> anyhow::Result<()> {
    let run_id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    results::fail_queued(w, l, &run_id, message, "skipped: request.json fails validation")?;
    while !w.flush() {
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(())
}

fn first_error(s: &Status) -> String {
    s.steps
        .iter()
        .enumerate()
        .find(|(_, st)| matches!(st.status, StepState::Failed | StepState::Stopped) && st.exit_code != Some(-1))
        .map(|(i, st)| format!("step {i} ({}) {}: {}", st.agent, st.status, st.error.clone().unwrap_or_default()))
        .unwrap_or_else(|| "the run failed".into())
}

fn signal_group(pgid: u32, sig: Signal) {
    let _ = killpg(Pid::from_raw(pgid as i32), sig);
}
