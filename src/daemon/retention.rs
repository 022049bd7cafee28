//! Retention (PROTOCOL §12): terminal runs other than `paused` older than the
//! limit are removed with their results; the run directory is first renamed
//! to `.runspool-deleting-<uuid>` so a half-removed run never looks like a run.
//! (`.deleting-run-*` and `<root>/async-retention-run-tombstones/` are
//! pi-subagents 0.67's own tombstones: it keeps them 24 h and may rename one
//! back into a run, so runspool never touches them, PROTOCOL §12.)
//!
//! A terminal marker is a hint, never a path (§14): retention removes only a
//! directory directly under the runs root, named by the run-id grammar, that
//! runspool launched, whose status parses and is terminal (not `paused`) and
//! ended before the cutoff. Other hosts' runs and their markers stay as they are.
//!
//! Rejected requests in `spool/rejected/` go by the same limit, with their
//! error files (`store::spool::reject::sweep_rejected`).

use std::path::Path;
use std::time::{Duration, Instant};

use super::part::Env;
use crate::protocol::status::{State, Status, TerminalMarker};
use crate::store::{fsutil, run, Layout, RunId};

/// Retention sweeps at start-up and then this often.
const SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// The retention part: its timer.
pub struct Retention {
    next: Instant,
}

impl Retention {
    /// The first sweep is due at once (start-up).
    pub fn new() -> Retention {
        Retention { next: Instant::now() }
    }

    /// Sweep when due (at start-up, then hourly).
    pub fn turn(&mut self, env: &mut Env) {
        if Instant::now() < self.next {
            return;
        }
        sweep(env.layout, env.cfg.retention_days);
        self.next = Instant::now() + SWEEP_EVERY;
    }

    /// A new `retention_days`: sweep in the next turn.
    pub fn sweep_soon(&mut self) {
        self.next = Instant::now();
    }

    pub fn next_wake(&self) -> Option<Instant> {
        Some(self.next)
    }
}

impl Default for Retention {
    fn default() -> Self {
        Retention::new()
    }
}

/// One sweep: removals cut short, then expired runs and rejected requests.
/// Returns how many were removed.
pub fn sweep(l: &Layout, retention_days: u64) -> usize {
    remove_leftovers(&l.runs());
    if retention_days == 0 {
        return 0;
    }
    let cutoff = crate::now_ms() - (retention_days as i64) * 86_400_000;
    let mut removed = crate::store::spool::reject::sweep_rejected(l, cutoff);
    let Ok(sessions) = std::fs::read_dir(l.terminal()) else { return 0 };
    for sdir in sessions.flatten() {
        if !sdir.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(markers) = std::fs::read_dir(sdir.path()) else { continue };
        for m in markers.flatten() {
            let name = m.file_name().to_string_lossy().into_owned();
            // The name starts with the zero-padded end time: no need to open young markers.
            let Some(ended) = name.get(..16).and_then(|s| s.parse::<i64>().ok()) else { continue };
            if ended >= cutoff || name.starts_with('.') {
                continue;
            }
            let Ok(bytes) = fsutil::read_nofollow(&m.path(), 64 * 1024) else { continue };
            let Ok(marker) = serde_json::from_slice::<TerminalMarker>(&bytes) else { continue };
            let Some((id, s)) = expired(l, &marker, cutoff) else { continue };
            remove_run(l, &id, &s, &m.path());
            removed += 1;
        }
        let _ = std::fs::remove_dir(sdir.path()); // only when empty
    }
    removed
}

/// The status of the run `m` names when retention may remove it, else None.
fn expired(l: &Layout, m: &TerminalMarker, cutoff: i64) -> Option<(RunId, Status)> {
    // The grammar has no `/` and no leading dot: the name cannot leave the runs root.
    let id = RunId::parse(&m.run_id)?;
    let dir = l.run_dir(&id);
    if !std::fs::symlink_metadata(&dir).ok()?.file_type().is_dir() {
        return None;
    }
    // read_status refuses a status that is not this directory's own.
    let s = run::read_status(&dir).ok()??;
    let ok = run::ownership(&dir, Some(&s)).is_ours()
        && !s.state.is_active()
        && s.state != State::Paused
        && s.ended_at.is_some_and(|e| e < cutoff);
    ok.then_some((id, s))
}

pub use crate::store::results::{remove_run, TOMBSTONE_PREFIX};

/// Finish removals cut short by a crash.
fn remove_leftovers(runs: &Path) {
    let Ok(rd) = std::fs::read_dir(runs) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // A staging directory may be a client's at work (`runspool stop` of a
        // pending request builds its rejected run there): it is a leftover when
        // its builder (the pid in its name) is gone, or when it is old.
        let staging = name.strip_prefix(crate::store::spool::reject::STAGING_PREFIX);
        let builder_gone = || {
            staging
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| pid != std::process::id() && !crate::platform::pid_alive(pid))
        };
        let old = || {
            e.metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a.as_secs() >= 60)
        };
        let ours = name.starts_with(TOMBSTONE_PREFIX) || (staging.is_some() && (builder_gone() || old()));
        if ours && e.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;

    #[test]
    fn retention_sweeps_at_its_first_turn_then_only_when_due() {
        let mut r = Root::new();
        let runs = r.layout.runs();
        let tombstone = |n: &str| runs.join(format!("{TOMBSTONE_PREFIX}{n}"));
        std::fs::create_dir(tombstone("a")).unwrap();
        let mut ret = Retention::new();
        assert!(ret.next_wake().is_some_and(|t| t <= Instant::now()));
        ret.turn(&mut r.env());
        assert!(!tombstone("a").exists(), "a removal cut short is finished at the first sweep");
        assert!(ret.next_wake().is_some_and(|t| t > Instant::now() + Duration::from_secs(3000)));

        std::fs::create_dir(tombstone("b")).unwrap();
        ret.turn(&mut r.env());
        assert!(tombstone("b").exists(), "not due: no sweep");
        ret.sweep_soon();
        ret.turn(&mut r.env());
        assert!(!tombstone("b").exists());
    }
}
