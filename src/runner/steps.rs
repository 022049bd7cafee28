//! Steps: the group loop, starting command steps in their own process
//! groups, timeouts and signal escalation, and recording how each ended.

use std::collections::{BTreeMap, VecDeque};
use std::io::Read as _;
use std::os::fd::AsFd as _;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;

use super::{heartbeat, signal_group, Msg, Runner, Running};
use crate::platform::exec;
use crate::protocol::outcome::{classify, Exit, Halt, StepEnd};
use crate::protocol::request::{Item, Step};
use crate::protocol::status::StepState;
use crate::store::fsutil;
use crate::store::layout::RunPaths;

impl Runner {
    pub(super) fn execute(&mut self) {
        self.check_control();
        let items = self.req.steps.clone();
        let mut flat = 0;
        for (ti, item) in items.iter().enumerate() {
            let members: Vec<usize> = match item {
                Item::Step(_) => vec![flat],
                Item::Parallel(p) => (flat..flat + p.parallel.len()).collect(),
            };
            flat += members.len();
            if self.halt.is_some() || self.any_failed() {
                break;
            }
            self.status.current_step = ti;
            let ok = match item {
                Item::Step(_) => self.run_group(&members, 1),
                Item::Parallel(p) => {
                    let agents: Vec<String> = members.iter().map(|&i| self.status.steps[i].agent.clone()).collect();
                    self.ev(
                        "subagent.parallel.started",
                        json!({"stepIndex": ti, "agents": agents, "count": members.len()}),
                    );
                    let conc = p.concurrency.map(|c| c as usize).unwrap_or(members.len()).max(1);
                    let ok = self.run_group(&members, conc);
                    self.ev("subagent.parallel.completed", json!({"stepIndex": ti, "success": ok}));
                    ok
                }
            };
            self.previous_output = members.last().and_then(|&i| self.status.steps[i].output_file.clone());
            if !ok {
                break;
            }
        }
    }

    /// A failed step, or one stopped on its own by a targeted stop request:
    /// either ends a chain, and the run is `failed` unless it was halted.
    pub(super) fn any_failed(&self) -> bool {
        self.status.steps.iter().any(|s| matches!(s.status, StepState::Failed | StepState::Stopped))
    }

    /// A pending step a stop request named: it never starts.
    fn skip_stopped(&mut self, i: usize, why: String) {
        let agent = self.status.steps[i].agent.clone();
        let st = &mut self.status.steps[i];
        st.status = StepState::Stopped;
        st.stopped = Some(true);
        st.exit_code = Some(-1);
        st.duration_ms = Some(0);
        st.error = Some(format!("{why} before it started"));
        self.save();
        self.ev("subagent.step.stopped", json!({"stepIndex": i, "agent": agent, "exitCode": -1, "durationMs": 0}));
    }

    /// Run the given flat steps with at most `conc` at once. True if all complete.
    fn run_group(&mut self, members: &[usize], conc: usize) -> bool {
        let mut queue: VecDeque<usize> = members.iter().copied().collect();
        let mut running: BTreeMap<usize, Running> = BTreeMap::new();
        let steps: Vec<Step> = self.req.flat_steps().into_iter().cloned().collect();
        loop {
            while self.halt.is_none() && running.len() < conc {
                let Some(i) = queue.pop_front() else { break };
                if let Some((why, _)) = self.step_stop.get(&i).cloned() {
                    self.skip_stopped(i, why);
                    continue;
                }
                if let Some(r) = self.spawn(i, &steps[i]) {
                    running.insert(i, r);
                }
            }
            if running.is_empty() {
                break;
            }
            let now = Instant::now();
            self.sleep(self.next_wake(&running).saturating_duration_since(now));
            while let Ok(m) = self.rx.try_recv() {
                match m {
                    Msg::External(i, ev) => self.on_external(i, ev, &mut running),
                    Msg::Control => {}
                }
            }
            self.reap_exited(&mut running);
            if self.watch_at.is_some_and(|t| Instant::now() >= t) {
                self.watch_at = None;
                self.watch_control(); // the check_control below sees what landed before the watch
            }
            let before = self.halt;
            self.check_control();
            let now = Instant::now();
            if now >= self.next_heartbeat {
                // pi-subagents 0.67 fails a run whose pid lives but whose
                // lastUpdate is over 24 h old; a long step must not look stale.
                self.next_heartbeat = now + heartbeat();
                self.save();
            }
            if self.halt.is_none() && now >= self.run_deadline {
                let msg = format!("run timed out after {} ms", self.status.timeout_ms);
                self.request_halt(Halt::Timeout, msg);
            }
            self.signal_steps(&mut running, before, now);
        }
        members.iter().all(|&i| self.status.steps[i].status == StepState::Complete)
    }

    /// When the loop wakes next: the nearest deadline, at most 1 s away (the
    /// control inbox is re-checked at least that often).
    fn next_wake(&self, running: &BTreeMap<usize, Running>) -> Instant {
        let mut wake = Instant::now() + Duration::from_secs(1);
        if self.halt.is_none() {
            wake = wake.min(self.run_deadline);
        }
        if let Some(t) = self.watch_at {
            wake = wake.min(t);
        }
        for r in running.values() {
            if let Some(d) = r.deadline {
                wake = wake.min(d);
            }
            if let Some((t, _)) = r.escalate {
                wake = wake.min(t);
            }
        }
        wake
    }

    /// Record the command steps that exited, and take what they left behind
    /// with them; orphans that exited on their own are reaped (they are our
    /// children now).
    fn reap_exited(&mut self, running: &mut BTreeMap<usize, Running>) {
        let exited: Vec<(usize, std::io::Result<ExitStatus>)> = running
            .iter_mut()
            .filter_map(|(&i, r)| match r.child.as_mut()?.try_wait() {
                Ok(None) => None,
                Ok(Some(st)) => Some((i, Ok(st))),
                Err(e) => Some((i, Err(e))),
            })
            .collect();
        let ended: Vec<(usize, u32)> = exited.iter().filter_map(|(i, _)| running.get(i).map(|r| (*i, r.pid))).collect();
        for (i, res) in exited {
            if let Some(r) = running.remove(&i) {
                // Perf: with nothing else running, the next status write (the
                // next step's start, or the terminal status) follows at once
                // and carries this exit too: one write and one inode fewer per
                // step. A member whose siblings still run is saved now.
                let save_now = !running.is_empty();
                self.record_exit(i, r, res, save_now);
            }
        }
        self.contain(&ended, running);
    }

    /// Signal the running steps: those a stop request named, all of them when
    /// the halt changed since `before`, those past their own deadline; and
    /// escalate what is due (SIGINT, then SIGTERM, then SIGKILL).
    fn signal_steps(&mut self, running: &mut BTreeMap<usize, Running>, before: Option<Halt>, now: Instant) {
        for (i, r) in running.iter_mut() {
            if let Some((_, sent)) = self.step_stop.get_mut(i) {
                if !*sent {
                    *sent = true;
                    r.signal(Signal::SIGTERM);
                    r.escalate = Some((now + Duration::from_secs(3), Signal::SIGKILL));
                }
            }
        }
        if self.halt != before {
            let first = match self.halt {
                Some(Halt::Interrupt) => (Signal::SIGINT, Duration::from_secs(1), Signal::SIGTERM),
                _ => (Signal::SIGTERM, Duration::from_secs(3), Signal::SIGKILL),
            };
            for r in running.values_mut() {
                r.signal(first.0);
                r.escalate = Some((now + first.1, first.2));
            }
        }
        for r in running.values_mut() {
            if r.deadline.is_some_and(|d| now >= d) && !r.timed_out {
                r.timed_out = true;
                r.deadline = None;
                r.signal(Signal::SIGTERM);
                r.escalate = Some((now + Duration::from_secs(3), Signal::SIGKILL));
            }
            if let Some((t, sig)) = r.escalate {
                if now >= t {
                    r.signal(sig);
                    // After SIGTERM (interrupt ladder) comes SIGKILL; after SIGKILL, nothing.
                    r.escalate = (sig == Signal::SIGTERM).then(|| (now + Duration::from_secs(3), Signal::SIGKILL));
                }
            }
        }
    }

    fn spawn(&mut self, i: usize, step: &Step) -> Option<Running> {
        let out_path = RunPaths::output(&self.dir, i);
        let now_ms = crate::now_ms();
        let agent = self.status.steps[i].agent.clone();
        {
            let st = &mut self.status.steps[i];
            st.status = StepState::Running;
            st.started_at = Some(now_ms);
            st.output_file = Some(out_path.display().to_string());
        }
        self.status.output_file = Some(out_path.display().to_string());
        let started = Instant::now();
        let result = match (&step.command, &step.external_job) {
            (Some(argv), _) => self.start_command(i, step, argv, &out_path),
            (None, Some(j)) => return self.spawn_external(i, step, j, started),
            (None, None) => Err("the step has no command".to_string()),
        };
        match result {
            Ok(child) => {
                let pid = child.id();
                self.status.steps[i].pid = Some(pid);
                self.save();
                self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
                let deadline = step.timeout_ms.map(|t| started + Duration::from_millis(t));
                Some(Running {
                    pid,
                    child: Some(child),
                    started,
                    deadline,
                    escalate: None,
                    timed_out: false,
                    external: None,
                })
            }
            Err(msg) => {
                self.fail_unstarted(i, &agent, &out_path, 127, msg, None);
                None
            }
        }
    }

    /// A step that could not start: its reason goes to its log and status,
    /// with `code` as its exit code (and the external job's record, if any).
    pub(crate) fn fail_unstarted(
        &mut self,
        i: usize,
        agent: &str,
        out: &Path,
        code: i32,
        msg: String,
        job: Option<serde_json::Value>,
    ) {
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
        let _ = fsutil::append_line(out, format!("runspool: {msg}").as_bytes());
        let st = &mut self.status.steps[i];
        st.status = StepState::Failed;
        st.exit_code = Some(code);
        st.error = Some(msg);
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(0);
        if job.is_some() {
            st.external_job = job.clone();
        }
        self.save();
        if let Some(job) = job {
            self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
        }
        self.ev("subagent.step.failed", json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": 0}));
    }

    fn start_command(&mut self, i: usize, step: &Step, argv: &[String], out: &Path) -> Result<Child, String> {
        // A full disk (or fd table) is waited out here rather than failing the
        // step; a stop request is seen once the file exists.
        let (file, err) = fsutil::wait_out_capacity(out, || {
            // An earlier step may have planted a FIFO here: refused, never waited on.
            let f = fsutil::open_append(out)?;
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
        cmd.env("RUNSPOOL_RUN_ID", &self.status.run_id)
            .env("RUNSPOOL_RUN_DIR", &self.dir)
            .env("RUNSPOOL_STEP_INDEX", i.to_string())
            .env("RUNSPOOL_PREVIOUS_OUTPUT", self.previous_output.as_deref().unwrap_or(""));
        cmd.spawn().map_err(|e| format!("cannot start `{}`: {e}", argv[0]))
    }

    /// Sleep until a step exits (SIGCHLD), another thread posts a message, or
    /// `d` has passed; then empty the wake socket.
    fn sleep(&self, d: Duration) {
        let ms = u16::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(self.wake.as_fd(), nix::poll::PollFlags::POLLIN)];
        // EINTR means a signal arrived, which is as good as a byte.
        let _ = nix::poll::poll(&mut fds, ms);
        let mut buf = [0u8; 64];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }

    fn record_exit(&mut self, i: usize, r: Running, res: std::io::Result<ExitStatus>, save_now: bool) {
        let (code, signal) = match res {
            Ok(st) => match (st.code(), st.signal()) {
                (Some(c), _) => (c, None),
                (None, Some(s)) => (128 + s, Some(crate::platform::signal_name(s))),
                _ => (1, None),
            },
            Err(_) => (1, None),
        };
        // The group may have members left after its leader exited.
        signal_group(r.pid, Signal::SIGKILL);
        let dur = r.started.elapsed().as_millis() as i64;
        let outcome = classify(StepEnd {
            exit: Exit::Process { code, signal },
            timed_out: r.timed_out,
            halt: self.halt,
            stopped_alone: self.step_stop.get(&i).map(|(why, _)| why.as_str()),
            duration_ms: dur,
        });
        self.step_timed_out |= r.timed_out;
        let st = &mut self.status.steps[i];
        outcome.apply(st);
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(dur);
        let agent = st.agent.clone();
        if save_now {
            self.save();
        }
        self.ev(
            &format!("subagent.step.{}", outcome.event_kind()),
            json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": dur}),
        );
    }
}
