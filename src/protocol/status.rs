//! status.json (PROTOCOL §4), events (§5), index markers (§6) and results (§7).
//! Unknown fields are kept (`extra`) so a pi-subagents writer's fields survive
//! our read-merge-write.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::ids::{run_id_grammar, LaneName};
use super::request::Mode;

super::open_enum! {
    /// A run's `state` (§4). `partial` is written by pi-subagents 0.67 hosts
    /// (some parallel members failed); runspool never writes it.
    pub enum State {
        Queued => "queued",
        Running => "running",
        Complete => "complete",
        Failed => "failed",
        Paused => "paused",
        Stopped => "stopped",
        Rejected => "rejected",
        Partial => "partial",
    }
}

impl State {
    /// Only `queued` and `running` are active; every other value, unknown
    /// ones included, is terminal (§4).
    pub fn is_active(&self) -> bool {
        matches!(self, State::Queued | State::Running)
    }
}

super::open_enum! {
    /// A step's `status`. pi-subagents 0.67 also writes `completed`,
    /// `partial` and `rejected`; runspool writes the first six.
    pub enum StepState {
        Pending => "pending",
        Running => "running",
        Complete => "complete",
        Failed => "failed",
        Paused => "paused",
        Stopped => "stopped",
        Completed => "completed",
        Partial => "partial",
        Rejected => "rejected",
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunnerInfo {
    pub pid: u32,
    pub hostname: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_identity: Option<String>,
    pub process_instance_id: String,
    /// How the runner keeps escaped step processes in reach: `subreaper`
    /// (PR_SET_CHILD_SUBREAPER) or `process-group` (runspool extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containment: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParallelGroup {
    pub start: usize,
    pub count: usize,
    pub step_index: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct QueueInfo {
    pub priority: i64,
    pub claimed_at: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StepStatus {
    pub agent: String,
    pub status: StepState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timed_out: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_job: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StepStatus {
    pub fn pending(agent: String) -> Self {
        StepStatus {
            agent,
            status: StepState::Pending,
            started_at: None,
            ended_at: None,
            duration_ms: None,
            exit_code: None,
            signal: None,
            error: None,
            timed_out: None,
            stopped: None,
            pid: None,
            output_file: None,
            external_job: None,
            extra: Map::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub run_id: String,
    /// Optional in pi-subagents' statuses; runspool always writes it.
    #[serde(default)]
    pub session_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_owner_id: Option<String>,
    pub mode: Mode,
    pub state: State,
    pub started_at: i64,
    /// Optional in pi-subagents' statuses; runspool always writes it.
    #[serde(default)]
    pub last_update: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<i64>,
    #[serde(default)]
    pub timeout_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<i64>,
    #[serde(default)]
    pub timed_out: bool,
    #[serde(default)]
    pub stopped: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<RunnerInfo>,
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub current_step: usize,
    #[serde(default)]
    pub chain_step_count: usize,
    #[serde(default)]
    pub parallel_groups: Vec<ParallelGroup>,
    #[serde(default)]
    pub queue: QueueInfo,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file: Option<String>,
    #[serde(default)]
    pub steps: Vec<StepStatus>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The status fields of a request's scheduling (PROTOCOL §15), and why it
/// waits from the start: held, dependencies, or a `notBefore` to come (the
/// daemon corrects `waiting` and `waitingFor` as they change).
fn scheduling_fields(req: &super::request::Request, now: i64) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if let Some(l) = &req.lane {
        out.push(("lane".to_string(), Value::String(l.clone())));
    }
    let after = req.dependencies();
    if !after.is_empty() {
        out.push(("after".to_string(), Value::from(after.clone())));
        let policy = req.after_policy.unwrap_or_default();
        out.push(("afterPolicy".to_string(), Value::String(policy.as_str().into())));
    }
    if let Some(t) = req.not_before {
        out.push(("notBefore".to_string(), Value::from(t)));
    }
    let held = req.hold == Some(true);
    if held {
        out.push(("held".to_string(), Value::Bool(true)));
    }
    let waiting = if held {
        Some("held")
    } else if !after.is_empty() {
        Some("dependencies")
    } else if req.not_before.is_some_and(|t| t > now) {
        Some("not-before")
    } else {
        None
    };
    if let Some(w) = waiting {
        out.push(("waiting".to_string(), Value::String(w.into())));
    }
    if !after.is_empty() {
        out.push(("waitingFor".to_string(), Value::from(after)));
    }
    out
}

/// How the steps a run leaves unfinished (pending or running) end with it
/// (`Status::end`).
#[derive(Debug, Clone, PartialEq)]
pub struct OpenSteps {
    /// Their new `status`: the run's (`stopped`, `paused`, `failed`, ...).
    pub status: StepState,
    /// Their `error`, e.g. "skipped: the run was stopped".
    pub error: String,
    pub how: Unfinished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfinished {
    /// They never ran to an end: exit code -1, duration 0, no `endedAt`
    /// (a run halted or failed by its runner, a queued run ended before
    /// it started).
    Skipped,
    /// Their runner died under them: exit code 1, `endedAt` now, the
    /// duration kept, else counted from `startedAt` (0 if never started).
    Cut,
}

impl OpenSteps {
    pub fn skipped(status: StepState, error: &str) -> Self {
        OpenSteps { status, error: error.to_string(), how: Unfinished::Skipped }
    }
}

/// `.terminal-runs/<seg(session)>/<E>-<seg(runId)>.json` content.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TerminalMarker {
    pub version: u32,
    pub run_id: String,
    pub session_id: String,
    pub ended_at: i64,
}

/// The file name of a terminal marker: 16-digit zero-padded `endedAt`.
pub fn terminal_marker_name(ended_at: i64, run_id: &str) -> String {
    format!("{:016}-{}.json", ended_at.max(0), super::seg::seg(run_id))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepResult {
    pub agent: String,
    pub exit_code: i32,
    pub success: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `<results>/<runId>.json` (PROTOCOL §7).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunResult {
    pub id: String,
    pub run_id: String,
    pub session_id: String,
    /// The run's `toolCallId`, when it has one: 0.67 indexes the result by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_owner_id: Option<String>,
    /// The first step's agent (PROTOCOL §7).
    #[serde(default)]
    pub agent: String,
    pub mode: Mode,
    pub state: State,
    pub success: bool,
    pub exit_code: i32,
    pub summary: String,
    pub results: Vec<StepResult>,
    pub duration_ms: i64,
    pub timestamp: i64,
    pub async_dir: String,
    pub cwd: String,
}

impl Status {
    /// True when runspool wrote this status's first version (`launchedBy`).
    pub fn launched_by_runspool(&self) -> bool {
        self.extra.get("launchedBy").and_then(Value::as_str) == Some("runspool")
    }

    /// Mark a status runspool creates as its own (`launchedBy: "runspool"`).
    pub fn mark_launched_by_runspool(&mut self) {
        self.extra.insert("launchedBy".into(), Value::String("runspool".into()));
    }

    /// The `queued` status written at claim time (PROTOCOL §2.3 step 8).
    pub fn queued(req: &super::request::Request, run_id: &str, run_dir: &std::path::Path, now: i64) -> Status {
        use super::request::Item;
        let mut steps = Vec::new();
        let mut groups = Vec::new();
        for (ti, item) in req.steps.iter().enumerate() {
            match item {
                Item::Step(s) => steps.push(StepStatus::pending(s.label(steps.len()))),
                Item::Parallel(p) => {
                    groups.push(ParallelGroup { start: steps.len(), count: p.parallel.len(), step_index: ti });
                    for s in &p.parallel {
                        steps.push(StepStatus::pending(s.label(steps.len())));
                    }
                }
            }
        }
        for (i, st) in steps.iter_mut().enumerate() {
            st.output_file = Some(run_dir.join(format!("output-{i}.log")).display().to_string());
        }
        Status {
            run_id: run_id.to_string(),
            session_id: req.session().to_string(),
            tool_call_id: req.tool_call_id.clone(),
            completion_owner_id: req.completion_owner_id.clone(),
            mode: req.mode(),
            state: State::Queued,
            started_at: now,
            last_update: now,
            ended_at: None,
            timeout_ms: req.timeout(),
            deadline_at: None,
            timed_out: false,
            stopped: false,
            error: None,
            exit_code: None,
            pid: None,
            runner: None,
            cwd: req.cwd.clone(),
            current_step: 0,
            chain_step_count: req.steps.len(),
            parallel_groups: groups,
            queue: QueueInfo { priority: req.priority, claimed_at: now },
            output_file: None,
            steps,
            extra: Map::from_iter(
                [("launchedBy".to_string(), Value::String("runspool".into()))]
                    .into_iter()
                    .chain(req.restart_of.clone().map(|id| ("restartOf".to_string(), Value::String(id))))
                    .chain(scheduling_fields(req, now)),
            ),
        }
    }

    /// The run's lane (PROTOCOL §15): `lane`, else `default`.
    pub fn lane(&self) -> &str {
        match self.extra.get("lane").and_then(Value::as_str) {
            Some(l) if LaneName::is_valid(l) => l,
            _ => super::request::DEFAULT_LANE,
        }
    }

    /// `after`: the run ids this run waits for (those that are run ids).
    pub fn after(&self) -> Vec<String> {
        let list = self.extra.get("after").and_then(Value::as_array);
        list.into_iter().flatten().filter_map(Value::as_str).filter(|s| run_id_grammar(s)).map(String::from).collect()
    }

    /// `afterPolicy` is `any`.
    pub fn after_any(&self) -> bool {
        self.extra.get("afterPolicy").and_then(Value::as_str) == Some("any")
    }

    /// `notBefore`, ms.
    pub fn not_before(&self) -> Option<i64> {
        self.extra.get("notBefore").and_then(Value::as_i64)
    }

    /// `held: true`.
    pub fn held(&self) -> bool {
        self.extra.get("held").and_then(Value::as_bool) == Some(true)
    }

    pub fn set_held(&mut self, held: bool) {
        if held {
            self.extra.insert("held".into(), Value::Bool(true));
        } else {
            self.extra.remove("held");
        }
    }

    /// `waiting`: why a queued run has not started.
    pub fn waiting(&self) -> Option<&str> {
        self.extra.get("waiting").and_then(Value::as_str)
    }

    /// `waitingFor`: the dependencies not yet ended.
    pub fn waiting_for(&self) -> Vec<String> {
        let list = self.extra.get("waitingFor").and_then(Value::as_array);
        list.into_iter().flatten().filter_map(Value::as_str).map(String::from).collect()
    }

    /// Record why a queued run waits (None: it does not) and for which
    /// dependencies (empty: none; the field is left out).
    pub fn set_waiting(&mut self, waiting: Option<&str>, waiting_for: &[String]) {
        match waiting {
            Some(w) => self.extra.insert("waiting".into(), Value::String(w.into())),
            None => self.extra.remove("waiting"),
        };
        if waiting_for.is_empty() {
            self.extra.remove("waitingFor");
        } else {
            self.extra.insert("waitingFor".into(), Value::from(waiting_for.to_vec()));
        }
    }

    /// End an active run (PROTOCOL §4): `state` (terminal), `error` when
    /// given (None leaves it: a complete run has none), `stopped` for a
    /// stopped run, `endedAt`, the exit code, a `lastUpdate` not before
    /// `now`, and every step still pending or running finished as `open`
    /// says. Steps that ended keep what they recorded, unknown step statuses
    /// included. False, changing nothing, when the run had already ended.
    pub fn end(&mut self, state: State, error: Option<String>, open: &OpenSteps, now: i64) -> bool {
        debug_assert!(!state.is_active(), "Status::end needs a terminal state, not {state}");
        if !self.state.is_active() {
            return false;
        }
        for st in self.steps.iter_mut().filter(|s| matches!(s.status, StepState::Pending | StepState::Running)) {
            st.status = open.status.clone();
            st.error = Some(open.error.clone());
            match open.how {
                Unfinished::Skipped => {
                    st.exit_code = Some(-1);
                    st.duration_ms = Some(0);
                }
                Unfinished::Cut => {
                    st.exit_code = Some(1);
                    st.ended_at = Some(now);
                    if st.duration_ms.is_none() {
                        st.duration_ms = Some(st.started_at.map(|t| now - t).unwrap_or(0));
                    }
                }
            }
        }
        if state == State::Stopped {
            self.stopped = true;
        }
        self.state = state;
        self.ended_at = Some(now);
        self.last_update = self.last_update.max(now);
        if error.is_some() {
            self.error = error;
        }
        self.exit_code = Some(self.terminal_exit_code());
        true
    }

    /// The exit code of a terminal run: 0 when complete, else the first failed
    /// step's (skipped steps excluded), else 1.
    pub fn terminal_exit_code(&self) -> i32 {
        if self.state == State::Complete {
            return 0;
        }
        self.steps
            .iter()
            .find(|s| s.status == StepState::Failed && s.exit_code.is_some_and(|c| c > 0))
            .and_then(|s| s.exit_code)
            .unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A status as a pi-subagents 0.67 host writes it: values runspool does not
    /// write, optional fields left out, fields of its own. It parses, and a
    /// rewrite keeps every value as written.
    #[test]
    fn pi_0_67_states_modes_and_step_statuses_parse_and_round_trip() {
        let raw = serde_json::json!({
            "runId": "pi-1", "mode": "workflow", "state": "partial", "startedAt": 5,
            "lifecycleArtifactVersion": 3, "workflowGraph": {"nodes": []},
            "steps": [
                {"agent": "a", "status": "completed", "exitCode": null},
                {"agent": "b", "status": "rejected"},
                {"agent": "c", "status": "some-future-status"}
            ]
        });
        let s: Status = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(s.state, State::Partial);
        assert!(!s.state.is_active(), "partial is terminal");
        assert_eq!(s.mode, Mode::Workflow);
        assert_eq!(s.steps[0].status, StepState::Completed);
        assert_eq!(s.steps[1].status, StepState::Rejected);
        assert_eq!(s.steps[2].status.as_str(), "some-future-status");
        let back = serde_json::to_value(&s).unwrap();
        for k in ["mode", "state", "lifecycleArtifactVersion", "workflowGraph"] {
            assert_eq!(back[k], raw[k], "{k} kept");
        }
        assert_eq!(back["steps"][2]["status"], "some-future-status");
        let odd: Status = serde_json::from_value(
            serde_json::json!({"runId": "x", "mode": "swarm", "state": "thinking", "startedAt": 1}),
        )
        .unwrap();
        assert!(!odd.state.is_active(), "an unknown state is not active");
        assert_eq!((odd.mode.as_str(), odd.state.as_str()), ("swarm", "thinking"));
    }

    fn running_run() -> Status {
        let mut s: Status = serde_json::from_value(serde_json::json!({
            "runId": "r", "mode": "chain", "state": "running", "startedAt": 100, "lastUpdate": 150,
            "steps": [
                {"agent": "done", "status": "complete", "exitCode": 0, "startedAt": 100, "endedAt": 120, "durationMs": 20},
                {"agent": "bad", "status": "failed", "exitCode": 3, "error": "exited with code 3"},
                {"agent": "run", "status": "running", "startedAt": 130},
                {"agent": "wait", "status": "pending"},
                {"agent": "odd", "status": "some-future-status"}
            ]
        }))
        .unwrap();
        s.extra.insert("launchedBy".into(), Value::String("runspool".into()));
        s
    }

    #[test]
    fn end_skips_the_unfinished_steps_and_keeps_the_rest() {
        for (state, step) in [
            (State::Stopped, StepState::Stopped),
            (State::Paused, StepState::Paused),
            (State::Failed, StepState::Failed),
            (State::Complete, StepState::Complete),
        ] {
            let mut s = running_run();
            let before = s.steps.clone();
            assert!(s.end(state.clone(), Some("why".into()), &OpenSteps::skipped(step.clone(), "skipped: x"), 200));
            assert_eq!((s.state.clone(), s.ended_at, s.last_update), (state.clone(), Some(200), 200));
            assert_eq!(s.stopped, state == State::Stopped);
            assert_eq!(s.error.as_deref(), Some("why"));
            for i in [2, 3] {
                let st = &s.steps[i];
                assert_eq!((st.status.clone(), st.exit_code, st.duration_ms), (step.clone(), Some(-1), Some(0)));
                assert_eq!((st.error.as_deref(), st.ended_at), (Some("skipped: x"), None));
            }
            for i in [0, 1, 4] {
                assert_eq!(s.steps[i], before[i], "step {i} kept");
            }
            let want = if state == State::Complete { 0 } else { 3 };
            assert_eq!(s.exit_code, Some(want), "{state}");
            assert!(s.launched_by_runspool());
        }
    }

    #[test]
    fn end_of_a_run_whose_runner_died_cuts_its_steps() {
        let mut s = running_run();
        s.steps[1].status = StepState::Complete;
        let open = OpenSteps { status: StepState::Failed, error: "runner died".into(), how: Unfinished::Cut };
        assert!(s.end(State::Failed, Some("runner died".into()), &open, 200));
        let (run, wait) = (&s.steps[2], &s.steps[3]);
        assert_eq!((run.exit_code, run.ended_at, run.duration_ms), (Some(1), Some(200), Some(70)));
        assert_eq!((wait.exit_code, wait.ended_at, wait.duration_ms), (Some(1), Some(200), Some(0)));
        assert_eq!(run.error.as_deref(), Some("runner died"));
        assert_eq!(s.exit_code, Some(1), "the cut steps' code counts");
        assert!(!s.stopped);
    }

    #[test]
    fn end_keeps_the_error_when_given_none_and_never_moves_last_update_back() {
        let mut s = running_run();
        s.error = Some("kept".into());
        s.last_update = 500;
        s.end(State::Complete, None, &OpenSteps::skipped(StepState::Complete, ""), 200);
        assert_eq!((s.error.as_deref(), s.last_update), (Some("kept"), 500));
    }

    #[test]
    fn end_is_idempotent_and_leaves_ended_runs_alone() {
        let mut s = running_run();
        assert!(s.end(State::Stopped, Some("a".into()), &OpenSteps::skipped(StepState::Stopped, "x"), 200));
        let once = s.clone();
        assert!(!s.end(State::Failed, Some("b".into()), &OpenSteps::skipped(StepState::Failed, "y"), 300));
        assert_eq!(s, once);
        let mut queued = running_run();
        queued.state = State::Queued;
        assert!(queued.end(State::Failed, Some("c".into()), &OpenSteps::skipped(StepState::Failed, "z"), 9));
        let mut odd = running_run();
        odd.state = State::from("thinking");
        assert!(!odd.end(State::Failed, None, &OpenSteps::skipped(StepState::Failed, "z"), 9));
        assert_eq!(odd.state.as_str(), "thinking");
    }
}
