//! What a dead runner leaves behind, cleared off the loop before its run is
//! repaired (PROTOCOL §12): every process of a running step still carrying
//! the run's marks (`RUNSPOOL_RUN_ID`, `RUNSPOOL_RUN_DIR` and the step's
//! `RUNSPOOL_STEP_INDEX`), so a step's `setsid`'d grandchild, re-parented to
//! init when the runner (its subreaper) died, goes too; and every external
//! job the status records as live (a `providerJobId` in state queued,
//! running or blocked), or that a start in flight when the runner died
//! produces, cancelled through its provider with the outcome written into
//! `steps[i].externalJob`, so the terminal status never claims a job runs
//! that nobody tracks. Meanwhile the bridge leaves the run's requests alone
//! (`holds`), so no new start is dispatched for a runner that is gone.
//!
//! The same clean-up is owed to a run of runspool's that another host ended
//! (`ended_elsewhere`: a pi-subagents 0.67 host's stale-run reconciliation
//! failed it while its runner was dead and the daemon was down): its step
//! processes are killed and its live external jobs cancelled
//! (`clean_ended`), but its status, which that host wrote, is left as it is;
//! what was done goes into a `subagent.run.leftovers_cleaned` event.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::protocol::bridge::{FailureCode, Handle, Operation, MAX_MESSAGE};
use crate::protocol::status::Status;
use crate::providers::{Call, ProviderError, Providers};
use crate::store::fsutil::is_capacity;
use crate::store::layout::{ClaimPaths, RunPaths};
use crate::store::{run, Writer};

/// A live job recorded in a status: flat step index, provider, job id.
type Job = (usize, String, String);
/// A provider with its time limit (None: the provider is not configured).
type Configured = Option<(Arc<dyn crate::providers::Provider>, Duration)>;
type Cancel = (Job, Configured);
/// A start in flight: flat step index, provider, start request id.
type Start = (usize, String, String);

#[derive(Default)]
pub struct DeadRunners {
    /// Runs whose clean-up is under way.
    inflight: HashSet<String>,
    /// Runs whose worker finished (shared with the workers).
    done: Arc<Mutex<HashSet<String>>>,
    /// Runs already handled: their repair goes ahead whatever the cancel did.
    settled: HashSet<String>,
    /// Runs another host ended whose leftovers were looked at (once per daemon).
    ended: HashSet<String>,
}

/// The event that records the clean-up of a run another host ended.
pub const LEFTOVERS_CLEANED: &str = "subagent.run.leftovers_cleaned";

use crate::protocol::outcome::ended_elsewhere;

impl DeadRunners {
    /// Is the run's clean-up under way? (The bridge then services none of its requests.)
    pub fn holds(&self, run_id: &str) -> bool {
        self.inflight.contains(run_id)
    }

    /// Called before repairing `run_id` (whose runner is dead, lock held by
    /// the caller, status `s` active). True: hold the repair, its processes
    /// and jobs are being cleared (ask again next turn). False: repair now.
    pub fn hold_repair(&mut self, providers: &Providers, run_dir: &Path, run_id: &str, s: &Status) -> bool {
        if self.done.lock().map(|mut d| d.remove(run_id)).unwrap_or(false) {
            self.inflight.remove(run_id);
            self.settled.insert(run_id.to_string());
            return false;
        }
        if self.inflight.contains(run_id) {
            return true;
        }
        // Only runs runspool launched (PROTOCOL §14); each is handled once per daemon.
        if self.settled.contains(run_id) || !crate::store::run::claimed(run_dir) {
            return false;
        }
        let calls: Vec<Cancel> = live_jobs(s).into_iter().map(|j| (j.clone(), providers.get(&j.1).cloned())).collect();
        let starts: Vec<(Start, Configured)> =
            starts_in_flight(s).into_iter().map(|j| (j.clone(), providers.get(&j.1).cloned())).collect();
        let running: Vec<usize> = s
            .steps
            .iter()
            .enumerate()
            .filter(|(_, st)| st.status == crate::protocol::status::StepState::Running)
            .map(|(i, _)| i)
            .collect();
        let (dir, id, done) = (run_dir.to_path_buf(), run_id.to_string(), self.done.clone());
        let span = tracing::error_span!("dead-runner", run_id = %run_id);
        let spawned = std::thread::Builder::new()
            .name(format!("dead-{}", run_id.chars().take(40).collect::<String>()))
            .spawn(move || {
                span.in_scope(|| {
                    kill_leftovers(&dir, &id, &running);
                    let mut calls = calls;
                    for ((i, provider, request), p) in starts {
                        if let Some(job) = landed_job(&dir, &request, p.as_ref().map(|p| p.1)) {
                            calls.push(((i, provider, job), p));
                        }
                    }
                    if !calls.is_empty() {
                        cancel_all(&dir, &id, calls);
                    }
                });
                if let Ok(mut d) = done.lock() {
                    d.insert(id);
                }
            });
        match spawned {
            Ok(_) => {
                tracing::debug!(run_id, "clearing the dead runner's processes and external jobs before its repair");
                self.inflight.insert(run_id.to_string());
                true
            }
            Err(e) => {
                tracing::error!(run_id, error = %e, "cannot start a thread to clear the dead runner's processes and external jobs; repairing without");
                self.settled.insert(run_id.to_string());
                false
            }
        }
    }
}

impl DeadRunners {
    /// Clean up after a run of runspool's that another host ended
    /// (`ended_elsewhere`, runner lock free: the caller checked), off the
    /// loop: every process still carrying the marks of one of its started
    /// steps is killed, every external job its status records as live (and
    /// every job a start in flight made) is cancelled through its provider.
    /// The status stays as that host wrote it; the event
    /// `subagent.run.leftovers_cleaned` and a log line say what was done.
    /// Once per run and daemon, and never again once the event is in
    /// `events.jsonl`.
    pub fn clean_ended(&mut self, providers: &Providers, run_dir: &Path, run_id: &str, s: &Status) {
        if !ended_elsewhere(s) || self.ended.contains(run_id) || !crate::store::run::claimed(run_dir) {
            return;
        }
        self.ended.insert(run_id.to_string());
        let events = crate::store::layout::RunPaths::events(run_dir);
        if crate::store::results::tail(&events, 1024 * 1024).contains(&format!("\"type\":\"{LEFTOVERS_CLEANED}\"")) {
            return;
        }
        let calls: Vec<Cancel> = live_jobs(s).into_iter().map(|j| (j.clone(), providers.get(&j.1).cloned())).collect();
        let starts: Vec<(Start, Configured)> =
            starts_in_flight(s).into_iter().map(|j| (j.clone(), providers.get(&j.1).cloned())).collect();
        let started: Vec<usize> =
            s.steps.iter().enumerate().filter(|(_, st)| st.pid.is_some()).map(|(i, _)| i).collect();
        let (dir, id, state) = (run_dir.to_path_buf(), run_id.to_string(), s.state.as_str().to_string());
        let span = tracing::error_span!("ended-elsewhere", run_id = %run_id);
        let spawned = std::thread::Builder::new()
            .name(format!("ended-{}", run_id.chars().take(40).collect::<String>()))
            .spawn(move || {
                span.in_scope(|| {
                    let killed = kill_leftovers(&dir, &id, &started);
                    let mut calls = calls;
                    for ((i, provider, request), p) in starts {
                        if let Some(job) = landed_job(&dir, &request, p.as_ref().map(|p| p.1)) {
                            calls.push(((i, provider, job), p));
                        }
                    }
                    let outcomes = cancel_calls(&dir, calls);
                    if killed.is_empty() && outcomes.is_empty() {
                        tracing::debug!("nothing left of a run another host ended");
                        return;
                    }
                    let jobs: Vec<Value> = outcomes
                        .iter()
                        .map(|(i, job, r)| match r {
                            Ok(h) => json!({"stepIndex": i, "providerJobId": job, "state": h.state.as_str()}),
                            Err(f) => json!({"stepIndex": i, "providerJobId": job, "failureCode": f.code, "failureMessage": f.message.chars().take(MAX_MESSAGE).collect::<String>()}),
                        })
                        .collect();
                    let message = format!(
                        "run ended {state} by another host while its runner was dead; runspool killed {} leftover step process(es) and cancelled {} external job(s)",
                        killed.len(),
                        jobs.len()
                    );
                    tracing::warn!(state = %state, pids = ?killed, jobs = jobs.len(), "cleaned up the leftovers of a run another host ended; its status stays as that host wrote it");
                    let mut w = Writer::new();
                    run::event(&mut w, &dir, &id, LEFTOVERS_CLEANED, json!({"pids": killed, "externalJobs": jobs, "message": message}));
                    let until = Instant::now() + Duration::from_secs(60);
                    while !w.flush() && Instant::now() < until {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                });
            });
        if let Err(e) = spawned {
            tracing::error!(run_id, error = %e, "cannot start a thread to clean up the leftovers of a run another host ended; the next start tries again");
        }
    }
}

/// SIGKILL what is left of the run's running steps, wherever it went. The
/// step index is part of the marks: the daemon's own provider processes for
/// this run carry its run id and directory too, and are left to finish.
fn kill_leftovers(dir: &Path, run_id: &str, steps: &[usize]) -> Vec<u32> {
    let mut killed = Vec::new();
    for i in steps {
        let marks = [
            format!("RUNSPOOL_RUN_ID={run_id}"),
            format!("RUNSPOOL_RUN_DIR={}", dir.display()),
            format!("RUNSPOOL_STEP_INDEX={i}"),
        ];
        let found = crate::platform::procs::with_env(&marks);
        if found.is_empty() {
            continue;
        }
        tracing::warn!(step = i, pids = ?found, "killing the step processes left by a dead runner");
        if !crate::platform::procs::kill_marked(&marks, Duration::from_secs(10)) {
            tracing::error!(step = i, pids = ?crate::platform::procs::with_env(&marks), "step processes of a dead runner survive SIGKILL; going on without them");
        }
        killed.extend(found);
    }
    killed
}

/// External steps whose start was sent without an answer recorded: a
/// `startRequestId`, no `providerJobId`, not in a terminal state.
fn starts_in_flight(s: &Status) -> Vec<Start> {
    s.steps
        .iter()
        .enumerate()
        .filter_map(|(i, st)| {
            let j = st.external_job.as_ref()?;
            let state = j.get("state").and_then(Value::as_str).unwrap_or("starting");
            let provider = j.get("provider").and_then(Value::as_str)?;
            let request = j.get("startRequestId").and_then(Value::as_str)?;
            (j.get("providerJobId").is_none() && !matches!(state, "completed" | "failed" | "stopped"))
                .then(|| (i, provider.to_string(), request.to_string()))
        })
        .collect()
}

/// The job a start in flight produced, once its claim is finished (the
/// servicer's own time limit plus a margin; no claim: never dispatched).
fn landed_job(dir: &Path, request: &str, limit: Option<Duration>) -> Option<String> {
    let claim = RunPaths::bridge_claim(dir, request);
    if !claim.is_dir() {
        return None;
    }
    let until = Instant::now() + limit.unwrap_or_default() + Duration::from_secs(30);
    while !ClaimPaths::completed(&claim).exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let bytes = crate::store::fsutil::read_nofollow(&ClaimPaths::handle(&claim), 2 * 1024 * 1024).ok()?;
    let h: Handle = serde_json::from_slice(&bytes).ok()?;
    tracing::warn!(request, job = %h.provider_job_id, "a start in flight when the runner died made a job");
    Some(h.provider_job_id)
}

/// Jobs with a `providerJobId` that are not in a terminal state.
fn live_jobs(s: &Status) -> Vec<Job> {
    s.steps
        .iter()
        .enumerate()
        .filter_map(|(i, st)| {
            let j = st.external_job.as_ref()?;
            let state = j.get("state").and_then(Value::as_str)?;
            let provider = j.get("provider").and_then(Value::as_str)?;
            let id = j.get("providerJobId").and_then(Value::as_str)?;
            matches!(state, "queued" | "running" | "blocked").then(|| (i, provider.to_string(), id.to_string()))
        })
        .collect()
}

type Outcome = (usize, String, Result<Handle, ProviderError>);

fn cancel_all(dir: &Path, run_id: &str, calls: Vec<Cancel>) {
    record(dir, run_id, &cancel_calls(dir, calls));
}

/// Cancel each job through its provider (an unconfigured provider is a
/// failure naming it); the outcome of each.
fn cancel_calls(dir: &Path, calls: Vec<Cancel>) -> Vec<Outcome> {
    let mut outcomes: Vec<Outcome> = Vec::new();
    for ((i, provider, job), p) in calls {
        let r = match p {
            None => Err(crate::providers::failure(
                FailureCode::ProviderUnavailable,
                format!(
                    "provider `{provider}` is not configured in this daemon, so job {job} could not be cancelled; cancel it on its engine"
                ),
            )),
            Some((p, limit)) => {
                let request_id = format!("repair-cancel-{i}");
                let call = Call {
                    op: Operation::Cancel,
                    request_id: &request_id,
                    provider_job_id: Some(&job),
                    start: None,
                    follow_up: None,
                    run_dir: dir,
                    deadline: Instant::now() + limit,
                };
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.call(&call))).unwrap_or_else(|_| {
                    Err(crate::providers::failure(FailureCode::ProviderError, format!("provider `{provider}` panicked during cancel")))
                })
            }
        };
        match &r {
            Ok(h) => {
                tracing::info!(step = i, job = %job, state = h.state.as_str(), "cancelled a dead runner's external job")
            }
            Err(f) => {
                tracing::warn!(step = i, job = %job, code = %f.code, detail = %f.message, "cancelling a dead runner's external job failed")
            }
        }
        outcomes.push((i, job, r));
    }
    outcomes
}

/// Write the outcomes into `steps[i].externalJob` (the run is still active:
/// the repair that follows keeps them), then one event per job.
fn record(dir: &Path, run_id: &str, outcomes: &[Outcome]) {
    let now = crate::now_ms();
    let job_ids: std::collections::HashMap<usize, &String> = outcomes.iter().map(|(i, j, _)| (*i, j)).collect();
    let mut jobs: Vec<(usize, Value)> = Vec::new();
    let mut w = Writer::new();
    let res = run::update_status(&mut w, dir, |cur| {
        let mut s = cur?;
        if !s.state.is_active() {
            return None;
        }
        for (i, _, r) in outcomes {
            let Some(Value::Object(j)) = s.steps.get_mut(*i).and_then(|st| st.external_job.as_mut()) else { continue };
            match r {
                Ok(h) => {
                    // A cancel accepted for a job not yet down is recorded as stopped: nobody follows it any more.
                    let state = if h.state.is_terminal() { h.state.as_str() } else { "stopped" };
                    j.insert("state".into(), json!(state));
                }
                Err(f) => {
                    j.insert("failureCode".into(), json!(f.code));
                    let m = format!("the runner died and cancelling the job failed: {}", f.message);
                    j.insert("failureMessage".into(), json!(m.chars().take(MAX_MESSAGE).collect::<String>()));
                }
            }
            if let Some(job) = job_ids.get(i) {
                j.entry("providerJobId").or_insert_with(|| json!(job));
            }
            j.insert("updatedAt".into(), json!(now));
            jobs.push((*i, Value::Object(j.clone())));
        }
        Some(s)
    });
    if let Err(e) = &res {
        tracing::warn!(error = %e, "cannot record the cancelled external jobs in status.json");
    }
    // A full disk: keep the payload and retry for a while (the repair waits).
    let until = Instant::now() + Duration::from_secs(60);
    while !w.flush() && Instant::now() < until {
        std::thread::sleep(Duration::from_secs(1));
    }
    if res.is_ok() || res.as_ref().is_err_and(is_capacity) {
        for (i, job) in jobs {
            run::event(
                &mut w,
                dir,
                run_id,
                "subagent.external_job.updated",
                json!({"stepIndex": i, "externalJob": job}),
            );
        }
    }
}
