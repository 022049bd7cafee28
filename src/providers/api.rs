//! What a provider is (PROTOCOL §8.4): the `Provider` trait, one `Call`,
//! and the failures and check errors it reports.

use std::path::Path;
use std::time::Instant;

use crate::protocol::bridge::{Failure, FailureCode, FollowUpInput, Handle, Operation, StartInput};

/// One provider operation, as the daemon's bridge hands it over.
pub struct Call<'a> {
    pub op: Operation,
    /// The bridge request id (Slurm records it in `--comment`).
    pub request_id: &'a str,
    pub provider_job_id: Option<&'a str>,
    pub start: Option<&'a StartInput>,
    /// The `followUp` object of a follow-up.
    pub follow_up: Option<&'a FollowUpInput>,
    /// The run directory the request came from (batch scripts and output live there).
    pub run_dir: &'a Path,
    /// The operation must be answered by then; processes still running are killed.
    pub deadline: Instant,
}

/// A provider error: a code (§8.2) and a message naming what to fix.
pub type ProviderError = Failure;

pub fn failure(code: FailureCode, message: impl Into<String>) -> ProviderError {
    let mut message: String = message.into();
    if message.chars().count() > crate::protocol::bridge::MAX_MESSAGE {
        message = message.chars().take(crate::protocol::bridge::MAX_MESSAGE - 3).collect::<String>() + "...";
    }
    let message = match message.trim() {
        "" => "no message".to_string(),
        m => m.to_string(),
    };
    Failure { code: code.into(), message, blocking_job_id: None }
}

pub trait Provider: Send + Sync {
    /// `command` or `slurm`.
    fn kind(&self) -> &'static str;
    /// Run one operation. The handle is validated by the caller.
    fn call(&self, call: &Call) -> Result<Handle, ProviderError>;
    /// Look up a job that an earlier `start` (or `follow-up`) of this request may already have
    /// submitted (its servicer died before saving the handle). `None` when the
    /// engine has no such job or cannot tell.
    fn find_started(&self, _call: &Call) -> Result<Option<Handle>, ProviderError> {
        Ok(None)
    }
    /// A one-line health check for `runspool providers`.
    fn check(&self) -> Result<String, CheckError>;
    /// `NAME=value` pairs in the environment of every process this provider
    /// starts for `call` (and of their descendants, unless they drop them):
    /// recovery kills what a dead servicer's call left with them before it
    /// decides that a start was abandoned. Empty: none are set (Slurm, whose
    /// `sbatch` would hand them to the job itself).
    fn marks(&self, _call: &Call) -> Vec<String> {
        Vec::new()
    }
}

/// Why a provider failed its health check: a message that names the
/// provider's config key and what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("{0}")]
    Failed(String),
}
