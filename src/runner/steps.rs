//! Steps: the group loop (which item is next, how many of a parallel group
//! run at once), starting command steps through the child supervisor
//! (`platform::child`: their own process groups, the kill ladder), reaping
//! them, their timeouts, and containing what escaped them. Owns the running
//! steps; says what happened as `Effect`s, which the `Runner` hands to the
//! record (and, for external-job steps, to the external part).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::platform::child::{self, Child, Ladder, Schedule, Signal};
use crate::platform::exec;
use crate::protocol::outcome::Halt;
use crate::protocol::request::{ExternalJob, Item, Request, Step};
use crate::protocol::status::{Status, StepState};
use crate::store::fsutil;
use crate::store::layout::RunPaths;

/// What the steps did, for the other parts (applied in order).
#[derive(Debug)]
pub(super) enum Effect {
    /// Top-level item `ti` starts with these members.
    GroupStarted { ti: usize, members: Vec<usize>, parallel: bool },
    /// Item `ti` ended; `ok`: every member completed.
    GroupEnded { ti: usize, ok: bool, parallel: bool },
    /// A pending step a stop request named never starts.
    Skip { i: usize, why: String },
    /// Step `i` is being started (epoch ms).
    Starting { i: usize, at: i64 },
    /// Command step `i` started as process group `pid`.
    Started { i: usize, pid: u32 },
    /// Command step `i` could not start.
    Unstarted { i: usize, msg: String },
    /// External-job step `i` is to be dispatched (it is running from now on).
    External { i: usize, step: Box<Step>, job: Box<ExternalJob> },
    /// Command step `i`'s process exited: its code (128 + n for signal n)
    /// and the signal's name. `save_now`: other steps still run.
    Exited { i: usize, code: i32, signal: Option<String>, timed_out: bool, duration_ms: i64, save_now: bool },
    /// External-job step `i` is due this signal of its ladder.
    SignalExternal { i: usize, sig: Signal },
}

/// What the steps read of the other parts' state.
pub(super) struct View<'a> {
    pub status: &'a Status,
    pub halt: Option<Halt>,
    /// Steps a stop request named alone, with its reason.
    pub stops: &'a BTreeMap<usize, String>,
}

/// The item being run.
struct Group {
    ti: usize,
    members: Vec<usize>,
    conc: usize,
    queue: VecDeque<usize>,
    parallel: bool,
}

enum Slot {
    /// A command step: its process group.
    Command(Child),
    /// An external-job step: its driver is the external part's; the ladder is ours.
    External(Schedule),
}

struct Running {
    started: Instant,
    slot: Slot,
}

pub(super) struct Steps {
    dir: PathBuf,
    run_id: String,
    req: Request,
    flat: Vec<Step>,
    /// The next top-level item.
    next_item: usize,
    next_flat: usize,
    group: Option<Group>,
    running: BTreeMap<usize, Running>,
    previous_output: Option<String>,
    step_timed_out: bool,
    /// The halt the running steps were last signalled for.
    halt_seen: Option<Halt>,
    /// Steps a stop request named that were signalled already.
    stop_sent: BTreeSet<usize>,
    /// Command steps (index, process group) that exited since the last `contain`.
    ended: Vec<(usize, u32)>,
    /// The last `contain` found nothing left with no step running, and no
    /// step started since: nothing of the run's can be around any more.
    swept: bool,
    done: bool,
}

impl Steps {
    pub(super) fn new(dir: PathBuf, run_id: String, req: Request) -> Steps {
        let flat = req.flat_steps().into_iter().cloned().collect();
        Steps {
            dir,
            run_id,
            req,
            flat,
            next_item: 0,
            next_flat: 0,
            group: None,
            running: BTreeMap::new(),
            previous_output: None,
            step_timed_out: false,
            halt_seen: None,
            stop_sent: BTreeSet::new(),
            ended: Vec::new(),
            swept: false,
            done: false,
        }
    }

    /// No step runs and none will start.
    pub(super) fn done(&self) -> bool {
        self.done
    }

    /// A step (command or external job) is running.
    pub(super) fn running(&self) -> bool {
        !self.running.is_empty()
    }

    /// A step's own `timeoutMs` fired.
    pub(super) fn step_timed_out(&self) -> bool {
        self.step_timed_out
    }

    /// One move of the group loop: start the next item, start (or skip) one
    /// more of its members, or end it once none runs. None: nothing to do
    /// until a step ends (or all is done).
    pub(super) fn advance(&mut self, v: &View) -> Option<Vec<Effect>> {
        if self.done {
            return None;
        }
        let Some(g) = self.group.as_mut() else {
            // A failed step, or one stopped on its own, ends a chain; so does a halt.
            let failed = v.status.steps.iter().any(|s| matches!(s.status, StepState::Failed | StepState::Stopped));
            let Some(item) = self.req.steps.get(self.next_item).filter(|_| v.halt.is_none() && !failed) else {
                self.done = true;
                return None;
            };
            let ti = self.next_item;
            let (members, conc, parallel): (Vec<usize>, usize, bool) = match item {
                Item::Step(_) => (vec![self.next_flat], 1, false),
                Item::Parallel(p) => {
                    let m: Vec<usize> = (self.next_flat..self.next_flat + p.parallel.len()).collect();
                    let conc = p.concurrency.map(|c| c as usize).unwrap_or(m.len()).max(1);
                    (m, conc, true)
                }
            };
            self.next_item += 1;
            self.next_flat += members.len();
            let queue = members.iter().copied().collect();
            self.group = Some(Group { ti, members: members.clone(), conc, queue, parallel });
            return Some(vec![Effect::GroupStarted { ti, members, parallel }]);
        };
        if v.halt.is_none() && self.running.len() < g.conc {
            if let Some(i) = g.queue.pop_front() {
                if let Some(why) = v.stops.get(&i) {
                    return Some(vec![Effect::Skip { i, why: why.clone() }]);
                }
                return Some(self.spawn(i));
            }
        }
        if !self.running.is_empty() {
            return None;
        }
        let g = self.group.take()?;
        let ok = g.members.iter().all(|&i| v.status.steps[i].status == StepState::Complete);
        self.previous_output = g.members.last().and_then(|&i| v.status.steps[i].output_file.clone());
        self.done = !ok;
        Some(vec![Effect::GroupEnded { ti: g.ti, ok, parallel: g.parallel }])
    }

    fn spawn(&mut self, i: usize) -> Vec<Effect> {
        self.swept = false;
        let at = crate::now_ms();
        let step = self.flat[i].clone();
        let started = Instant::now();
        let deadline = step.timeout_ms.map(|t| started + Duration::from_millis(t));
        let mut fx = vec![Effect::Starting { i, at }];
        match (&step.command, &step.external_job) {
            (Some(argv), _) => match self.start_command(i, &step, argv, deadline) {
                Ok(c) => {
                    fx.push(Effect::Started { i, pid: c.id() });
                    self.running.insert(i, Running { started, slot: Slot::Command(c) });
                }
                Err(msg) => fx.push(Effect::Unstarted { i, msg }),
            },
            (None, Some(job)) => {
                let slot = Slot::External(Schedule::new(deadline, Ladder::STOP));
                self.running.insert(i, Running { started, slot });
                fx.push(Effect::External { i, job: Box::new(job.clone()), step: Box::new(step.clone()) });
            }
            (None, None) => fx.push(Effect::Unstarted { i, msg: "the step has no command".to_string() }),
        }
        fx
    }

    fn start_command(
        &mut self,
        i: usize,
        step: &Step,
        argv: &[String],
        deadline: Option<Instant>,
    ) -> Result<Child, String> {
        let out = RunPaths::output(&self.dir, i);
        // A full disk (or fd table) is waited out here rather than failing the
        // step; a stop request is seen once the file exists.
        let (file, err) = fsutil::wait_out_capacity(&out, || {
            // An earlier step may have planted a FIFO here: refused, never waited on.
            let f = fsutil::open_append(&out)?;
            let e = f.try_clone()?;
            Ok((f, e))
        })
        .map_err(|e| format!("cannot open {}: {e}", out.display()))?;
        let mut cmd = exec::command(&argv[0], exec::Detach { own_group: true, die_with_thread: false });
        cmd.args(&argv[1..])
            .current_dir(step.cwd.as_deref().unwrap_or(&self.req.cwd))
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err);
        cmd.envs(&self.req.env).envs(&step.env);
        cmd.env("RUNSPOOL_RUN_ID", &self.run_id)
            .env("RUNSPOOL_RUN_DIR", &self.dir)
            .env("RUNSPOOL_STEP_INDEX", i.to_string())
            .env("RUNSPOOL_PREVIOUS_OUTPUT", self.previous_output.as_deref().unwrap_or(""));
        Child::spawn(&mut cmd, deadline, Ladder::STOP).map_err(|e| format!("cannot start `{}`: {e}", argv[0]))
    }

    /// An external-job step the external part could not start (or whose
    /// driver did not): it runs no more.
    pub(super) fn forget(&mut self, i: usize) {
        self.running.remove(&i);
    }

    /// External-job step `i` ended: how long it ran and whether its own
    /// timeout fired. None when it was not running.
    pub(super) fn external_ended(&mut self, i: usize) -> Option<(i64, bool)> {
        let r = self.running.remove(&i)?;
        let timed_out = match &r.slot {
            Slot::External(s) => s.timed_out(),
            Slot::Command(c) => c.timed_out(),
        };
        self.step_timed_out |= timed_out;
        Some((r.started.elapsed().as_millis() as i64, timed_out))
    }

    /// When the steps need the loop next: the nearest deadline or rung.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        self.running
            .values()
            .filter_map(|r| match &r.slot {
                Slot::Command(c) => c.next_wake(),
                Slot::External(s) => s.next_wake(),
            })
            .min()
    }

    /// The command steps whose process exited; `contain` then takes what
    /// they left behind.
    pub(super) fn reap(&mut self) -> Vec<Effect> {
        let exited: Vec<(usize, std::io::Result<ExitStatus>)> = self
            .running
            .iter_mut()
            .filter_map(|(&i, r)| match &mut r.slot {
                Slot::Command(c) => match c.try_wait() {
                    Ok(None) => None,
                    Ok(Some(st)) => Some((i, Ok(st))),
                    Err(e) => Some((i, Err(e))),
                },
                Slot::External(_) => None,
            })
            .collect();
        let mut fx = Vec::new();
        for (i, res) in exited {
            let Some(Running { started, slot: Slot::Command(c) }) = self.running.remove(&i) else { continue };
            let (code, signal) = match res {
                Ok(st) => match (st.code(), st.signal()) {
                    (Some(c), _) => (c, None),
                    (None, Some(s)) => (128 + s, Some(crate::platform::signal_name(s))),
                    _ => (1, None),
                },
                Err(_) => (1, None),
            };
            // The group may have members left after its leader exited.
            c.kill();
            self.ended.push((i, c.id()));
            self.step_timed_out |= c.timed_out();
            fx.push(Effect::Exited {
                i,
                code,
                signal,
                timed_out: c.timed_out(),
                duration_ms: started.elapsed().as_millis() as i64,
                // Perf: with nothing else running, the next status write (the
                // next step's start, or the terminal status) carries this exit.
                save_now: !self.running.is_empty(),
            });
        }
        fx
    }

    /// Signal the running steps: those a stop request named, all of them when
    /// the halt changed since they were last signalled, those past their own
    /// deadline; and climb the ladders (`Ladder::STOP`, `Ladder::INTERRUPT`).
    pub(super) fn signal(&mut self, now: Instant, v: &View) -> Vec<Effect> {
        let mut fx = Vec::new();
        let halt_changed = v.halt != self.halt_seen;
        self.halt_seen = v.halt;
        let on_halt = match v.halt {
            Some(Halt::Interrupt) => Ladder::INTERRUPT,
            _ => Ladder::STOP,
        };
        for (&i, r) in self.running.iter_mut() {
            let mut ladders = Vec::new();
            if v.stops.contains_key(&i) && self.stop_sent.insert(i) {
                ladders.push(Ladder::STOP);
            }
            if halt_changed {
                ladders.push(on_halt);
            }
            match &mut r.slot {
                Slot::Command(c) => {
                    for l in ladders {
                        c.stop(l, now);
                    }
                    c.tick(now);
                }
                Slot::External(s) => {
                    for l in ladders {
                        fx.push(Effect::SignalExternal { i, sig: s.start(l, now) });
                    }
                    if let Some(sig) = s.due(now) {
                        fx.push(Effect::SignalExternal { i, sig });
                    }
                }
            }
        }
        fx
    }

    /// The run's last containment: whatever escaped its steps and is still
    /// around ends with the run. Perf: skipped when the loop's last pass,
    /// after the last step ended, already found nothing (it ran with no step
    /// running, so it took every adopted process); `/proc/self/task/*/children`
    /// is then read twice per run, not four times.
    pub(super) fn contain_at_end(&mut self) {
        if !self.swept {
            self.contain();
        }
    }

    /// Reap the orphans this subreaper adopted that exited, and kill (then
    /// reap) what the steps that ended since the last call left behind:
    /// every adopted process in one of their process groups, or started with
    /// one of their `RUNSPOOL_STEP_INDEX` values in this run. With no step
    /// running (between steps, at the run's end) every adopted process goes,
    /// whatever its environment says. Killing one may orphan its own
    /// children to us: repeat until nothing is left (bounded).
    pub(super) fn contain(&mut self) {
        use crate::platform::procs;
        self.swept = false;
        let ended = std::mem::take(&mut self.ended);
        // Step processes are reaped by their `Child` (try_wait), never here.
        let steps: std::collections::HashSet<u32> = self
            .running
            .values()
            .filter_map(|r| match &r.slot {
                Slot::Command(c) => Some(c.id()),
                Slot::External(_) => None,
            })
            .collect();
        let all = self.running.is_empty();
        let adopted =
            || procs::children().into_iter().filter(|p| !steps.contains(p)).filter(|&p| !child::reap_adopted(p));
        if ended.is_empty() && !all {
            adopted().for_each(drop);
            return;
        }
        let run_dir = self.dir.as_os_str().as_encoded_bytes().to_vec();
        let left_by_ended = |pid: u32| -> bool {
            let pgrp = procs::stat(pid).map(|s| s.pgrp);
            let ours = procs::environ_var(pid, "RUNSPOOL_RUN_DIR").is_some_and(|d| d == run_dir);
            let index = procs::environ_var(pid, "RUNSPOOL_STEP_INDEX").filter(|_| ours);
            ended.iter().any(|(i, pg)| pgrp == Some(*pg) || index.as_deref() == Some(i.to_string().as_bytes()))
        };
        let until = Instant::now() + Duration::from_secs(5);
        // A `children` file read while the list changes may miss an entry:
        // done after two clean reads in a row.
        let mut clean = 0;
        loop {
            let targets: Vec<u32> = adopted().filter(|&p| all || left_by_ended(p)).collect();
            if targets.is_empty() {
                clean += 1;
                if clean == 2 {
                    self.swept = all;
                    return;
                }
                continue;
            }
            clean = 0;
            if Instant::now() >= until {
                crate::note!(
                    "processes {targets:?} left by the steps of {} survive SIGKILL (uninterruptible?); giving up on them",
                    self.dir.display()
                );
                return;
            }
            for &pid in &targets {
                tracing::info!(run_id = %self.run_id, pid, "killing a process that escaped its step");
                procs::kill_with_group(pid);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The steps of `body` run to their end, each effect applied to the
    /// status the way the record does, with no daemon and no other part.
    /// Returns the status, the effects in order, and the most steps that
    /// ran at once. (`contain` is left out: in a test binary every other
    /// test's children are ours too.)
    fn run(body: serde_json::Value) -> (Status, Vec<String>, usize, bool) {
        let dir = tempfile::tempdir().unwrap();
        let req: Request = serde_json::from_value(body).unwrap();
        let mut status = Status::queued(&req, "run-steps-test", dir.path(), crate::now_ms());
        let mut steps = Steps::new(dir.path().to_path_buf(), "run-steps-test".into(), req);
        let stops = BTreeMap::new();
        let (mut log, mut most, mut now_running) = (Vec::new(), 0, 0usize);
        let until = Instant::now() + Duration::from_secs(60);
        let mut apply = |fx: Vec<Effect>, status: &mut Status| {
            for e in fx {
                match &e {
                    Effect::Starting { i, .. } => status.steps[*i].status = StepState::Running,
                    Effect::Started { .. } => {
                        now_running += 1;
                        most = most.max(now_running);
                    }
                    Effect::Unstarted { i, .. } => status.steps[*i].status = StepState::Failed,
                    Effect::Exited { i, code, .. } => {
                        now_running -= 1;
                        status.steps[*i].status = if *code == 0 { StepState::Complete } else { StepState::Failed };
                        status.steps[*i].exit_code = Some(*code);
                    }
                    _ => {}
                }
                log.push(format!("{e:?}").split([' ', '{']).next().unwrap().to_string());
            }
        };
        loop {
            while let Some(fx) = steps.advance(&View { status: &status, halt: None, stops: &stops }) {
                apply(fx, &mut status);
            }
            if steps.done() {
                break;
            }
            assert!(Instant::now() < until, "the steps never ended");
            std::thread::sleep(Duration::from_millis(10));
            let fx = steps.reap();
            apply(fx, &mut status);
            let fx = steps.signal(Instant::now(), &View { status: &status, halt: None, stops: &stops });
            apply(fx, &mut status);
        }
        (status, log, most, steps.step_timed_out())
    }

    fn cwd() -> String {
        std::env::temp_dir().display().to_string()
    }

    #[test]
    fn a_chain_stops_at_its_first_failed_step() {
        let (s, log, _, timed_out) = run(json!({"version": 1, "cwd": cwd(), "steps": [
            {"command": ["true"]}, {"command": ["false"]}, {"command": ["true"]}]}));
        let states: Vec<StepState> = s.steps.iter().map(|s| s.status.clone()).collect();
        assert_eq!(states, [StepState::Complete, StepState::Failed, StepState::Pending]);
        assert_eq!(s.steps[1].exit_code, Some(1));
        assert!(!timed_out);
        assert_eq!(
            log,
            [
                "GroupStarted",
                "Starting",
                "Started",
                "Exited",
                "GroupEnded",
                "GroupStarted",
                "Starting",
                "Started",
                "Exited",
                "GroupEnded",
            ]
        );
    }

    #[test]
    fn a_step_past_its_timeout_is_stopped_by_the_ladder() {
        let (s, _, _, timed_out) = run(json!({"version": 1, "cwd": cwd(), "steps": [
            {"command": ["sleep", "30"], "timeoutMs": 200}, {"command": ["true"]}]}));
        assert!(timed_out);
        assert_eq!(s.steps[0].status, StepState::Failed);
        assert_eq!(s.steps[0].exit_code, Some(128 + libc::SIGTERM), "SIGTERM, the ladder's first rung");
        assert_eq!(s.steps[1].status, StepState::Pending);
    }

    #[test]
    fn a_parallel_group_runs_at_most_its_concurrency_at_once() {
        let sleep = json!({"command": ["sleep", "0.2"]});
        let (s, _, most, _) = run(json!({"version": 1, "cwd": cwd(), "steps": [
            {"parallel": [sleep, sleep, sleep, sleep, sleep], "concurrency": 2}, {"command": ["true"]}]}));
        assert!(s.steps.iter().all(|s| s.status == StepState::Complete), "{:?}", s.steps);
        assert_eq!(most, 2);
        let (_, _, most, _) = run(json!({"version": 1, "cwd": cwd(), "steps": [{"parallel": [sleep, sleep, sleep]}]}));
        assert_eq!(most, 3, "without a limit every member starts at once");
    }

    #[test]
    fn a_command_that_cannot_start_fails_its_step() {
        let (s, log, _, _) =
            run(json!({"version": 1, "cwd": cwd(), "steps": [{"command": ["/nonexistent/runspool-test"]}]}));
        assert_eq!(s.steps[0].status, StepState::Failed);
        assert_eq!(log, ["GroupStarted", "Starting", "Unstarted", "GroupEnded"]);
    }
}
