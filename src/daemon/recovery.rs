//! Recovery: rebuild what the daemon knows from disk (PROTOCOL §12). At
//! start-up the live runs of the active index; then every run directory, a
//! slice per turn; claims cut short after their commit, retried until they
//! are finished; and the periodic rescan of the active index. Runs it finds
//! go out as effects (`Queue`, `Adopt`); runs of other hosts are only noted
//! for the bridge (§14).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::part::{Effect, Env};
use crate::protocol::status::{State, Status};
use crate::store::fsutil::{self, is_capacity};
use crate::store::layout::RunPaths;
use crate::store::repaired::ensure_published_status;
use crate::store::spool;
use crate::store::spool::claimed;
use crate::store::{index, run, RunId};

/// A run that ended up to this long before the previous daemon's last sign
/// of life may not have been settled (and logged) by it: its end is logged
/// again rather than never (a runner is reaped within a second of its end,
/// and daemon.json follows within 250 ms).
const UNSEEN_MARGIN_MS: i64 = 2_000;

/// Run directories checked per loop turn after start-up.
const RECOVER_PER_TURN: usize = 1000;
/// Unfinished claims and a failed listing are retried this often.
const RETRY: Duration = Duration::from_secs(1);

pub struct Recovery {
    /// Run directories still to be checked after start-up.
    backlog: Vec<RunId>,
    /// The listing of run directories failed: retry it at this time.
    unlisted: Option<Instant>,
    /// Committed claims whose queued status could not be written yet, by
    /// run id (their spool names are gone).
    unfinished: Vec<RunId>,
    unfinished_retry_at: Instant,
    /// When the previous daemon on this root started (0: unknown): only
    /// directories changed since then can hold a fresh temp file.
    previous_start: i64,
    /// The previous daemon's last daemon.json write (0: unknown): runs that
    /// ended after it (less `UNSEEN_MARGIN_MS`) may have ended unseen.
    previous_seen: i64,
    next_rescan: Instant,
    rescan_every: Duration,
    last_rescan_at: Option<i64>,
    /// Active runs of other hosts (pi-subagents) found in the active index:
    /// read-only to runspool (§14), but their bridge requests are serviced.
    foreign: HashSet<RunId>,
}

/// What recovery does with one run directory (`decide`, pure).
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Another host's active run: its bridge only.
    Foreign,
    /// Not ours and not active: a rejection of ours may need its publication finished.
    Rejection,
    /// Not ours, or nothing to read: left alone.
    Leave,
    /// Claimed, with no status yet: finish the claim.
    HalfClaimed,
    /// Ours and queued or running: supervise it.
    Queued,
    Running,
    /// Ours and ended: make sure it is published.
    Ended,
}

/// Recovery's decision for a run directory, from what it holds: whether
/// runspool claimed it (`request.json`), whether it has a status, and that
/// status's state and ownership.
fn decide(claimed: bool, status: Option<&Status>, rejection: bool) -> Verdict {
    match (claimed, status) {
        (false, Some(s)) if s.state.is_active() => Verdict::Foreign,
        (false, Some(_)) if rejection => Verdict::Rejection,
        (false, _) => Verdict::Leave,
        (true, None) => Verdict::HalfClaimed,
        (true, Some(s)) => match s.state {
            State::Queued => Verdict::Queued,
            State::Running => Verdict::Running,
            _ => Verdict::Ended,
        },
    }
}

impl Recovery {
    pub fn new(previous_start: i64, previous_seen: i64, rescan_every: Duration) -> Recovery {
        Recovery {
            backlog: Vec::new(),
            unlisted: None,
            unfinished: Vec::new(),
            unfinished_retry_at: Instant::now(),
            previous_start,
            previous_seen,
            next_rescan: Instant::now() + rescan_every,
            rescan_every,
            last_rescan_at: None,
            foreign: HashSet::new(),
        }
    }

    /// Start-up: finish interrupted rejections, sweep temps, and recover the
    /// runs of the active index at once (the daemon is ready once they are
    /// adopted). Every other run directory (half-done claims, terminal runs
    /// whose publication was cut short, active runs whose marker was lost) is
    /// checked in slices from the loop (`turn`), so start-up does not grow
    /// with the number of finished runs kept on disk.
    pub fn start(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        spool::reject::recover_rejected(env.w, env.layout, env.cfg, self.previous_start - 60_000);
        sweep_shared_temps(env);
        for id in run_names(&env.layout.active(), false).unwrap_or_default() {
            self.recover_run(env, &id, out);
        }
        self.list_backlog(env);
    }

    /// The loop's turn: retry a failed listing, check the next slice of run
    /// directories (those `known` to the daemon already are skipped), and
    /// retry unfinished claims.
    pub fn turn(&mut self, env: &mut Env, known: &dyn Fn(&str) -> bool, out: &mut Vec<Effect>) {
        let now = Instant::now();
        if self.unlisted.is_some_and(|t| now >= t) {
            self.list_backlog(env);
        }
        if !self.backlog.is_empty() {
            for _ in 0..RECOVER_PER_TURN {
                let Some(id) = self.backlog.pop() else { break };
                if !known(&id) {
                    self.recover_run(env, &id, out);
                }
            }
            if self.backlog.is_empty() {
                self.backlog = Vec::new(); // give the names' memory back
                tracing::debug!("start-up check of every run directory done");
            }
        }
        if !self.unfinished.is_empty() && now >= self.unfinished_retry_at {
            self.retry_unfinished(env, out);
        }
    }

    /// The run directories for `turn`. A listing that fails (EMFILE at
    /// start-up) is retried every second: a half-claimed run must not wait
    /// for the next daemon start.
    fn list_backlog(&mut self, env: &mut Env) {
        let runs = env.layout.runs();
        match run_names(&runs, true) {
            Ok(names) => {
                self.backlog = names;
                if self.unlisted.take().is_some() {
                    env.w.outside_ok();
                }
            }
            Err(e) => {
                tracing::warn!(runs = %runs.display(), error = %e, "cannot list the run directories; retrying every second");
                if is_capacity(&e) {
                    env.w.capacity_error(&runs, &e);
                }
                self.unlisted = Some(Instant::now() + RETRY);
            }
        }
    }

    /// Recovery of one run directory (PROTOCOL §12).
    fn recover_run(&mut self, env: &mut Env, id: &RunId, out: &mut Vec<Effect>) {
        let dir = env.layout.run_dir(id);
        let claimed = run::claimed(&dir);
        if claimed && std::fs::symlink_metadata(&dir).is_ok_and(|m| m.mtime() * 1000 >= self.previous_start - 60_000) {
            fsutil::sweep_temps(&dir);
        }
        let status = match run::read_status(&dir) {
            Ok(s) => s,
            Err(e) if claimed && is_capacity(&e) => {
                // No descriptor or space to read it now: look again, never forget the run.
                tracing::warn!(run_id = %id, error = %e, "cannot read status.json now; retrying every second");
                env.w.capacity_error(&dir, &e);
                self.remember_unfinished(id.clone());
                return;
            }
            // The queued status (and a runner's updates) are written without
            // fsync: a power loss may leave status.json empty or zero-filled.
            // Such a claim is finished again, as if that write had been lost.
            Err(_) if claimed && claimed::status_is_torn(&dir) => {
                self.finish_half_claim(env, id, out);
                return;
            }
            Err(e) => {
                if run::is_identity_mismatch(&e) {
                    // A copied or crafted run directory: reported, never acted on.
                    tracing::warn!(run_id = %id, error = %e, "status.json is not this run's own; leaving the directory alone");
                } else if claimed {
                    tracing::warn!(run_id = %id, error = %e, "unreadable status.json; leaving the run alone");
                }
                return;
            }
        };
        let rejection = !claimed
            && status
                .as_ref()
                .is_some_and(|s| !s.state.is_active() && run::ownership(&dir, Some(s)) == run::Ownership::Rejection);
        match (decide(claimed, status.as_ref(), rejection), status) {
            (Verdict::Foreign, _) => {
                self.foreign.insert(id.clone());
            }
            (Verdict::Rejection, Some(s)) => {
                if let Err(e) = ensure_published_status(env.w, env.layout, id, &s) {
                    tracing::warn!(run_id = %id, error = %e, "could not finish publishing a rejected run");
                }
            }
            (Verdict::HalfClaimed, _) => self.finish_half_claim(env, id, out),
            (Verdict::Queued, Some(s)) => {
                claimed::ensure_queued_event(env.w, &dir, id, s.queue.priority);
                let _ = claimed::mark_claimed(env.w, env.layout, id);
                out.push(queued_or_running(env, id, s));
            }
            (Verdict::Running, _) => {
                let _ = claimed::mark_claimed(env.w, env.layout, id);
                out.push(Effect::Adopt(id.clone()));
            }
            (Verdict::Ended, Some(s)) => {
                if let Err(e) = ensure_published_status(env.w, env.layout, id, &s) {
                    tracing::warn!(run_id = %id, error = %e, "could not finish publishing a terminal run");
                }
                let unseen =
                    self.previous_seen > 0 && s.ended_at.is_some_and(|e| e > self.previous_seen - UNSEEN_MARGIN_MS);
                if unseen {
                    out.push(Effect::EndedUnseen(id.clone()));
                }
                if crate::protocol::outcome::ended_elsewhere(&s) {
                    out.push(Effect::EndedElsewhere(id.clone(), Box::new(s)));
                }
            }
            _ => {}
        }
    }

    /// Finish a run with `request.json` and no status (`spool::finish_half_claim`);
    /// one that meets a capacity error is remembered and retried.
    fn finish_half_claim(&mut self, env: &mut Env, id: &RunId, out: &mut Vec<Effect>) {
        match claimed::finish_half_claim(env.w, env.layout, id, env.cfg) {
            Ok(Some(s)) => {
                tracing::info!(run_id = %id, "finished a half-done claim");
                let _ = claimed::mark_claimed(env.w, env.layout, id);
                out.push(queued_or_running(env, id, s));
            }
            Ok(None) => {}
            Err(e) if is_capacity(&e) => {
                tracing::warn!(run_id = %id, error = %e, "cannot finish a half-done claim now; retrying every second");
                env.w.capacity_error(&env.layout.run_dir(id), &e);
                self.remember_unfinished(id.clone());
            }
            Err(e) => {
                tracing::error!(run_id = %id, error = %e, "cannot finish a half-done claim; the next start tries again")
            }
        }
    }

    /// A committed claim whose post-commit work (queued status, queued
    /// event, active marker) met an error: finished by its run directory,
    /// claiming paused meanwhile (PROTOCOL §2.3, §11: capacity errors never
    /// strand work).
    pub fn remember_unfinished(&mut self, id: RunId) {
        if !self.unfinished.contains(&id) {
            self.unfinished.push(id);
        }
        self.unfinished_retry_at = Instant::now() + RETRY;
    }

    pub fn has_unfinished(&self) -> bool {
        !self.unfinished.is_empty()
    }

    fn retry_unfinished(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        for id in std::mem::take(&mut self.unfinished) {
            self.recover_run(env, &id, out);
        }
        if self.unfinished.is_empty() {
            tracing::info!("every claim cut short after its commit is finished: claiming resumes");
            env.w.outside_ok();
            out.push(Effect::ClaimAgain);
        }
    }

    pub fn rescan_due(&self, now: Instant) -> bool {
        now >= self.next_rescan
    }

    /// A hint asked for a rescan (lost events, a replaced watcher).
    pub fn rescan_now(&mut self, why: &str) {
        if self.next_rescan > Instant::now() {
            tracing::debug!(reason = %why, "full rescan");
        }
        self.next_rescan = Instant::now();
    }

    /// A new `watch.rescan_interval_s` (SIGHUP).
    pub fn set_rescan_interval(&mut self, every: Duration) {
        self.rescan_every = every;
        self.next_rescan = self.next_rescan.min(Instant::now() + every);
    }

    pub fn last_rescan_at(&self) -> Option<i64> {
        self.last_rescan_at
    }

    /// The rescan's own part: the active index. Runs of ours started by
    /// another path (or lost from memory) show up there and are adopted;
    /// other hosts' active runs are noted for the bridge only (§14). With
    /// `safe` false (a root directory replaced by a symlink) the index is
    /// not read: what it points to is not adopted.
    pub fn rescan(&mut self, env: &mut Env, safe: bool, known: &dyn Fn(&str) -> bool, out: &mut Vec<Effect>) {
        self.next_rescan = Instant::now() + self.rescan_every;
        self.last_rescan_at = Some(crate::now_ms());
        if !safe {
            return;
        }
        // Withdrawals whose client was cut short after moving the entry.
        spool::reject::finish_withdrawals(env.w, env.layout, env.cfg);
        // Runs this daemon knows are queued or running are not read again: a
        // backlog costs the rescan a listing, not every queued run's status.
        let mut foreign = HashSet::new();
        let mut found = Vec::new();
        let listed = index::each_active(env.layout, &|id| !known(id), &mut |x| {
            let Ok(s) = x.status else { return };
            if !x.ownership.is_ours() {
                foreign.insert(x.run_id);
            } else {
                found.push((x.run_id, s));
            }
        });
        if listed.is_err() {
            return;
        }
        self.foreign = foreign;
        // In claim order, as the index lists them.
        found.sort_by(|a, b| (a.1.queue.claimed_at, &a.0).cmp(&(b.1.queue.claimed_at, &b.0)));
        for (id, s) in found {
            out.push(match s.state {
                State::Queued => Effect::Queue(id, Box::new(s)),
                _ => Effect::Adopt(id),
            });
        }
    }

    /// Other hosts' active runs (their bridge requests are serviced).
    pub fn foreign(&self) -> impl Iterator<Item = &RunId> {
        self.foreign.iter()
    }

    pub fn next_wake(&self) -> Option<Instant> {
        let now = Instant::now();
        [
            Some(self.next_rescan),
            self.unlisted,
            (!self.unfinished.is_empty()).then_some(self.unfinished_retry_at),
            (!self.backlog.is_empty()).then_some(now),
            // Other hosts' bridge requests are swept once a second.
            (!self.foreign.is_empty()).then(|| now + RETRY),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// A queued run may already have a runner (spawned just before the
/// previous daemon died): then it is adopted as running.
fn queued_or_running(env: &Env, id: &RunId, s: Status) -> Effect {
    if fsutil::lock_held(&RunPaths::runner_lock(&env.layout.run_dir(id))).unwrap_or(false) {
        Effect::Adopt(id.clone())
    } else {
        Effect::Queue(id.clone(), Box::new(s))
    }
}

/// Temps left by writers killed mid-write, in the shared directories (not
/// the spool: its dot files belong to clients).
fn sweep_shared_temps(env: &Env) {
    let l = env.layout;
    // The hook records and the list cache are written atomically too: a
    // daemon killed mid-write leaves its temp there (docs/crash-points.md).
    let mut dirs = vec![l.rejected(), l.active(), l.results(), l.daemon_dir(), l.result_index_runs()];
    dirs.extend([l.hooks_pending(), l.hooks_running(), l.recent_cache()]);
    for parent in [l.terminal(), l.result_pending(), l.result_index_sessions(), l.result_index_tool_calls()] {
        if let Ok(rd) = std::fs::read_dir(&parent) {
            dirs.extend(rd.flatten().map(|e| e.path()));
        }
    }
    let n: usize = dirs.iter().map(|d| fsutil::sweep_temps(d)).sum();
    if n > 0 {
        tracing::info!(removed = n, "removed temp files left by an interrupted writer");
    }
}

/// Run ids named by the entries of `dir`: its run directories (`dirs`: real
/// directories, never symbolic links) or its marker files. Only names of the
/// run-id grammar name a run (dot names are temps and the indexes).
fn run_names(dir: &Path, dirs: bool) -> std::io::Result<Vec<RunId>> {
    Ok(std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| if dirs { t.is_dir() } else { t.is_file() }))
        .filter_map(|e| e.file_name().to_str().and_then(RunId::parse))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: &str) -> Status {
        serde_json::from_value(serde_json::json!({
            "runId": "r", "mode": "single", "state": state, "sessionId": "s",
            "startedAt": 1, "lastUpdate": 1, "steps": [],
        }))
        .unwrap()
    }

    #[test]
    fn another_hosts_runs_are_never_supervised() {
        assert_eq!(decide(false, Some(&status("running")), false), Verdict::Foreign);
        assert_eq!(decide(false, Some(&status("queued")), false), Verdict::Foreign);
        assert_eq!(decide(false, Some(&status("complete")), false), Verdict::Leave);
        assert_eq!(decide(false, Some(&status("partial")), false), Verdict::Leave);
        assert_eq!(decide(false, None, false), Verdict::Leave);
    }

    #[test]
    fn only_our_rejections_are_published_again() {
        assert_eq!(decide(false, Some(&status("failed")), true), Verdict::Rejection);
    }

    #[test]
    fn our_runs_by_state() {
        assert_eq!(decide(true, None, false), Verdict::HalfClaimed);
        assert_eq!(decide(true, Some(&status("queued")), false), Verdict::Queued);
        assert_eq!(decide(true, Some(&status("running")), false), Verdict::Running);
        assert_eq!(decide(true, Some(&status("stopped")), false), Verdict::Ended);
        assert_eq!(decide(true, Some(&status("failed")), false), Verdict::Ended);
    }
}
