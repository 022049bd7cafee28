//! The daemon's health as the CLI sees it, and `runspool status` without a
//! run: the typed daemon.json (`DaemonStatus`), checked against the lock,
//! the clock and the filesystem itself. `doctor` builds its checks on it.

use std::path::Path;

use serde_json::json;

use super::text::visible;
use crate::protocol::daemon::{DaemonStatus, QueueInfo};
use crate::store::queue;
use crate::store::{fsutil, Layout};

/// daemon.json is rewritten at least every 60 s (PROTOCOL §10): older than
/// three such periods while the daemon holds its lock, its loop is not
/// turning (stopped, stuck, or unable to write anything).
pub const STALE_AFTER_MS: i64 = 180_000;

/// `runspool status` exit codes (besides 1 for an error).
pub const EXIT_NOT_RUNNING: i32 = 3;
pub const EXIT_DEGRADED: i32 = 4;
pub const EXIT_UNRESPONSIVE: i32 = 5;

/// The free-space floor when neither daemon.json nor the config names one
/// (the config's default `storage.min_free_bytes`).
pub(crate) const DEFAULT_MIN_FREE: u64 = 16 << 20;

/// The daemon's health: daemon.json, checked against the lock, the clock and
/// the filesystem itself.
pub(crate) struct Health {
    pub alive: bool,
    /// daemon.json as the last daemon wrote it (also when none runs now).
    pub daemon: Option<DaemonStatus>,
    /// How old daemon.json is, when the daemon holds its lock and the file
    /// is older than `STALE_AFTER_MS`.
    pub stale_ms: Option<i64>,
    /// Candidate requests (`*.json`) in the spool.
    pub spool_waiting: usize,
    pub storage_state: String,
    pub storage_reason: Option<String>,
}

impl Health {
    /// `config_min`: the config's `storage.min_free_bytes`, used when
    /// daemon.json does not name the daemon's own floor.
    pub fn read(layout: &Layout, config_min: Option<u64>) -> Health {
        let alive = fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false);
        let daemon = read_report_nofollow(layout);
        let d = daemon.as_ref().filter(|_| alive);
        let stale_ms = d.map(|d| crate::now_ms() - d.updated_at).filter(|age| *age > STALE_AFTER_MS);
        // The CLI's own statvfs: a daemon that could not write `degraded` (a
        // 100% full disk) must not make a full disk look fine.
        let min = d.and_then(|d| d.storage.min_free_bytes).or(config_min).unwrap_or(DEFAULT_MIN_FREE);
        let own = crate::store::fsutil::space_shortage(root_or_slash(layout), min);
        let daemon_reason = d.and_then(|d| d.storage.reason.clone());
        let (storage_state, storage_reason) = match (d.map(|d| d.storage.state.as_str()), own) {
            (Some(s), _) if s != "ok" => (s.to_string(), daemon_reason),
            (_, Some(why)) => ("degraded".to_string(), Some(why)),
            (s, None) => (s.unwrap_or("ok").to_string(), daemon_reason),
        };
        Health { alive, daemon, stale_ms, spool_waiting: spool_waiting(layout), storage_state, storage_reason }
    }

    /// The report of the daemon that runs now: None when none holds the lock.
    pub fn running_report(&self) -> Option<&DaemonStatus> {
        self.daemon.as_ref().filter(|_| self.alive)
    }

    fn running(&self) -> bool {
        self.running_report().is_some()
    }

    fn pid(&self) -> String {
        self.daemon.as_ref().map(|d| d.pid.to_string()).unwrap_or_else(|| "?".into())
    }

    /// One line on an unresponsive daemon: how old daemon.json is and what waits.
    pub fn unresponsive(&self) -> Option<String> {
        let age = self.stale_ms?;
        let n = self.spool_waiting;
        Some(format!(
            "unresponsive (pid {}): daemon.json was last rewritten {} s ago (it is rewritten at least every 60 s; unresponsive after {} s); {n} request{} waiting in the spool",
            self.pid(),
            age / 1000,
            STALE_AFTER_MS / 1000,
            if n == 1 { "" } else { "s" },
        ) + if self.storage_state == "ok" {
            ""
        } else {
            "; storage is degraded, which may be what keeps it from rewriting daemon.json"
        })
    }

    pub fn fix(&self) -> String {
        let pid = self.pid();
        format!(
            "see its log (journalctl --user -u runspool), resume it if it was stopped (kill -CONT {pid}), or restart it (systemctl --user restart runspool, or kill {pid} and start `runspool daemon`)"
        )
    }

    fn storage_text(&self) -> String {
        format!(
            "{}{}",
            self.storage_state,
            self.storage_reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        )
    }

    fn exit_code(&self) -> i32 {
        if !self.running() {
            EXIT_NOT_RUNNING
        } else if self.stale_ms.is_some() {
            EXIT_UNRESPONSIVE
        } else if self.storage_state != "ok" {
            EXIT_DEGRADED
        } else {
            0
        }
    }
}

/// The root, or `/` before the root exists: where free space and the
/// filesystem kind are measured.
pub(crate) fn root_or_slash(layout: &Layout) -> &Path {
    if layout.root.exists() {
        layout.root.as_path()
    } else {
        Path::new("/")
    }
}

/// Requests waiting in the spool: `*.json` entries that are not dot names.
fn spool_waiting(layout: &Layout) -> usize {
    let Ok(rd) = std::fs::read_dir(layout.spool()) else { return 0 };
    rd.flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            !n.starts_with('.') && n.ends_with(".json") && e.file_type().is_ok_and(|t| t.is_file())
        })
        .count()
}

/// The `watch` line: `strategy (backend): reason`.
pub(crate) fn watch_text(d: &DaemonStatus) -> String {
    format!("{} ({}): {}", d.watch.strategy, d.watch.backend, d.watch.reason)
}

/// The `steward` line: whether the daemon reconciles pi-subagents runs
/// whose runner is gone (PROTOCOL §14.1).
pub(crate) fn steward_text(d: &DaemonStatus) -> String {
    match &d.steward {
        Some(s) if s.enabled => "on: pi-subagents runs whose runner is gone are reconciled as pi-subagents 0.67 would \
                                 (`steward = false` in the config turns it off)"
            .into(),
        Some(_) => "off (`steward = false` in the config): pi-subagents runs whose runner is gone stay `running` \
                    until a pi host reconciles them"
            .into(),
        None => "not reported (the daemon predates the steward)".into(),
    }
}

/// `runspool status` with no run: the daemon's own status. Exit codes: 0
/// healthy, 3 not running, 4 storage degraded, 5 unresponsive.
pub fn daemon_status(layout: &Layout, as_json: bool) -> anyhow::Result<i32> {
    let config_min = crate::config::Config::load(None).ok().map(|c| c.storage.min_free_bytes);
    let h = Health::read(layout, config_min);
    let code = h.exit_code();
    if as_json {
        let v = json!({
            "alive": h.alive,
            "daemon": h.daemon,
            "responsive": h.running() && h.stale_ms.is_none(),
            "staleMs": h.stale_ms,
            "spoolWaiting": h.spool_waiting,
            "storage": {"state": h.storage_state, "reason": h.storage_reason},
            "queue": h.running_report().map(|d| &d.queue),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(code);
    }
    match h.running_report() {
        Some(d) => {
            match h.unresponsive() {
                Some(why) => {
                    println!("daemon    {}", visible(&why.to_string()));
                    println!("fix       {}", visible(&h.fix().to_string()));
                }
                None => println!("daemon    running (pid {}, version {})", d.pid, visible(&d.runspool_version)),
            }
            // daemon.json's words, like a run's: never a terminal escape from them.
            println!("root      {}", layout.root.display());
            println!("watch     {}", visible(&watch_text(d)));
            println!("storage   {}", visible(&h.storage_text()));
            println!(
                "runs      {} running, {} queued, {} pending in the spool",
                d.runs.running, d.runs.queued, h.spool_waiting
            );
            println!("steward   {}", steward_text(d));
            if let Some(line) = d.queue.as_ref().map(describe_report) {
                println!("queue     {}", visible(&line));
            }
        }
        None => {
            println!("daemon    not running on {} (start it with `runspool daemon`)", layout.root.display());
            if h.spool_waiting > 0 {
                println!("runs      {} pending in the spool (claimed when a daemon starts)", h.spool_waiting);
            }
            if let Some(line) = describe_file(layout) {
                println!("queue     {}", visible(&line));
            }
        }
    }
    Ok(code)
}

/// The `queue` line of `runspool status` (and `doctor`) from daemon.json's `queue`.
pub(crate) fn describe_report(q: &QueueInfo) -> String {
    let mut s = if q.paused {
        let mut s = "paused".to_string();
        if let Some(since) = q.since {
            let secs = (crate::now_ms() - since).max(0) / 1000;
            s.push_str(&format!(" for {secs}s"));
        }
        if let Some(r) = &q.reason {
            s.push_str(&format!(" ({r})"));
        }
        s.push_str(", nothing claimed or started until `runspool resume`");
        s
    } else {
        "accepting".to_string()
    };
    let max = q.max_running;
    match q.max_running_override {
        Some(_) => s.push_str(&format!("; max-running {max} (override; `runspool max-running --clear`)")),
        None => s.push_str(&format!("; max-running {max} (config)")),
    }
    if let Some(e) = &q.error {
        s.push_str(&format!("; queue file ignored: {e}"));
    }
    s
}

/// daemon.json as the daemon wrote it, read the way a file others could
/// replace is read (bounded, never through a link).
pub(crate) fn read_report_nofollow(layout: &Layout) -> Option<DaemonStatus> {
    crate::store::daemon_json::read(layout)
}

/// The `queue` line of `runspool status` with no daemon: what the file says.
pub fn describe_file(layout: &Layout) -> Option<String> {
    match queue::read(&queue::path(layout)) {
        Ok(Some(q)) if q.paused || q.max_running.is_some() => Some(format!(
            "{}{} (applies when the daemon starts)",
            if q.paused { "paused" } else { "accepting" },
            q.max_running.map(|n| format!("; max-running {n}")).unwrap_or_default()
        )),
        Ok(_) => None,
        Err(e) => Some(format!("queue file ignored: {e}")),
    }
}
