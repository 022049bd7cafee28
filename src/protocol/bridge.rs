//! External-job bridge files (PROTOCOL §8): requests, responses, start
//! claims and provider handles, with the limits of §8.2. Pure: no I/O.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::seg::sha256_hex;

/// Largest request file read (a prompt may be long; the spool's 1 MiB is for launch requests).
pub const MAX_REQUEST_BYTES: u64 = 4 * 1024 * 1024;
pub const MAX_ID: usize = 256;
pub const MAX_URL: usize = 4096;
pub const MAX_CODE: usize = 128;
pub const MAX_MESSAGE: usize = 4096;
pub const MAX_OUTPUT: usize = 1024 * 1024;
/// Request ids are file names: `[A-Za-z0-9][A-Za-z0-9._-]{0,199}`.
pub const MAX_REQUEST_ID: usize = 200;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Operation {
    Start,
    /// pi-subagents 0.67: a new job continuing a parent job's conversation;
    /// claimed and tombstoned exactly like a start.
    #[serde(rename = "follow-up")]
    FollowUp,
    Status,
    Result,
    Reattach,
    Cancel,
}

impl Operation {
    /// Start and follow-up dispatch a prompt: claimed, never dispatched twice.
    pub fn is_dispatch(self) -> bool {
        matches!(self, Operation::Start | Operation::FollowUp)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Start => "start",
            Operation::FollowUp => "follow-up",
            Operation::Status => "status",
            Operation::Result => "result",
            Operation::Reattach => "reattach",
            Operation::Cancel => "cancel",
        }
    }
}

/// The failure codes runspool itself writes (PROTOCOL §8.2, §8.3, §8.4): as
/// `code` of a bridge response, as a job's `failureCode`, as the code of a
/// failed external step. A provider may give codes of its own, so the
/// `code` fields on disk stay strings; these are the ones runspool spells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureCode {
    /// The request does not parse or validate.
    MalformedRequest,
    /// The provider failed without a code of its own.
    ProviderError,
    /// The operation ran past the provider's `timeout_ms`.
    ProviderTimeout,
    /// No provider of that name is configured.
    ProviderUnavailable,
    /// A start's servicer died before saving the job handle.
    StartDispatchAbandoned,
    /// A follow-up's servicer died before saving the job handle.
    FollowUpDispatchAbandoned,
    /// An earlier start ended without a job id; it is never sent again.
    StartRedispatchBlocked,
    /// status.json records a job of another provider or prompt.
    RecoveryMismatch,
    /// The runner cannot write its bridge request.
    BridgeIo,
    /// No answer to a bridge request within the stop's grace.
    BridgeNoAnswer,
    /// A provider option has a value the provider refuses (Slurm).
    InvalidOption,
    /// The engine knows no such job (Slurm).
    JobNotFound,
    /// A Slurm job was cancelled.
    SlurmCancelled,
}

impl FailureCode {
    /// Every code runspool writes.
    pub const ALL: [FailureCode; 13] = [
        FailureCode::MalformedRequest,
        FailureCode::ProviderError,
        FailureCode::ProviderTimeout,
        FailureCode::ProviderUnavailable,
        FailureCode::StartDispatchAbandoned,
        FailureCode::FollowUpDispatchAbandoned,
        FailureCode::StartRedispatchBlocked,
        FailureCode::RecoveryMismatch,
        FailureCode::BridgeIo,
        FailureCode::BridgeNoAnswer,
        FailureCode::InvalidOption,
        FailureCode::JobNotFound,
        FailureCode::SlurmCancelled,
    ];

    /// The code as written on disk.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureCode::MalformedRequest => "malformed-request",
            FailureCode::ProviderError => "provider-error",
            FailureCode::ProviderTimeout => "provider-timeout",
            FailureCode::ProviderUnavailable => "provider-unavailable",
            FailureCode::StartDispatchAbandoned => "start-dispatch-abandoned",
            FailureCode::FollowUpDispatchAbandoned => "follow-up-dispatch-abandoned",
            FailureCode::StartRedispatchBlocked => "start-redispatch-blocked",
            FailureCode::RecoveryMismatch => "recovery-mismatch",
            FailureCode::BridgeIo => "bridge-io",
            FailureCode::BridgeNoAnswer => "bridge-no-answer",
            FailureCode::InvalidOption => "invalid-option",
            FailureCode::JobNotFound => "job-not-found",
            FailureCode::SlurmCancelled => "slurm-cancelled",
        }
    }

    /// The code spelled `s` on disk, if runspool writes it.
    pub fn parse(s: &str) -> Option<FailureCode> {
        FailureCode::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// True when `code` (a string from disk or a provider) is this code.
    pub fn is(self, code: &str) -> bool {
        self.as_str() == code
    }

    /// The code of a dispatch (start or follow-up) whose servicer died
    /// before saving the job handle.
    pub fn dispatch_abandoned(op: Operation) -> FailureCode {
        match op {
            Operation::FollowUp => FailureCode::FollowUpDispatchAbandoned,
            _ => FailureCode::StartDispatchAbandoned,
        }
    }

    /// The code of a Slurm job that ended in a failure state: `slurm-` and
    /// the state in lower case with `-` for `_` (`NODE_FAIL`: `slurm-node-fail`).
    pub fn slurm_state(state: &str) -> String {
        format!("slurm-{}", state.to_ascii_lowercase().replace('_', "-"))
    }
}

impl std::fmt::Display for FailureCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FailureCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl From<FailureCode> for String {
    fn from(c: FailureCode) -> String {
        c.as_str().to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Completed,
    Failed,
    Stopped,
    Blocked,
}

impl JobState {
    /// Completed, failed and stopped jobs never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Completed | JobState::Failed | JobState::Stopped)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Stopped => "stopped",
            JobState::Blocked => "blocked",
        }
    }
}

/// The `start` object of a start request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartInput {
    pub prompt: String,
    pub prompt_digest: String,
    pub cwd: String,
    pub run_id: String,
    pub step_index: usize,
    pub agent: String,
    #[serde(default)]
    pub options: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

/// The `followUp` object of a follow-up request (pi-subagents 0.67's
/// `ExternalJobFollowUpInput`): a start input plus the lineage of the job it
/// follows up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FollowUpInput {
    #[serde(flatten)]
    pub start: StartInput,
    pub source_run_id: String,
    pub source_step_index: usize,
    pub parent_provider_job_id: String,
    pub request_id: String,
    pub request_digest: String,
}

/// `<runDir>/external-job-requests/<id>.json`. Unknown fields are ignored so
/// other writers (pi-subagents) may add their own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub id: String,
    pub operation: Operation,
    pub provider: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_job_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartInput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow_up: Option<FollowUpInput>,
    pub created_at: i64,
    /// Only in the copy kept in a start claim (`<id>.claim/request.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_at: Option<i64>,
}

/// A provider's handle, or for `result` a handle plus `output`/`artifactPath`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Handle {
    pub provider_job_id: String,
    pub state: JobState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocking_job_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_path: Option<String>,
}

impl Handle {
    pub fn new(provider_job_id: impl Into<String>, state: JobState) -> Handle {
        Handle {
            provider_job_id: provider_job_id.into(),
            state,
            handle_url: None,
            conversation_url: None,
            failure_code: None,
            failure_message: None,
            blocking_job_id: None,
            output: None,
            artifact_path: None,
        }
    }
}

/// What a command provider may print on stdout when it exits non-zero.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Failure {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocking_job_id: Option<String>,
}

/// `<runDir>/external-job-responses/<id>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    pub id: String,
    pub ok: bool,
    pub operation: String,
    pub provider: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Handle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocking_job_id: Option<String>,
    pub completed_at: i64,
}

impl Response {
    pub fn ok(id: &str, op: &str, provider: &str, h: Handle, now: i64) -> Response {
        Response {
            id: id.into(),
            ok: true,
            operation: op.into(),
            provider: provider.into(),
            result: Some(h),
            code: None,
            message: None,
            blocking_job_id: None,
            completed_at: now,
        }
    }
    pub fn err(id: &str, op: &str, provider: &str, f: Failure, now: i64) -> Response {
        Response {
            id: id.into(),
            ok: false,
            operation: op.into(),
            provider: provider.into(),
            result: None,
            code: Some(f.code),
            message: Some(f.message),
            blocking_job_id: f.blocking_job_id,
            completed_at: now,
        }
    }
}

/// `<id>.claim/owner.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimOwner {
    pub version: u32,
    pub pid: u32,
    pub hostname: String,
    pub claimed_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_start_identity: Option<String>,
}

/// `<id>.claim/completed.json`: the tombstone that keeps a start from being dispatched twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Completed {
    pub completed_at: i64,
}

pub fn digest(prompt: &str) -> String {
    sha256_hex(prompt.as_bytes())
}

/// Why a bridge file (request, handle, failure) is refused: a message that
/// names the field and the fix, shown as it is to whoever wrote the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("{0}")]
    Invalid(String),
}

fn invalid(message: String) -> ValidationError {
    ValidationError::Invalid(message)
}

/// §8.2 string rule: non-empty, no NUL, no leading or trailing white space, at most `max` characters.
pub fn check_str(field: &str, v: &str, max: usize) -> Result<(), ValidationError> {
    if v.is_empty() {
        return Err(invalid(format!("`{field}` is empty; give a non-empty string or leave the field out")));
    }
    if v.contains('\0') {
        return Err(invalid(format!("`{field}` contains a NUL character; remove it")));
    }
    if v.trim() != v {
        return Err(invalid(format!("`{field}` has leading or trailing white space; trim it")));
    }
    let n = v.chars().count();
    if n > max {
        return Err(invalid(format!("`{field}` is {n} characters; the limit is {max}")));
    }
    Ok(())
}

fn check_opt(field: &str, v: &Option<String>, max: usize) -> Result<(), ValidationError> {
    v.as_deref().map_or(Ok(()), |s| check_str(field, s, max))
}

/// Validate a handle for `op`: the limits of §8.2; `output` and
/// `artifactPath` only in answers to `result`.
pub fn validate_handle(h: &Handle, op: Operation) -> Result<(), ValidationError> {
    check_str("providerJobId", &h.provider_job_id, MAX_ID)?;
    check_opt("handleUrl", &h.handle_url, MAX_URL)?;
    check_opt("conversationUrl", &h.conversation_url, MAX_URL)?;
    check_opt("failureCode", &h.failure_code, MAX_CODE)?;
    check_opt("failureMessage", &h.failure_message, MAX_MESSAGE)?;
    check_opt("blockingJobId", &h.blocking_job_id, MAX_ID)?;
    check_opt("artifactPath", &h.artifact_path, MAX_URL)?;
    if let Some(o) = &h.output {
        if o.len() > MAX_OUTPUT {
            return Err(invalid(format!(
                "`output` is {} bytes; the limit is {MAX_OUTPUT} (1 MiB): return an artifactPath instead",
                o.len()
            )));
        }
        if o.contains('\0') {
            return Err(invalid("`output` contains a NUL character; remove it".into()));
        }
    }
    if op != Operation::Result && (h.output.is_some() || h.artifact_path.is_some()) {
        return Err(invalid(format!(
            "`output`/`artifactPath` belong only in the answer to `result`, not `{}`",
            op.as_str()
        )));
    }
    if let Some(p) = &h.artifact_path {
        if !p.starts_with('/') {
            return Err(invalid(format!("`artifactPath` is `{p}`; it must be an absolute path")));
        }
    }
    Ok(())
}

/// Parse and validate a handle printed by a provider (unknown fields refused).
pub fn parse_handle(bytes: &[u8], op: Operation) -> Result<Handle, ValidationError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let h: Handle = serde_path_to_error::deserialize(de)
        .map_err(|e| {
            let path = e.path().to_string();
            let inner = strip_position(&e.into_inner().to_string());
            if path == "." || path.is_empty() {
                inner
            } else {
                format!("`{path}`: {inner}")
            }
        })
        .map_err(invalid)?;
    validate_handle(&h, op)?;
    Ok(h)
}

/// Parse and validate a provider's failure object.
pub fn parse_failure(bytes: &[u8]) -> Result<Failure, ValidationError> {
    let f: Failure = serde_json::from_slice(bytes).map_err(|e| invalid(strip_position(&e.to_string())))?;
    check_str("code", &f.code, MAX_CODE)?;
    check_str("message", &f.message, MAX_MESSAGE)?;
    check_opt("blockingJobId", &f.blocking_job_id, MAX_ID)?;
    Ok(f)
}

fn strip_position(s: &str) -> String {
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s.to_string(),
    }
}

/// Parse and validate a request file named `<stem>.json` in the run `run_id`.
pub fn parse_request(bytes: &[u8], stem: &str, run_id: &str) -> Result<Request, ValidationError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let r: Request = serde_path_to_error::deserialize(de)
        .map_err(|e| {
            let path = e.path().to_string();
            let inner = strip_position(&e.into_inner().to_string());
            if path == "." || path.is_empty() {
                format!("{inner}; see docs/protocol.md §8.1 for the request fields")
            } else {
                format!("field `{path}`: {inner}")
            }
        })
        .map_err(invalid)?;
    if r.id != stem {
        return Err(invalid(format!(
            "field `id` is `{}` but the file is named `{stem}.json`; they must match",
            r.id.escape_debug()
        )));
    }
    check_str("provider", &r.provider, MAX_ID)?;
    match r.operation {
        Operation::Start => {
            let Some(s) = &r.start else {
                return Err(invalid("operation `start` needs a `start` object (docs/protocol.md §8.1)".into()));
            };
            check_start("start", s, run_id)?;
        }
        Operation::FollowUp => {
            let Some(f) = &r.follow_up else {
                return Err(invalid("operation `follow-up` needs a `followUp` object (docs/protocol.md §8.1)".into()));
            };
            check_start("followUp", &f.start, run_id)?;
            check_str("followUp.parentProviderJobId", &f.parent_provider_job_id, MAX_ID)?;
            check_str("followUp.sourceRunId", &f.source_run_id, MAX_ID)?;
            check_str("followUp.requestId", &f.request_id, MAX_ID)?;
            check_str("followUp.requestDigest", &f.request_digest, MAX_ID)?;
        }
        op => match &r.provider_job_id {
            Some(id) => check_str("providerJobId", id, MAX_ID)?,
            None => return Err(invalid(format!("operation `{}` needs `providerJobId`", op.as_str()))),
        },
    }
    Ok(r)
}

/// The checks shared by a start and a follow-up (`field` names the object).
fn check_start(field: &str, s: &StartInput, run_id: &str) -> Result<(), ValidationError> {
    if s.prompt.contains('\0') {
        return Err(invalid(format!("field `{field}.prompt` contains a NUL character; remove it")));
    }
    if s.prompt_digest != digest(&s.prompt) {
        return Err(invalid(format!(
            "field `{field}.promptDigest` is `{}` but the SHA-256 of `{field}.prompt` is `{}`; write the digest of the prompt as sent",
            s.prompt_digest.escape_debug(),
            digest(&s.prompt)
        )));
    }
    if !s.cwd.starts_with('/') {
        return Err(invalid(format!("field `{field}.cwd` is `{}`; it must be an absolute path", s.cwd.escape_debug())));
    }
    if s.run_id != run_id {
        return Err(invalid(format!(
            "field `{field}.runId` is `{}` but the request lives in run `{run_id}`; a run may only start its own jobs",
            s.run_id.escape_debug()
        )));
    }
    check_str(&format!("{field}.agent"), &s.agent, 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_codes_round_trip_and_keep_their_spelling() {
        let spelled: Vec<&str> = FailureCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            spelled,
            [
                "malformed-request",
                "provider-error",
                "provider-timeout",
                "provider-unavailable",
                "start-dispatch-abandoned",
                "follow-up-dispatch-abandoned",
                "start-redispatch-blocked",
                "recovery-mismatch",
                "bridge-io",
                "bridge-no-answer",
                "invalid-option",
                "job-not-found",
                "slurm-cancelled",
            ]
        );
        for c in FailureCode::ALL {
            assert_eq!(FailureCode::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), serde_json::json!(c.as_str()));
            assert_eq!(c.to_string(), c.as_str());
            assert!(c.is(c.as_str()));
        }
        assert_eq!(FailureCode::parse("quota"), None);
        assert_eq!(FailureCode::dispatch_abandoned(Operation::Start), FailureCode::StartDispatchAbandoned);
        assert_eq!(FailureCode::dispatch_abandoned(Operation::FollowUp), FailureCode::FollowUpDispatchAbandoned);
        assert_eq!(FailureCode::slurm_state("NODE_FAIL"), "slurm-node-fail");
        assert_eq!(FailureCode::slurm_state("OUT_OF_MEMORY"), "slurm-out-of-memory");
    }

    #[test]
    fn follow_up_requests_validate() {
        let fu = |digest_of: &str, parent: &str| {
            serde_json::json!({
                "id": "f1", "operation": "follow-up", "provider": "slurm", "createdAt": 1,
                "followUp": {"prompt": "more", "promptDigest": digest(digest_of), "cwd": "/", "runId": "run",
                             "stepIndex": 0, "agent": "a", "options": {}, "sourceRunId": "run0", "sourceStepIndex": 1,
                             "parentProviderJobId": parent, "requestId": "req-1", "requestDigest": "abc"}
            })
            .to_string()
        };
        let r = parse_request(fu("more", "42").as_bytes(), "f1", "run").unwrap();
        assert_eq!(r.operation, Operation::FollowUp);
        assert!(r.operation.is_dispatch());
        assert_eq!(r.follow_up.as_ref().unwrap().parent_provider_job_id, "42");
        assert!(parse_request(fu("other", "42").as_bytes(), "f1", "run")
            .unwrap_err()
            .to_string()
            .contains("followUp.promptDigest"));
        assert!(parse_request(fu("more", "").as_bytes(), "f1", "run")
            .unwrap_err()
            .to_string()
            .contains("parentProviderJobId"));
        let bare = r#"{"id":"f1","operation":"follow-up","provider":"p","createdAt":1}"#;
        assert!(parse_request(bare.as_bytes(), "f1", "run").unwrap_err().to_string().contains("followUp"));
        // The followUp object round-trips flat, as 0.67 writes it.
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["followUp"]["prompt"], "more");
        assert_eq!(v["followUp"]["parentProviderJobId"], "42");
    }

    fn start_req(prompt: &str, digest_of: &str) -> String {
        serde_json::json!({
            "id": "r1", "operation": "start", "provider": "slurm", "createdAt": 1,
            "start": {"prompt": prompt, "promptDigest": digest(digest_of), "cwd": "/", "runId": "run",
                      "stepIndex": 0, "agent": "a", "options": {}}
        })
        .to_string()
    }

    #[test]
    fn requests_validate() {
        assert!(parse_request(start_req("echo", "echo").as_bytes(), "r1", "run").is_ok());
        let e = parse_request(start_req("echo", "other").as_bytes(), "r1", "run").unwrap_err().to_string();
        assert!(e.contains("promptDigest"), "{e}");
        let e = parse_request(start_req("echo", "echo").as_bytes(), "r2", "run").unwrap_err().to_string();
        assert!(e.contains("r2.json"), "{e}");
        let e = parse_request(start_req("echo", "echo").as_bytes(), "r1", "other").unwrap_err().to_string();
        assert!(e.contains("start.runId"), "{e}");
        let s = r#"{"id":"x","operation":"status","provider":"p","createdAt":1}"#;
        assert!(parse_request(s.as_bytes(), "x", "run").unwrap_err().to_string().contains("providerJobId"));
        let s = r#"{"id":"x","operation":"explode","provider":"p","createdAt":1}"#;
        assert!(parse_request(s.as_bytes(), "x", "run").unwrap_err().to_string().contains("operation"));
        let s = r#"{"id":"x","operation":"status","provider":"p","providerJobId":"7","createdAt":1,"extra":true}"#;
        assert!(parse_request(s.as_bytes(), "x", "run").is_ok());
    }

    #[test]
    fn handles_validate() {
        assert!(parse_handle(br#"{"providerJobId":"1","state":"queued"}"#, Operation::Start).is_ok());
        let e = parse_handle(br#"{"providerJobId":"1","state":"queued","bogus":1}"#, Operation::Start)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = parse_handle(br#"{"providerJobId":" 1","state":"queued"}"#, Operation::Start).unwrap_err().to_string();
        assert!(e.contains("providerJobId") && e.contains("white space"), "{e}");
        let e = parse_handle(br#"{"providerJobId":"1","state":"done"}"#, Operation::Status).unwrap_err().to_string();
        assert!(e.contains("state"), "{e}");
        let e = parse_handle(br#"{"providerJobId":"1","state":"completed","output":"x"}"#, Operation::Status)
            .unwrap_err()
            .to_string();
        assert!(e.contains("result"), "{e}");
        assert!(parse_handle(br#"{"providerJobId":"1","state":"completed","output":"x\n"}"#, Operation::Result).is_ok());
        let long = format!(r#"{{"providerJobId":"{}","state":"queued"}}"#, "x".repeat(257));
        assert!(parse_handle(long.as_bytes(), Operation::Start).unwrap_err().to_string().contains("257"));
        assert!(parse_handle(b"not json", Operation::Start).is_err());
    }

    #[test]
    fn failures_validate() {
        assert!(parse_failure(br#"{"code":"quota","message":"over quota"}"#).is_ok());
        assert!(parse_failure(br#"{"code":"","message":"x"}"#).is_err());
        assert!(parse_failure(br#"{"code":"a","message":"x","more":1}"#).is_err());
    }
}
