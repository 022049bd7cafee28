//! The built-in `slurm` provider (PROTOCOL §8.4), on the Slurm CLI:
//! `sbatch --parsable`, `squeue`, `scontrol`/`sacct`, `scancel`.
//!
//! Start is idempotent: the job name `runspool-<runId>-<stepIndex>` is
//! deterministic (and the bridge request id goes into `--comment`), so before
//! submitting, and when a start claim's servicer died before saving the
//! handle, the job is looked up by name and adopted instead of submitted again.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;

use super::api::{failure, Call, CheckError, Provider, ProviderError};
use super::bounded::{run_bounded, tail_text};
use crate::protocol::bridge::{
    digest, FailureCode, FollowUpInput, Handle, JobState, Operation, StartInput, MAX_OUTPUT,
};
use crate::store::layout::RunPaths;

pub struct Slurm {
    name: String,
}

/// What Slurm says about one job.
#[derive(Debug, Clone, PartialEq)]
struct JobInfo {
    id: String,
    state: String,
    exit_code: Option<String>,
    reason: Option<String>,
    /// `JobName` and `UserId` (scontrol only), for lookups by name.
    name: Option<String>,
    user: Option<String>,
}

/// Map a Slurm job state (squeue %T, scontrol JobState, sacct State) to a handle state.
pub fn map_state(raw: &str) -> Option<JobState> {
    // sacct writes "CANCELLED by 0"; some states carry a "+" suffix.
    let s = raw.split_whitespace().next().unwrap_or("").trim_end_matches('+').to_ascii_uppercase();
    Some(match s.as_str() {
        "PENDING" | "REQUEUED" | "REQUEUE_FED" | "REQUEUE_HOLD" | "RESV_DEL_HOLD" | "SPECIAL_EXIT" | "CONFIGURING" => {
            JobState::Queued
        }
        "RUNNING" | "COMPLETING" | "SUSPENDED" | "STOPPED" | "SIGNALING" | "STAGE_OUT" | "RESIZING" => {
            JobState::Running
        }
        "COMPLETED" => JobState::Completed,
        "CANCELLED" => JobState::Stopped,
        "FAILED" | "TIMEOUT" | "NODE_FAIL" | "PREEMPTED" | "BOOT_FAIL" | "DEADLINE" | "OUT_OF_MEMORY" | "REVOKED" => {
            JobState::Failed
        }
        _ => return None,
    })
}

/// `runspool-<runId>-<stepIndex>`: the deterministic job name of a step.
pub fn job_name(run_id: &str, step_index: usize) -> String {
    format!("runspool-{run_id}-{step_index}")
}

/// A follow-up's job: its step's name plus a digest of the follow-up request
/// id, so each follow-up has a name of its own to be found by after a crash.
pub fn follow_up_job_name(f: &FollowUpInput) -> String {
    format!("{}-fu-{}", job_name(&f.start.run_id, f.start.step_index), &digest(&f.request_id)[..12])
}

fn option_token(key: &str, v: &Value) -> Result<String, ProviderError> {
    let bad = |why: &str| {
        failure(
            FailureCode::InvalidOption,
            format!("externalJob.options.{key} {why}; see docs/external-jobs.md for the Slurm options"),
        )
    };
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) if n.as_u64().is_some_and(|n| n > 0) => n.to_string(),
        _ => return Err(bad("must be a non-empty string or a positive integer")),
    };
    if s.is_empty() || s.len() > 128 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-,".contains(&b)) {
        return Err(bad(&format!("is `{}`; use letters, digits and . _ : - , only (at most 128)", s.escape_debug())));
    }
    Ok(s)
}

/// Map `externalJob.options` to sbatch flags; unknown options are refused.
pub fn sbatch_flags(options: &serde_json::Map<String, Value>) -> Result<Vec<String>, ProviderError> {
    let mut flags = Vec::new();
    for (k, v) in options {
        let flag = match k.as_str() {
            "partition" => "--partition",
            "account" => "--account",
            "timeLimit" => "--time",
            "cpus" => {
                if !v.as_u64().is_some_and(|n| (1..=4096).contains(&n)) {
                    return Err(failure(
                        FailureCode::InvalidOption,
                        format!("externalJob.options.cpus is {v}; give a whole number of CPUs from 1 to 4096"),
                    ));
                }
                "--cpus-per-task"
            }
            "memory" => "--mem",
            other => {
                return Err(failure(
                    FailureCode::InvalidOption,
                    format!(
                        "externalJob.options.{other} is not a Slurm option runspool knows; use partition, account, timeLimit, cpus or memory"
                    ),
                ))
            }
        };
        flags.push(format!("{flag}={}", option_token(k, v)?));
    }
    Ok(flags)
}

impl Slurm {
    pub fn new(name: &str) -> Self {
        Slurm { name: name.to_string() }
    }

    /// Run one Slurm command; Ok((success, stdout, stderr)).
    fn run(&self, bin: &str, args: &[String], deadline: Instant) -> Result<(bool, String, String), ProviderError> {
        let mut argv = vec![bin.to_string()];
        argv.extend(args.iter().cloned());
        let out = run_bounded(&argv, b"", &[], deadline, 4 * MAX_OUTPUT).map_err(|e| {
            failure(
                FailureCode::ProviderError,
                format!(
                    "providers.{}: cannot run `{bin}`: {e}; install the Slurm client commands (Debian: slurm-client) and make sure they are on the daemon's PATH",
                    self.name
                ),
            )
        })?;
        if out.timed_out {
            return Err(failure(
                FailureCode::ProviderTimeout,
                format!(
                    "providers.{}: `{}` did not finish within the time limit (providers.{}.timeout_ms) and was killed; is slurmctld reachable?",
                    self.name,
                    argv.join(" "),
                    self.name
                ),
            ));
        }
        let ok = out.status.is_some_and(|s| s.success());
        Ok((ok, String::from_utf8_lossy(&out.stdout).into_owned(), out.stderr_tail))
    }

    fn cmd_error(&self, what: &str, stderr: &str) -> ProviderError {
        failure(
            FailureCode::ProviderError,
            format!("providers.{}: `{what}` failed: {}", self.name, tail_text(stderr, 1500)),
        )
    }

    /// squeue, then scontrol, then sacct: the first that knows the job wins.
    fn query(&self, id: &str, deadline: Instant) -> Result<Option<JobInfo>, ProviderError> {
        let args = vec!["-h".into(), "-t".into(), "all".into(), "-j".into(), id.into(), "-o".into(), "%i|%T|%r".into()];
        let (ok, out, err) = self.run("squeue", &args, deadline)?;
        let mut found = None;
        // Errors other than "no such job" mean Slurm could not be asked.
        let mut unreachable = (!ok && !err.contains("Invalid job id")).then(|| err.clone());
        if ok {
            if let Some(line) = out.lines().find(|l| l.split('|').next() == Some(id)) {
                let f: Vec<&str> = line.split('|').collect();
                found = Some(JobInfo {
                    id: id.into(),
                    state: f[1].to_string(),
                    exit_code: None,
                    reason: f.get(2).map(|s| s.to_string()),
                    name: None,
                    user: None,
                });
            }
        } else if !err.contains("Invalid job id") {
            tracing::debug!(job = id, stderr = %err.trim(), "squeue failed; asking scontrol");
        }
        // The exit code of a finished job comes from scontrol, which also knows
        // jobs squeue has already dropped.
        if found.as_ref().is_none_or(|j| map_state(&j.state).is_some_and(|s| s.is_terminal())) {
            let (ok, out, err) =
                self.run("scontrol", &["-o".into(), "show".into(), "job".into(), id.into()], deadline)?;
            if ok {
                unreachable = None;
                if let Some(j) = parse_scontrol(&out).into_iter().find(|j| j.id == id) {
                    return Ok(Some(j));
                }
            } else if err.contains("Invalid job id") {
                unreachable = None;
            }
        }
        if found.is_some() {
            return Ok(found);
        }
        let args: Vec<String> =
            ["-X", "-n", "-P", "-j", id, "-o", "JobID,State,ExitCode"].iter().map(|s| s.to_string()).collect();
        let (ok, out, _) = self.run("sacct", &args, deadline)?;
        if ok {
            for line in out.lines() {
                let f: Vec<&str> = line.split('|').collect();
                if f.len() >= 3 && f[0] == id {
                    return Ok(Some(JobInfo {
                        id: id.into(),
                        state: f[1].into(),
                        exit_code: Some(f[2].into()),
                        reason: None,
                        name: None,
                        user: None,
                    }));
                }
            }
        }
        if let Some(err) = unreachable {
            return Err(self.cmd_error(&format!("squeue -j {id}"), &err));
        }
        Ok(None)
    }

    fn handle_for(&self, j: &JobInfo) -> Result<Handle, ProviderError> {
        let state = map_state(&j.state).ok_or_else(|| {
            failure(
                FailureCode::ProviderError,
                format!(
                    "providers.{}: Slurm job {} is in state `{}`, which runspool does not know",
                    self.name, j.id, j.state
                ),
            )
        })?;
        let mut h = Handle::new(j.id.clone(), state);
        let slurm_state = j.state.split_whitespace().next().unwrap_or("").to_string();
        let detail = {
            let mut d = Vec::new();
            if let Some(ec) = j.exit_code.as_deref().filter(|e| !e.is_empty()) {
                d.push(format!("exit code {ec}"));
            }
            if let Some(r) = j.reason.as_deref().filter(|r| !r.is_empty() && *r != "None") {
                d.push(format!("reason {r}"));
            }
            if d.is_empty() {
                String::new()
            } else {
                format!(" ({})", d.join(", "))
            }
        };
        match state {
            JobState::Failed => {
                h.failure_code = Some(FailureCode::slurm_state(&slurm_state));
                h.failure_message = Some(format!("Slurm job {} ended in state {slurm_state}{detail}", j.id));
            }
            JobState::Stopped => {
                h.failure_code = Some(FailureCode::SlurmCancelled.into());
                h.failure_message = Some(format!("Slurm job {} was {slurm_state}{detail}", j.id));
            }
            _ => {}
        }
        Ok(h)
    }

    fn known(&self, c: &Call) -> Result<Handle, ProviderError> {
        let id = c.provider_job_id.unwrap_or("");
        match self.query(id, c.deadline)? {
            Some(j) => self.handle_for(&j),
            None => Err(failure(
                FailureCode::JobNotFound,
                format!("providers.{}: Slurm knows no job {id} (asked squeue, scontrol and sacct); it may have aged out of slurmctld (MinJobAge) with accounting disabled", self.name),
            )),
        }
    }

    /// Jobs of ours named `name`: squeue (all states), then scontrol, then sacct.
    fn find_by_name(&self, name: &str, deadline: Instant) -> Result<Vec<JobInfo>, ProviderError> {
        let uid = nix::unistd::getuid().as_raw().to_string();
        let args: Vec<String> = ["-h", "-t", "all", "-u", &uid, "--name", name, "-o", "%i|%T|%j|%r"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (ok, out, err) = self.run("squeue", &args, deadline)?;
        if !ok {
            // Without a reliable answer a second job could be submitted: refuse instead.
            return Err(self.cmd_error(&format!("squeue --name {name}"), &err));
        }
        let mut jobs: Vec<JobInfo> = out
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split('|').collect();
                (f.len() >= 3 && f[2] == name).then(|| JobInfo {
                    id: f[0].into(),
                    state: f[1].into(),
                    exit_code: None,
                    reason: f.get(3).map(|s| s.to_string()),
                    name: None,
                    user: None,
                })
            })
            .collect();
        if jobs.is_empty() {
            let (ok, out, err) = self.run("scontrol", &["-o".into(), "show".into(), "job".into()], deadline)?;
            if !ok && !err.contains("No jobs in the system") {
                return Err(self.cmd_error("scontrol -o show job", &err));
            }
            let mine = format!("({uid})");
            jobs = parse_scontrol(&out)
                .into_iter()
                .filter(|j| j.name.as_deref() == Some(name) && j.user.as_deref().is_some_and(|u| u.ends_with(&mine)))
                .collect();
        }
        if jobs.is_empty() {
            let args: Vec<String> =
                ["-X", "-n", "-P", "-u", &uid, "--name", name, "-S", "now-30days", "-o", "JobID,State,ExitCode"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            // Accounting may be disabled; then sacct has nothing to add.
            if let (true, out, _) = self.run("sacct", &args, deadline)? {
                for l in out.lines() {
                    let f: Vec<&str> = l.split('|').collect();
                    if f.len() >= 3 {
                        jobs.push(JobInfo {
                            id: f[0].into(),
                            state: f[1].into(),
                            exit_code: Some(f[2].into()),
                            reason: None,
                            name: None,
                            user: None,
                        });
                    }
                }
            }
        }
        jobs.sort_by_key(|j| j.id.parse::<u64>().unwrap_or(u64::MAX));
        Ok(jobs)
    }

    fn start(&self, c: &Call, s: &StartInput) -> Result<Handle, ProviderError> {
        self.submit(c, s, &job_name(&s.run_id, s.step_index), &script_path(c.run_dir, s.step_index), None)
    }

    /// A follow-up is a job of its own, run after its parent ends: submitted
    /// with `--dependency=afterany:<parent>` while Slurm still knows the
    /// parent (pending or running), at once otherwise.
    fn follow_up(&self, c: &Call, f: &FollowUpInput) -> Result<Handle, ProviderError> {
        let parent = &f.parent_provider_job_id;
        if !parent.bytes().all(|b| b.is_ascii_digit()) {
            return Err(failure(
                FailureCode::MalformedRequest,
                format!("followUp.parentProviderJobId `{parent}` is not a Slurm job id (digits only)"),
            ));
        }
        let (ok, out, _) =
            self.run("squeue", &["-h".into(), "-j".into(), parent.clone(), "-o".into(), "%i".into()], c.deadline)?;
        let active = ok && out.lines().any(|l| l.trim() == parent);
        let name = follow_up_job_name(f);
        let script = RunPaths::slurm_follow_up_script(c.run_dir, f.start.step_index, &digest(&f.request_id)[..12]);
        let dep = active.then(|| format!("--dependency=afterany:{parent}"));
        self.submit(c, &f.start, &name, &script, dep)
    }

    /// Submit `s.prompt` as batch job `name` (adopting a job of that name an
    /// earlier attempt already submitted).
    fn submit(
        &self,
        c: &Call,
        s: &StartInput,
        name: &str,
        script: &Path,
        extra: Option<String>,
    ) -> Result<Handle, ProviderError> {
        let flags = sbatch_flags(&s.options)?;
        if let Some(h) = self.adopt(c, name)? {
            return Ok(h);
        }
        let script = script.to_path_buf();
        let mut body = s.prompt.clone();
        if !body.starts_with("#!") {
            body = format!("#!/bin/sh\n{body}");
        }
        crate::store::fsutil::write_atomic(&script, body.as_bytes(), true)
            .and_then(|_| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(|e| {
                failure(
                    FailureCode::ProviderError,
                    format!("providers.{}: cannot write the batch script {}: {e}", self.name, script.display()),
                )
            })?;
        let mut args = vec![
            "--parsable".to_string(),
            format!("--job-name={name}"),
            format!("--comment=runspool-request={}", c.request_id),
            format!("--chdir={}", s.cwd),
            format!("--output={}", RunPaths::slurm_output(c.run_dir, "%j").display()),
        ];
        args.extend(extra);
        args.extend(flags);
        args.push(script.display().to_string());
        let (ok, out, err) = self.run("sbatch", &args, c.deadline)?;
        if !ok {
            return Err(failure(
                FailureCode::ProviderError,
                format!("providers.{}: sbatch refused the job {name}: {}", self.name, tail_text(&err, 1500)),
            ));
        }
        let id = out.lines().next().unwrap_or("").split(';').next().unwrap_or("").trim().to_string();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(failure(
                FailureCode::ProviderError,
                format!(
                    "providers.{}: sbatch --parsable printed `{}`, not a job id; stderr: {}",
                    self.name,
                    tail_text(&out, 200),
                    tail_text(&err, 500)
                ),
            ));
        }
        tracing::info!(provider = %self.name, job = %id, job_name = %name, "submitted a Slurm job");
        Ok(Handle::new(id, JobState::Queued))
    }

    /// The job an earlier start (or follow-up) already submitted as `name`, if any.
    fn adopt(&self, c: &Call, name: &str) -> Result<Option<Handle>, ProviderError> {
        let jobs = self.find_by_name(name, c.deadline)?;
        let Some(j) = jobs.first() else { return Ok(None) };
        tracing::warn!(provider = %self.name, job = %j.id, job_name = %name, "adopting a Slurm job submitted earlier for this step instead of submitting again");
        // A job Slurm no longer tracks closely still gets a handle with the state it reported.
        match self.handle_for(j) {
            Ok(h) => Ok(Some(h)),
            Err(_) => Ok(Some(Handle::new(j.id.clone(), JobState::Running))),
        }
    }

    fn result(&self, c: &Call) -> Result<Handle, ProviderError> {
        let mut h = self.known(c)?;
        let path = RunPaths::slurm_output(c.run_dir, &h.provider_job_id);
        match read_tail(&path, MAX_OUTPUT) {
            Ok(text) => {
                h.output = Some(text);
                h.artifact_path = Some(path.display().to_string());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.output = Some(String::new()),
            Err(e) => {
                return Err(failure(
                    FailureCode::ProviderError,
                    format!("providers.{}: cannot read the job output {}: {e}", self.name, path.display()),
                ))
            }
        }
        Ok(h)
    }

    fn cancel(&self, c: &Call) -> Result<Handle, ProviderError> {
        let id = c.provider_job_id.unwrap_or("");
        let (ok, _, err) = self.run("scancel", &[id.to_string()], c.deadline)?;
        if !ok && !err.contains("already completing or completed") {
            return Err(self.cmd_error(&format!("scancel {id}"), &err));
        }
        self.known(c)
    }
}

impl Provider for Slurm {
    fn kind(&self) -> &'static str {
        "slurm"
    }

    fn call(&self, c: &Call) -> Result<Handle, ProviderError> {
        match (c.op, c.start) {
            (Operation::Start, Some(s)) => self.start(c, s),
            (Operation::Start, None) => {
                Err(failure(FailureCode::MalformedRequest, "a start request without its `start` object"))
            }
            (Operation::FollowUp, _) => match c.follow_up {
                Some(f) => self.follow_up(c, f),
                None => {
                    Err(failure(FailureCode::MalformedRequest, "a follow-up request without its `followUp` object"))
                }
            },
            (Operation::Status | Operation::Reattach, _) => self.known(c),
            (Operation::Result, _) => self.result(c),
            (Operation::Cancel, _) => self.cancel(c),
        }
    }

    fn find_started(&self, c: &Call) -> Result<Option<Handle>, ProviderError> {
        match (c.start, c.follow_up) {
            (Some(s), _) if c.op == Operation::Start => self.adopt(c, &job_name(&s.run_id, s.step_index)),
            (_, Some(f)) if c.op == Operation::FollowUp => self.adopt(c, &follow_up_job_name(f)),
            _ => Ok(None),
        }
    }

    fn check(&self) -> Result<String, CheckError> {
        let deadline = Instant::now() + std::time::Duration::from_secs(15);
        match self.run("sinfo", &["-h".into(), "-o".into(), "%P %a %D %T".into()], deadline) {
            Ok((true, out, _)) if !out.trim().is_empty() => Ok(format!("sinfo: {}", out.lines().collect::<Vec<_>>().join("; "))),
            Ok((true, _, _)) => Err(CheckError::Failed(format!("providers.{}: sinfo reports no partitions; configure one in slurm.conf", self.name))),
            Ok((false, _, err)) => Err(CheckError::Failed(format!("providers.{}: sinfo failed: {}; is slurmctld running and SLURM_CONF right?", self.name, tail_text(&err, 400)))),
            Err(f) if FailureCode::ProviderTimeout.is(&f.code) => Err(CheckError::Failed(format!(
                "providers.{}: sinfo did not answer within 15 s; is slurmctld running and SLURM_CONF (or /etc/slurm/slurm.conf) right?",
                self.name
            ))),
            Err(f) => Err(CheckError::Failed(f.message)),
        }
    }
}

fn script_path(run_dir: &Path, i: usize) -> PathBuf {
    RunPaths::slurm_script(run_dir, i)
}

/// Parse `scontrol -o show job` lines (one job per line).
fn parse_scontrol(out: &str) -> Vec<JobInfo> {
    let mut v = Vec::new();
    for line in out.lines() {
        let get = |key: &str| -> Option<String> {
            let pat = format!("{key}=");
            line.split(' ').find_map(|tok| tok.strip_prefix(pat.as_str())).map(str::to_string)
        };
        let (Some(id), Some(state)) = (get("JobId"), get("JobState")) else { continue };
        v.push(JobInfo {
            id,
            state,
            exit_code: get("ExitCode"),
            reason: get("Reason"),
            name: get("JobName"),
            user: get("UserId"),
        });
    }
    v
}

fn read_tail(path: &Path, max: usize) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    // The job's output file is the job's to write: never block on a FIFO there.
    let mut f = crate::store::fsutil::open_read(path)?;
    let len = f.metadata()?.len();
    if len > max as u64 {
        f.seek(SeekFrom::Start(len - max as u64))?;
    }
    let mut b = Vec::new();
    f.take(max as u64).read_to_end(&mut b)?;
    let mut s = String::from_utf8_lossy(&b).replace('\0', "");
    while s.len() > max {
        s.remove(0);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_map() {
        assert_eq!(map_state("PENDING"), Some(JobState::Queued));
        assert_eq!(map_state("RUNNING"), Some(JobState::Running));
        assert_eq!(map_state("COMPLETING"), Some(JobState::Running));
        assert_eq!(map_state("COMPLETED"), Some(JobState::Completed));
        assert_eq!(map_state("CANCELLED by 0"), Some(JobState::Stopped));
        assert_eq!(map_state("CANCELLED+"), Some(JobState::Stopped));
        for f in ["FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"] {
            assert_eq!(map_state(f), Some(JobState::Failed), "{f}");
        }
        assert_eq!(map_state("WHATEVER"), None);
    }

    #[test]
    fn options_map_to_flags() {
        let o: serde_json::Map<String, Value> = serde_json::from_str(
            r#"{"partition":"debug","account":"lab","timeLimit":"00:10:00","cpus":2,"memory":"512M"}"#,
        )
        .unwrap();
        let f = sbatch_flags(&o).unwrap();
        assert_eq!(f, vec!["--partition=debug", "--account=lab", "--time=00:10:00", "--cpus-per-task=2", "--mem=512M"]);
        let o: serde_json::Map<String, Value> = serde_json::from_str(r#"{"gpus":1}"#).unwrap();
        let e = sbatch_flags(&o).unwrap_err();
        assert_eq!(e.code, FailureCode::InvalidOption.as_str());
        assert!(e.message.contains("options.gpus"), "{}", e.message);
        let o: serde_json::Map<String, Value> = serde_json::from_str(r#"{"partition":"a b"}"#).unwrap();
        assert!(sbatch_flags(&o).unwrap_err().message.contains("options.partition"));
        let o: serde_json::Map<String, Value> = serde_json::from_str(r#"{"cpus":0}"#).unwrap();
        assert!(sbatch_flags(&o).unwrap_err().message.contains("options.cpus"));
    }

    #[test]
    fn scontrol_lines_parse() {
        let line = "JobId=7 JobName=runspool-r-1 UserId=root(0) JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 RunTime=00:00:00";
        let j = parse_scontrol(line);
        assert_eq!(j[0].id, "7");
        assert_eq!(j[0].state, "FAILED");
        assert_eq!(j[0].exit_code.as_deref(), Some("3:0"));
    }
}
