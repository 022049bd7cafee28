//! How a step ended and how a run ends, decided in one place for command
//! steps and external-job steps alike (PROTOCOL §4). Pure: the runner
//! gathers the facts, these functions say what status.json records.

use super::status::{State, Status, StepState, StepStatus};

/// Why the runner halts a run. Ordered weakest first: a stronger halt
/// replaces a weaker one, never the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Halt {
    Interrupt,
    Timeout,
    Stop,
}

/// The run's terminal state, the status its unfinished steps take and
/// their `error`, given the halt (if any) and whether a step failed or was
/// stopped on its own.
pub fn run_ending(halt: Option<Halt>, any_failed: bool) -> (State, StepState, &'static str) {
    match halt {
        Some(Halt::Stop) => (State::Stopped, StepState::Stopped, "skipped: the run was stopped"),
        Some(Halt::Interrupt) => (State::Paused, StepState::Paused, "skipped: the run was interrupted"),
        Some(Halt::Timeout) => (State::Failed, StepState::Failed, "skipped: the run timed out"),
        None if any_failed => (State::Failed, StepState::Failed, "skipped: an earlier step failed"),
        None => (State::Complete, StepState::Complete, ""),
    }
}

/// What ended a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    /// A command step's process exited: its code (128 + n for signal n) and
    /// the signal's name when a signal ended it.
    Process { code: i32, signal: Option<String> },
    /// An external-job step's driver ended: whether the job completed, and
    /// its note (why it did not, or what went wrong cancelling it).
    Job { completed: bool, note: Option<String> },
}

/// The facts about one ended step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepEnd<'a> {
    pub exit: Exit,
    /// The step's own `timeoutMs` fired.
    pub timed_out: bool,
    /// The run's halt when the step ended.
    pub halt: Option<Halt>,
    /// The reason of a stop request that named this step alone. The runner
    /// gives it for command steps only: a targeted stop cancels an external
    /// job, which then ends as a failed step.
    pub stopped_alone: Option<&'a str>,
    pub duration_ms: i64,
}

/// What status.json records for an ended step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    pub status: StepState,
    pub exit_code: i32,
    pub signal: Option<String>,
    /// None leaves the step's `error` as it is.
    pub error: Option<String>,
    pub timed_out: bool,
    pub stopped: bool,
}

/// Classify how a step ended. The first rule that applies wins: its own
/// timeout, success (with no halt), a stop that named it alone, the run's
/// halt, else failure.
pub fn classify(e: StepEnd<'_>) -> StepOutcome {
    let (code, signal, ok, note) = match e.exit {
        Exit::Process { code, signal } => (Some(code), signal, code == 0, None),
        Exit::Job { completed, note } => (None, None, completed, note),
    };
    let out = |status: StepState, error: Option<String>| StepOutcome {
        exit_code: code.unwrap_or(if status == StepState::Complete { 0 } else { 1 }),
        timed_out: false,
        stopped: status == StepState::Stopped,
        signal: signal.clone(),
        status,
        error,
    };
    if e.timed_out {
        let tail = note.map(|n| format!("; {n}")).unwrap_or_default();
        let error = format!("step timed out after {} ms{tail}", e.duration_ms);
        return StepOutcome { timed_out: true, ..out(StepState::Failed, Some(error)) };
    }
    match (e.halt, e.stopped_alone) {
        (None, _) if ok => out(StepState::Complete, None),
        (None, Some(why)) => out(StepState::Stopped, Some(why.to_string())),
        (Some(Halt::Stop), _) => out(StepState::Stopped, note),
        (Some(Halt::Interrupt), _) => out(StepState::Paused, note),
        (Some(Halt::Timeout), _) => StepOutcome { timed_out: true, ..out(StepState::Failed, note) },
        (None, None) => {
            let error = match code {
                Some(c) => format!("exited with code {c}"),
                None => note.unwrap_or_else(|| "the external job did not complete".into()),
            };
            out(StepState::Failed, Some(error))
        }
    }
}

impl StepOutcome {
    /// The suffix of the step's event: `subagent.step.<kind>`.
    pub fn event_kind(&self) -> &'static str {
        match self.status {
            StepState::Complete => "completed",
            StepState::Stopped => "stopped",
            StepState::Paused => "paused",
            _ => "failed",
        }
    }

    /// Record the outcome in the step's status (its times are the caller's).
    pub fn apply(&self, st: &mut StepStatus) {
        st.status = self.status.clone();
        st.exit_code = Some(self.exit_code);
        if self.signal.is_some() {
            st.signal = self.signal.clone();
        }
        if self.error.is_some() {
            st.error = self.error.clone();
        }
        if self.timed_out {
            st.timed_out = Some(true);
        }
        if self.stopped {
            st.stopped = Some(true);
        }
    }
}

/// Did a host other than runspool end this run of runspool's? Every
/// terminal write of runspool's (its runner's end, a repair, the stop of a
/// queued run, a rejection: `Status::end` and the rejected status) records
/// the run's `exitCode`; pi-subagents 0.67's `reconcileAsyncRun` (both of
/// its repairs: a dead pid, and a result that already exists) keeps every
/// field of the running status it read and adds none, so a terminal status
/// without `exitCode` was written by another host. Only a run that started
/// something (a step with a `pid`, or an external job) can have leftovers.
pub fn ended_elsewhere(s: &Status) -> bool {
    !s.state.is_active()
        && s.exit_code.is_none()
        && s.steps.iter().any(|st| st.pid.is_some() || st.external_job.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(code: i32) -> Exit {
        Exit::Process { code, signal: None }
    }

    fn job(completed: bool, note: Option<&str>) -> Exit {
        Exit::Job { completed, note: note.map(str::to_string) }
    }

    fn end(exit: Exit, timed_out: bool, halt: Option<Halt>, stopped_alone: Option<&str>) -> StepOutcome {
        classify(StepEnd { exit, timed_out, halt, stopped_alone, duration_ms: 42 })
    }

    #[test]
    fn a_process_that_exits_0_completes() {
        let o = end(process(0), false, None, None);
        assert_eq!((o.status.clone(), o.exit_code, o.error.clone()), (StepState::Complete, 0, None));
        assert_eq!(o.event_kind(), "completed");
        assert!(!o.timed_out && !o.stopped);
    }

    #[test]
    fn a_process_that_exits_non_zero_fails_with_its_code() {
        let o = end(process(3), false, None, None);
        assert_eq!((o.status.clone(), o.exit_code), (StepState::Failed, 3));
        assert_eq!(o.error.as_deref(), Some("exited with code 3"));
        assert_eq!(o.event_kind(), "failed");
    }

    #[test]
    fn a_signal_is_kept_with_its_128_plus_code() {
        let o = end(Exit::Process { code: 137, signal: Some("SIGKILL".into()) }, false, None, None);
        assert_eq!((o.exit_code, o.signal.as_deref()), (137, Some("SIGKILL")));
    }

    #[test]
    fn the_steps_own_timeout_wins_over_everything() {
        for halt in [None, Some(Halt::Stop), Some(Halt::Interrupt), Some(Halt::Timeout)] {
            let o = end(process(0), true, halt, Some("why"));
            assert_eq!(o.status, StepState::Failed);
            assert!(o.timed_out);
            assert_eq!(o.error.as_deref(), Some("step timed out after 42 ms"));
        }
        let o = end(job(false, Some("cancelled")), true, None, None);
        assert_eq!(o.error.as_deref(), Some("step timed out after 42 ms; cancelled"));
        assert_eq!(o.exit_code, 1);
    }

    #[test]
    fn a_halt_decides_a_step_that_ended_under_it() {
        let o = end(process(0), false, Some(Halt::Stop), None);
        assert_eq!((o.status.clone(), o.stopped, o.error.clone()), (StepState::Stopped, true, None));
        assert_eq!(o.event_kind(), "stopped");
        let o = end(process(130), false, Some(Halt::Interrupt), None);
        assert_eq!((o.status.clone(), o.exit_code), (StepState::Paused, 130));
        assert_eq!(o.event_kind(), "paused");
        let o = end(process(143), false, Some(Halt::Timeout), None);
        assert_eq!((o.status.clone(), o.timed_out, o.error.clone()), (StepState::Failed, true, None));
    }

    #[test]
    fn a_stop_naming_the_step_alone_stops_it_with_its_reason() {
        let o = end(process(143), false, None, Some("stopped by cli"));
        assert_eq!((o.status.clone(), o.stopped), (StepState::Stopped, true));
        assert_eq!(o.error.as_deref(), Some("stopped by cli"));
        // A run-wide halt is the reason that counts.
        let o = end(process(143), false, Some(Halt::Stop), Some("stopped by cli"));
        assert_eq!(o.error, None);
        // A step that completed before the stop reached it stays complete.
        assert_eq!(end(process(0), false, None, Some("late")).status, StepState::Complete);
    }

    #[test]
    fn external_jobs_exit_0_or_1_and_carry_their_note() {
        let o = end(job(true, None), false, None, None);
        assert_eq!((o.status.clone(), o.exit_code), (StepState::Complete, 0));
        let o = end(job(true, None), false, Some(Halt::Stop), None);
        assert_eq!((o.status.clone(), o.exit_code), (StepState::Stopped, 1));
        let o = end(job(false, Some("cancel failed")), false, Some(Halt::Interrupt), None);
        assert_eq!((o.status.clone(), o.error.as_deref()), (StepState::Paused, Some("cancel failed")));
        let o = end(job(false, Some("job 7 failed")), false, None, None);
        assert_eq!((o.status.clone(), o.exit_code, o.error.as_deref()), (StepState::Failed, 1, Some("job 7 failed")));
        let o = end(job(false, None), false, None, None);
        assert_eq!(o.error.as_deref(), Some("the external job did not complete"));
    }

    #[test]
    fn apply_leaves_what_the_outcome_does_not_say() {
        let mut st = StepStatus::pending("a".into());
        st.signal = Some("SIGTERM".into());
        st.error = Some("earlier".into());
        end(process(0), false, Some(Halt::Stop), None).apply(&mut st);
        assert_eq!(st.status, StepState::Stopped);
        assert_eq!((st.exit_code, st.stopped, st.timed_out), (Some(0), Some(true), None));
        assert_eq!((st.signal.as_deref(), st.error.as_deref()), (Some("SIGTERM"), Some("earlier")));
    }

    #[test]
    fn run_endings() {
        assert_eq!(run_ending(None, false).0, State::Complete);
        assert_eq!(run_ending(None, true), (State::Failed, StepState::Failed, "skipped: an earlier step failed"));
        assert_eq!(run_ending(Some(Halt::Stop), true).0, State::Stopped);
        assert_eq!(run_ending(Some(Halt::Interrupt), false).1, StepState::Paused);
        assert_eq!(
            run_ending(Some(Halt::Timeout), false),
            (State::Failed, StepState::Failed, "skipped: the run timed out")
        );
        assert!(Halt::Interrupt < Halt::Timeout && Halt::Timeout < Halt::Stop);
    }
}
