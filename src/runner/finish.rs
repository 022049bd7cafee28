//! The end of a run: its terminal status, events, indexes and result, and
//! the processes its steps left behind.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nix::unistd::Pid;
use serde_json::json;

use super::{Runner, Running};
use crate::protocol::outcome::{run_ending, Halt};
use crate::protocol::status::{OpenSteps, State, Status, StepState};
use crate::store::results;

impl Runner {
    pub(super) fn finish(&mut self) {
        let now = crate::now_ms();
        let (state, skip_status, skip_msg) = run_ending(self.halt, self.any_failed());
        // Skipped steps are not failed ones: the first error is read before they are skipped.
        let error = (state != State::Complete).then(|| match self.halt {
            Some(_) => self.halt_reason.clone(),
            None => first_error(&self.status),
        });
        self.status.end(state.clone(), error, &OpenSteps::skipped(skip_status, skip_msg), now);
        self.status.timed_out = self.halt == Some(Halt::Timeout) || self.step_timed_out;
        let duration = now - self.status.started_at;
        match self.halt {
            Some(Halt::Stop) => self.ev("subagent.run.stopped", json!({"message": self.halt_reason})),
            Some(Halt::Timeout) => self.ev(
                "subagent.run.timed_out",
                json!({"timeoutMs": self.status.timeout_ms, "deadlineAt": self.status.deadline_at, "message": self.halt_reason}),
            ),
            Some(Halt::Interrupt) => self.ev("subagent.run.paused", json!({"message": self.halt_reason})),
            None => {}
        }
        // The event goes first: a reader that sees the terminal status finds the whole story.
        self.ev(
            "subagent.run.completed",
            json!({"status": state.as_str(), "durationMs": duration, "exitCode": self.status.exit_code}),
        );
        self.save();
        if let Err(e) = results::finish_terminal(&mut self.w, &self.layout, &self.id, &self.status) {
            crate::note!("publishing the run's indexes and result failed: {e}");
        }
        // A runner with pending terminal writes does not exit (PROTOCOL §11).
        let mut waited = 0u64;
        while !self.w.flush() {
            if waited.is_multiple_of(60) {
                crate::note!(
                    "storage full: the terminal status is kept in memory and retried every second ({waited} s so far)"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
            waited += 1;
        }
    }
}

impl Runner {
    /// Reap the orphans this subreaper adopted that exited, and kill (then
    /// reap) what the steps in `ended` (index, process group) left behind:
    /// every adopted process in one of their process groups, or started with
    /// one of their `RUNSPOOL_STEP_INDEX` values in this run. With no step
    /// running (between steps, at the run's end) every adopted process goes,
    /// whatever its environment says. Killing one may orphan its own
    /// children to us: repeat until nothing is left (bounded).
    pub(super) fn contain(&mut self, ended: &[(usize, u32)], running: &BTreeMap<usize, Running>) {
        use crate::platform::procs;
        // Step processes are reaped by their `Child` (try_wait), never here.
        let steps: std::collections::HashSet<u32> =
            running.values().filter(|r| r.child.is_some()).map(|r| r.pid).collect();
        let all = running.is_empty();
        let adopted = || procs::children().into_iter().filter(|p| !steps.contains(p)).filter(|&p| !reap(p));
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
                tracing::info!(run_id = %self.status.run_id, pid, "killing a process that escaped its step");
                procs::kill_with_group(pid);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Reap `pid` if it has exited. True when it is gone (reaped now, or not our child).
fn reap(pid: u32) -> bool {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    match waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) => false,
        Ok(_) => true,
        Err(_) => true,
    }
}

fn first_error(s: &Status) -> String {
    s.steps
        .iter()
        .enumerate()
        .find(|(_, st)| matches!(st.status, StepState::Failed | StepState::Stopped) && st.exit_code != Some(-1))
        .map(|(i, st)| format!("step {i} ({}) {}: {}", st.agent, st.status, st.error.clone().unwrap_or_default()))
        .unwrap_or_else(|| "the run failed".into())
}
