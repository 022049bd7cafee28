//! status.json (PROTOCOL §4), events (§5), index markers (§6) and results (§7).
//! Unknown fields are kept (`extra`) so a pi-subagents writer's fields survive
//! our read-merge-write.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_owner_id: Option<String>,
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
                    .chain(req.restart_of.clone().map(|id| ("restartOf".to_string(), Value::String(id)))),
            ),
        }
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
}
