//! The steward (PROTOCOL §14.1): a pi-subagents run whose runner died while
//! no pi host was open stays `running` for ever, because only pi hosts
//! reconcile runs, and only while they run. The daemon stands in for such a
//! host, and only the way the host itself would: for runs it did not claim,
//! it applies pi-subagents 0.67.0's own `reconcileAsyncRun` (see
//! `reconcile.rs`) and writes the bytes 0.67 writes.
//!
//! A run is repaired only after two looks at least `confirm` apart (30 s)
//! found it in a case 0.67 repairs with status.json unchanged in between.
//! The steward never signals a process: `kill(pid, 0)` only asks the kernel
//! whether the pid exists. `steward = false` in the configuration turns it
//! off.

mod reconcile;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::part::Env;
use crate::store::layout::RunPaths;
use crate::store::{fsutil, run, RunId};
pub use reconcile::{Case, Liveness};

/// Test only: the confirmation delay in ms instead of 30 s.
pub const CONFIRM_ENV: &str = "RUNSPOOL_STEWARD_CONFIRM_MS";
/// Test only: a fixed clock (ms since the epoch) for the steward's decisions
/// and the times it writes, so a test can compare its bytes with 0.67's.
pub const NOW_ENV: &str = "RUNSPOOL_STEWARD_NOW_MS";

const DEFAULT_CONFIRM: Duration = Duration::from_secs(30);
/// Largest status.json the steward reads.
const MAX_STATUS_BYTES: u64 = 16 * 1024 * 1024;

/// What one look saw of a run in a case 0.67 repairs.
struct Seen {
    since: Instant,
    fingerprint: [u8; 32],
}

pub struct Steward {
    confirm: Duration,
    every: Duration,
    fixed_now: Option<i64>,
    next_look: Instant,
    seen: HashMap<RunId, Seen>,
}

impl Default for Steward {
    fn default() -> Self {
        Steward::new()
    }
}

impl Steward {
    pub fn new() -> Steward {
        let confirm = std::env::var(CONFIRM_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_CONFIRM);
        let fixed_now = std::env::var(NOW_ENV).ok().and_then(|v| v.trim().parse::<i64>().ok());
        // Three looks per confirmation delay: a run is repaired at most
        // about a third of it after it could be.
        let every = (confirm / 3).clamp(Duration::from_millis(100), Duration::from_secs(10));
        Steward { confirm, every, fixed_now, next_look: Instant::now(), seen: HashMap::new() }
    }

    fn now_ms(&self) -> i64 {
        self.fixed_now.unwrap_or_else(crate::now_ms)
    }

    pub fn next_wake(&self, enabled: bool) -> Option<Instant> {
        enabled.then_some(self.next_look)
    }

    /// One look at every active run of the index that runspool did not claim.
    pub fn turn(&mut self, env: &mut Env) {
        if !env.cfg.steward {
            self.seen.clear();
            return;
        }
        let now = Instant::now();
        if now < self.next_look {
            return;
        }
        self.next_look = now + self.every;
        let Ok(rd) = std::fs::read_dir(env.layout.active()) else { return };
        let mut looked = HashSet::new();
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let Some(id) = e.file_name().to_str().and_then(RunId::parse) else { continue };
            self.look(env, &id, now);
            // Only what `seen` may keep: not every queued run of a backlog.
            if self.seen.contains_key(&id) {
                looked.insert(id);
            }
        }
        self.seen.retain(|id, _| looked.contains(id));
    }

    fn look(&mut self, env: &mut Env, id: &RunId, now: Instant) {
        let dir = env.layout.run_dir(id);
        // runspool's own runs are supervised by their runner lock (§12).
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) || run::claimed(&dir) {
            self.seen.remove(id);
            return;
        }
        let Ok(bytes) = fsutil::read_nofollow(&RunPaths::status(&dir), MAX_STATUS_BYTES) else {
            self.seen.remove(id);
            return;
        };
        let r = reconcile::Run { layout: env.layout, id };
        let repair = match reconcile::plan(&r, &bytes, self.now_ms() as f64, reconcile::kill0) {
            reconcile::Verdict::Leave(why) => {
                if self.seen.remove(id).is_some() {
                    tracing::debug!(run_id = %id, "steward: no longer a run to reconcile: {why}");
                }
                return;
            }
            reconcile::Verdict::Repair(repair) => repair,
        };
        let fingerprint: [u8; 32] = Sha256::digest(&bytes).into();
        match self.seen.get(id) {
            Some(s) if s.fingerprint == fingerprint && now.duration_since(s.since) >= self.confirm => {}
            Some(s) if s.fingerprint == fingerprint => return,
            _ => {
                tracing::debug!(
                    run_id = %id, case = repair.case.as_str(), confirm_ms = self.confirm.as_millis() as u64,
                    "steward: a pi-subagents run 0.67 would reconcile; looking again before acting"
                );
                self.seen.insert(id.clone(), Seen { since: now, fingerprint });
                return;
            }
        }
        self.seen.remove(id);
        // The last moment to notice a host that came back and wrote the status.
        let again = fsutil::read_nofollow(&RunPaths::status(&dir), MAX_STATUS_BYTES).unwrap_or_default();
        if again != bytes {
            tracing::debug!(run_id = %id, "steward: status.json changed just before the repair; looking again");
            return;
        }
        match repair.write(&r) {
            Ok(()) => tracing::info!(
                run_id = %id, case = repair.case.as_str(), state = %repair.state,
                "steward: reconciled a pi-subagents run whose runner is gone, as pi-subagents 0.67 would"
            ),
            Err(e) => tracing::warn!(
                run_id = %id, case = repair.case.as_str(), error = %e,
                "steward: the reconciliation stopped part way, where pi-subagents 0.67 would stop too"
            ),
        }
    }
}
