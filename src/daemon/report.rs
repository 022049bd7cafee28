//! The report part: `runspool/daemon.json` (PROTOCOL §10) and what the
//! service manager hears of the daemon (`STATUS=`, the watchdog's feed,
//! through `platform::sdnotify`). A daemon.json write that waits for room
//! hands the loop an `Effect::SpendReserve` (the storage reserve is the
//! storage part's).

use std::path::Path;
use std::time::{Duration, Instant};

use super::part::{Effect, Env};
use super::watch::{self, Watch};
use crate::config::Config;
use crate::platform::sdnotify::{sd_notify, Watchdog};
use crate::protocol::daemon::{ConfigInfo, DaemonStatus, QueueInfo, RunCounts, StewardInfo, StorageInfo, WatchInfo};
use crate::store::Layout;

/// Run counts in daemon.json and STATUS= lag by at most this much.
const REPORT_EVERY: Duration = Duration::from_millis(250);
/// daemon.json is rewritten at least this often (its `updatedAt` says the daemon lives).
const REPORT_AT_LEAST: Duration = Duration::from_secs(60);

/// The queue objects are equal but for their counts.
fn same_control(a: &Option<QueueInfo>, b: &Option<QueueInfo>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.same_control(b),
        (a, b) => a == b,
    }
}

/// What the rest of the daemon knows that daemon.json reports.
pub struct Facts {
    pub runs: RunCounts,
    pub queue: QueueInfo,
    /// Why storage is `degraded`; None: `ok`.
    pub degraded: Option<String>,
    pub last_rescan_at: Option<i64>,
    pub min_free_bytes: u64,
    /// The configuration's `steward`.
    pub steward: bool,
}

/// The report part: daemon.json as last written, and the systemd watchdog.
pub struct Reporter {
    status: DaemonStatus,
    last_write: Instant,
    /// Counts changed but were written less than REPORT_EVERY ago.
    due: Option<Instant>,
    watchdog: Watchdog,
}

impl Reporter {
    pub fn new(l: &Layout, cfg: &Config, config_path: Option<&Path>, w: &Watch) -> Reporter {
        let pid = std::process::id();
        let now = crate::now_ms();
        let status = DaemonStatus {
            version: 1,
            pid,
            hostname: crate::platform::hostname(),
            start_identity: crate::platform::start_identity(pid),
            started_at: now,
            updated_at: now,
            runspool_version: env!("CARGO_PKG_VERSION").to_string(),
            watch: WatchInfo {
                strategy: w.strategy_name().into(),
                backend: w.choice.backend.into(),
                reason: w.choice.reason.clone(),
                fs_type: watch::fs_type(&l.root),
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
            config: Some(cfg.info(config_path)),
            queue: None,
            steward: Some(StewardInfo { enabled: cfg.steward }),
        };
        Reporter { status, last_write: Instant::now(), due: None, watchdog: Watchdog::new() }
    }

    /// When this daemon started (daemon.json `startedAt`), ms since the epoch.
    pub fn started_at(&self) -> i64 {
        self.status.started_at
    }

    pub fn set_config(&mut self, info: ConfigInfo) {
        self.status.config = Some(info);
    }

    /// Write daemon.json (and STATUS=) when something changed: a change of
    /// storage, watch or queue state at once, run counts at most every
    /// REPORT_EVERY, and at least every minute. `force`: now, whatever changed.
    pub fn write(&mut self, env: &mut Env, facts: Facts, force: bool, out: &mut Vec<Effect>) {
        let watch = &*env.watch;
        let mut r = self.status.clone();
        r.last_rescan_at = facts.last_rescan_at;
        if r.watch.backend != watch.choice.backend.as_str() {
            r.watch.inotify = crate::platform::inotify_usage();
        }
        r.watch.strategy = watch.strategy_name().into();
        r.watch.backend = watch.choice.backend.into();
        r.watch.reason = watch.choice.reason.clone();
        r.runs = facts.runs;
        r.queue = Some(facts.queue);
        r.steward = Some(StewardInfo { enabled: facts.steward });
        let min_free_bytes = Some(facts.min_free_bytes);
        r.storage = match facts.degraded {
            Some(reason) => StorageInfo {
                min_free_bytes,
                state: "degraded".into(),
                since: Some(
                    self.status
                        .storage
                        .since
                        .filter(|_| self.status.storage.state == "degraded")
                        .unwrap_or_else(crate::now_ms),
                ),
                reason: Some(reason),
            },
            None => StorageInfo { state: "ok".into(), reason: None, since: None, min_free_bytes },
        };
        if !force && r.same_as(&self.status) && self.last_write.elapsed() < REPORT_AT_LEAST {
            self.due = None;
            return;
        }
        // Perf: run counts change with every claim and every exit; in a burst,
        // rewriting daemon.json (and STATUS=) each time competed with the
        // runners for the CPU.
        let urgent = r.storage.state != self.status.storage.state
            || r.watch.backend != self.status.watch.backend
            || !same_control(&r.queue, &self.status.queue);
        if !force && !urgent && self.last_write.elapsed() < REPORT_EVERY {
            self.due = Some(self.last_write + REPORT_EVERY);
            return;
        }
        self.due = None;
        sd_notify(&format!(
            "STATUS=watching {}; {} running, {} queued; storage {}",
            r.watch.backend, r.runs.running, r.runs.queued, r.storage.state
        ));
        r.updated_at = crate::now_ms();
        let bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
        let path = env.layout.daemon_json();
        if let Err(e) = env.w.write(&path, bytes, false) {
            tracing::warn!(error = %e, "cannot write daemon.json");
        }
        // A full filesystem must not keep daemon.json saying `ok`: the
        // storage reserve is spent on it (docs/watching-and-storage.md).
        if env.w.pending_for(&path).is_some() {
            out.push(Effect::SpendReserve(path));
        }
        self.status = r;
        self.last_write = Instant::now();
    }

    /// Write daemon.json when due (`write`), and feed the watchdog. It is
    /// fed from the loop itself, so a wedged loop gets restarted.
    pub fn turn(&mut self, env: &mut Env, facts: Facts, out: &mut Vec<Effect>) {
        self.write(env, facts, false, out);
        self.watchdog.feed();
    }

    pub fn next_wake(&self) -> Option<Instant> {
        [Some(self.last_write + REPORT_AT_LEAST), self.due, self.watchdog.next_wake()].into_iter().flatten().min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;

    fn facts(running: usize) -> Facts {
        Facts {
            runs: RunCounts { queued: 0, running },
            queue: QueueInfo::default(),
            degraded: None,
            last_rescan_at: None,
            min_free_bytes: 7,
            steward: false,
        }
    }

    #[test]
    fn daemon_json_says_what_the_daemon_knows_and_counts_wait_for_their_debounce() {
        let mut r = Root::new();
        let mut rep = Reporter::new(&r.layout, &r.cfg, None, &r.watch);
        let mut out = Vec::new();
        rep.write(&mut r.env(), facts(1), true, &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert!(r.w.flush());
        let d = crate::store::daemon_json::read(&r.layout).expect("daemon.json written");
        assert_eq!((d.pid, d.runs.running, d.storage.state.as_str()), (std::process::id(), 1, "ok"));
        assert_eq!(d.storage.min_free_bytes, Some(7));
        assert_eq!(d.started_at, rep.started_at());

        // A new count right after a write waits (at most REPORT_EVERY).
        rep.turn(&mut r.env(), facts(2), &mut out);
        assert!(r.w.flush());
        assert_eq!(crate::store::daemon_json::read(&r.layout).unwrap().runs.running, 1);
        assert!(rep.next_wake().is_some_and(|t| t <= Instant::now() + REPORT_EVERY));
        std::thread::sleep(REPORT_EVERY);
        rep.turn(&mut r.env(), facts(2), &mut out);
        assert!(r.w.flush());
        assert_eq!(crate::store::daemon_json::read(&r.layout).unwrap().runs.running, 2);

        // Storage turning degraded is written at once, with its reason.
        let mut f = facts(2);
        f.degraded = Some("the disk is full".into());
        rep.turn(&mut r.env(), f, &mut out);
        assert!(r.w.flush());
        let d = crate::store::daemon_json::read(&r.layout).unwrap();
        assert_eq!((d.storage.state.as_str(), d.storage.reason.as_deref()), ("degraded", Some("the disk is full")));
        assert!(d.storage.since.is_some());
    }
}
