//! The supervisor: the runs that have a runner (started by this daemon or
//! re-adopted), their slots, reaping, liveness by `runner.lock`, and the
//! repair of runs whose runner died (PROTOCOL §12).

mod dead_runner;
mod program;
mod repair;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::part::{Effect, Env};
use crate::protocol::status::Status;
use crate::store::fsutil::is_capacity;
use crate::store::repaired::ensure_published_status;
use crate::store::run::take_runner_lock;
use crate::store::{run, RunId};
use dead_runner::DeadRunners;
pub use program::{RunnerProgram, SpawnError, Started};

struct Slot {
    /// None: a runner this daemon did not start (re-adopted), or one whose
    /// fork server is gone; watched by its lock.
    child: Option<Started>,
}

/// What became of a start (`Supervisor::start`).
pub enum Start {
    Started,
    /// A transient failure (EAGAIN, ENOMEM, a full descriptor table): the
    /// run stays queued and the start is retried later.
    Retry {
        message: String,
    },
    /// The run could not start and ended `failed`, or a runner turned out
    /// to hold its lock after all (then it is supervised as running).
    Failed,
}

pub struct Supervisor {
    running: HashMap<RunId, Slot>,
    /// Runs whose runner exited, to be settled by `check`.
    settling: Vec<RunId>,
    /// Dead runners' processes and external jobs, cleared before their run is repaired.
    dead: DeadRunners,
    program: RunnerProgram,
}

impl Supervisor {
    pub fn new(program: RunnerProgram) -> Supervisor {
        Supervisor { running: HashMap::new(), settling: Vec::new(), dead: DeadRunners::default(), program }
    }

    pub fn program(&self) -> &RunnerProgram {
        &self.program
    }

    /// Runs holding a slot (what `max_running` counts).
    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty() && self.settling.is_empty()
    }

    /// Does this run have a runner, or is it being settled?
    pub fn knows(&self, run_id: &str) -> bool {
        self.running.contains_key(run_id) || self.settling.iter().any(|s| s.as_str() == run_id)
    }

    /// The runs holding a slot (what `len` counts).
    pub fn slots(&self) -> impl Iterator<Item = &RunId> {
        self.running.keys()
    }

    pub fn ids(&self) -> impl Iterator<Item = &RunId> {
        self.running.keys().chain(self.settling.iter())
    }

    /// Runs whose external-job requests the bridge services: every running
    /// run but those whose dead runner is being cleaned up.
    pub fn bridged(&self) -> impl Iterator<Item = &RunId> {
        self.running.keys().filter(|id| !self.dead.holds(id))
    }

    /// Supervise a run whose runner this daemon did not start.
    pub fn adopt(&mut self, run_id: RunId) {
        self.running.entry(run_id).or_insert(Slot { child: None });
    }

    /// Start the runner of a queued run.
    pub fn start(&mut self, env: &mut Env, run_id: &RunId, out: &mut Vec<Effect>) -> Start {
        let dir = env.layout.run_dir(run_id);
        match self.program.start(&dir) {
            Ok(child) => {
                env.w.outside_ok();
                tracing::info!(run_id = %run_id, runner_pid = child.id(), "runner started");
                self.running.insert(run_id.clone(), Slot { child: Some(child) });
                Start::Started
            }
            Err(SpawnError::Transient { error, message }) => {
                if is_capacity(&error) {
                    env.w.capacity_error(&dir, &error);
                }
                Start::Retry { message }
            }
            Err(SpawnError::Permanent { message }) => {
                tracing::error!(run_id = %run_id, runner = %self.program.describe(), "{message}; the run fails");
                self.fail_unstartable(env, run_id, &message, out);
                Start::Failed
            }
        }
    }

    /// A queued run whose runner cannot be started ends `failed` with the
    /// reason, which names the errno and the runner program.
    fn fail_unstartable(&mut self, env: &mut Env, run_id: &RunId, message: &str, out: &mut Vec<Effect>) {
        let dir = env.layout.run_dir(run_id);
        match take_runner_lock(&dir) {
            Ok(Some(_lock)) => match repair::fail_unstartable(env.w, env.layout, run_id, message) {
                Ok(true) => out.push(Effect::Ended(run_id.clone())),
                Ok(false) => {}
                Err(e) => tracing::error!(run_id = %run_id, error = %e, "could not record why the run failed to start"),
            },
            // Some runner holds it after all: `check` watches it.
            Ok(None) => self.adopt(run_id.clone()),
            Err(e) => tracing::error!(run_id = %run_id, error = %e, "could not record why the run failed to start"),
        }
    }

    /// Free the slots of runners that exited. Perf: the loop reaps, starts
    /// queued runs, and only then settles the finished ones (`check`:
    /// runner lock, status, published markers), so the next queued run
    /// starts without waiting for that.
    pub fn reap(&mut self) {
        let mut exited = Vec::new();
        let mut forked = self.program.exits();
        for (id, slot) in &mut self.running {
            let status = match slot.child.as_mut() {
                None => continue,
                Some(Started::Child(child)) => child.try_wait(),
                Some(Started::Forked { server, serial, .. }) => match forked.exited.remove(&(*server, *serial)) {
                    Some(st) => Ok(Some(st)),
                    None if forked.live_server == Some(*server) => Ok(None),
                    None => {
                        // Its server is gone, so its exit will not be reported: watch its lock.
                        slot.child = None;
                        continue;
                    }
                },
            };
            match status {
                Ok(None) => {} // still alive
                Ok(Some(st)) => {
                    if !st.success() {
                        tracing::warn!(run_id = %id, status = %st, "runner exited abnormally");
                    }
                    exited.push(id.clone());
                }
                Err(_) => exited.push(id.clone()),
            }
        }
        for id in exited {
            self.running.remove(&id);
            self.settling.push(id);
        }
    }

    /// Settle the runs whose runner `reap` saw exit, and check runners we did
    /// not start (re-adopted ones) by their lock; repair the dead ones.
    pub fn check(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        let childless = self.running.iter().filter(|(_, s)| s.child.is_none()).map(|(id, _)| (id.clone(), false));
        let ids: Vec<(RunId, bool)> =
            std::mem::take(&mut self.settling).into_iter().map(|id| (id, true)).chain(childless).collect();
        for (id, reaped) in ids {
            match self.settle(env, &id) {
                Settle::Alive => {
                    if reaped {
                        self.adopt(id);
                    }
                }
                Settle::Held => self.adopt(id),
                Settle::Later => {
                    if reaped {
                        self.settling.push(id);
                    }
                }
                Settle::Ended => {
                    self.running.remove(&id);
                    out.push(Effect::Ended(id));
                }
                Settle::Forget => {
                    self.running.remove(&id);
                }
            }
        }
    }

    /// One run of `check`: is its runner alive, and if not, its run repaired
    /// (or its publication finished)?
    fn settle(&mut self, env: &mut Env, id: &RunId) -> Settle {
        let dir = env.layout.run_dir(id);
        if !run::claimed(&dir) {
            // Only runs we claimed get here; should one ever lose its
            // request.json, taking its lock would write into a directory
            // that may not be ours (§14).
            tracing::warn!(run_id = %id, path = %dir.display(), "run has no request.json; no longer supervised");
            return Settle::Forget;
        }
        let _lock = match take_runner_lock(&dir) {
            // A live runner holds it (one we did not start, after ours exited).
            Ok(None) => return Settle::Alive,
            Ok(Some(lock)) => lock,
            Err(e) if is_capacity(&e) => return Settle::Later,
            Err(e) => {
                tracing::error!(run_id = %id, error = %e, "cannot check the runner lock; forgetting the run");
                return Settle::Forget;
            }
        };
        let r = match run::read_status(&dir) {
            // Its processes and external jobs are being cleared; the repair follows.
            Ok(Some(s)) if s.state.is_active() && self.dead.hold_repair(env.providers, &dir, id, &s) => {
                return Settle::Held
            }
            Ok(Some(s)) if s.state.is_active() => repair::repair(env.w, env.layout, id),
            Ok(Some(s)) => {
                // Another host may have ended it after its runner died (PROTOCOL §12).
                self.dead.clean_ended(env.providers, &dir, id, &s);
                ensure_published_status(env.w, env.layout, id, &s)
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => env.w.outside_ok(),
            Err(e) if is_capacity(&e) => {
                env.w.capacity_error(&dir, &e);
                return Settle::Later; // retried next turn
            }
            Err(e) => tracing::error!(run_id = %id, error = %e, "could not settle a finished run"),
        }
        Settle::Ended
    }

    /// A terminal run of ours found by recovery: when another host ended it
    /// and its runner is dead (its lock is free), its leftover step
    /// processes and external jobs are cleaned up (`DeadRunners::clean_ended`).
    pub fn clean_ended(&mut self, env: &mut Env, id: &RunId, s: &Status) {
        let dir = env.layout.run_dir(id);
        // A runner that holds its lock is finishing its own end, which cleans up.
        if matches!(crate::store::fsutil::lock_held(&crate::store::layout::RunPaths::runner_lock(&dir)), Ok(false)) {
            self.dead.clean_ended(env.providers, &dir, id, s);
        }
    }

    /// Runners are checked once a second while there are any.
    pub fn next_wake(&self) -> Option<Instant> {
        (!self.is_empty()).then(|| Instant::now() + Duration::from_secs(1))
    }

    /// The daemon stops; runs keep running. Reap what already exited.
    pub fn shutdown(&mut self) {
        for slot in self.running.values_mut() {
            if let Some(Started::Child(c)) = slot.child.as_mut() {
                let _ = c.try_wait();
            }
        }
    }
}

enum Settle {
    /// A live runner holds the lock.
    Alive,
    /// A dead runner's processes and jobs are being cleared: ask again.
    Held,
    /// A capacity error: try again next turn.
    Later,
    /// Settled (repaired, published, or nothing to do): the run has ended.
    Ended,
    /// Not ours to supervise, or its lock cannot be checked.
    Forget,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;
    use crate::daemon::spool::intake::{Gate, Intake};
    use crate::protocol::status::State;

    /// A run claimed through the intake, queued, with no runner.
    fn claimed(r: &mut Root, id: &str) -> RunId {
        let id = r.drop_request(id, "true");
        let mut out = Vec::new();
        Intake::default().turn(&mut r.env(), Gate::Open, &mut out);
        assert!(matches!(&out[..], [Effect::Queue(..)]), "{out:?}");
        id
    }

    fn supervisor() -> Supervisor {
        Supervisor::new(RunnerProgram::find(&std::env::current_exe().unwrap()))
    }

    #[test]
    fn a_run_whose_runner_is_gone_is_repaired_failed_and_ends() {
        let mut r = Root::new();
        let id = claimed(&mut r, "sup-dead");
        let mut sup = supervisor();
        sup.adopt(id.clone());
        assert!(sup.knows(&id));
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        // The dead runner's leftovers are cleared on a thread first: check again until it ends.
        while out.is_empty() && Instant::now() < deadline {
            sup.check(&mut r.env(), &mut out);
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(matches!(&out[..], [Effect::Ended(e)] if *e == id), "{out:?}");
        assert!(!sup.knows(&id));
        assert!(r.w.flush());
        let s = r.status(&id);
        assert_eq!(s.state, State::Failed);
        assert!(s.error.as_deref().is_some_and(|e| e.contains("exited before recording a result")), "{:?}", s.error);
        assert!(!r.layout.active_marker(&id).exists());
    }

    #[test]
    fn a_run_whose_runner_lock_is_held_stays_supervised() {
        let mut r = Root::new();
        let id = claimed(&mut r, "sup-live");
        // This test stands for the live runner: it holds runner.lock.
        let _lock = crate::store::run::take_runner_lock(&r.layout.run_dir(&id)).unwrap().unwrap();
        let mut sup = supervisor();
        sup.adopt(id.clone());
        let mut out = Vec::new();
        sup.check(&mut r.env(), &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert!(sup.knows(&id));
        assert_eq!(sup.bridged().collect::<Vec<_>>(), vec![&id]);
        assert_eq!(r.status(&id).state, State::Queued);
    }
}
