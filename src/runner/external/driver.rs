//! The driver thread of one external-job step: requests into
//! `external-job-requests/`, answers from `external-job-responses/`, progress
//! and the end to the runner's loop.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::protocol::bridge::{
    validate_handle, FailureCode, Handle, JobState, Operation, Request, Response, StartInput,
};
use crate::runner::post::{Msg, Post, Report};
use crate::store::fsutil;
use crate::store::layout::RunPaths;

/// How often a job's status is asked for (§8.3).
const POLL: Duration = Duration::from_secs(1);
/// How long to wait for answers once a stop is under way (the daemon may be down).
const STOP_GRACE: Duration = Duration::from_secs(120);
/// Consecutive failed status polls before the step gives up on the job
/// (about a minute: long enough to ride out a controller restart).
const MAX_STATUS_ERRORS: u32 = 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completed,
    Failed,
    Cancelled,
    Detached,
}

/// How a driver ended; the loop is told it as a `Report::Done`.
pub(super) struct Outcome {
    pub(super) kind: Kind,
    pub(super) error: Option<String>,
    pub(super) job: Value,
    pub(super) output_file: Option<String>,
}

impl Outcome {
    pub(super) fn report(self) -> Report {
        Report::Done {
            completed: self.kind == Kind::Completed,
            note: self.error,
            job: self.job,
            output_file: self.output_file,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ctl {
    Cancel,
    Detach,
}

/// What a driver does first: start the job anew, or reattach to the job
/// whose id the step's status already records.
pub(super) enum Plan {
    Start(String),
    Reattach(String),
}

pub(super) fn request_id(op: Operation, i: usize) -> String {
    format!("{}-{i}-{}", op.as_str(), uuid::Uuid::new_v4().simple())
}

/// Why a request got no handle.
enum Fail {
    /// The daemon answered `ok: false` (or with an invalid handle).
    Bridge { code: String, message: String },
    /// A cancel or detach arrived while an interruptible request was waiting.
    Interrupted,
}

pub(super) struct Driver {
    dir: PathBuf,
    out: PathBuf,
    i: usize,
    tx: Post,
    ctl: Receiver<Ctl>,
    pending: Option<Ctl>,
    job: Map<String, Value>,
    provider: String,
    start: StartInput,
    /// Requests given up on; their late answers are cleaned away at the end.
    abandoned: Vec<String>,
}

impl Driver {
    #[allow(clippy::too_many_arguments)] // each is one field of the driver; a builder would only rename them
    pub(super) fn new(
        dir: PathBuf,
        out: PathBuf,
        i: usize,
        tx: Post,
        ctl: Receiver<Ctl>,
        job: Map<String, Value>,
        provider: String,
        start: StartInput,
    ) -> Driver {
        Driver { dir, out, i, tx, ctl, pending: None, job, provider, start, abandoned: Vec::new() }
    }

    pub(super) fn run(mut self, plan: Plan) {
        let o = self.drive(plan);
        for id in std::mem::take(&mut self.abandoned) {
            let _ = fsutil::remove_if_exists(&RunPaths::bridge_request(&self.dir, &id));
            let _ = fsutil::remove_if_exists(&RunPaths::bridge_response(&self.dir, &id));
        }
        self.tx.send(Msg::External(self.i, o.report()));
    }

    fn publish(&mut self, line: Option<String>) {
        self.job.insert("updatedAt".into(), json!(crate::now_ms()));
        self.tx.send(Msg::External(self.i, Report::Update { job: Value::Object(self.job.clone()), line }));
    }

    fn outcome(&self, kind: Kind, error: Option<String>, output_file: Option<String>) -> Outcome {
        Outcome { kind, error, job: Value::Object(self.job.clone()), output_file }
    }

    /// Record a handle in `externalJob`; true when something a reader cares about changed.
    fn apply(&mut self, h: &Handle) -> bool {
        let before = self.job.clone();
        self.job.insert("providerJobId".into(), json!(h.provider_job_id));
        self.job.insert("state".into(), json!(h.state.as_str()));
        // A handle URL, once known, stays; failure fields follow the latest answer.
        if let Some(u) = &h.handle_url {
            self.job.insert("handleUrl".into(), json!(u));
        }
        for (k, v) in [
            ("failureCode", &h.failure_code),
            ("failureMessage", &h.failure_message),
            ("blockingJobId", &h.blocking_job_id),
        ] {
            match v {
                Some(s) => {
                    self.job.insert(k.into(), json!(s));
                }
                None => {
                    self.job.remove(k);
                }
            }
        }
        if let Some(u) = &h.conversation_url {
            self.job.insert("conversationUrl".into(), json!(u));
        }
        let mut a = before;
        a.remove("updatedAt");
        let mut b = self.job.clone();
        b.remove("updatedAt");
        a != b
    }

    fn bridge_failure(&mut self, code: &str, message: &str) -> Outcome {
        self.job.insert("failureCode".into(), json!(code));
        self.job.insert("failureMessage".into(), json!(message));
        if self.job.get("state").and_then(Value::as_str) == Some("starting") {
            self.job.insert("state".into(), json!("failed"));
        }
        self.outcome(Kind::Failed, Some(format!("{code}: {message}")), None)
    }

    fn drive(&mut self, plan: Plan) -> Outcome {
        let first = match &plan {
            Plan::Start(id) => self.request(id.clone(), Operation::Start, None, false),
            Plan::Reattach(jid) => {
                self.request(request_id(Operation::Reattach, self.i), Operation::Reattach, Some(jid.clone()), true)
            }
        };
        let h = match first {
            Ok(h) => h,
            Err(Fail::Bridge { code, message }) => return self.bridge_failure(&code, &message),
            Err(Fail::Interrupted) => {
                // Only a reattach is interruptible; the job id is already recorded.
                let jid = match &plan {
                    Plan::Reattach(j) => j.clone(),
                    Plan::Start(_) => unreachable!("a start waits for its answer"),
                };
                return self.halted(&jid);
            }
        };
        let verb = if matches!(plan, Plan::Start(_)) { "started" } else { "reattached to" };
        self.apply(&h);
        self.publish(Some(format!(
            "{verb} job {} on provider `{}` ({})",
            h.provider_job_id,
            self.provider,
            h.state.as_str()
        )));
        let jid = h.provider_job_id.clone();
        match self.follow(&jid, h.state) {
            ControlFlow::Continue(state) => self.conclude(&jid, state),
            ControlFlow::Break(o) => o,
        }
    }

    /// Poll job `jid` until it ends: its terminal state, or the step's
    /// outcome when a cancel or detach came first or the polls kept failing.
    fn follow(&mut self, jid: &str, mut state: JobState) -> ControlFlow<Outcome, JobState> {
        let jid = jid.to_string();
        let mut errors = 0;
        while !state.is_terminal() {
            if self.pending.is_some() {
                return ControlFlow::Break(self.halted(&jid));
            }
            match self.ctl.recv_timeout(POLL) {
                Ok(c) => {
                    self.pending = Some(c);
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.pending = Some(Ctl::Detach),
            }
            match self.request(request_id(Operation::Status, self.i), Operation::Status, Some(jid.clone()), true) {
                Ok(h) => {
                    errors = 0;
                    state = h.state;
                    if self.apply(&h) {
                        self.publish(Some(format!("job {jid}: {}", h.state.as_str())));
                    }
                }
                Err(Fail::Interrupted) => {}
                Err(Fail::Bridge { code, message }) => {
                    errors += 1;
                    let _ = fsutil::append_line(
                        &self.out,
                        format!(
                            "runspool: status of job {jid} failed ({errors}/{MAX_STATUS_ERRORS}): {code}: {message}"
                        )
                        .as_bytes(),
                    );
                    if errors >= MAX_STATUS_ERRORS {
                        return ControlFlow::Break(self.bridge_failure(
                            &code,
                            &format!("{message} (after {errors} failed status requests for job {jid})"),
                        ));
                    }
                }
            }
        }
        ControlFlow::Continue(state)
    }

    /// The outcome of job `jid`, ended in `state`: its result fetched when
    /// it completed or failed on the engine.
    fn conclude(&mut self, jid: &str, state: JobState) -> Outcome {
        if state == JobState::Stopped {
            let why = self.job.get("failureMessage").and_then(Value::as_str).unwrap_or("no reason given").to_string();
            return self.outcome(
                Kind::Failed,
                Some(format!("external job {jid} ({}) was stopped outside runspool: {why}", self.provider)),
                None,
            );
        }
        let output_file = match self.fetch_result(jid) {
            Ok(f) => f,
            // The job finished but its result could not be had: the step has
            // no output to hand on, so it must not pass for a success.
            Err((code, message)) if state == JobState::Completed => {
                return self.bridge_failure(&code, &format!("result of job {jid} failed: {message}"));
            }
            Err(_) => None, // the job's own failure, below, is the reason that counts
        };
        if state == JobState::Completed {
            return self.outcome(Kind::Completed, None, output_file);
        }
        let why = self.job.get("failureMessage").and_then(Value::as_str).unwrap_or("no reason given").to_string();
        let code = self.job.get("failureCode").and_then(Value::as_str).map(|c| format!(" [{c}]")).unwrap_or_default();
        self.outcome(
            Kind::Failed,
            Some(format!("external job {jid} ({}) failed: {why}{code}", self.provider)),
            output_file,
        )
    }

    /// Ask for the result and store it; returns the step's output file, or
    /// the provider's code and message when the `result` operation failed.
    fn fetch_result(&mut self, jid: &str) -> Result<Option<String>, (String, String)> {
        match self.request(request_id(Operation::Result, self.i), Operation::Result, Some(jid.to_string()), true) {
            Ok(h) => {
                if let Some(p) = &h.artifact_path {
                    self.job.insert("resultArtifactPath".into(), json!(p));
                    self.publish(Some(format!("job {jid}: result in {p}")));
                    return Ok(Some(p.clone()));
                }
                let path = RunPaths::external_result(&self.dir, self.i);
                match fsutil::write_atomic(&path, h.output.as_deref().unwrap_or("").as_bytes(), true) {
                    Ok(()) => {
                        self.publish(Some(format!("job {jid}: result in {}", path.display())));
                        Ok(Some(path.display().to_string()))
                    }
                    Err(e) => {
                        let _ = fsutil::append_line(
                            &self.out,
                            format!("runspool: cannot write {}: {e}", path.display()).as_bytes(),
                        );
                        Ok(None)
                    }
                }
            }
            Err(Fail::Bridge { code, message }) => {
                let _ = fsutil::append_line(
                    &self.out,
                    format!("runspool: result of job {jid} failed: {code}: {message}").as_bytes(),
                );
                Err((code, message))
            }
            Err(Fail::Interrupted) => Ok(None),
        }
    }

    /// A cancel or detach is pending for job `jid`.
    fn halted(&mut self, jid: &str) -> Outcome {
        if self.pending == Some(Ctl::Detach) {
            let _ = fsutil::append_line(
                &self.out,
                format!("runspool: detached from job {jid}; it keeps running").as_bytes(),
            );
            return self.outcome(
                Kind::Detached,
                Some(format!("detached from external job {jid}, which keeps running")),
                None,
            );
        }
        match self.request(request_id(Operation::Cancel, self.i), Operation::Cancel, Some(jid.to_string()), false) {
            Ok(h) => {
                self.apply(&h);
                if !h.state.is_terminal() {
                    self.job.insert("state".into(), json!("stopped"));
                }
                self.publish(Some(format!("cancelled job {jid}")));
                self.outcome(Kind::Cancelled, None, None)
            }
            Err(Fail::Bridge { code, message }) => {
                let msg =
                    format!("cancelling external job {jid} failed: {code}: {message}; cancel it on the engine by hand");
                let _ = fsutil::append_line(&self.out, format!("runspool: {msg}").as_bytes());
                self.outcome(Kind::Cancelled, Some(msg), None)
            }
            Err(Fail::Interrupted) => {
                self.outcome(Kind::Cancelled, Some(format!("cancelling external job {jid} got no answer")), None)
            }
        }
    }

    /// Write a request and wait for its answer. `interruptible`: give up when
    /// a cancel or detach arrives. Once a stop is pending, waits are bounded.
    fn request(
        &mut self,
        id: String,
        op: Operation,
        job_id: Option<String>,
        interruptible: bool,
    ) -> Result<Handle, Fail> {
        let req = Request {
            id: id.clone(),
            operation: op,
            provider: self.provider.clone(),
            provider_job_id: job_id,
            start: (op == Operation::Start).then(|| self.start.clone()),
            follow_up: None,
            created_at: crate::now_ms(),
            claimed_at: None,
        };
        let path = RunPaths::bridge_request(&self.dir, &id);
        let resp_path = RunPaths::bridge_response(&self.dir, &id);
        let bytes = serde_json::to_vec_pretty(&req).unwrap_or_default();
        let mut backoff = Duration::from_millis(100);
        loop {
            match fsutil::write_atomic(&path, &bytes, op == Operation::Start) {
                Ok(()) => break,
                Err(e) if fsutil::is_capacity(&e) => {
                    // Keep the request in memory and retry (PROTOCOL §11).
                    if self.take_ctl() && interruptible {
                        return Err(Fail::Interrupted);
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    return Err(Fail::Bridge {
                        code: FailureCode::BridgeIo.into(),
                        message: format!("cannot write {}: {e}; check the run directory", path.display()),
                    })
                }
            }
        }
        let mut grace_until: Option<Instant> = None;
        loop {
            if let Ok(b) = fsutil::read_nofollow(&resp_path, 8 * 1024 * 1024) {
                match serde_json::from_slice::<Response>(&b) {
                    Ok(r) if r.id == id => {
                        let _ = std::fs::remove_file(&resp_path);
                        return answer(r, op);
                    }
                    // Not yet complete or someone else's: look again.
                    _ => {}
                }
            }
            if self.take_ctl() {
                if interruptible {
                    self.abandoned.push(id);
                    return Err(Fail::Interrupted);
                }
                grace_until.get_or_insert_with(|| Instant::now() + STOP_GRACE);
            }
            if grace_until.is_some_and(|t| Instant::now() >= t) {
                self.abandoned.push(id.clone());
                return Err(Fail::Bridge {
                    code: FailureCode::BridgeNoAnswer.into(),
                    message: format!(
                        "no answer to {} request {id} within {} s of the stop; is the runspool daemon running? If a job was started, cancel it by hand",
                        op.as_str(),
                        STOP_GRACE.as_secs()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Note a control message if one arrived; true when one is pending.
    fn take_ctl(&mut self) -> bool {
        match self.ctl.try_recv() {
            Ok(c) => {
                if self.pending.is_none() {
                    self.pending = Some(c);
                }
            }
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => {
                self.pending.get_or_insert(Ctl::Detach);
            }
        }
        self.pending.is_some()
    }
}

fn answer(r: Response, op: Operation) -> Result<Handle, Fail> {
    if !r.ok {
        return Err(Fail::Bridge {
            code: r.code.unwrap_or_else(|| FailureCode::ProviderError.into()),
            message: r.message.unwrap_or_else(|| "the provider gave no message".into()),
        });
    }
    let Some(h) = r.result else {
        return Err(Fail::Bridge {
            code: FailureCode::ProviderError.into(),
            message: format!("the answer to {} has ok: true but no result", op.as_str()),
        });
    };
    validate_handle(&h, op).map_err(|e| Fail::Bridge {
        code: FailureCode::ProviderError.into(),
        message: format!("invalid handle in the answer to {}: {e}", op.as_str()),
    })?;
    Ok(h)
}
