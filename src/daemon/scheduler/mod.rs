//! The scheduler: queued runs per lane in priority order, what holds them
//! back (PROTOCOL §15: dependencies, `notBefore`, holds), the queue control
//! (`runspool/queue.json`: pause, the `maxRunning` override), the start
//! backoff after a transient runner start failure, and the control inboxes
//! of runs that have not started (a stop ends them `stopped`, PROTOCOL §9;
//! `hold.json` and `release.json` hold and release them, §15).

pub mod queue;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::part::{Effect, Env};
use super::watch::Watch;
use crate::config::Config;
use crate::protocol::control::{describe, StopRequest};
use crate::protocol::status::{OpenSteps, State, Status, StepState};
use crate::store::deps::{self, Dep, PendingIds};
use crate::store::dirfd::DirFd;
use crate::store::layout::{RunPaths, CONTROL_HOLD, CONTROL_INTERRUPT, CONTROL_RELEASE, CONTROL_STOP, CONTROL_TIMEOUT};
use crate::store::run::take_runner_lock;
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
/// How often, while runs are queued, the dependencies that this daemon does
/// not see end (requests in the spool, other hosts' runs) are looked at
/// again, and the `waiting` of queued runs and daemon.json's counts brought
/// up to date.
const GATE_POLL: Duration = Duration::from_secs(1);
/// A run that waits only for a slot (`lane`, `max_running`, `paused`) gets
/// its `waiting` written once it has waited this long: in a burst, runs that
/// start within a second cost no extra status write.
const WAITING_AFTER: Duration = Duration::from_secs(1);
/// Most `waiting` updates written per pass; the rest follow in the next.
const WAITING_WRITES_PER_PASS: usize = 512;

/// A queued run in a lane's heap: higher priority first, then earlier
/// claims. `gen` tells an entry made stale (by a hold) from the live one.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Queued {
    priority: i64,
    order: Reverse<(i64, u64)>,
    pub run_id: RunId,
    gen: u64,
}

/// Why a queued run waits (status `waiting`, PROTOCOL §15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    Held,
    Dependencies,
    NotBefore,
    Paused,
    Lane,
    MaxRunning,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Held => "held",
            Reason::Dependencies => "dependencies",
            Reason::NotBefore => "not-before",
            Reason::Paused => "paused",
            Reason::Lane => "lane",
            Reason::MaxRunning => "max_running",
        }
    }

    /// Held, dependencies and `notBefore` are the run's own; the others
    /// only say it waits for a slot.
    fn own(self) -> bool {
        matches!(self, Reason::Held | Reason::Dependencies | Reason::NotBefore)
    }
}

/// What status.json says of a queued run's wait.
#[derive(Debug, Clone, Default, PartialEq)]
struct Shown {
    waiting: Option<String>,
    waiting_for: Vec<String>,
    held: bool,
}

/// One queued run.
#[derive(Debug)]
struct Entry {
    lane: String,
    priority: i64,
    order: Reverse<(i64, u64)>,
    /// Dependencies not yet ended.
    after: Vec<RunId>,
    /// `afterPolicy: any`.
    any: bool,
    /// The dependencies were looked at once (and the cycle check made).
    checked: bool,
    not_before: Option<i64>,
    held: bool,
    since: Instant,
    /// In its lane's heap with this generation.
    gen: u64,
    in_heap: bool,
    shown: Shown,
}

/// Counts of queued runs for daemon.json (PROTOCOL §15).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub by_lane: BTreeMap<String, usize>,
    pub by_reason: BTreeMap<String, usize>,
    pub running_by_lane: BTreeMap<String, usize>,
    /// Queued runs per lane and reason, for the metrics file.
    pub by_lane_reason: BTreeMap<String, BTreeMap<&'static str, usize>>,
}

/// What limits starts now: the run count of each lane (runs with a runner)
/// and the global room left.
pub struct Slots<'a> {
    pub lanes: &'a mut HashMap<String, usize>,
    pub cfg: &'a Config,
}

impl Slots<'_> {
    fn lane_full(&self, lane: &str) -> bool {
        self.cfg.lane_max_running(lane).is_some_and(|cap| self.lanes.get(lane).copied().unwrap_or(0) >= cap)
    }
}

#[derive(Default)]
pub struct Scheduler {
    /// The runs still queued; a run stopped while queued leaves this map
    /// and its heap entry is dropped when it comes up.
    /// Boxed: the table of a 20,000-run backlog holds pointers, not its
    /// entries' room twice over (a hash table is a third empty or more).
    runs: HashMap<RunId, Box<Entry>>,
    /// Per lane, the runs nothing but a slot holds back.
    lanes: HashMap<String, BinaryHeap<Queued>>,
    /// Who waits for whom: a dependency's end looks at its dependents again.
    dependents: HashMap<RunId, Vec<RunId>>,
    /// Runs whose dependencies are to be looked at in the next pass.
    dirty: HashSet<RunId>,
    /// `notBefore` timers, earliest first.
    timers: BinaryHeap<Reverse<(i64, RunId)>>,
    /// The lane of each run handed to a runner (or adopted), for the lane limits.
    running_lane: HashMap<RunId, String>,
    /// The run last handed out by `next_ready`, until its start is settled.
    starting: Option<(RunId, Box<Entry>)>,
    pending: PendingIds,
    next_gate_check: Option<Instant>,
    /// A `GATE_POLL` pass is due to bring `waiting` up to date.
    show_due: bool,
    counts: Counts,
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
    /// The most runs queued at once since the queue was last empty.
    high: usize,
}

impl Scheduler {
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn contains(&self, run_id: &str) -> bool {
        self.runs.contains_key(run_id)
    }

    pub fn ids(&self) -> impl Iterator<Item = &RunId> {
        self.runs.keys()
    }

    /// Queue a run (claimed or recovered) with what its status says of its
    /// lane, dependencies, `notBefore` and hold.
    pub fn enqueue(&mut self, id: &RunId, s: &Status) {
        if self.runs.contains_key(id) {
            return;
        }
        self.seq += 1;
        let after: Vec<RunId> = s.after().iter().filter_map(|d| RunId::parse(d)).collect();
        for d in &after {
            self.dependents.entry(d.clone()).or_default().push(id.clone());
        }
        if !after.is_empty() {
            self.dirty.insert(id.clone());
        }
        if let Some(t) = s.not_before() {
            self.timers.push(Reverse((t, id.clone())));
        }
        let e = Box::new(Entry {
            lane: s.lane().to_string(),
            priority: s.queue.priority,
            order: Reverse((s.queue.claimed_at, self.seq)),
            after,
            any: s.after_any(),
            checked: false,
            not_before: s.not_before(),
            held: s.held(),
            since: Instant::now(),
            gen: 0,
            in_heap: false,
            shown: Shown { waiting: s.waiting().map(String::from), waiting_for: s.waiting_for(), held: s.held() },
        });
        self.runs.insert(id.clone(), e);
        self.high = self.high.max(self.runs.len());
        self.make_ready(id);
        self.poll_inbox(id);
        if self.next_gate_check.is_none() {
            self.next_gate_check = Some(Instant::now() + GATE_POLL);
        }
    }

    /// True once when the queue has emptied after a backlog of at least
    /// `BACKLOG` runs: its maps, which never shrink by themselves, are
    /// given their memory back (with the queue empty, whatever is left in
    /// the lane heaps, timers and dependents is stale), and the caller
    /// hands the freed memory back to the system.
    pub fn drained(&mut self) -> bool {
        const BACKLOG: usize = 256;
        if !self.runs.is_empty() || self.high < BACKLOG {
            return false;
        }
        self.high = 0;
        self.runs = HashMap::new();
        self.lanes = HashMap::new();
        self.dependents = HashMap::new();
        self.dirty = HashSet::new();
        self.timers = BinaryHeap::new();
        self.polled_inboxes = VecDeque::new();
        self.running_lane.shrink_to_fit();
        true
    }

    /// What holds `e` back of its own (PROTOCOL §15), None when only a slot does.
    fn gate(e: &Entry, now_ms: i64) -> Option<Reason> {
        if e.held {
            Some(Reason::Held)
        } else if !e.after.is_empty() {
            Some(Reason::Dependencies)
        } else if e.not_before.is_some_and(|t| t > now_ms) {
            Some(Reason::NotBefore)
        } else {
            None
        }
    }

    /// Put the run in its lane's heap when nothing of its own holds it back.
    fn make_ready(&mut self, id: &RunId) {
        let now_ms = crate::now_ms();
        let Some(e) = self.runs.get_mut(id) else { return };
        if e.in_heap || Self::gate(e, now_ms).is_some() {
            return;
        }
        e.in_heap = true;
        let q = Queued { priority: e.priority, order: e.order, run_id: id.clone(), gen: e.gen };
        self.lanes.entry(e.lane.clone()).or_default().push(q);
    }

    /// How many more runs may start when `running` run now.
    pub fn free_slots(&self, running: usize, configured: usize) -> usize {
        if self.ctl.paused() {
            return 0;
        }
        self.ctl.max_running(configured).saturating_sub(running)
    }

    /// The runs with a runner, counted by lane (for `Slots`).
    pub fn lane_counts<'a>(&mut self, running: impl Iterator<Item = &'a RunId>) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for id in running {
            let lane = self.running_lane.get(id).map_or(crate::protocol::request::DEFAULT_LANE, String::as_str);
            *out.entry(lane.to_string()).or_insert(0) += 1;
        }
        out
    }

    /// A run with a runner this daemon did not start: its lane counts.
    pub fn note_running(&mut self, id: &RunId, lane: &str) {
        self.running_lane.insert(id.clone(), lane.to_string());
    }

    /// A run ended: the runs waiting for it are looked at again.
    pub fn ended(&mut self, id: &RunId) {
        self.running_lane.remove(id);
        if let Some(waiting) = self.dependents.remove(id) {
            self.dirty.extend(waiting.into_iter().filter(|w| self.runs.contains_key(w)));
        }
    }

    /// The next run to start: the first of the lane heads whose lane has
    /// room, unless a start backoff is under way. It leaves the queue (and
    /// its inbox is no longer watched: the runner reads it from now on).
    pub fn next_ready(&mut self, watch: &mut Watch, slots: &mut Slots) -> Option<Queued> {
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        self.retry_at = None;
        let lane = self.best_lane(slots)?;
        let q = self.lanes.get_mut(&lane)?.pop()?;
        let e = self.runs.remove(&q.run_id)?;
        *slots.lanes.entry(lane.clone()).or_insert(0) += 1;
        self.running_lane.insert(q.run_id.clone(), lane);
        watch.unwatch_control(&q.run_id);
        self.starting = Some((q.run_id.clone(), e));
        Some(q)
    }

    /// The lane whose head starts next: the best head (priority, then claim
    /// order) among the lanes with room. Stale heap entries are dropped.
    fn best_lane(&mut self, slots: &Slots) -> Option<String> {
        let mut best: Option<(&Queued, &String)> = None;
        for heap in self.lanes.values_mut() {
            // Drop what went stale: stopped, failed, or held since it was pushed.
            while let Some(top) = heap.peek() {
                match self.runs.get(&top.run_id) {
                    Some(e) if e.in_heap && e.gen == top.gen => break,
                    _ => {
                        heap.pop();
                    }
                }
            }
        }
        self.lanes.retain(|_, h| !h.is_empty());
        for (lane, heap) in &self.lanes {
            let Some(top) = heap.peek() else { continue };
            if slots.lane_full(lane) {
                continue;
            }
            if best.is_none_or(|(b, _)| (top.priority, top.order) > (b.priority, b.order)) {
                best = Some((top, lane));
            }
        }
        best.map(|(_, lane)| lane.clone())
    }

    /// A runner started: the backoff is over.
    pub fn started(&mut self) {
        self.backoff = None;
        self.starting = None;
    }

    /// The runner of `q` could not start for a transient reason: it goes
    /// back in its place, and no run starts before a growing delay.
    pub fn retry_later(&mut self, q: Queued) -> Duration {
        let delay = self.backoff.map_or(SPAWN_RETRY_FIRST, |d| (d * 2).min(SPAWN_RETRY_MAX));
        self.backoff = Some(delay);
        self.retry_at = Some(Instant::now() + delay);
        self.running_lane.remove(&q.run_id);
        if let Some((id, e)) = self.starting.take().filter(|(id, _)| *id == q.run_id) {
            self.lanes.entry(e.lane.clone()).or_default().push(q);
            self.runs.insert(id.clone(), e);
            self.poll_inbox(&id);
        }
        delay
    }

    pub fn next_wake(&self) -> Option<Instant> {
        let retry = self.retry_at.filter(|_| !self.runs.is_empty());
        let dirty = (!self.dirty.is_empty()).then(Instant::now);
        let timer = self.timers.peek().map(|Reverse((t, _))| {
            let ms = (*t - crate::now_ms()).clamp(0, 24 * 3600 * 1000) as u64;
            Instant::now() + Duration::from_millis(ms)
        });
        // Also once after the queue emptied: the counts are brought to zero.
        let gates = self.next_gate_check;
        [retry, self.next_inbox_poll, self.ctl.next_wake(), dirty, timer, gates].into_iter().flatten().min()
    }

    /// Counts of queued runs for daemon.json, as of the last pass.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Before starts: look at the dependencies of the runs marked (and,
    /// every `GATE_POLL`, of every waiting run), fail the runs a dependency
    /// fails, release the runs whose `notBefore` came, and every
    /// `GATE_POLL` have `show_waiting` bring each queued run's `waiting`
    /// (and daemon.json's counts) up to date.
    /// `active`: does this daemon know the run as running?
    pub fn settle_gates(&mut self, env: &mut Env, active: &dyn Fn(&str) -> bool, out: &mut Vec<Effect>) {
        let now = Instant::now();
        let pass = self.next_gate_check.is_some_and(|t| now >= t);
        let mut ids: Vec<RunId> = self.dirty.drain().collect();
        if pass {
            ids = self.runs.iter().filter(|(_, e)| !e.after.is_empty()).map(|(id, _)| id.clone()).collect();
        }
        for id in ids {
            self.check_dependencies(env, &id, active, out);
        }
        let now_ms = crate::now_ms();
        while let Some(Reverse((t, _))) = self.timers.peek() {
            if *t > now_ms {
                break;
            }
            let Some(Reverse((_, id))) = self.timers.pop() else { break };
            self.make_ready(&id);
        }
        if pass {
            self.next_gate_check = (!self.runs.is_empty()).then(|| now + GATE_POLL);
            self.show_due = true;
        }
    }

    /// Bring `waiting`, `waitingFor` and `held` of the queued runs' statuses
    /// up to date (at most `WAITING_WRITES_PER_PASS` writes), and the
    /// counts for daemon.json. Called after the starts of a turn, with
    /// what limits starts now; does its work after each `GATE_POLL` pass.
    pub fn show_waiting(&mut self, env: &mut Env, slots: &Slots) {
        if !self.show_due {
            return;
        }
        self.show_due = false;
        let now_ms = crate::now_ms();
        let paused = self.ctl.paused();
        let mut counts = Counts::default();
        for (lane, n) in slots.lanes.iter().filter(|(_, n)| **n > 0) {
            counts.running_by_lane.insert(lane.clone(), *n);
        }
        let mut writes = Vec::new();
        for (id, e) in &self.runs {
            let reason = Self::gate(e, now_ms).unwrap_or(if paused {
                Reason::Paused
            } else if slots.lane_full(&e.lane) {
                Reason::Lane
            } else {
                Reason::MaxRunning
            });
            match counts.by_lane.get_mut(&e.lane) {
                Some(n) => *n += 1,
                None => {
                    counts.by_lane.insert(e.lane.clone(), 1);
                }
            }
            *counts.by_reason.entry(reason.as_str().to_string()).or_insert(0) += 1;
            match counts.by_lane_reason.get_mut(&e.lane) {
                Some(m) => *m.entry(reason.as_str()).or_insert(0) += 1,
                None => {
                    counts.by_lane_reason.insert(e.lane.clone(), BTreeMap::from([(reason.as_str(), 1)]));
                }
            }
            let shown = &e.shown;
            let same = shown.waiting.as_deref() == Some(reason.as_str())
                && shown.held == e.held
                && shown.waiting_for.len() == e.after.len()
                && shown.waiting_for.iter().zip(&e.after).all(|(a, b)| a == b.as_str());
            let due = reason.own() || e.since.elapsed() >= WAITING_AFTER || shown.waiting.is_some();
            if !same && due && writes.len() < WAITING_WRITES_PER_PASS {
                let want = Shown {
                    waiting: Some(reason.as_str().to_string()),
                    waiting_for: e.after.iter().map(|d| d.to_string()).collect(),
                    held: e.held,
                };
                writes.push((id.clone(), want));
            }
        }
        self.counts = counts;
        for (id, want) in writes {
            let w = want.clone();
            let r = run::update_status(env.w, &env.layout.run_dir(&id), move |cur| {
                let mut s = cur?;
                if s.state != State::Queued {
                    return None;
                }
                s.set_waiting(w.waiting.as_deref(), &w.waiting_for);
                s.set_held(w.held);
                Some(s)
            });
            match r {
                Ok(_) => {
                    if let Some(e) = self.runs.get_mut(&id) {
                        e.shown = want;
                    }
                }
                Err(e) => tracing::warn!(run_id = %id, error = %e, "could not record why a queued run waits"),
            }
        }
    }

    /// Look at the dependencies of queued run `id` (PROTOCOL §15): those
    /// that ended `complete` (or, with `afterPolicy: any`, in any way) are
    /// done; one that ended otherwise, or is neither a run nor a request
    /// any more, fails the run without starting it (policy `success`).
    fn check_dependencies(&mut self, env: &mut Env, id: &RunId, active: &dyn Fn(&str) -> bool, out: &mut Vec<Effect>) {
        let Some(e) = self.runs.get(id) else { return };
        if e.after.is_empty() {
            return;
        }
        let (after, any, first) = (e.after.clone(), e.any, !e.checked);
        if first {
            if let Some(cycle) = self.cycle_from(id) {
                let msg = format!("its dependencies form a cycle ({cycle}); it was not started");
                self.fail_dependent(env, id, &msg, out);
                return;
            }
        }
        let mut left = Vec::new();
        for d in after {
            if self.runs.contains_key(&d) || self.starting.as_ref().is_some_and(|(s, _)| *s == d) || active(d.as_str())
            {
                left.push(d);
                continue;
            }
            let why = match deps::look(env.layout, &d, &mut self.pending) {
                Dep::Active | Dep::Pending => {
                    left.push(d);
                    continue;
                }
                Dep::Unreadable(e) => {
                    if first {
                        tracing::warn!(run_id = %id, dependency = %d, error = %e, "cannot tell whether a dependency ended; the run waits");
                    }
                    left.push(d);
                    continue;
                }
                Dep::Ended(State::Complete) => continue,
                Dep::Ended(st) => format!("dependency `{d}` ended `{st}`"),
                Dep::Gone => format!(
                    "dependency `{d}` is neither a run nor a request in the spool any more (rejected, withdrawn or removed)"
                ),
            };
            if any {
                continue;
            }
            let msg = format!("{why}; this run was not started (afterPolicy `success`; use `any` to start regardless)");
            self.fail_dependent(env, id, &msg, out);
            return;
        }
        if let Some(e) = self.runs.get_mut(id) {
            e.checked = true;
            e.after = left;
        }
        self.make_ready(id);
    }

    /// The cycle through `id` along the `after` of queued runs, if any
    /// (possible only through requests that were still in the spool).
    fn cycle_from(&self, id: &RunId) -> Option<String> {
        let mut stack: Vec<(RunId, Vec<RunId>)> = vec![(id.clone(), vec![id.clone()])];
        let mut seen = HashSet::new();
        while let Some((at, path)) = stack.pop() {
            let Some(e) = self.runs.get(&at) else { continue };
            for d in &e.after {
                if d == id {
                    let mut names: Vec<String> = path.iter().map(|p| p.to_string()).collect();
                    names.push(id.to_string());
                    return Some(names.join(" -> "));
                }
                if seen.insert(d.clone()) {
                    let mut p = path.clone();
                    p.push(d.clone());
                    stack.push((d.clone(), p));
                }
            }
        }
        None
    }

    /// End queued run `id` `failed` without starting it: its steps skipped
    /// (`exitCode: -1`), `msg` as its error, its events, indexes and result.
    fn fail_dependent(&mut self, env: &mut Env, id: &RunId, msg: &str, out: &mut Vec<Effect>) {
        let dir = env.layout.run_dir(id);
        let Ok(Some(_lock)) = take_runner_lock(&dir) else { return };
        let (m, now) = (msg.to_string(), crate::now_ms());
        let r = results::write_terminal(env.w, env.layout, id, move |cur| {
            let mut s = cur?;
            if s.state != State::Queued {
                return None;
            }
            s.set_waiting(None, &[]);
            let open = OpenSteps::skipped(StepState::Failed, "skipped: a dependency did not complete");
            s.end(State::Failed, Some(m), &open, now);
            Some(s)
        });
        match r {
            Ok(Some(s)) if s.state == State::Failed => {
                let done = json!({"status": "failed", "durationMs": 0, "exitCode": s.exit_code});
                run::event(env.w, &dir, id, "subagent.run.completed", done);
                tracing::info!(run_id = %id, "{msg}");
                out.push(Effect::Ended(id.clone()));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(run_id = %id, error = %e, "could not fail a run whose dependency failed");
                return;
            }
        }
        self.runs.remove(id);
        env.watch.unwatch_control(id);
    }

    /// `hold.json` or `release.json` in a queued run's inbox: the later of
    /// them (by its `ts`, a release on a tie) decides; status.json records
    /// it before the files are removed, so a crash in between only repeats it.
    fn hold_or_release(&mut self, env: &mut Env, run_id: &RunId, control: &DirFd) {
        let ts = |b: Option<Vec<u8>>| {
            b.map(|b| serde_json::from_slice::<Value>(&b).ok().and_then(|v| v.get("ts")?.as_i64()).unwrap_or(0))
        };
        let (hold, release) = (ts(inbox::legacy(control, CONTROL_HOLD)), ts(inbox::legacy(control, CONTROL_RELEASE)));
        let held = match (hold, release) {
            (None, None) => return,
            (Some(h), Some(r)) => h > r,
            (h, _) => h.is_some(),
        };
        let dir = env.layout.run_dir(run_id);
        let r = run::update_status(env.w, &dir, |cur| {
            let mut s = cur?;
            if s.state != State::Queued {
                return None;
            }
            s.set_held(held);
            if held {
                s.set_waiting(Some(Reason::Held.as_str()), &s.waiting_for());
            }
            Some(s)
        });
        let s = match r {
            Ok(Some(s)) if s.state == State::Queued => s,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(run_id = %run_id, error = %e, "could not record a hold or release; retried on the next look");
                return;
            }
        };
        inbox::remove_legacy(control, CONTROL_HOLD);
        inbox::remove_legacy(control, CONTROL_RELEASE);
        tracing::info!(run_id = %run_id, "{}", if held { "held a queued run" } else { "released a queued run" });
        let Some(e) = self.runs.get_mut(run_id) else { return };
        e.held = held;
        e.shown.held = held;
        if held {
            e.shown.waiting = Some(Reason::Held.as_str().into());
            if e.in_heap {
                e.gen += 1;
                e.in_heap = false;
            }
        } else {
            // `runspool edit` may have changed the scheduling of the held run.
            self.refresh(run_id, &s);
            self.make_ready(run_id);
        }
        self.next_gate_check = Some(Instant::now());
    }

    /// Take a queued run's lane, priority, dependencies and `notBefore`
    /// again from its status (rewritten by `runspool edit` while it was
    /// held). Its generation goes on, so no heap entry of before counts.
    fn refresh(&mut self, id: &RunId, s: &Status) {
        let Some(e) = self.runs.get_mut(id) else { return };
        let after: Vec<RunId> = s.after().iter().filter_map(|d| RunId::parse(d)).collect();
        let lane = s.lane().to_string();
        if e.lane == lane
            && e.priority == s.queue.priority
            && e.after == after
            && e.any == s.after_any()
            && e.not_before == s.not_before()
        {
            return;
        }
        if e.in_heap {
            e.gen += 1;
            e.in_heap = false;
        }
        e.lane = lane;
        e.priority = s.queue.priority;
        e.any = s.after_any();
        e.checked = false;
        e.not_before = s.not_before();
        if let Some(t) = e.not_before {
            self.timers.push(Reverse((t, id.clone())));
        }
        for d in &after {
            self.dependents.entry(d.clone()).or_default().push(id.clone());
        }
        if !after.is_empty() {
            self.dirty.insert(id.clone());
        }
        e.after = after;
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
            if !self.runs.contains_key(&id) {
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
            if self.runs.contains_key(&id) {
                self.polled_inboxes.push_back((since, id));
            }
        }
        if self.polled_inboxes.is_empty() {
            self.next_inbox_poll = None;
        }
    }

    /// The control inbox of every queued run (the rescan: they may have changed unseen).
    pub fn control_all(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        let ids: Vec<RunId> = self.runs.keys().cloned().collect();
        for id in ids {
            self.control(env, &id, out);
        }
    }

    /// Act on the control inbox of a run that is still queued: it never
    /// starts and ends `stopped` (PROTOCOL §9).
    pub fn control(&mut self, env: &mut Env, run_id: &RunId, out: &mut Vec<Effect>) {
        if !self.runs.contains_key(run_id) {
            return;
        }
        let dir = env.layout.run_dir(run_id);
        // Opened without following, like the runner does: a symlinked control/
        // or stop-requests/ is no inbox, and only a regular legacy file is a request.
        let Some(control) = inbox::open(&dir) else { return };
        self.hold_or_release(env, run_id, &control);
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
        self.runs.remove(run_id);
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
        status_in(id, priority, claimed_at, None)
    }

    fn status_in(id: &str, priority: i64, claimed_at: i64, lane: Option<&str>) -> (RunId, Status) {
        let mut s: Status = serde_json::from_value(json!({
            "runId": id, "mode": "single", "state": "queued", "sessionId": "s",
            "startedAt": claimed_at, "lastUpdate": claimed_at, "steps": [],
        }))
        .unwrap();
        s.queue.priority = priority;
        s.queue.claimed_at = claimed_at;
        if let Some(l) = lane {
            s.extra.insert("lane".into(), json!(l));
        }
        (RunId::parse(id).unwrap(), s)
    }

    fn enqueue(s: &mut Scheduler, (id, st): (RunId, Status)) {
        s.enqueue(&id, &st);
    }

    /// Pop what `next_ready` would pick, ignoring backoff and watches.
    fn pick(s: &mut Scheduler, lanes: &mut HashMap<String, usize>, cfg: &Config) -> Option<String> {
        let lane = s.best_lane(&Slots { lanes: &mut *lanes, cfg })?;
        let q = s.lanes.get_mut(&lane)?.pop()?;
        s.runs.remove(&q.run_id);
        *lanes.entry(lane).or_insert(0) += 1;
        Some(q.run_id.to_string())
    }

    fn pop_all(s: &mut Scheduler) -> Vec<String> {
        let cfg = Config::default();
        let mut lanes = HashMap::new();
        std::iter::from_fn(|| pick(s, &mut lanes, &cfg)).collect()
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
    fn a_full_lane_never_holds_back_another() {
        let cfg = Config::parse("[lanes.gpu]\nmax_running = 1\n").unwrap();
        let mut s = Scheduler::default();
        enqueue(&mut s, status_in("gpu-1", 9, 1, Some("gpu")));
        enqueue(&mut s, status_in("gpu-2", 9, 2, Some("gpu")));
        enqueue(&mut s, status_in("cpu-1", 0, 3, None));
        enqueue(&mut s, status_in("cpu-2", 0, 4, None));
        let mut lanes = HashMap::new();
        let order: Vec<String> = std::iter::from_fn(|| pick(&mut s, &mut lanes, &cfg)).collect();
        assert_eq!(order, ["gpu-1", "cpu-1", "cpu-2"], "the second gpu run waits for its lane, not the others");
        assert!(s.contains("gpu-2"));
        lanes.insert("gpu".into(), 0);
        assert_eq!(pick(&mut s, &mut lanes, &cfg).as_deref(), Some("gpu-2"));
    }

    #[test]
    fn held_and_dependent_runs_stay_out_of_the_heaps() {
        let mut s = Scheduler::default();
        let (id, mut st) = status("held", 0, 1);
        st.set_held(true);
        s.enqueue(&id, &st);
        let (id, mut st) = status("waits", 0, 2);
        st.extra.insert("after".into(), json!(["held"]));
        s.enqueue(&id, &st);
        let (id, mut st) = status("later", 0, 3);
        st.extra.insert("notBefore".into(), json!(crate::now_ms() + 3_600_000));
        s.enqueue(&id, &st);
        assert_eq!(pop_all(&mut s), Vec::<String>::new());
        assert_eq!(s.len(), 3);
        assert!(s.dirty.contains("waits"));
        assert!(s.next_wake().is_some());
    }

    #[test]
    fn a_dependency_cycle_is_found() {
        let mut s = Scheduler::default();
        for (id, dep) in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")] {
            let (rid, mut st) = status(id, 0, 1);
            st.extra.insert("after".into(), json!([dep]));
            s.enqueue(&rid, &st);
        }
        assert_eq!(s.cycle_from(&RunId::parse("a").unwrap()).as_deref(), Some("a -> b -> c -> a"));
        assert_eq!(s.cycle_from(&RunId::parse("d").unwrap()), None, "d waits on a cycle, it is not in one");
    }

    #[test]
    fn a_failed_start_backs_off_doubling_up_to_the_limit() {
        let mut s = Scheduler::default();
        enqueue(&mut s, status("a", 0, 1));
        let mut delays = Vec::new();
        for _ in 0..8 {
            let q = s.lanes.get_mut("default").unwrap().pop().expect("the run is back in the heap");
            let e = s.runs.remove(&q.run_id).unwrap();
            s.starting = Some((q.run_id.clone(), e));
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
