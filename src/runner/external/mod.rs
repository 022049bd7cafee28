//! External-job steps (PROTOCOL §8.3): the runner side of the bridge.
//!
//! Each external step is driven by a thread that writes requests into
//! `external-job-requests/`, waits for the daemon's answers in
//! `external-job-responses/`, and reports progress to the runner's loop
//! (`Msg::External`), which owns status.json. Stop and timeout send `cancel`;
//! an interrupt detaches (the job keeps running and can be reattached).
//! A start is never sent twice: a step whose status already records a start
//! without a job id fails with `start-redispatch-blocked`.

mod driver;

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Sender};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{json, Map, Value};

use super::{Runner, Running};
use crate::protocol::bridge::{digest, FailureCode, Operation, StartInput};
use crate::protocol::outcome::{classify, Exit, StepEnd};
use crate::protocol::request::{ExternalJob, Step};
use crate::store::fsutil;
use crate::store::layout::RunPaths;
use driver::{request_id, Driver};

/// What the driver thread reports to the runner loop.
pub(super) enum Event {
    /// `steps[i].externalJob` changed; `line` goes to the step's output log.
    Update {
        job: Value,
        line: Option<String>,
    },
    Done(Outcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completed,
    Failed,
    Cancelled,
    Detached,
}

pub(super) struct Outcome {
    kind: Kind,
    error: Option<String>,
    job: Value,
    output_file: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctl {
    Cancel,
    Detach,
}

/// The runner's handle on a driver thread: signals become cancel or detach.
pub(super) struct Control {
    tx: Sender<Ctl>,
    sent: bool,
}

impl Running {
    /// Signal the step: a process group, or for an external job cancel
    /// (SIGTERM, SIGKILL) or detach (SIGINT).
    pub(super) fn signal(&mut self, sig: Signal) {
        match self.external.as_mut() {
            None => super::signal_group(self.pid, sig),
            Some(c) => {
                if c.sent {
                    return;
                }
                c.sent = true;
                let _ = c.tx.send(if sig == Signal::SIGINT { Ctl::Detach } else { Ctl::Cancel });
            }
        }
    }
}

enum Plan {
    Start(String),
    Reattach(String),
}

impl Runner {
    /// Start (or reattach) external step `i`. None when it failed at once.
    pub(super) fn spawn_external(
        &mut self,
        i: usize,
        step: &Step,
        job: &ExternalJob,
        started: Instant,
    ) -> Option<Running> {
        let now = crate::now_ms();
        let dg = digest(&job.prompt);
        let previous = self.status.steps[i].external_job.clone();
        let mut ej = Map::new();
        ej.insert("provider".into(), json!(job.provider));
        ej.insert("promptDigest".into(), json!(dg));
        ej.insert("options".into(), Value::Object(job.options.clone()));
        ej.insert("state".into(), json!("starting"));
        ej.insert("startedAt".into(), json!(now));
        ej.insert("updatedAt".into(), json!(now));
        let plan = plan(previous.as_ref().and_then(Value::as_object), job, i, &dg, &mut ej, now);
        let agent = self.status.steps[i].agent.clone();
        let out = RunPaths::output(&self.dir, i);
        let plan = match plan {
            Ok(p) => p,
            Err((code, msg)) => {
                if let Some(p) = previous.and_then(|v| v.as_object().cloned()) {
                    ej = p;
                }
                ej.insert("failureCode".into(), json!(code));
                ej.insert("failureMessage".into(), json!(msg));
                ej.insert("updatedAt".into(), json!(now));
                self.fail_unstarted(i, &agent, &out, 1, format!("{code}: {msg}"), Some(Value::Object(ej)));
                return None;
            }
        };
        for d in [RunPaths::bridge_requests(&self.dir), RunPaths::bridge_responses(&self.dir)] {
            if let Err(e) = fsutil::mkdir_private(&d) {
                let msg =
                    format!("cannot create {}: {e}; check the run directory's permissions and free space", d.display());
                self.fail_unstarted(i, &agent, &out, 1, msg, Some(Value::Object(ej)));
                return None;
            }
        }
        if let Plan::Start(id) = &plan {
            // Recorded before the request exists, so a later runner knows a start may have gone out.
            ej.insert("startRequestId".into(), json!(id));
        }
        self.status.steps[i].external_job = Some(Value::Object(ej.clone()));
        self.save();
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
        self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": Value::Object(ej.clone())}));
        let (ctx, crx) = channel();
        let start = StartInput {
            prompt: job.prompt.clone(),
            prompt_digest: dg,
            cwd: step.cwd.clone().unwrap_or_else(|| self.req.cwd.clone()),
            run_id: self.status.run_id.clone(),
            step_index: i,
            agent,
            options: job.options.clone(),
            session_id: Some(self.status.session_id.clone()),
        };
        let d = Driver::new(self.dir.clone(), out, i, self.post.clone(), crx, ej, job.provider.clone(), start);
        std::thread::Builder::new()
            .name(format!("external-{i}"))
            .spawn(move || d.run(plan))
            .map_err(|e| crate::note!("cannot start the driver thread of step {i}: {e}"))
            .ok()?;
        let deadline = step.timeout_ms.map(|t| started + Duration::from_millis(t));
        Some(Running {
            pid: 0,
            child: None,
            started,
            deadline,
            escalate: None,
            timed_out: false,
            external: Some(Control { tx: ctx, sent: false }),
        })
    }

    /// A message from a driver thread.
    pub(super) fn on_external(&mut self, i: usize, ev: Event, running: &mut BTreeMap<usize, Running>) {
        match ev {
            Event::Update { job, line } => {
                if let Some(l) = line {
                    let _ = fsutil::append_line(&RunPaths::output(&self.dir, i), format!("runspool: {l}").as_bytes());
                }
                self.status.steps[i].external_job = Some(job.clone());
                self.save();
                self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
            }
            Event::Done(o) => {
                if let Some(r) = running.remove(&i) {
                    self.record_external(i, r, o);
                }
            }
        }
    }

    fn record_external(&mut self, i: usize, r: Running, o: Outcome) {
        let dur = r.started.elapsed().as_millis() as i64;
        if let Some(f) = &o.output_file {
            if self.status.output_file == self.status.steps[i].output_file {
                self.status.output_file = Some(f.clone());
            }
        }
        let outcome = classify(StepEnd {
            exit: Exit::Job { completed: o.kind == Kind::Completed, note: o.error },
            timed_out: r.timed_out,
            halt: self.halt,
            // A targeted stop cancels the job; the step then ends as failed.
            stopped_alone: None,
            duration_ms: dur,
        });
        self.step_timed_out |= r.timed_out;
        let st = &mut self.status.steps[i];
        st.external_job = Some(o.job.clone());
        if let Some(f) = &o.output_file {
            st.output_file = Some(f.clone());
        }
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(dur);
        outcome.apply(st);
        let agent = st.agent.clone();
        self.save();
        self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": o.job}));
        self.ev(
            &format!("subagent.step.{}", outcome.event_kind()),
            json!({"stepIndex": i, "agent": agent, "exitCode": outcome.exit_code, "durationMs": dur}),
        );
    }
}

/// Start anew, or go on with the job `previous` (the step's recorded
/// `externalJob`) names; refused with a failure code when that record belongs
/// to another job, or records a start that may have gone out without an
/// answer. `ej` is the new record (kept from `previous` on a reattach).
fn plan(
    previous: Option<&Map<String, Value>>,
    job: &ExternalJob,
    i: usize,
    dg: &str,
    ej: &mut Map<String, Value>,
    now: i64,
) -> Result<Plan, (&'static str, String)> {
    match previous {
        Some(p) => {
            let same = p.get("provider").and_then(Value::as_str) == Some(job.provider.as_str())
                && p.get("promptDigest").and_then(Value::as_str) == Some(dg);
            match p.get("providerJobId").and_then(Value::as_str) {
                Some(jid) if same => {
                    // Keep what was recorded (startedAt, handle URL) and go on from it.
                    for (k, v) in p {
                        ej.insert(k.clone(), v.clone());
                    }
                    ej.insert("updatedAt".into(), json!(now));
                    Ok(Plan::Reattach(jid.to_string()))
                }
                Some(jid) => Err((
                    FailureCode::RecoveryMismatch.as_str(),
                    format!(
                        "status.json records job {jid} of provider `{}` with prompt digest {}, but step {i} asks provider `{}` with digest {dg}; \
                         runspool will not attach this step to another job: resubmit the run",
                        p.get("provider").and_then(Value::as_str).unwrap_or("?"),
                        p.get("promptDigest").and_then(Value::as_str).unwrap_or("?"),
                        job.provider
                    ),
                )),
                None if p.contains_key("startRequestId") || p.get("state").and_then(Value::as_str).is_some_and(|s| s != "pending") => Err((
                    FailureCode::StartRedispatchBlocked.as_str(),
                    format!(
                        "an earlier start of step {i} (request {}) ended without a job id; runspool never sends a start twice, \
                         because the first may have started a job: check provider `{}` for it, then resubmit the run",
                        p.get("startRequestId").and_then(Value::as_str).unwrap_or("unknown"),
                        job.provider
                    ),
                )),
                None => Ok(Plan::Start(request_id(Operation::Start, i))),
            }
        }
        None => Ok(Plan::Start(request_id(Operation::Start, i))),
    }
}
