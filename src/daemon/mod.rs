//! The resident daemon. This file wires the parts together and runs the
//! loop; each part owns its state, does its work in a call from the turn,
//! says when it next needs one (`next_wake`), and hands what it wants of
//! the others back as `Effect`s, which the loop applies:
//!
//! - `spool::intake::Intake`: claiming from the spool (PROTOCOL §2);
//! - `scheduler`: the queue, priorities, `max_running`, queue control, queued-run control;
//! - `supervisor`: runner slots, reaping, liveness, repair of dead runs;
//! - `recovery`: start-up adoption, run-directory slices, unfinished claims, rescans;
//! - `storage`: may we claim (safe directories, free space), the storage reserve;
//! - `report`: daemon.json, `STATUS=` and the watchdog's feed;
//! - `metrics`: the log line of each run's end, and the `metrics_file`;
//! - `steward`: pi-subagents runs whose runner is gone, reconciled as 0.67 would (§14.1);
//! - `bridge`, `hooks`, `retention`, `watch` (file events as `Hint`s).
//!
//! Everything the daemon knows is on disk; a restart rebuilds the rest.
//! Start-up is in `startup.rs`, SIGHUP in `reload.rs`, `Env` and `Effect` in
//! `part.rs`.

/// `Env` from the daemon's fields, leaving the parts free to borrow.
macro_rules! env_of {
    ($d:ident) => {
        $crate::daemon::part::Env {
            layout: &$d.layout,
            cfg: &$d.cfg,
            w: &mut $d.w,
            watch: &mut $d.watch,
            providers: &$d.providers,
        }
    };
}

pub mod bridge;
pub mod hint;
pub mod hooks;
mod metrics;
mod part;
mod recovery;
mod reload;
pub mod report;
pub mod retention;
mod scheduler;
pub mod spool;
mod startup;
pub mod steward;
mod storage;
pub mod supervisor;
pub mod watch;

use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::protocol::daemon::RunCounts;
use crate::store::{Layout, Writer};
pub use hint::Hint;
use part::Effect;
use recovery::Recovery;
use scheduler::{Scheduler, Slots};
use storage::Storage;
use supervisor::{Start, Supervisor};
use watch::Watch;

/// How `runspool daemon` was asked to start (`Daemon::start`, in startup.rs).
pub struct Options {
    pub root: Option<PathBuf>,
    pub config: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Unsafe(#[from] crate::store::safety::SafetyError),
    #[error("another runspool daemon (pid {pid}) is running on {root}; stop it first (`kill {pid}` or `runspool service stop`)")]
    AlreadyRunning { pid: String, root: String },
    #[error("{path}: {error}; check that the directory is writable by you")]
    Io { path: String, error: std::io::Error },
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot install the signal handlers (SIGTERM, SIGINT, SIGHUP, SIGCHLD): {0}")]
    Signals(std::io::Error),
    #[error("{0}")]
    Watch(String),
}

pub struct Daemon {
    layout: Layout,
    cfg: Config,
    config_path: Option<PathBuf>,
    /// The flag or variable that chose the root over the config's `root`
    /// (`Layout::root_override`), for the SIGHUP report.
    root_override: Option<String>,
    w: Writer,
    _lock: File,
    tx: Sender<Hint>,
    rx: Receiver<Hint>,
    watch: Watch,
    /// Why the watcher failed: it is replaced once the root is safe.
    watch_failed: Option<String>,
    intake: spool::intake::Intake,
    scheduler: Scheduler,
    supervisor: Supervisor,
    recovery: Recovery,
    storage: Storage,
    report: report::Reporter,
    /// The providers built from the configuration (`Env::providers`).
    providers: crate::providers::Providers,
    bridge: bridge::Bridge,
    hooks: hooks::Hooks,
    steward: steward::Steward,
    metrics: metrics::Metrics,
    retention: retention::Retention,
    stopping: bool,
}

impl Daemon {
    pub fn sender(&self) -> Sender<Hint> {
        self.tx.clone()
    }

    /// The event loop. Returns when asked to stop (SIGTERM/SIGINT).
    pub fn run(mut self) -> i32 {
        crate::platform::sdnotify::sd_notify("READY=1");
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
        let now = Instant::now();
        let soon = now + Duration::from_secs(1);
        let busy = self.bridge.wants_turn().then_some(now);
        // Deferred writes are retried once a second.
        let flush = (!self.w.is_idle()).then_some(soon);
        [
            self.retention.next_wake(),
            self.intake.next_wake(),
            self.scheduler.next_wake(),
            self.supervisor.next_wake(),
            self.recovery.next_wake(),
            self.storage.next_wake(),
            self.report.next_wake(),
            self.metrics.next_wake(),
            self.hooks.next_wake(),
            self.steward.next_wake(self.cfg.steward),
            busy,
            flush,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(soon)
    }

    fn hint(&mut self, h: Hint) {
        match h {
            Hint::Spool => self.intake.mark_dirty(),
            // The turn that follows looks at the file (`queue::Control::check`).
            Hint::Queue => {}
            Hint::Control(id) => {
                let mut out = Vec::new();
                self.scheduler.control(&mut env_of!(self), &id, &mut out);
                self.apply(out);
            }
            // Both are handled once in the next turn, however many arrive.
            Hint::Rescan(why) => self.recovery.rescan_now(&why),
            Hint::WatchFailed(why) => {
                self.recovery.rescan_now(&why);
                self.watch_failed = Some(why);
            }
            Hint::Bridge(run_id) => self.bridge.hint(run_id),
            Hint::BridgeDone { run_id, id, retry } => self.bridge.done(run_id, id, retry),
            // The turn reaps.
            Hint::RunnerExited => {}
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

    /// One pass over the parts, whatever hint woke us. Order matters in
    /// two places: claims come before starts (a claimed run may start in
    /// the same turn), and runners are reaped and new ones started before
    /// the finished runs are settled (the next run does not wait for that).
    fn turn(&mut self) {
        let now = Instant::now();
        let mut out = Vec::new();
        if !self.w.is_idle() {
            self.w.flush();
        }
        if self.scheduler.ctl.check(&self.layout, self.cfg.max_running) {
            self.intake.mark_dirty();
        }
        let (scheduler, supervisor) = (&self.scheduler, &self.supervisor);
        let known = |id: &str| scheduler.contains(id) || supervisor.knows(id);
        self.recovery.turn(&mut env_of!(self), &known, &mut out);
        self.apply(std::mem::take(&mut out));
        // A new watcher on a spool that became a symlink would follow it: wait until it is fixed.
        if self.watch_failed.is_some() && self.storage.dirs_safe(&self.layout) {
            let why = self.watch_failed.take().unwrap_or_default();
            self.watch.replace(&why);
        }
        if self.recovery.rescan_due(now) {
            self.rescan();
        }
        self.storage.turn(&mut env_of!(self), &mut out);
        self.apply(std::mem::take(&mut out));
        self.retention.turn(&mut env_of!(self));
        if self.intake.due(now) {
            let gate = self.claim_gate();
            self.intake.turn(&mut env_of!(self), gate, &mut out);
            self.metrics.claimed(&self.intake.take_latencies());
            self.apply(std::mem::take(&mut out));
        }
        self.supervisor.reap();
        let supervisor = &self.supervisor;
        self.scheduler.settle_gates(&mut env_of!(self), &|id| supervisor.knows(id), &mut out);
        self.apply(std::mem::take(&mut out));
        self.start_runs(&mut out);
        self.supervisor.check(&mut env_of!(self), &mut out);
        self.intake.mark_claimed(&mut env_of!(self));
        self.scheduler.poll_inboxes(&mut env_of!(self), &mut out);
        self.apply(std::mem::take(&mut out));
        self.bridge.turn(&mut env_of!(self), self.supervisor.bridged(), self.recovery.foreign());
        self.hooks.turn(&mut env_of!(self));
        self.steward.turn(&mut env_of!(self));
        let facts = self.facts();
        self.metrics.turn(&metrics_view(&self.scheduler, &self.cfg, &self.watch, &facts));
        self.report.turn(&mut env_of!(self), facts, &mut out);
        self.apply(out);
        if self.scheduler.drained() {
            self.watch.compact();
            crate::platform::release_free_memory();
        }
    }

    /// Start-up recovery (PROTOCOL §12): hooks owed, the live runs of the
    /// active index, then a first check of the runners found.
    fn recover(&mut self) {
        self.hooks.recover(&self.layout);
        let mut out = Vec::new();
        self.recovery.start(&mut env_of!(self), &mut out);
        self.apply(std::mem::take(&mut out));
        self.supervisor.check(&mut env_of!(self), &mut out);
        self.apply(out);
    }

    fn apply(&mut self, out: Vec<Effect>) {
        for e in out {
            match e {
                Effect::Queue(id, s) => {
                    self.hooks.track(&self.cfg.hooks, &id);
                    self.scheduler.enqueue(&id, &s);
                }
                Effect::Adopt(id) => {
                    self.hooks.track(&self.cfg.hooks, &id);
                    // Its lane counts against the lane limits (PROTOCOL §15).
                    if let Ok(Some(s)) = crate::store::run::read_status(&self.layout.run_dir(&id)) {
                        self.scheduler.note_running(&id, s.lane());
                    }
                    self.supervisor.adopt(id);
                }
                Effect::Ended(id) => {
                    self.scheduler.ended(&id);
                    self.hooks.ended(&id);
                    self.metrics.ended(&self.layout, &id, false);
                }
                Effect::EndedUnseen(id) => self.metrics.ended(&self.layout, &id, true),
                Effect::EndedElsewhere(id, s) => self.supervisor.clean_ended(&mut env_of!(self), &id, &s),
                Effect::Unfinished(id) => self.recovery.remember_unfinished(id),
                Effect::ClaimAgain => self.intake.mark_dirty(),
                Effect::SpendReserve(path) => self.storage.spend_reserve(&mut self.w, &path),
            }
        }
    }

    /// May the intake claim now? Not while paused; not while a root
    /// directory is unsafe, space is low, writes are deferred or claims cut
    /// short are unfinished (PROTOCOL §11).
    fn claim_gate(&mut self) -> spool::intake::Gate {
        if self.scheduler.ctl.paused() {
            return spool::intake::Gate::Paused;
        }
        let open = self.storage.dirs_safe(&self.layout)
            && self.storage.room_to_claim(&self.layout, self.cfg.storage.min_free_bytes, &self.w)
            && !self.recovery.has_unfinished();
        if open {
            spool::intake::Gate::Open
        } else {
            spool::intake::Gate::Closed
        }
    }

    /// Start queued runs while slots are free. A runner needs the queued
    /// status on disk (and files of its own): while writes are deferred,
    /// nothing new starts.
    ///
    /// Then the queued runs' `waiting` is brought up to date (PROTOCOL §15).
    fn start_runs(&mut self, out: &mut Vec<Effect>) {
        let mut lanes = self.scheduler.lane_counts(self.supervisor.slots());
        if self.w.is_idle() {
            self.start_some(&mut lanes, out);
        }
        let slots = Slots { lanes: &mut lanes, cfg: &self.cfg };
        self.scheduler.show_waiting(&mut env_of!(self), &slots);
    }

    /// Start queued runs while the global limit and their lanes' leave room.
    fn start_some(&mut self, lanes: &mut std::collections::HashMap<String, usize>, out: &mut Vec<Effect>) {
        while self.scheduler.free_slots(self.supervisor.len(), self.cfg.max_running) > 0 {
            let mut slots = Slots { lanes: &mut *lanes, cfg: &self.cfg };
            let Some(q) = self.scheduler.next_ready(&mut self.watch, &mut slots) else { break };
            match self.supervisor.start(&mut env_of!(self), &q.run_id, out) {
                Start::Started => self.scheduler.started(),
                Start::Retry { message } => {
                    let run_id = q.run_id.clone();
                    let delay = self.scheduler.retry_later(q);
                    tracing::warn!(
                        run_id = %run_id, runner = %self.supervisor.program().describe(), retry_in_ms = delay.as_millis() as u64,
                        "{message}; the run stays queued and the start is retried"
                    );
                    break;
                }
                Start::Failed => {}
            }
        }
    }

    /// The periodic rescan (and the one hints ask for): the spool, the
    /// watcher, queued runs' control inboxes and the active index, in case
    /// events were lost.
    fn rescan(&mut self) {
        tracing::debug!(queued = self.scheduler.len(), running = self.supervisor.len(), "periodic rescan");
        self.intake.mark_dirty();
        // A spool replaced by a symlink must not get a watcher (inotify follows
        // links), nor a runs root replaced by one adopt what it points to.
        let safe = self.storage.dirs_safe(&self.layout);
        if safe && self.watch.spool_replaced() {
            self.watch.replace("the spool directory was replaced");
        }
        let mut out = Vec::new();
        self.scheduler.control_all(&mut env_of!(self), &mut out);
        self.apply(std::mem::take(&mut out));
        let (scheduler, supervisor) = (&self.scheduler, &self.supervisor);
        let known = |id: &str| scheduler.contains(id) || supervisor.knows(id);
        self.recovery.rescan(&mut env_of!(self), safe, &known, &mut out);
        self.apply(out);
    }

    fn write_report(&mut self, force: bool) {
        let facts = self.facts();
        self.metrics.turn(&metrics_view(&self.scheduler, &self.cfg, &self.watch, &facts));
        let mut out = Vec::new();
        self.report.write(&mut env_of!(self), facts, force, &mut out);
        self.apply(out);
    }

    fn facts(&self) -> report::Facts {
        report::Facts {
            runs: RunCounts { queued: self.scheduler.len(), running: self.supervisor.len() },
            queue: {
                let mut q = self.scheduler.ctl.info(self.cfg.max_running);
                let c = self.scheduler.counts();
                (q.by_lane, q.by_reason, q.running_by_lane) =
                    (c.by_lane.clone(), c.by_reason.clone(), c.running_by_lane.clone());
                q
            },
            degraded: self.storage.degraded(&self.w),
            last_rescan_at: self.recovery.last_rescan_at(),
            min_free_bytes: self.cfg.storage.min_free_bytes,
            steward: self.cfg.steward,
        }
    }

    fn shutdown(&mut self) {
        crate::platform::sdnotify::sd_notify("STOPPING=1");
        // daemon.json's updatedAt tells the next daemon until when run ends were seen.
        self.write_report(true);
        // Flush deferred writes for a little while; whatever is left is
        // rebuilt from disk by the next start.
        let until = Instant::now() + Duration::from_secs(3);
        while !self.w.flush() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(200));
        }
        self.supervisor.shutdown();
        let facts = self.facts();
        self.metrics.shutdown(&metrics_view(&self.scheduler, &self.cfg, &self.watch, &facts));
        tracing::info!(running = self.supervisor.len(), queued = self.scheduler.len(), "runspool daemon stopped");
    }
}

/// What the metrics file says besides run ends and claims.
fn metrics_view<'a>(
    s: &'a Scheduler,
    cfg: &'a Config,
    watch: &'a Watch,
    facts: &'a report::Facts,
) -> metrics::View<'a> {
    metrics::View {
        runs: &facts.runs,
        queue: &facts.queue,
        by_lane_reason: &s.counts().by_lane_reason,
        lanes: &cfg.lanes,
        degraded: facts.degraded.is_some(),
        watch_strategy: watch.strategy_name(),
        watch_backend: watch.choice.backend.as_str(),
    }
}
