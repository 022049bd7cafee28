//! External-job steps (PROTOCOL §8.3): the runner side of the bridge.
//!
//! Each external step is driven by a thread that writes requests into
//! `external-job-requests/`, waits for the daemon's answers in
//! `external-job-responses/`, and reports progress to the runner's loop
//! (`Msg::External`); the `Runner` hands that to the record, which owns
//! status.json. Stop and timeout send `cancel`; an interrupt detaches (the
//! job keeps running and can be reattached). A start is never sent twice: a
//! step whose status already records a start without a job id fails with
//! `start-redispatch-blocked`.
//!
//! This part owns the driver threads: `prepare` plans a step (start anew or
//! reattach) and gives the record its job record, `launch` starts its
//! driver, `signal` becomes cancel or detach, `ended` forgets it.

mod driver;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};

use nix::sys::signal::Signal;
use serde_json::{json, Map, Value};

use super::post::Post;
use crate::protocol::bridge::{digest, FailureCode, Operation, StartInput};
use crate::protocol::request::{ExternalJob, Step};
use crate::protocol::status::Status;
use crate::store::fsutil;
use crate::store::layout::RunPaths;
use driver::{request_id, Ctl, Driver, Plan};

/// The part's handle on a driver thread: signals become cancel or detach.
struct DriverHandle {
    tx: Sender<Ctl>,
    sent: bool,
}

pub(super) struct External {
    dir: PathBuf,
    /// The request's `cwd`, for steps without their own.
    cwd: String,
    /// Steps prepared, not launched yet: their plan and driver.
    prepared: BTreeMap<usize, (Plan, Driver, DriverHandle)>,
    /// Launched steps' drivers.
    running: BTreeMap<usize, DriverHandle>,
}

impl External {
    pub(super) fn new(dir: PathBuf, cwd: String) -> External {
        External { dir, cwd, prepared: BTreeMap::new(), running: BTreeMap::new() }
    }

    /// Plan external step `i` (start anew or reattach the job `status`
    /// records) and make its bridge directories. Ok: the job record the step
    /// starts with. Err: why it cannot start, and the job record saying so.
    pub(super) fn prepare(
        &mut self,
        i: usize,
        step: &Step,
        job: &ExternalJob,
        status: &Status,
        post: &Post,
    ) -> Result<Value, (String, Value)> {
        let now = crate::now_ms();
        let dg = digest(&job.prompt);
        let previous = status.steps[i].external_job.clone();
        let mut ej = Map::new();
        ej.insert("provider".into(), json!(job.provider));
        ej.insert("promptDigest".into(), json!(dg));
        ej.insert("options".into(), Value::Object(job.options.clone()));
        ej.insert("state".into(), json!("starting"));
        ej.insert("startedAt".into(), json!(now));
        ej.insert("updatedAt".into(), json!(now));
        let plan = plan(previous.as_ref().and_then(Value::as_object), job, i, &dg, &mut ej, now);
        let plan = match plan {
            Ok(p) => p,
            Err((code, msg)) => {
                if let Some(p) = previous.and_then(|v| v.as_object().cloned()) {
                    ej = p;
                }
                ej.insert("failureCode".into(), json!(code));
                ej.insert("failureMessage".into(), json!(msg));
                ej.insert("updatedAt".into(), json!(now));
                return Err((format!("{code}: {msg}"), Value::Object(ej)));
            }
        };
        for d in [RunPaths::bridge_requests(&self.dir), RunPaths::bridge_responses(&self.dir)] {
            if let Err(e) = fsutil::mkdir_private(&d) {
                let msg =
                    format!("cannot create {}: {e}; check the run directory's permissions and free space", d.display());
                return Err((msg, Value::Object(ej)));
            }
        }
        if let Plan::Start(id) = &plan {
            // Recorded before the request exists, so a later runner knows a start may have gone out.
            ej.insert("startRequestId".into(), json!(id));
        }
        let (ctx, crx) = channel();
        let start = StartInput {
            prompt: job.prompt.clone(),
            prompt_digest: dg,
            cwd: step.cwd.clone().unwrap_or_else(|| self.cwd.clone()),
            run_id: status.run_id.clone(),
            step_index: i,
            agent: status.steps[i].agent.clone(),
            options: job.options.clone(),
            session_id: Some(status.session_id.clone()),
        };
        let out = RunPaths::output(&self.dir, i);
        let d = Driver::new(self.dir.clone(), out, i, post.clone(), crx, ej.clone(), job.provider.clone(), start);
        self.prepared.insert(i, (plan, d, DriverHandle { tx: ctx, sent: false }));
        Ok(Value::Object(ej))
    }

    /// Start the driver of prepared step `i` (once the record has its job
    /// record). False when its thread could not start.
    pub(super) fn launch(&mut self, i: usize) -> bool {
        let Some((plan, d, handle)) = self.prepared.remove(&i) else { return false };
        let started = std::thread::Builder::new()
            .name(format!("external-{i}"))
            .spawn(move || d.run(plan))
            .map_err(|e| crate::note!("cannot start the driver thread of step {i}: {e}"))
            .is_ok();
        if started {
            self.running.insert(i, handle);
        }
        started
    }

    /// Signal step `i`'s job: cancel (SIGTERM, SIGKILL) or detach (SIGINT),
    /// once; later signals of the ladder are no news to a driver.
    pub(super) fn signal(&mut self, i: usize, sig: Signal) {
        let Some(c) = self.running.get_mut(&i) else { return };
        if c.sent {
            return;
        }
        c.sent = true;
        let _ = c.tx.send(if sig == Signal::SIGINT { Ctl::Detach } else { Ctl::Cancel });
    }

    /// Step `i`'s driver ended.
    pub(super) fn ended(&mut self, i: usize) {
        self.running.remove(&i);
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
