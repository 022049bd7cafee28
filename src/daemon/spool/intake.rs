//! The intake part of the daemon: when to look at the spool, the backlog
//! of a listing worked off a slice per turn, and the claims' active markers.

use std::collections::VecDeque;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use super::{classify_name, Claimer, Grace, Name, Outcome};
use crate::daemon::part::{Effect, Env};
use crate::protocol::request::{Rejection, RejectionCode};
use crate::store::fsutil::is_capacity;
use crate::store::spool::reject::reject_entry;

/// Most claims per loop turn, so a flood of requests never starves the
/// scheduler and the liveness checks.
const CLAIMS_PER_TURN: usize = 256;
/// Busy or half-written entries are looked at again after this.
const RETRY_BUSY: Duration = Duration::from_millis(500);
/// A spool that cannot be listed (EMFILE, being replaced) is listed again after this.
const RETRY_LISTING: Duration = Duration::from_secs(1);

/// May the intake claim now (decided by the loop from the queue control,
/// the root's safety and the storage)?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Open,
    /// The queue is paused: requests stay in the spool until `resume`.
    Paused,
    /// Unsafe directories, low space, deferred writes or unfinished claims:
    /// look again when that changes.
    Closed,
}

pub struct Intake {
    /// Something may have changed in the spool since the last look.
    dirty: bool,
    /// The rest of the last listing, oldest first.
    backlog: VecDeque<String>,
    grace: Grace,
    retry_at: Option<Instant>,
    /// Claimed in this turn: their active markers follow the start of runners.
    claimed: Vec<crate::store::RunId>,
    pending: crate::store::deps::PendingIds,
    /// Milliseconds from publication to claim of the runs claimed since the
    /// last `take_latencies` (kept only while a metrics file is configured).
    latencies: Vec<u64>,
}

impl Default for Intake {
    fn default() -> Self {
        Intake {
            dirty: true,
            backlog: VecDeque::new(),
            grace: Grace::default(),
            retry_at: None,
            claimed: Vec::new(),
            pending: Default::default(),
            latencies: Vec::new(),
        }
    }
}

impl Intake {
    pub fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Should this turn look at the spool?
    pub fn due(&mut self, now: Instant) -> bool {
        if self.retry_at.is_some_and(|t| now >= t) {
            self.dirty = true;
        }
        self.dirty
    }

    pub fn next_wake(&self) -> Option<Instant> {
        if self.dirty {
            return Some(Instant::now());
        }
        self.retry_at
    }

    /// Claim from the spool. One listing (sorted oldest first) feeds a
    /// backlog that is worked off `CLAIMS_PER_TURN` entries per turn, so a
    /// flood of 20,000 files costs one readdir, not one per turn, and the
    /// scheduler and liveness checks still run in between. Claimed runs go
    /// out as `Effect::Queue`, claims cut short after their commit as
    /// `Effect::Unfinished`.
    pub fn turn(&mut self, env: &mut Env, gate: Gate, out: &mut Vec<Effect>) {
        self.dirty = false;
        match gate {
            Gate::Paused => {
                // `resume` marks the spool dirty again.
                self.retry_at = None;
                return;
            }
            Gate::Closed => return,
            Gate::Open => {}
        }
        let fresh = self.backlog.is_empty();
        if fresh && !self.list(env) {
            return; // retried at retry_at
        }
        let (mut later, mut capacity, mut unfinished) = (false, false, false);
        let mut done = 0;
        while done < CLAIMS_PER_TURN {
            let Some(name) = self.backlog.pop_front() else { break };
            let mut claimer = Claimer {
                layout: env.layout,
                w: &mut *env.w,
                ctx: env.cfg,
                grace: &mut self.grace,
                pending: &mut self.pending,
            };
            match claimer.process(&name) {
                Outcome::Claimed(id, s) => {
                    done += 1;
                    if env.cfg.metrics_file.is_some() {
                        self.latencies.extend(claim_latency(env, &id, s.queue.claimed_at));
                    }
                    self.claimed.push(id.clone());
                    out.push(Effect::Queue(id, s));
                    if !env.w.is_idle() {
                        // Its status is only in memory: stop claiming until storage recovers.
                        later = true;
                        break;
                    }
                }
                Outcome::Rejected => done += 1,
                Outcome::Later => later |= classify_name(&name) == Name::Candidate,
                Outcome::Unfinished { run_id, error } => {
                    tracing::warn!(
                        run_id = %run_id, request = %name, error = %error,
                        "claimed, but the queued status could not be written: finishing the run by its directory, claiming paused meanwhile"
                    );
                    if is_capacity(&error) {
                        env.w.capacity_error(&env.layout.run_dir(&run_id), &error);
                        capacity = true;
                    }
                    out.push(Effect::Unfinished(run_id));
                    (later, unfinished) = (true, true);
                    break;
                }
                Outcome::Capacity(e) => {
                    tracing::warn!(request = %name, error = %e, "capacity error while claiming: claiming paused until storage recovers");
                    env.w.capacity_error(&env.layout.spool().join(&name), &e);
                    self.backlog.push_front(name);
                    (later, capacity) = (true, true);
                    break;
                }
            }
        }
        if !capacity && !unfinished {
            env.w.outside_ok();
        }
        if !self.backlog.is_empty() && env.w.is_idle() {
            self.dirty = true;
        }
        if later {
            self.retry_at = Some(Instant::now() + RETRY_BUSY);
        } else if fresh {
            self.retry_at = None;
        }
    }

    /// List the spool into the backlog; false when it cannot be listed now.
    fn list(&mut self, env: &mut Env) -> bool {
        let spool = env.layout.spool();
        let rd = match std::fs::read_dir(&spool) {
            Ok(rd) => rd,
            Err(e) => {
                // Capacity (EMFILE) or a spool being replaced: list again shortly.
                tracing::warn!(spool = %spool.display(), error = %e, "cannot list the spool; retrying");
                if is_capacity(&e) {
                    env.w.capacity_error(&spool, &e);
                }
                self.retry_at = Some(Instant::now() + RETRY_LISTING);
                return false;
            }
        };
        let mut names: Vec<(i64, String)> = Vec::new();
        for e in rd.flatten() {
            let Ok(name) = e.file_name().into_string() else {
                // A non-UTF-8 name is a bad name too; handle it by its lossy form.
                let lossy = e.file_name().to_string_lossy().replace('\u{FFFD}', "_");
                let why = Rejection::new(
                    RejectionCode::BadName,
                    "the file name is not valid UTF-8; use <name>.json with <name> matching [A-Za-z0-9][A-Za-z0-9._-]{0,199}",
                );
                let _ = reject_entry(env.w, env.layout, &e.path(), &lossy, &why, None, None);
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
        self.backlog = names.into_iter().map(|(_, n)| n).collect();
        true
    }

    /// The claim latencies gathered since the last call.
    pub fn take_latencies(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.latencies)
    }

    /// Active markers for the runs claimed in this turn, after the loop has
    /// started those that found a slot: the runner's start-up overlaps with
    /// the marker's creation instead of waiting for it.
    pub fn mark_claimed(&mut self, env: &mut Env) {
        for id in std::mem::take(&mut self.claimed) {
            if let Err(e) = super::mark_claimed(env.w, env.layout, &id) {
                tracing::warn!(run_id = %id, error = %e, "could not create the active marker; the next daemon start repairs it");
            }
        }
    }
}

/// Milliseconds from the publication of run `id`'s request (the spool
/// file's mtime, which the claim's rename kept on request.json) to its claim.
fn claim_latency(env: &Env, id: &crate::store::RunId, claimed_at: i64) -> Option<u64> {
    let md = std::fs::symlink_metadata(crate::store::layout::RunPaths::request(&env.layout.run_dir(id))).ok()?;
    let published = md.mtime() * 1000 + md.mtime_nsec() / 1_000_000;
    Some((claimed_at - published).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;
    use crate::protocol::status::State;

    #[test]
    fn a_paused_gate_claims_nothing_and_an_open_one_queues_the_request() {
        let mut r = Root::new();
        let id = r.drop_request("intake-1", "true");
        let mut intake = Intake::default();
        let mut out = Vec::new();
        assert!(intake.due(Instant::now()), "a new intake looks at the spool at once");
        intake.turn(&mut r.env(), Gate::Paused, &mut out);
        assert!(out.is_empty(), "paused: {out:?}");
        assert!(r.layout.spool().join("intake-1.json").exists(), "a paused queue leaves the request in the spool");
        assert!(!r.layout.run_dir(&id).exists());

        intake.mark_dirty();
        intake.turn(&mut r.env(), Gate::Open, &mut out);
        assert!(matches!(&out[..], [Effect::Queue(q, s)] if *q == id && s.state == State::Queued), "{out:?}");
        assert!(!r.layout.spool().join("intake-1.json").exists(), "the claim takes the request out of the spool");
        assert_eq!(r.status(&id).state, State::Queued);
        // The active marker follows the claim (after the runner's start).
        intake.mark_claimed(&mut r.env());
        assert!(r.w.flush());
        assert!(r.layout.active_marker(&id).exists());
    }

    #[test]
    fn a_bad_request_is_rejected_next_to_the_spool_and_not_queued() {
        let mut r = Root::new();
        std::fs::write(r.layout.spool().join("bad-1.json"), b"{\"version\": 1}").unwrap();
        // Old enough to be past the write grace of a file that does not parse.
        let old = std::time::SystemTime::now() - Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(r.layout.spool().join("bad-1.json"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        let mut intake = Intake::default();
        let mut out = Vec::new();
        intake.turn(&mut r.env(), Gate::Open, &mut out);
        assert!(out.iter().all(|e| !matches!(e, Effect::Queue(..))), "{out:?}");
        assert!(!r.layout.spool().join("bad-1.json").exists());
        let rejected: Vec<String> = std::fs::read_dir(r.layout.rejected())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(rejected.iter().any(|n| n.starts_with("bad-1")), "{rejected:?}");
    }
}
