//! Start-up: check the root, take the daemon lock, start the watcher, and
//! rebuild the parts' state from disk (PROTOCOL §1, §12).

use std::fs::File;
use std::path::Path;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use super::hint::{forward_signals, Hint};
use super::recovery::Recovery;
use super::storage::Storage;
use super::supervisor::{RunnerProgram, Supervisor};
use super::watch::Watch;
use super::{bridge, hooks, report, retention, spool, Daemon, Options, StartError};
use crate::config::Config;
use crate::store::{fsutil, Layout, Writer};

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StartError + '_ {
    move |error| StartError::Io { path: path.display().to_string(), error }
}

impl Daemon {
    pub fn start(opts: Options) -> Result<Daemon, StartError> {
        // Signals become hints for the loop before anything can see this
        // daemon (daemon.json): a SIGHUP sent as soon as it appears is a
        // reload, not the signal's default action (exit).
        let (tx, rx) = channel::<Hint>();
        forward_signals(tx.clone()).map_err(StartError::Signals)?;
        let cfg = Config::load(opts.config.as_deref())?;
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
        let mut watch =
            Watch::start(&layout, tx.clone(), cfg.watch.strategy, Duration::from_millis(cfg.watch.poll_interval_ms))
                .map_err(StartError::Watch)?;
        // queue.json changes wake the loop (Hint::Queue); each turn re-checks it with one lstat.
        watch.add(&layout.daemon_dir());
        let (previous_start, previous_seen) =
            crate::store::daemon_json::read(&layout).map(|d| (d.started_at, d.updated_at)).unwrap_or((0, 0));
        let exe = std::env::current_exe().map_err(|e| StartError::Io { path: "/proc/self/exe".into(), error: e })?;
        let mut d = Daemon {
            report: report::Reporter::new(&layout, &cfg, opts.config.as_deref(), &watch),
            recovery: Recovery::new(previous_start, previous_seen, Duration::from_secs(cfg.watch.rescan_interval_s)),
            supervisor: Supervisor::new(RunnerProgram::find(&exe).forking(tx.clone())),
            scheduler: Default::default(),
            intake: spool::intake::Intake::default(),
            storage: Storage::new(&layout),
            providers: crate::providers::build_all(&cfg),
            bridge: bridge::Bridge::new(tx.clone()),
            hooks: hooks::Hooks::new(&layout),
            steward: super::steward::Steward::new(),
            metrics: super::metrics::Metrics::new(None, 0),
            retention: retention::Retention::new(),
            layout,
            cfg,
            config_path: opts.config,
            root_override,
            w: Writer::new(),
            _lock: lock,
            tx,
            rx,
            watch,
            watch_failed: None,
            stopping: false,
        };
        crate::providers::check_in_background(&d.providers);
        d.metrics = super::metrics::Metrics::new(d.cfg.metrics_file.clone(), d.report.started_at());
        d.scheduler.ctl.check(&d.layout, d.cfg.max_running);
        // The storage reserve, before daemon.json needs it.
        let mut out = Vec::new();
        d.storage.turn(&mut env_of!(d), &mut out);
        d.apply(out);
        d.write_report(true);
        d.recover();
        // The re-adopted counts at once, not after the report debounce.
        d.write_report(true);
        d.retention.turn(&mut env_of!(d));
        tracing::info!(
            root = %d.layout.root.display(), watch = d.watch.choice.backend.as_str(),
            queued = d.scheduler.len(), running = d.supervisor.len(),
            runner = %d.supervisor.program().path.display(), "runspool daemon started"
        );
        Ok(d)
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
        let holder = crate::store::daemon_json::read(layout);
        let pid = holder.as_ref().map(|d| d.pid);
        let alive = pid.is_some_and(|pid| {
            let recorded = holder.as_ref().and_then(|d| d.start_identity.as_deref());
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
