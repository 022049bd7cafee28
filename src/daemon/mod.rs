//! The resident daemon: startup (check the root, take the lock, rebuild
//! state from disk) and one event loop that claims, schedules, supervises
//! and reports. Everything it knows is on disk; a restart rebuilds the rest.

pub mod bridge;
pub mod dead_runner;
pub mod hooks;
pub mod queue;
pub mod report;
pub mod retention;
pub mod spool;
pub mod supervisor;
pub mod watch;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::Config;
use crate::protocol::daemon::{DaemonStatus, QueueInfo, RunCounts, StorageInfo, WatchInfo};
use crate::protocol::request::Context;
use crate::protocol::status::{State, Status};
use crate::store::fsutil::{self, is_capacity};
use crate::store::layout::RunPaths;
use crate::store::{results, run, Layout, Writer};
use spool::{Claimer, Outcome};
use watch::{Hint, Watch};

/// Run counts in daemon.json and STATUS= lag by at most this much.
const REPORT_EVERY: Duration = Duration::from_millis(250);

/// Most claims per loop turn, so a flood of requests never starves the
/// scheduler and the liveness checks.
const CLAIMS_PER_TURN: usize = 256;
/// Run directories checked per loop turn after start-up (`recover_slice`).
const RECOVER_PER_TURN: usize = 1000;
/// The first and the longest delay before retrying a runner start that
/// failed for a transient reason (EAGAIN, ENOMEM, ...).
const SPAWN_RETRY_FIRST: Duration = Duration::from_millis(200);
const SPAWN_RETRY_MAX: Duration = Duration::from_secs(10);
/// How often the control inboxes of recently queued runs are looked at, and
/// how long a run stays queued before its inbox is watched instead (see
/// `poll_queued_inboxes`).
const INBOX_POLL: Duration = Duration::from_secs(1);
const INBOX_WATCH_AFTER: Duration = Duration::from_secs(5);
/// Free space under the root is looked at this often besides before every
/// claim scan, so daemon.json turns `degraded` (and back) within seconds on
/// an idle daemon too. One statvfs.
const SPACE_CHECK_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Unsafe(#[from] crate::store::safety::SafetyError),
    #[error("another runspool daemon (pid {pid}) is running on {root}; stop it first (`kill {pid}` or `runspool service stop`)")]
    AlreadyRunning { pid: String, root: String },
    #[error("{path}: {error}; check that the directory is writable by you")]
    Io { path: String, error: std::io::Error },
    #[error("{0}")]
    Config(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StartError + '_ {
    move |error| StartError::Io { path: path.display().to_string(), error }
}

struct Ctx<'a>(&'a Config);
impl Context for Ctx<'_> {
    fn provider_configured(&self, name: &str) -> bool {
        self.0.providers.contains_key(name)
    }
    fn default_timeout_ms(&self) -> u64 {
        self.0.default_timeout_ms
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Queued {
    priority: i64,
    order: Reverse<(i64, u64)>,
    run_id: String,
}

struct Slot {
    child: Option<Child>,
}

pub struct Daemon {
    layout: Layout,
    cfg: Config,
    config_path: Option<PathBuf>,
    /// The flag or variable that chose the root over the config's `root`
    /// (`Layout::root_override`), for the SIGHUP report.
    root_override: Option<String>,
    runner: supervisor::RunnerProgram,
    w: Writer,
    _lock: File,
    tx: Sender<Hint>,
    rx: Receiver<Hint>,
    watch: Watch,
    bridge: bridge::Bridge,
    hooks: hooks::Hooks,
    /// Dead runners' processes and external jobs, cleared before their run is repaired.
    dead_runners: dead_runner::DeadRunners,
    queue: BinaryHeap<Queued>,
    queued: HashSet<String>,
    /// Queued runs whose control inbox is polled, not watched (yet), with
    /// when they were queued (see `poll_queued_inboxes`).
    polled_inboxes: VecDeque<(Instant, String)>,
    next_inbox_poll: Instant,
    /// Claimed in this turn: their active markers follow the scheduler.
    claimed: Vec<String>,
    /// Run directories still to be checked after start-up.
    recovery_backlog: Vec<String>,
    running: HashMap<String, Slot>,
    /// Runs whose runner exited, to be settled by `check_running`.
    settling: Vec<String>,
    /// Active runs of other hosts (pi-subagents) found in the active index:
    /// read-only to runspool (§14), but their bridge requests are serviced.
    foreign: HashSet<String>,
    /// When the last rescan ran (daemon.json `lastRescanAt`; `report` holds
    /// what was last written).
    last_rescan_at: Option<i64>,
    seq: u64,
    report: DaemonStatus,
    /// Room kept for daemon.json on a full filesystem.
    reserve: report::Reserve,
    last_report_write: Instant,
    /// Counts changed but were written less than REPORT_EVERY ago.
    report_due: Option<Instant>,
    spool_dirty: bool,
    watch_failed: Option<String>,
    spool_backlog: std::collections::VecDeque<String>,
    grace: spool::Grace,
    /// After a transient runner start failure: no start before this, and the
    /// delay that led to it (doubling up to SPAWN_RETRY_MAX).
    spawn_retry_at: Option<Instant>,
    spawn_backoff: Option<Duration>,
    /// Committed claims whose queued status could not be written yet, by run
    /// id (their spool names are gone), retried every `unfinished_retry_at`.
    unfinished_claims: Vec<String>,
    unfinished_retry_at: Instant,
    /// The start-up listing of run directories failed: retry it at this time.
    recovery_unlisted: Option<Instant>,
    spool_retry_at: Option<Instant>,
    next_rescan: Instant,
    next_retention: Instant,
    next_space_check: Instant,
    low_space: Option<String>,
    /// Why the root, spool/ or the runs root fails `store::safety::check_dir` now
    /// (re-checked before every spool scan): nothing is claimed meanwhile.
    unsafe_dir: Option<String>,
    stopping: bool,
    watchdog: Option<Duration>,
    last_watchdog: Instant,
    /// When the previous daemon on this root started (0: unknown).
    previous_start: i64,
    /// `runspool/queue.json` as last read (`queue::read`), re-read when its
    /// identity (one lstat per turn) changes.
    queue_ctl: QueueCtl,
}

#[derive(Default)]
struct QueueCtl {
    identity: Option<(u64, u64, u64, i64, i64, i64, i64)>,
    file: Option<queue::QueueFile>,
    /// Why the file present is ignored (logged once per version of it).
    error: Option<String>,
    /// When this daemon saw the pause, for a file without `pausedAt`.
    seen_paused_at: Option<i64>,
}

pub struct Options {
    pub root: Option<PathBuf>,
    pub config: Option<PathBuf>,
}

impl Daemon {
    pub fn start(opts: Options) -> Result<Daemon, StartError> {
        // Signals become hints for the loop before anything can see this
        // daemon (daemon.json): a SIGHUP sent as soon as it appears is a
        // reload, not the signal's default action (exit).
        let (tx, rx) = channel();
        forward_signals(tx.clone()).map_err(|e| {
            StartError::Config(format!("cannot install the signal handlers (SIGTERM, SIGINT, SIGHUP, SIGCHLD): {e}"))
        })?;
        let cfg = Config::load(opts.config.as_deref()).map_err(|e| StartError::Config(e.to_string()))?;
        let layout = Layout::resolve(opts.root.as_deref(), cfg.root.as_deref());
        let root_override = Layout::root_override(opts.root.as_deref());
        for p in [layout.root.clone(), layout.spool(), layout.runs()] {
            crate::store::safety::check_dir(&p)?;
        }
        for d in layout.dirs() {
            fsutil::mkdir_private_all(&d).map_err(io_err(&d))?;
        }
        crate::store::safety::check_layout(&layout)?;
        let lock = take_daemon_lock(&layout)?;
        let watch = Watch::start(
            &layout,
            tx.clone(),
            watch::Strategy::from_config(&cfg.watch.strategy),
            Duration::from_millis(cfg.watch.poll_interval_ms),
        )
        .map_err(StartError::Config)?;
        let pid = std::process::id();
        let now = crate::now_ms();
        let report = DaemonStatus {
            version: 1,
            pid,
            hostname: crate::platform::hostname(),
            start_identity: crate::platform::start_identity(pid),
            started_at: now,
            updated_at: now,
            runspool_version: env!("CARGO_PKG_VERSION").to_string(),
            watch: WatchInfo {
                strategy: watch.strategy_name().into(),
                backend: watch.choice.backend.into(),
                reason: watch.choice.reason.clone(),
                fs_type: watch::fs_type(&layout.root),
                inotify: crate::platform::inotify_usage(),
            },
            storage: StorageInfo {
                state: "ok".into(),
                reason: None,
                since: None,
                min_free_bytes: Some(cfg.storage.min_free_bytes),
            },
            runs: RunCounts { queued: 0, running: 0 },
            last_rescan_at: None,
            config: Some(cfg.info(opts.config.as_deref())),
            queue: None,
        };
        let previous_start = std::fs::read(layout.daemon_json())
            .ok()
            .and_then(|b| serde_json::from_slice::<DaemonStatus>(&b).ok())
            .map(|d| d.started_at)
            .unwrap_or(0);
        let exe = std::env::current_exe().map_err(|e| StartError::Io { path: "/proc/self/exe".into(), error: e })?;
        let bridge = bridge::Bridge::new(&cfg, tx.clone());
        let hooks = hooks::Hooks::new(&layout);
        let reserve = report::Reserve::new(&layout);
        let mut d = Daemon {
            next_rescan: Instant::now() + Duration::from_secs(cfg.watch.rescan_interval_s),
            layout,
            cfg,
            config_path: opts.config,
            root_override,
            runner: supervisor::RunnerProgram::find(&exe),
            w: Writer::new(),
            _lock: lock,
            tx,
            rx,
            watch,
            bridge,
            hooks,
            dead_runners: Default::default(),
            queue: BinaryHeap::new(),
            queued: HashSet::new(),
            polled_inboxes: VecDeque::new(),
            next_inbox_poll: Instant::now(),
            claimed: Vec::new(),
            recovery_backlog: Vec::new(),
            running: HashMap::new(),
            settling: Vec::new(),
            foreign: HashSet::new(),
            last_rescan_at: None,
            seq: 0,
            report,
            reserve,
            last_report_write: Instant::now(),
            report_due: None,
            spool_dirty: true,
            watch_failed: None,
            spool_backlog: Default::default(),
            grace: Default::default(),
            spawn_retry_at: None,
            spawn_backoff: None,
            unfinished_claims: Vec::new(),
            unfinished_retry_at: Instant::now(),
            recovery_unlisted: None,
            spool_retry_at: None,
            next_retention: Instant::now() + Duration::from_secs(3600),
            next_space_check: Instant::now() + SPACE_CHECK_EVERY,
            low_space: None,
            unsafe_dir: None,
            stopping: false,
            previous_start,
            watchdog: report::watchdog_interval(),
            last_watchdog: Instant::now(),
            queue_ctl: QueueCtl::default(),
        };
        // queue.json changes wake the loop (Hint::Queue); each turn re-checks it with one lstat.
        d.watch.add(&d.layout.daemon_dir());
        d.check_queue_file();
        d.reserve.ensure();
        d.write_report(true);
        d.recover();
        // The re-adopted counts at once, not after the report debounce.
        d.write_report(true);
        retention::sweep(&d.layout, d.cfg.retention_days);
        tracing::info!(
            root = %d.layout.root.display(), watch = d.watch.choice.backend.as_str(),
            queued = d.queue.len(), running = d.running.len(), runner = %d.runner.path.display(), "runspool daemon started"
        );
        Ok(d)
    }

    pub fn sender(&self) -> Sender<Hint> {
        self.tx.clone()
    }

    /// Rebuild the in-memory state from disk (PROTOCOL §12): finish half
    /// claims, re-queue queued runs, re-adopt live runners, repair dead ones,
    /// finish interrupted publications.
    fn recover(&mut self) {
        self.hooks.recover(&self.layout);
        let ctx = Ctx(&self.cfg);
        spool::recover_rejected(&mut self.w, &self.layout, &ctx, self.previous_start - 60_000);
        self.sweep_temps();
        // Live runs first, from the active index: the daemon is ready once they
        // are adopted. Every other run directory (half-done claims, terminal runs
        // whose publication was cut short, active runs whose marker was lost) is
        // checked in slices from the loop (`recover_slice`), so start-up does not
        // grow with the number of finished runs kept on disk.
        let mut queued = Vec::new();
        for id in run_names(&self.layout.active(), false) {
            self.recover_run(&id, &mut queued);
        }
        self.adopt_queued(queued);
        self.list_recovery_backlog();
        self.check_running();
    }

    /// The run directories for `recover_slice`. A listing that fails (EMFILE
    /// at start-up) is retried every second: a half-claimed run must not wait
    /// for the next daemon start.
    fn list_recovery_backlog(&mut self) {
        match try_run_names(&self.layout.runs(), true) {
            Ok(names) => {
                self.recovery_backlog = names;
                if self.recovery_unlisted.take().is_some() {
                    self.w.outside_ok();
                }
            }
            Err(e) => {
                tracing::warn!(runs = %self.layout.runs().display(), error = %e, "cannot list the run directories; retrying every second");
                if is_capacity(&e) {
                    self.w.capacity_error(&self.layout.runs(), &e);
                }
                self.recovery_unlisted = Some(Instant::now() + Duration::from_secs(1));
            }
        }
    }

    /// Check the next slice of run directories left by `recover`.
    fn recover_slice(&mut self) {
        let mut queued = Vec::new();
        for _ in 0..RECOVER_PER_TURN {
            let Some(id) = self.recovery_backlog.pop() else { break };
            // Claimed, started or adopted by this daemon already: it knows them.
            if !self.queued.contains(&id) && !self.running.contains_key(&id) {
                self.recover_run(&id, &mut queued);
            }
        }
        self.adopt_queued(queued);
        if self.recovery_backlog.is_empty() {
            self.recovery_backlog = Vec::new(); // give the names' memory back
            tracing::debug!("start-up check of every run directory done");
        }
    }

    /// Recovery of one run directory (PROTOCOL §12); queued runs go to `queued`.
    fn recover_run(&mut self, id: &str, queued: &mut Vec<Status>) {
        let dir = self.layout.run_dir(id);
        if !run::claimed(&dir) {
            // Not claimed by runspool: another host's run is never touched
            // (§14) beyond servicing its bridge requests; only a rejection of
            // ours may need its publication finished.
            if let Ok(Some(s)) = run::read_status(&dir) {
                if s.state.is_active() {
                    self.foreign.insert(id.to_string());
                } else if run::ownership(&dir, Some(&s)) == run::Ownership::Rejection {
                    if let Err(e) = supervisor::ensure_published_status(&mut self.w, &self.layout, &s) {
                        tracing::warn!(run_id = %id, error = %e, "could not finish publishing a rejected run");
                    }
                }
            }
            return;
        }
        // Only a directory changed since the previous daemon started can hold a fresh temp.
        if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.mtime() * 1000 >= self.previous_start - 60_000) {
            fsutil::sweep_temps(&dir);
        }
        if spool::is_half_claimed(&dir) {
            self.finish_half_claim(id, queued);
            return;
        }
        let s = match run::read_status(&dir) {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) if is_capacity(&e) => {
                // No descriptor or space to read it now: look again, never forget the run.
                tracing::warn!(run_id = %id, error = %e, "cannot read status.json now; retrying every second");
                self.w.capacity_error(&dir, &e);
                self.remember_unfinished(id.to_string());
                return;
            }
            Err(e) => {
                tracing::warn!(run_id = %id, error = %e, "unreadable status.json; leaving the run alone");
                return;
            }
        };
        match s.state {
            State::Queued => {
                spool::ensure_queued_event(&mut self.w, &dir, id, s.queue.priority);
                let _ = spool::mark_claimed(&mut self.w, &self.layout, id);
                self.hooks.track(&self.cfg.hooks, id);
                queued.push(s);
            }
            State::Running => {
                let _ = spool::mark_claimed(&mut self.w, &self.layout, id);
                self.hooks.track(&self.cfg.hooks, id);
                self.running.insert(id.to_string(), Slot { child: None });
            }
            _ => {
                if let Err(e) = supervisor::ensure_published_status(&mut self.w, &self.layout, &s) {
                    tracing::warn!(run_id = %id, error = %e, "could not finish publishing a terminal run");
                }
            }
        }
    }

    /// Finish a run with `request.json` and no status (`spool::finish_half_claim`);
    /// one that meets a capacity error is remembered and retried every turn.
    fn finish_half_claim(&mut self, id: &str, queued: &mut Vec<Status>) {
        let ctx_cfg = self.cfg.clone();
        match spool::finish_half_claim(&mut self.w, &self.layout, id, &Ctx(&ctx_cfg)) {
            Ok(Some(s)) => {
                tracing::info!(run_id = %id, "finished a half-done claim");
                self.hooks.track(&self.cfg.hooks, id);
                let _ = spool::mark_claimed(&mut self.w, &self.layout, id);
                queued.push(s);
            }
            Ok(None) => {}
            Err(e) if is_capacity(&e) => {
                tracing::warn!(run_id = %id, error = %e, "cannot finish a half-done claim now; retrying every second");
                self.w.capacity_error(&self.layout.run_dir(id), &e);
                self.remember_unfinished(id.to_string());
            }
            Err(e) => {
                tracing::error!(run_id = %id, error = %e, "cannot finish a half-done claim; the next start tries again")
            }
        }
    }

    fn remember_unfinished(&mut self, id: String) {
        if !self.unfinished_claims.contains(&id) {
            self.unfinished_claims.push(id);
        }
        self.unfinished_retry_at = Instant::now() + Duration::from_secs(1);
    }

    /// Retry the claims whose post-commit work (queued status, queued event,
    /// active marker) met an error (PROTOCOL §2.3, §11: capacity errors never
    /// strand work). Claiming stays paused until every one is finished.
    fn retry_unfinished_claims(&mut self) {
        let mut queued = Vec::new();
        for id in std::mem::take(&mut self.unfinished_claims) {
            self.recover_run(&id, &mut queued);
        }
        self.adopt_queued(queued);
        if self.unfinished_claims.is_empty() {
            tracing::info!("every claim cut short after its commit is finished: claiming resumes");
            self.w.outside_ok();
            self.spool_dirty = true;
        }
    }

    /// A queued run may already have a runner (spawned just before our predecessor died).
    fn adopt_queued(&mut self, queued: Vec<Status>) {
        for s in queued {
            if fsutil::lock_held(&RunPaths::runner_lock(&self.layout.run_dir(&s.run_id))).unwrap_or(false) {
                self.running.insert(s.run_id.clone(), Slot { child: None });
            } else {
                self.enqueue(&s);
            }
        }
    }

    /// Temps left by writers killed mid-write, in the shared directories.
    fn sweep_temps(&self) {
        let l = &self.layout;
        // Not the spool: its dot files belong to clients.
        let mut dirs = vec![l.rejected(), l.active(), l.results(), l.daemon_dir()];
        for parent in [l.terminal(), l.results().join("result-pending"), l.results().join("result-index/sessions")] {
            if let Ok(rd) = std::fs::read_dir(&parent) {
                dirs.extend(rd.flatten().map(|e| e.path()));
            }
        }
        let n: usize = dirs.iter().map(|d| fsutil::sweep_temps(d)).sum();
        if n > 0 {
            tracing::info!(removed = n, "removed temp files left by an interrupted writer");
        }
    }

    fn enqueue(&mut self, s: &Status) {
        if self.queued.insert(s.run_id.clone()) {
            self.seq += 1;
            self.queue.push(Queued {
                priority: s.queue.priority,
                order: Reverse((s.queue.claimed_at, self.seq)),
                run_id: s.run_id.clone(),
            });
            self.poll_inbox(&s.run_id);
        }
    }

    fn poll_inbox(&mut self, run_id: &str) {
        if self.polled_inboxes.is_empty() {
            self.next_inbox_poll = Instant::now() + INBOX_POLL;
        }
        self.polled_inboxes.push_back((Instant::now(), run_id.to_string()));
    }

    /// The event loop. Returns when asked to stop (SIGTERM/SIGINT).
    pub fn run(mut self) -> i32 {
        report::sd_notify("READY=1");
        while !self.stopping {
            self.turn();
            let timeout = self.next_wake().saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(timeout) {
                Ok(h) => {
                    self.hint(h);
                    // Drain what else arrived (many events, one scan), bounded so a
                    // flood of hints can never keep the loop from its turn.
                    for _ in 0..4096 {
                        let Ok(h) = self.rx.try_recv() else { break };
                        self.hint(h);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        self.shutdown();
        0
    }

    fn next_wake(&self) -> Instant {
        let mut t = self.next_rescan.min(self.next_retention);
        t = t.min(self.last_report_write + Duration::from_secs(60));
        t = t.min(self.next_space_check);
        // Other hosts' active runs too: their bridge requests are swept once a second.
        if !self.running.is_empty()
            || !self.foreign.is_empty()
            || !self.settling.is_empty()
            || !self.w.is_idle()
            || self.low_space.is_some()
        {
            t = t.min(Instant::now() + Duration::from_secs(1));
        }
        if let Some(r) = self.spool_retry_at {
            t = t.min(r);
        }
        if !self.unfinished_claims.is_empty() {
            t = t.min(self.unfinished_retry_at);
        }
        if let Some(r) = self.recovery_unlisted {
            t = t.min(r);
        }
        if let Some(r) = self.spawn_retry_at.filter(|_| !self.queue.is_empty()) {
            t = t.min(r);
        }
        if !self.polled_inboxes.is_empty() {
            t = t.min(self.next_inbox_poll);
        }
        if let Some(h) = self.hooks.next_wake() {
            t = t.min(h);
        }
        if let Some(r) = self.reserve.next_wake() {
            t = t.min(r);
        }
        if let Some(r) = self.report_due {
            t = t.min(r);
        }
        if let Some(w) = self.watchdog {
            t = t.min(self.last_watchdog + w);
        }
        if self.spool_dirty || self.bridge.wants_turn() || !self.recovery_backlog.is_empty() {
            t = Instant::now();
        }
        t
    }

    fn hint(&mut self, h: Hint) {
        match h {
            Hint::Spool => self.spool_dirty = true,
            // The turn that follows looks at the file (`check_queue_file`).
            Hint::Queue => {}
            Hint::Control(id) => self.control_queued(&id),
            // Both are handled once in the next turn, however many arrive.
            Hint::Rescan(why) => {
                if self.next_rescan > Instant::now() {
                    tracing::debug!(reason = %why, "full rescan");
                }
                self.next_rescan = Instant::now();
            }
            Hint::WatchFailed(why) => {
                self.watch_failed = Some(why);
                self.next_rescan = Instant::now();
            }
            Hint::Bridge(run_id) => self.bridge.hint(run_id),
            Hint::BridgeDone { run_id, id, retry } => self.bridge.done(run_id, id, retry),
            Hint::Signal(sig) => match sig {
                libc::SIGTERM | libc::SIGINT => {
                    tracing::info!("stopping on signal {}; runs keep running", crate::platform::signal_name(sig));
                    self.stopping = true;
                }
                libc::SIGHUP => self.reload(),
                _ => {} // SIGCHLD: the turn reaps
            },
        }
    }

    /// One pass of the work that does not depend on which hint woke us.
    fn turn(&mut self) {
        let now = Instant::now();
        if !self.w.is_idle() {
            self.w.flush();
        }
        self.check_queue_file();
        if self.recovery_unlisted.is_some_and(|t| now >= t) {
            self.list_recovery_backlog();
        }
        if !self.recovery_backlog.is_empty() {
            self.recover_slice();
        }
        // A new watcher on a spool that became a symlink would follow it: wait until it is fixed.
        if self.watch_failed.is_some() && self.dirs_safe() {
            let why = self.watch_failed.take().unwrap_or_default();
            self.watch.replace(&why);
        }
        if now >= self.next_rescan {
            self.rescan();
        }
        if now >= self.next_space_check {
            let was_low = self.low_space.is_some();
            self.storage_ok();
            // Space came back: claim what waited, without waiting for the rescan.
            self.spool_dirty |= was_low && self.low_space.is_none();
        }
        if now >= self.next_retention {
            retention::sweep(&self.layout, self.cfg.retention_days);
            self.next_retention = now + Duration::from_secs(3600);
        }
        if !self.unfinished_claims.is_empty() && now >= self.unfinished_retry_at {
            self.retry_unfinished_claims();
        }
        if self.spool_retry_at.is_some_and(|t| now >= t) {
            self.spool_dirty = true;
        }
        if self.spool_dirty {
            self.scan_spool();
        }
        self.reap();
        self.schedule();
        self.check_running();
        self.mark_claimed();
        self.poll_queued_inboxes();
        let held = &self.dead_runners;
        let bridged = self.running.keys().filter(|id| !held.holds(id)).chain(self.foreign.iter());
        self.bridge.turn(&mut self.w, &self.layout, bridged, &mut self.watch);
        self.hooks.turn(&self.layout, &self.cfg.hooks);
        self.write_report(false);
        // Back after a release once there is room again (tried every 10 s).
        self.reserve.ensure();
        // The watchdog is fed from the loop itself, so a wedged loop gets restarted.
        if self.watchdog.is_some_and(|w| self.last_watchdog.elapsed() >= w) {
            report::sd_notify("WATCHDOG=1");
            self.last_watchdog = Instant::now();
        }
    }

    fn rescan(&mut self) {
        tracing::debug!(queued = self.queued.len(), running = self.running.len(), "periodic rescan");
        self.spool_dirty = true;
        // A spool replaced by a symlink must not get a watcher (inotify follows
        // links), nor a runs root replaced by one adopt what it points to.
        let safe = self.dirs_safe();
        if safe && self.watch.spool_replaced() {
            self.watch.replace("the spool directory was replaced");
        }
        self.next_rescan = Instant::now() + Duration::from_secs(self.cfg.watch.rescan_interval_s);
        self.last_rescan_at = Some(crate::now_ms());
        // Control inboxes of queued runs may have changed unseen.
        let ids: Vec<String> = self.queued.iter().cloned().collect();
        for id in ids {
            self.control_queued(&id);
        }
        if safe {
            self.scan_active_index();
        }
    }

    /// Runs of ours started by another path (or lost from memory) show up in
    /// the active index and are adopted; other hosts' active runs are noted
    /// for the bridge only (§14).
    fn scan_active_index(&mut self) {
        if let Ok(active) = crate::store::index::list_active(&self.layout) {
            self.foreign.clear();
            for x in active {
                let Ok(s) = x.status else { continue };
                if !x.ownership.is_ours() {
                    self.foreign.insert(x.run_id);
                    continue;
                }
                let known = self.queued.contains(&s.run_id)
                    || self.running.contains_key(&s.run_id)
                    || self.settling.contains(&s.run_id);
                if !known {
                    self.hooks.track(&self.cfg.hooks, &s.run_id);
                    match s.state {
                        State::Queued => self.enqueue(&s),
                        _ => {
                            self.running.insert(s.run_id.clone(), Slot { child: None });
                        }
                    }
                }
            }
        }
    }

    /// Do the root, spool/ and the runs root still pass the start-up check
    /// (`store::safety::check_dir`)? One replaced by a symlink, or loosened, while
    /// we run is never followed: the error is logged once with the path and
    /// the fix, daemon.json reports storage `degraded` with it, and nothing
    /// is claimed until it is fixed. Three lstat calls.
    fn dirs_safe(&mut self) -> bool {
        let l = &self.layout;
        let bad = [l.root.clone(), l.spool(), l.runs()].iter().find_map(|p| crate::store::safety::check_dir(p).err());
        match (&self.unsafe_dir, &bad) {
            (None, Some(e)) => tracing::error!(root = %l.root.display(), "claiming stopped: {e}"),
            (Some(_), None) => {
                tracing::info!(root = %l.root.display(), "the root's directories are safe again: claiming resumed")
            }
            _ => {}
        }
        self.unsafe_dir = bad.map(|e| e.to_string());
        self.unsafe_dir.is_none()
    }

    /// Is there room to claim? Below the free-space floor, or with writes
    /// still deferred, the spool is left alone (PROTOCOL §11).
    fn storage_ok(&mut self) -> bool {
        self.next_space_check = Instant::now() + SPACE_CHECK_EVERY;
        let low = report::space_shortage(&self.layout.root, self.cfg.storage.min_free_bytes);
        match (&self.low_space, &low) {
            (None, Some(r)) => tracing::warn!(reason = %r, "storage low: claiming paused"),
            (Some(_), None) => tracing::info!("storage space back above the floor: claiming resumed"),
            _ => {}
        }
        self.low_space = low;
        self.low_space.is_none() && self.w.is_idle() && self.unfinished_claims.is_empty()
    }

    /// Claim from the spool. One listing (sorted oldest first) feeds a
    /// backlog that is worked off `CLAIMS_PER_TURN` entries per loop turn, so
    /// a flood of 20,000 files costs one readdir, not one per turn, and the
    /// scheduler and liveness checks still run in between.
    fn scan_spool(&mut self) {
        self.spool_dirty = false;
        if self.paused() {
            // Requests stay in the spool; `resume` marks it dirty again.
            self.spool_retry_at = None;
            return;
        }
        if !self.dirs_safe() || !self.storage_ok() {
            return;
        }
        let fresh = self.spool_backlog.is_empty();
        if fresh && !self.list_spool() {
            return; // retried at spool_retry_at
        }
        let mut later = false;
        let mut capacity = false;
        let mut done = 0;
        let ctx_cfg = self.cfg.clone();
        let ctx = Ctx(&ctx_cfg);
        while done < CLAIMS_PER_TURN {
            let Some(name) = self.spool_backlog.pop_front() else { break };
            let outcome =
                Claimer { layout: &self.layout, w: &mut self.w, ctx: &ctx, grace: &mut self.grace }.process(&name);
            match outcome {
                Outcome::Claimed(s) => {
                    done += 1;
                    self.hooks.track(&self.cfg.hooks, &s.run_id);
                    self.enqueue(&s);
                    self.claimed.push(s.run_id.clone());
                    if !self.w.is_idle() {
                        // Its status is only in memory: stop claiming until storage recovers.
                        later = true;
                        break;
                    }
                }
                Outcome::Rejected => done += 1,
                Outcome::Later => later |= spool::classify_name(&name) == spool::Name::Candidate,
                Outcome::Unfinished { run_id, error } => {
                    tracing::warn!(
                        run_id = %run_id, request = %name, error = %error,
                        "claimed, but the queued status could not be written: finishing the run by its directory, claiming paused meanwhile"
                    );
                    if is_capacity(&error) {
                        self.w.capacity_error(&self.layout.run_dir(&run_id), &error);
                        capacity = true;
                    }
                    self.remember_unfinished(run_id);
                    later = true;
                    break;
                }
                Outcome::Capacity(e) => {
                    tracing::warn!(request = %name, error = %e, "capacity error while claiming: claiming paused until storage recovers");
                    self.w.capacity_error(&self.layout.spool().join(&name), &e);
                    self.spool_backlog.push_front(name);
                    later = true;
                    capacity = true;
                    break;
                }
            }
        }
        if !capacity && self.unfinished_claims.is_empty() {
            self.w.outside_ok();
        }
        if !self.spool_backlog.is_empty() && self.w.is_idle() {
            self.spool_dirty = true;
        }
        // Busy or half-written entries: look again shortly.
        if later {
            self.spool_retry_at = Some(Instant::now() + Duration::from_millis(500));
        } else if fresh {
            self.spool_retry_at = None;
        }
    }

    /// List the spool into the backlog; false when it cannot be listed now.
    fn list_spool(&mut self) -> bool {
        let rd = match std::fs::read_dir(self.layout.spool()) {
            Ok(rd) => rd,
            Err(e) => {
                // Capacity (EMFILE) or a spool being replaced: list again shortly.
                tracing::warn!(spool = %self.layout.spool().display(), error = %e, "cannot list the spool; retrying");
                if is_capacity(&e) {
                    self.w.capacity_error(&self.layout.spool(), &e);
                }
                self.spool_retry_at = Some(Instant::now() + Duration::from_secs(1));
                return false;
            }
        };
        let mut names: Vec<(i64, String)> = Vec::new();
        for e in rd.flatten() {
            let Ok(name) = e.file_name().into_string() else {
                // A non-UTF-8 name is a bad name too; handle it by its lossy form.
                let lossy = e.file_name().to_string_lossy().into_owned();
                let _ = spool::reject_entry(
                    &mut self.w,
                    &self.layout,
                    &e.path(),
                    &lossy.replace('\u{FFFD}', "_"),
                    &crate::protocol::request::Rejection::new(crate::protocol::request::RejectionCode::BadName, "the file name is not valid UTF-8; use <name>.json with <name> matching [A-Za-z0-9][A-Za-z0-9._-]{0,199}"),
                    None,
                );
                continue;
            };
            if name == "rejected" || name.starts_with('.') {
                continue;
            }
            let mtime = e.metadata().map(|m| m.mtime() * 1000 + m.mtime_nsec() / 1_000_000).unwrap_or(0);
            names.push((mtime, name));
        }
        // Oldest first, so claim order follows publication order.
        names.sort();
        self.grace.retain(&names.iter().map(|(_, n)| n.as_str()).collect());
        self.spool_backlog = names.into_iter().map(|(_, n)| n).collect();
        true
    }

    /// Act on the control inbox of a run that is still queued: it never starts
    /// and ends `stopped` (PROTOCOL §9).
    fn control_queued(&mut self, run_id: &str) {
        if !self.queued.contains(run_id) {
            return;
        }
        let dir = self.layout.run_dir(run_id);
        let control = RunPaths::control(&dir);
        let legacy = ["stop.json", "timeout.json", "interrupt.json"].into_iter().find(|f| control.join(f).exists());
        let pending = legacy.is_some() || queued_stop_waiting(&dir);
        if !pending {
            return;
        }
        let Ok(Some(_lock)) = supervisor::take_runner_lock(&dir) else { return };
        // 0.67's stop requests: one that names a step of the run is the
        // runner's to honour (that step is skipped); any other stops the run.
        let run_stop = if legacy.is_none() { take_run_level_stop(&dir) } else { None };
        let msg = match (legacy, &run_stop) {
            (Some(file), _) => format!("stopped before it started ({file} in the control inbox)"),
            (None, Some(r)) => format!("{} before it started", crate::protocol::control::describe(r, "a stop request")),
            (None, None) => return,
        };
        let file = legacy.unwrap_or("");
        let m2 = msg.clone();
        let now = crate::now_ms();
        let res = results::write_terminal(&mut self.w, &self.layout, run_id, move |cur| {
            let mut s = cur?;
            if s.state != State::Queued {
                return None;
            }
            spool::skip_all(
                &mut s,
                crate::protocol::status::StepState::Stopped,
                "skipped: the run was stopped before it started",
            );
            s.state = State::Stopped;
            s.stopped = true;
            s.ended_at = Some(now);
            s.error = Some(m2);
            s.exit_code = Some(s.terminal_exit_code());
            Some(s)
        });
        match res {
            Ok(Some(s)) if s.state == State::Stopped => {
                run::event(&mut self.w, &dir, run_id, "subagent.run.stopped", json!({"message": msg}));
                run::event(
                    &mut self.w,
                    &dir,
                    run_id,
                    "subagent.run.completed",
                    json!({"status": "stopped", "durationMs": 0, "exitCode": s.exit_code}),
                );
                if !file.is_empty() {
                    let _ = std::fs::remove_file(control.join(file));
                }
                tracing::info!(run_id, "stopped a queued run");
                self.hooks.ended(run_id);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(run_id, error = %e, "could not stop a queued run"),
        }
        self.queued.remove(run_id);
        self.watch.unwatch_control(run_id);
    }

    /// Settle the runs whose runner `reap` saw exit, and check runners we did
    /// not start (re-adopted ones) by their lock; repair the dead ones.
    fn check_running(&mut self) {
        let childless = self.running.iter().filter(|(_, s)| s.child.is_none()).map(|(id, _)| (id.clone(), false));
        let ids: Vec<(String, bool)> =
            std::mem::take(&mut self.settling).into_iter().map(|id| (id, true)).chain(childless).collect();
        for (id, reaped) in ids {
            let dir = self.layout.run_dir(&id);
            if !run::claimed(&dir) {
                // Only runs we claimed get here; should one ever lose its
                // request.json, taking its lock would write into a directory
                // that may not be ours (§14).
                tracing::warn!(run_id = %id, path = %dir.display(), "run has no request.json; no longer supervised");
                self.running.remove(&id);
                continue;
            }
            match supervisor::take_runner_lock(&dir) {
                Ok(None) => {
                    // A live runner holds it (one we did not start, after ours exited).
                    if reaped {
                        self.running.insert(id, Slot { child: None });
                    }
                }
                Ok(Some(_lock)) => {
                    let r = match run::read_status(&dir) {
                        Ok(Some(s))
                            if s.state.is_active() && self.dead_runners.hold_repair(&self.bridge, &dir, &id, &s) =>
                        {
                            // Its processes and external jobs are being cleared; the repair follows.
                            self.running.entry(id).or_insert(Slot { child: None });
                            continue;
                        }
                        Ok(Some(s)) if s.state.is_active() => supervisor::repair(&mut self.w, &self.layout, &id),
                        Ok(Some(s)) => supervisor::ensure_published_status(&mut self.w, &self.layout, &s),
                        Ok(None) => Ok(()),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = r {
                        if is_capacity(&e) {
                            self.w.capacity_error(&dir, &e);
                            if reaped {
                                self.settling.push(id);
                            }
                            continue; // retry next turn
                        }
                        tracing::error!(run_id = %id, error = %e, "could not settle a finished run");
                    } else {
                        self.w.outside_ok();
                    }
                    self.running.remove(&id);
                    self.hooks.ended(&id);
                }
                Err(e) if is_capacity(&e) => {
                    if reaped {
                        self.settling.push(id);
                    }
                }
                Err(e) => {
                    tracing::error!(run_id = %id, error = %e, "cannot check the runner lock; forgetting the run");
                    self.running.remove(&id);
                }
            }
        }
    }

    /// Free the slots of runners that exited. Perf: `turn` reaps, schedules,
    /// and only then settles the finished runs (`check_running`: runner lock,
    /// status, published markers), so the next queued run starts without
    /// waiting for that.
    fn reap(&mut self) {
        let mut exited = Vec::new();
        for (id, slot) in &mut self.running {
            let Some(child) = slot.child.as_mut() else { continue };
            match child.try_wait() {
                Ok(None) => {} // our child, still alive
                Ok(Some(st)) => {
                    if !st.success() {
                        tracing::warn!(run_id = %id, status = %st, "runner exited abnormally");
                    }
                    exited.push(id.clone());
                }
                Err(_) => exited.push(id.clone()),
            }
        }
        for id in exited {
            self.running.remove(&id);
            self.settling.push(id);
        }
    }

    fn schedule(&mut self) {
        // A runner needs the queued status on disk (and files of its own):
        // while writes are deferred, nothing new starts.
        if !self.w.is_idle() {
            return;
        }
        if self.spawn_retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        self.spawn_retry_at = None;
        if self.paused() {
            return;
        }
        while self.running.len() < self.max_running() {
            let Some(q) = self.queue.pop() else { break };
            if !self.queued.remove(&q.run_id) {
                continue; // stopped while queued
            }
            self.watch.unwatch_control(&q.run_id);
            let dir = self.layout.run_dir(&q.run_id);
            match self.runner.start(&dir) {
                Ok(child) => {
                    self.w.outside_ok();
                    self.spawn_backoff = None;
                    tracing::info!(run_id = %q.run_id, runner_pid = child.id(), "runner started");
                    self.running.insert(q.run_id.clone(), Slot { child: Some(child) });
                }
                Err(supervisor::SpawnError::Transient { error, message }) => {
                    // EAGAIN (RLIMIT_NPROC), ENOMEM, a full descriptor table: the run
                    // stays queued and the start is retried with a growing delay.
                    let delay = self.spawn_backoff.map_or(SPAWN_RETRY_FIRST, |d| (d * 2).min(SPAWN_RETRY_MAX));
                    self.spawn_backoff = Some(delay);
                    self.spawn_retry_at = Some(Instant::now() + delay);
                    tracing::warn!(
                        run_id = %q.run_id, runner = %self.runner.describe(), retry_in_ms = delay.as_millis() as u64,
                        "{message}; the run stays queued and the start is retried"
                    );
                    if is_capacity(&error) {
                        self.w.capacity_error(&dir, &error);
                    }
                    self.queued.insert(q.run_id.clone());
                    self.poll_inbox(&q.run_id);
                    self.queue.push(q);
                    break;
                }
                Err(supervisor::SpawnError::Permanent { message }) => {
                    tracing::error!(run_id = %q.run_id, runner = %self.runner.describe(), "{message}; the run fails");
                    self.fail_unstartable(&q.run_id, &message);
                }
            }
        }
    }

    /// A queued run whose runner cannot be started ends `failed` with the
    /// reason, which names the errno and the runner program.
    fn fail_unstartable(&mut self, run_id: &str, message: &str) {
        let dir = self.layout.run_dir(run_id);
        match supervisor::take_runner_lock(&dir) {
            Ok(Some(_lock)) => match supervisor::fail_unstartable(&mut self.w, &self.layout, run_id, message) {
                Ok(true) => self.hooks.ended(run_id),
                Ok(false) => {}
                Err(e) => tracing::error!(run_id, error = %e, "could not record why the run failed to start"),
            },
            // Some runner holds it after all: the check of running runs watches it.
            Ok(None) => {
                self.running.insert(run_id.to_string(), Slot { child: None });
            }
            Err(e) => tracing::error!(run_id, error = %e, "could not record why the run failed to start"),
        }
    }

    /// Active markers for the runs claimed in this turn, after `schedule` has
    /// started those that found a slot: the runner's start-up overlaps with
    /// the marker's creation instead of waiting for it.
    fn mark_claimed(&mut self) {
        for id in std::mem::take(&mut self.claimed) {
            if let Err(e) = spool::mark_claimed(&mut self.w, &self.layout, &id) {
                tracing::warn!(run_id = %id, error = %e, "could not create the active marker; the next daemon start repairs it");
            }
        }
    }

    /// The control inboxes of runs queued for less than `INBOX_WATCH_AFTER`
    /// are looked at every `INBOX_POLL` (one stat of `control/` each, which
    /// usually does not exist); a run still queued after that has its inbox
    /// created and watched. Perf: in a burst, runs that wait only seconds for a
    /// slot cost no `mkdir` and no two synchronous round trips to the watcher
    /// thread each (a tenth of the daemon's CPU per run); a stop of such a run
    /// takes effect within about a second (PROTOCOL §9 sets no bound).
    fn poll_queued_inboxes(&mut self) {
        let now = Instant::now();
        if self.polled_inboxes.is_empty() || now < self.next_inbox_poll {
            return;
        }
        self.next_inbox_poll = now + INBOX_POLL;
        for (since, id) in std::mem::take(&mut self.polled_inboxes) {
            if !self.queued.contains(&id) {
                continue;
            }
            let control = RunPaths::control(&self.layout.run_dir(&id));
            if now >= since + INBOX_WATCH_AFTER {
                // Clients create control/ too (PROTOCOL §3); a queued run needs it to be watched.
                let _ = fsutil::mkdir_private(&control);
                let _ = fsutil::mkdir_private(&RunPaths::stop_requests(&self.layout.run_dir(&id)));
                self.watch.watch_control(&id);
                self.control_queued(&id); // what landed before the watch
                continue;
            }
            if control.exists() {
                self.control_queued(&id);
            }
            if self.queued.contains(&id) {
                self.polled_inboxes.push_back((since, id));
            }
        }
    }

    /// SIGHUP: re-read the config file and say what changed, or why the new
    /// file was refused (the running configuration then stays).
    fn reload(&mut self) {
        use crate::logging::{self, LevelChange};
        let file = self
            .config_path
            .clone()
            .or_else(crate::config::default_path)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "(no config file: defaults)".into());
        let new = match Config::load(self.config_path.as_deref()) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(config = %file, "configuration refused, keeping the running one: {e}");
                return;
            }
        };
        let mut changes = new.changes_from(&self.cfg, self.root_override.as_deref());
        if changes.is_empty() {
            tracing::info!(config = %file, "configuration reloaded: nothing changed");
            return;
        }
        // A quieter level is applied after the report, a louder one before,
        // so the report itself is never filtered out.
        let (old_level, new_level) = (self.cfg.log.level.clone(), new.log.level.clone());
        let mut quieter_later = false;
        if old_level != new_level {
            if let Some(v) = logging::env_level() {
                note_level(&mut changes, &format!("not applied: {} = {v} is set and wins", logging::LEVEL_ENV));
            } else if logging::verbosity(&new_level) >= logging::verbosity(&old_level) {
                if let LevelChange::Failed(e) = logging::set_config_level(&new_level) {
                    note_level(&mut changes, &format!("not applied: {e}"));
                }
            } else {
                quieter_later = true;
            }
        }
        tracing::info!(config = %file, "configuration reloaded: {}", changes.join("; "));
        if quieter_later {
            if let LevelChange::Failed(e) = logging::set_config_level(&new_level) {
                tracing::warn!(config = %file, "log.level {new_level} not applied: {e}");
            }
        }
        if new.providers != self.cfg.providers {
            self.bridge.set_providers(&new);
        }
        if new.watch.rescan_interval_s != self.cfg.watch.rescan_interval_s {
            self.next_rescan = self.next_rescan.min(Instant::now() + Duration::from_secs(new.watch.rescan_interval_s));
        }
        if new.retention_days != self.cfg.retention_days {
            self.next_retention = Instant::now();
        }
        if new.hooks != self.cfg.hooks {
            // Hooks apply at once: added hooks are owed by every run active now.
            let active: Vec<String> =
                self.queued.iter().chain(self.running.keys()).chain(self.settling.iter()).cloned().collect();
            self.hooks.reconfigure(&new.hooks, &active);
        }
        if let Some(n) = self.queue_ctl.file.as_ref().and_then(|q| q.max_running) {
            if new.max_running != self.cfg.max_running {
                tracing::info!(
                    queue = %queue::path(&self.layout).display(),
                    "max_running = {} from the config is not applied: the queue file's maxRunning = {n} overrides it until `runspool max-running --clear`",
                    new.max_running
                );
            }
        }
        // A new max_running or storage floor takes effect in the next turn.
        self.spool_dirty = true;
        self.cfg = new;
        self.report.config = Some(self.cfg.info(self.config_path.as_deref()));
        self.write_report(true);
    }

    fn write_report(&mut self, force: bool) {
        let mut r = self.report.clone();
        r.last_rescan_at = self.last_rescan_at;
        if r.watch.backend != self.watch.choice.backend.as_str() {
            r.watch.inotify = crate::platform::inotify_usage();
        }
        r.watch.strategy = self.watch.strategy_name().into();
        r.watch.backend = self.watch.choice.backend.into();
        r.watch.reason = self.watch.choice.reason.clone();
        r.runs = RunCounts { queued: self.queued.len(), running: self.running.len() };
        r.queue = Some(self.queue_info());
        let degraded = self.unsafe_dir.clone().or_else(|| self.low_space.clone()).or_else(|| self.w.last_error.clone());
        let min_free_bytes = Some(self.cfg.storage.min_free_bytes);
        r.storage = match degraded {
            Some(reason) => StorageInfo {
                min_free_bytes,
                state: "degraded".into(),
                since: Some(
                    self.report
                        .storage
                        .since
                        .filter(|_| self.report.storage.state == "degraded")
                        .unwrap_or_else(crate::now_ms),
                ),
                reason: Some(reason),
            },
            None => StorageInfo { state: "ok".into(), reason: None, since: None, min_free_bytes },
        };
        if !force && r.same_as(&self.report) && self.last_report_write.elapsed() < Duration::from_secs(60) {
            self.report_due = None;
            return;
        }
        // Perf: run counts change with every claim and every exit; in a burst,
        // rewriting daemon.json (and STATUS=) each time competed with the
        // runners for the CPU. Counts are written at most every REPORT_EVERY;
        // a change of storage or watch state goes out at once.
        let urgent = r.storage.state != self.report.storage.state
            || r.watch.backend != self.report.watch.backend
            || r.queue != self.report.queue;
        if !force && !urgent && self.last_report_write.elapsed() < REPORT_EVERY {
            self.report_due = Some(self.last_report_write + REPORT_EVERY);
            return;
        }
        self.report_due = None;
        report::sd_notify(&format!(
            "STATUS=watching {}; {} running, {} queued; storage {}",
            r.watch.backend, r.runs.running, r.runs.queued, r.storage.state
        ));
        r.updated_at = crate::now_ms();
        let bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
        let path = self.layout.daemon_json();
        if let Err(e) = self.w.write(&path, bytes, false) {
            tracing::warn!(error = %e, "cannot write daemon.json");
        }
        // A full filesystem must not keep daemon.json saying `ok`: spend the
        // reserve on it (docs/watching-and-storage.md).
        if self.w.pending_for(&path).is_some() && self.reserve.release() {
            self.w.flush_path(&path);
            self.reserve.take_back();
        }
        self.report = r;
        self.last_report_write = Instant::now();
    }

    fn paused(&self) -> bool {
        self.queue_ctl.file.as_ref().is_some_and(|q| q.paused)
    }

    /// The queue file's `maxRunning` when set, else the config's `max_running`.
    fn max_running(&self) -> usize {
        self.queue_ctl.file.as_ref().and_then(|q| q.max_running).unwrap_or(self.cfg.max_running)
    }

    fn queue_info(&self) -> QueueInfo {
        let q = self.queue_ctl.file.as_ref();
        let paused = self.paused();
        QueueInfo {
            paused,
            since: paused.then(|| q.and_then(|q| q.paused_at).or(self.queue_ctl.seen_paused_at)).flatten(),
            reason: q.filter(|_| paused).and_then(|q| q.reason.clone()),
            max_running: self.max_running(),
            max_running_override: q.and_then(|q| q.max_running),
            error: self.queue_ctl.error.clone(),
        }
    }

    /// Re-read `runspool/queue.json` when it changed (one lstat when it did
    /// not). An invalid or hostile file (FIFO, symlink, garbage) is logged
    /// once with the path and the fix and ignored: no pause, no override.
    fn check_queue_file(&mut self) {
        let path = queue::path(&self.layout);
        let identity = queue::identity(&path);
        if identity.is_some() && identity == self.queue_ctl.identity {
            return;
        }
        if identity.is_none()
            && self.queue_ctl.identity.is_none()
            && self.queue_ctl.file.is_none()
            && self.queue_ctl.error.is_none()
        {
            return;
        }
        let (was_paused, was_max) = (self.paused(), self.max_running());
        let (file, error) = match queue::read_file(&path) {
            Ok(f) => (f, None),
            Err(queue::ReadError::Invalid(e)) => {
                tracing::warn!(queue = %path.display(), "queue file ignored (not paused, config max_running): {e}");
                (None, Some(e))
            }
            Err(queue::ReadError::Io(e)) => {
                // Keep what applies; the identity stays unrecorded, so the next turn tries again.
                tracing::warn!(queue = %path.display(), "{e}; keeping the current queue control and retrying");
                return;
            }
        };
        self.queue_ctl.identity = identity;
        self.queue_ctl.file = file;
        self.queue_ctl.error = error;
        let paused = self.paused();
        if paused && !was_paused {
            self.queue_ctl.seen_paused_at = Some(crate::now_ms());
            let reason = self.queue_ctl.file.as_ref().and_then(|q| q.reason.clone()).unwrap_or_default();
            tracing::info!(queue = %path.display(), reason = %reason, "queue paused: nothing is claimed or started until `runspool resume`");
        } else if !paused && was_paused {
            self.queue_ctl.seen_paused_at = None;
            tracing::info!(queue = %path.display(), "queue resumed: claiming and starting again");
            self.spool_dirty = true;
        }
        if self.max_running() != was_max {
            tracing::info!(queue = %path.display(), "max_running is now {} (was {was_max})", self.max_running());
        }
    }

    fn shutdown(&mut self) {
        report::sd_notify("STOPPING=1");
        // Flush deferred writes for a little while; whatever is left is
        // rebuilt from disk by the next start.
        let until = Instant::now() + Duration::from_secs(3);
        while !self.w.flush() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(200));
        }
        for slot in self.running.values_mut() {
            if let Some(c) = slot.child.as_mut() {
                let _ = c.try_wait();
            }
        }
        tracing::info!(running = self.running.len(), queued = self.queued.len(), "runspool daemon stopped");
    }
}

/// How long a busy `daemon.lock` whose recorded holder is gone is retried.
const LOCK_HOLDER_GONE_WAIT: Duration = Duration::from_secs(5);

/// Take `daemon.lock` (PROTOCOL §1: one daemon per root). The lock is opened
/// `O_CLOEXEC`, yet a child forked by a daemon that was just SIGKILLed (a
/// runner between fork and exec, a provider or hook being spawned) briefly
/// shares its open file description and with it the lock. So a busy lock is
/// refused at once only while the daemon named by daemon.json is alive (same
/// pid and start identity); when that daemon is gone, or daemon.json names no
/// one yet, it is retried for `LOCK_HOLDER_GONE_WAIT` before refusing.
fn take_daemon_lock(layout: &Layout) -> Result<File, StartError> {
    let lock_path = layout.daemon_lock();
    let deadline = Instant::now() + LOCK_HOLDER_GONE_WAIT;
    let mut waited = false;
    loop {
        if let Some(lock) = fsutil::lock(&lock_path, true).map_err(io_err(&lock_path))? {
            if waited {
                tracing::info!(lock = %lock_path.display(), "daemon.lock released by the children of a dead daemon");
            }
            return Ok(lock);
        }
        let holder = fsutil::read_nofollow(&layout.daemon_json(), 1024 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let pid = holder.as_ref().and_then(|v| v.get("pid")).and_then(|p| p.as_u64()).filter(|p| *p <= u32::MAX as u64);
        let alive = pid.is_some_and(|pid| {
            let pid = pid as u32;
            let recorded = holder.as_ref().and_then(|v| v.get("startIdentity")).and_then(|s| s.as_str());
            crate::platform::pid_alive(pid)
                && match (recorded, crate::platform::start_identity(pid)) {
                    (Some(r), Some(now)) => r == now,
                    _ => true,
                }
        });
        if alive || Instant::now() >= deadline {
            let pid = pid.map(|p| p.to_string()).unwrap_or_else(|| "unknown".into());
            return Err(StartError::AlreadyRunning { pid, root: layout.root.display().to_string() });
        }
        if !waited {
            tracing::info!(
                lock = %lock_path.display(),
                "daemon.lock is busy but the daemon daemon.json names is gone; waiting for its children to exec"
            );
            waited = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Run ids named by the entries of `dir`: its run directories (`dirs`) or its
/// marker files, dot names (temps, the indexes) left out.
/// A 0.67 stop request waits in a queued run's `control/stop-requests/`.
fn queued_stop_waiting(run_dir: &Path) -> bool {
    std::fs::read_dir(RunPaths::stop_requests(run_dir))
        .is_ok_and(|mut rd| rd.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".json"))))
}

/// For a queued run: take the first stop request (in `ts` order) that stops
/// the whole run, i.e. names no step of it; requests that name a step stay
/// for the runner. Invalid requests are removed, as the runner would.
fn take_run_level_stop(run_dir: &Path) -> Option<crate::protocol::control::StopRequest> {
    use crate::protocol::control::{parse_stop_request, MAX_STOP_REQUEST_BYTES};
    let steps = run::read_status(run_dir).ok().flatten().map(|s| s.steps.len()).unwrap_or(0);
    let dir = RunPaths::stop_requests(run_dir);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && n.ends_with(".json"))
        .collect();
    names.sort();
    for n in names {
        let p = dir.join(&n);
        match fsutil::read_nofollow(&p, MAX_STOP_REQUEST_BYTES).ok().and_then(|b| parse_stop_request(&b)) {
            Some(r) if r.target_index.is_some_and(|t| (t as usize) < steps) => continue,
            Some(r) => {
                if std::fs::remove_file(&p).is_ok() {
                    return Some(r);
                }
            }
            None => {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    None
}

fn run_names(dir: &Path, dirs: bool) -> Vec<String> {
    try_run_names(dir, dirs).unwrap_or_default()
}

fn try_run_names(dir: &Path, dirs: bool) -> std::io::Result<Vec<String>> {
    Ok(std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| if dirs { t.is_dir() } else { t.is_file() }))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|id| !id.starts_with('.'))
        .collect())
}

/// Append a remark to the `log.level` item of a reload report.
fn note_level(changes: &mut [String], remark: &str) {
    if let Some(c) = changes.iter_mut().find(|c| c.starts_with("log.level ")) {
        c.push_str(&format!(" ({remark})"));
    }
}

/// Forward SIGTERM, SIGINT, SIGHUP and SIGCHLD to the loop as hints
/// (`Daemon::start` does, first thing).
fn forward_signals(tx: Sender<Hint>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGCHLD, SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP, SIGCHLD])?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for s in signals.forever() {
            if tx.send(Hint::Signal(s)).is_err() {
                break;
            }
        }
    })?;
    Ok(())
}
