//! The scheduler: queued runs in priority order, the queue control
//! (`runspool/queue.json`: pause, the `maxRunning` override), the start
//! backoff after a transient runner start failure, and the control inboxes
//! of runs that have not started (a stop ends them `stopped`, PROTOCOL §9).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::part::{Effect, Env};
use super::queue;
use super::supervisor::take_runner_lock;
use super::watch::Watch;
use crate::protocol::control::{describe, StopRequest};
use crate::protocol::status::{OpenSteps, State, Status, StepState};
use crate::store::dirfd::DirFd;
use crate::store::layout::{RunPaths, CONTROL_INTERRUPT, CONTROL_STOP, CONTROL_TIMEOUT};
use crate::store::{inbox, results, run, RunId};

/// The first and the longest delay before retrying a runner start that
/// failed for a transient reason (EAGAIN, ENOMEM, ...).
const SPAWN_RETRY_FIRST: Duration = Duration::from_millis(200);
const SPAWN_RETRY_MAX: Duration = Duration::from_secs(10);
/// How often the control inboxes of recently queued runs are looked at, and
/// how long a run stays queued before its inbox is watched instead (see
/// `poll_inboxes`).
const INBOX_POLL: Duration = Duration::from_secs(1);
const INBOX_WATCH_AFTER: Duration = Duration::from_secs(5);

/// A queued run in the heap: higher priority first, then earlier claims.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Queued {
    priority: i64,
    order: Reverse<(i64, u64)>,
    pub run_id: RunId,
}

#[derive(Default)]
pub struct Scheduler {
    heap: BinaryHeap<Queued>,
    /// The runs still queued; a run stopped while queued leaves this set and
    /// its heap entry is dropped when it comes up.
    queued: HashSet<RunId>,
    seq: u64,
    pub ctl: queue::Control,
    /// Queued runs whose control inbox is polled, not watched (yet), with
    /// when they were queued.
    polled_inboxes: VecDeque<(Instant, RunId)>,
    next_inbox_poll: Option<Instant>,
    /// After a transient runner start failure: no start before this, and the
    /// delay that led to it (doubling up to SPAWN_RETRY_MAX).
    retry_at: Option<Instant>,
    backoff: Option<Duration>,
}

impl Scheduler {
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    pub fn contains(&self, run_id: &str) -> bool {
        self.queued.contains(run_id)
    }

    pub fn ids(&self) -> impl Iterator<Item = &RunId> {
        self.queued.iter()
    }

    pub fn enqueue(&mut self, id: &RunId, s: &Status) {
        if self.queued.insert(id.clone()) {
            self.seq += 1;
            let order = Reverse((s.queue.claimed_at, self.seq));
            self.heap.push(Queued { priority: s.queue.priority, order, run_id: id.clone() });
            self.poll_inbox(id);
        }
    }

    /// How many more runs may start when `running` run now.
    pub fn free_slots(&self, running: usize, configured: usize) -> usize {
        if self.ctl.paused() {
            return 0;
        }
        self.ctl.max_running(configured).saturating_sub(running)
    }

    /// The next run to start, unless a start backoff is under way. It
    /// leaves the queue (and its inbox is no longer watched: the runner
    /// reads it from now on).
    pub fn next_ready(&mut self, watch: &mut Watch) -> Option<Queued> {
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        self.retry_at = None;
        while let Some(q) = self.heap.pop() {
            if self.queued.remove(&q.run_id) {
                watch.unwatch_control(&q.run_id);
                return Some(q);
            }
            // Stopped while queued.
        }
        None
    }

    /// A runner started: the backoff is over.
    pub fn started(&mut self) {
        self.backoff = None;
    }

    /// The runner of `q` could not start for a transient reason: it goes
    /// back in its place, and no run starts before a growing delay.
    pub fn retry_later(&mut self, q: Queued) -> Duration {
        let delay = self.backoff.map_or(SPAWN_RETRY_FIRST, |d| (d * 2).min(SPAWN_RETRY_MAX));
        self.backoff = Some(delay);
        self.retry_at = Some(Instant::now() + delay);
        self.queued.insert(q.run_id.clone());
        self.poll_inbox(&q.run_id);
        self.heap.push(q);
        delay
    }

    pub fn next_wake(&self) -> Option<Instant> {
        let retry = self.retry_at.filter(|_| !self.queued.is_empty());
        [retry, self.next_inbox_poll, self.ctl.next_wake()].into_iter().flatten().min()
    }

    fn poll_inbox(&mut self, run_id: &RunId) {
        if self.polled_inboxes.is_empty() {
            self.next_inbox_poll = Some(Instant::now() + INBOX_POLL);
        }
        self.polled_inboxes.push_back((Instant::now(), run_id.clone()));
    }

    /// The control inboxes of runs queued for less than `INBOX_WATCH_AFTER`
    /// are looked at every `INBOX_POLL` (one stat of `control/` each, which
    /// usually does not exist); a run still queued after that has its inbox
    /// created and watched. Perf: in a burst, runs that wait only seconds for a
    /// slot cost no `mkdir` and no two synchronous round trips to the watcher
    /// thread each (a tenth of the daemon's CPU per run); a stop of such a run
    /// takes effect within about a second (PROTOCOL §9 sets no bound).
    pub fn poll_inboxes(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        let now = Instant::now();
        if self.next_inbox_poll.is_none_or(|t| now < t) {
            return;
        }
        self.next_inbox_poll = Some(now + INBOX_POLL);
        for (since, id) in std::mem::take(&mut self.polled_inboxes) {
            if !self.queued.contains(&id) {
                continue;
            }
            let dir = env.layout.run_dir(&id);
            if now >= since + INBOX_WATCH_AFTER {
                // Clients create control/ too (PROTOCOL §3); a queued run needs it to be
                // watched. A symlinked one is never watched (nor followed): the rescan
                // still looks at it, and finds no inbox.
                if inbox::prepare(&dir) {
                    env.watch.watch_control(&id);
                }
                self.control(env, &id, out); // what landed before the watch
                continue;
            }
            if std::fs::symlink_metadata(RunPaths::control(&dir)).is_ok() {
                self.control(env, &id, out);
            }
            if self.queued.contains(&id) {
                self.polled_inboxes.push_back((since, id));
            }
        }
        if self.polled_inboxes.is_empty() {
            self.next_inbox_poll = None;
        }
    }

    /// The control inbox of every queued run (the rescan: they may have changed unseen).
    pub fn control_all(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        let ids: Vec<RunId> = self.queued.iter().cloned().collect();
        for id in ids {
            self.control(env, &id, out);
        }
    }

    /// Act on the control inbox of a run that is still queued: it never
    /// starts and ends `stopped` (PROTOCOL §9).
    pub fn control(&mut self, env: &mut Env, run_id: &RunId, out: &mut Vec<Effect>) {
        if !self.queued.contains(run_id) {
            return;
        }
        let dir = env.layout.run_dir(run_id);
        // Opened without following, like the runner does: a symlinked control/
        // or stop-requests/ is no inbox, and only a regular legacy file is a request.
        let Some(control) = inbox::open(&dir) else { return };
        let legacy = [CONTROL_STOP, CONTROL_TIMEOUT, CONTROL_INTERRUPT]
            .into_iter()
            .find(|f| inbox::legacy(&control, f).is_some());
        if legacy.is_none() && !inbox::stop_request_waiting(&control) {
            return;
        }
        let Ok(Some(_lock)) = take_runner_lock(&dir) else { return };
        // 0.67's stop requests: one that names a step of the run is the
        // runner's to honour (that step is skipped); any other stops the run.
        let msg = match legacy {
            Some(file) => format!("stopped before it started ({file} in the control inbox)"),
            None => match take_run_level_stop(&dir, &control) {
                Some(r) => format!("{} before it started", describe(&r, "a stop request")),
                None => return,
            },
        };
        match stop_queued(env, run_id, &msg) {
            Ok(true) => {
                if let Some(file) = legacy {
                    inbox::remove_legacy(&control, file);
                }
                tracing::info!(run_id = %run_id, "stopped a queued run");
                out.push(Effect::Ended(run_id.clone()));
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(run_id = %run_id, error = %e, "could not stop a queued run"),
        }
        self.queued.remove(run_id);
        env.watch.unwatch_control(run_id);
    }
}

/// End a queued run `stopped` with `msg`, its steps skipped, and record its
/// events. False when it was no longer queued. The caller holds runner.lock.
fn stop_queued(env: &mut Env, run_id: &RunId, msg: &str) -> std::io::Result<bool> {
    let (m, now) = (msg.to_string(), crate::now_ms());
    let s = results::write_terminal(env.w, env.layout, run_id, move |cur| {
        let mut s = cur?;
        if s.state != State::Queued {
            return None;
        }
        let open = OpenSteps::skipped(StepState::Stopped, "skipped: the run was stopped before it started");
        s.end(State::Stopped, Some(m), &open, now);
        Some(s)
    })?;
    let Some(s) = s.filter(|s| s.state == State::Stopped) else { return Ok(false) };
    let dir = env.layout.run_dir(run_id);
    run::event(env.w, &dir, run_id, "subagent.run.stopped", json!({"message": msg}));
    let done = json!({"status": "stopped", "durationMs": 0, "exitCode": s.exit_code});
    run::event(env.w, &dir, run_id, "subagent.run.completed", done);
    Ok(true)
}

/// For a queued run: take the first stop request (in `ts` order) that stops
/// the whole run, i.e. names no step of it; requests that name a step stay
/// for the runner. Invalid requests are removed, as the runner would.
fn take_run_level_stop(run_dir: &Path, control: &DirFd) -> Option<StopRequest> {
    let steps = run::read_status(run_dir).ok().flatten().map(|s| s.steps.len()).unwrap_or(0);
    let run_level = |r: &StopRequest| r.target_index.is_none_or(|t| (t as usize) >= steps);
    inbox::take_stop_requests(control, run_level, 1).pop()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(id: &str, priority: i64, claimed_at: i64) -> (RunId, Status) {
        let mut s: Status = serde_json::from_value(json!({
            "runId": id, "mode": "single", "state": "queued", "sessionId": "s",
            "startedAt": claimed_at, "lastUpdate": claimed_at, "steps": [],
        }))
        .unwrap();
        s.queue.priority = priority;
        s.queue.claimed_at = claimed_at;
        (RunId::parse(id).unwrap(), s)
    }

    fn enqueue(s: &mut Scheduler, (id, st): (RunId, Status)) {
        s.enqueue(&id, &st);
    }

    fn pop_all(s: &mut Scheduler) -> Vec<String> {
        let mut order = Vec::new();
        while let Some(q) = s.heap.pop() {
            if s.queued.remove(&q.run_id) {
                order.push(q.run_id.to_string());
            }
        }
        order
    }

    #[test]
    fn higher_priority_first_then_claim_order() {
        let mut s = Scheduler::default();
        enqueue(&mut s, status("late-low", 0, 30));
        enqueue(&mut s, status("early-low", 0, 10));
        enqueue(&mut s, status("high", 5, 40));
        enqueue(&mut s, status("same-time-second", 0, 10));
        assert_eq!(pop_all(&mut s), ["high", "early-low", "same-time-second", "late-low"]);
    }

    #[test]
    fn a_run_is_queued_once() {
        let mut s = Scheduler::default();
        enqueue(&mut s, status("a", 0, 1));
        enqueue(&mut s, status("a", 9, 1));
        assert_eq!(s.len(), 1);
        assert_eq!(pop_all(&mut s), ["a"]);
    }

    #[test]
    fn a_failed_start_backs_off_doubling_up_to_the_limit() {
        let mut s = Scheduler::default();
        enqueue(&mut s, status("a", 0, 1));
        let mut delays = Vec::new();
        for _ in 0..8 {
            let q = s.heap.pop().expect("the run is back in the heap");
            assert!(s.queued.remove(&q.run_id));
            delays.push(s.retry_later(q));
        }
        assert_eq!(delays[0], SPAWN_RETRY_FIRST);
        assert_eq!(delays[1], SPAWN_RETRY_FIRST * 2);
        assert_eq!(*delays.last().unwrap(), SPAWN_RETRY_MAX);
        assert!(s.contains("a"), "the run went back in the queue");
        assert!(s.next_wake().is_some_and(|t| t > Instant::now()), "the loop wakes for the retry");
        s.started();
        assert_eq!(s.backoff, None);
    }

    #[test]
    fn free_slots_are_what_max_running_leaves() {
        let s = Scheduler::default();
        assert_eq!(s.free_slots(1, 4), 3);
        assert_eq!(s.free_slots(5, 4), 0);
    }
}
