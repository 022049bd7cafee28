//! The `command` provider (PROTOCOL §8.4): `<command...> <operation>` with
//! the operation's input as JSON on stdin, one JSON handle on stdout, exit 0.
//! A non-zero exit may print `{"code","message","blockingJobId"?}`; anything
//! else is `provider-error` with the tail of stderr.

use serde_json::json;

use super::api::{failure, Call, CheckError, Provider, ProviderError};
use super::bounded::{run_bounded, tail_text};
use crate::platform::exec::find_executable;
use crate::protocol::bridge::{parse_failure, parse_handle, FailureCode, Handle, Operation, MAX_OUTPUT};

pub struct CommandProvider {
    name: String,
    argv: Vec<String>,
}

impl CommandProvider {
    pub fn new(name: &str, argv: Vec<String>) -> Self {
        CommandProvider { name: name.to_string(), argv }
    }

    fn shown(&self, op: Operation) -> String {
        format!("{} {}", self.argv.join(" "), op.as_str())
    }
}

impl Provider for CommandProvider {
    fn kind(&self) -> &'static str {
        "command"
    }

    fn call(&self, c: &Call) -> Result<Handle, ProviderError> {
        let name = &self.name;
        let input = match (c.op, c.start, c.follow_up) {
            (Operation::Start, Some(s), _) => serde_json::to_vec(s).unwrap_or_default(),
            (Operation::Start, None, _) => {
                return Err(failure(FailureCode::MalformedRequest, "a start request without its `start` object"))
            }
            // `<command...> follow-up` with the followUp object on stdin.
            (Operation::FollowUp, _, Some(f)) => serde_json::to_vec(f).unwrap_or_default(),
            (Operation::FollowUp, _, None) => {
                return Err(failure(FailureCode::MalformedRequest, "a follow-up request without its `followUp` object"))
            }
            (_, _, _) => serde_json::to_vec(&json!({"providerJobId": c.provider_job_id})).unwrap_or_default(),
        };
        let mut argv = self.argv.clone();
        argv.push(c.op.as_str().to_string());
        let envs = envs(name, c);
        // Room for a 1 MiB output once JSON-escaped, and the handle around it.
        let out = run_bounded(&argv, &input, &envs, c.deadline, 4 * MAX_OUTPUT).map_err(|e| {
            failure(
                FailureCode::ProviderError,
                format!(
                    "providers.{name}: cannot run `{}`: {e}; check that providers.{name}.command[0] exists and is executable (`runspool providers` checks it)",
                    argv[0]
                ),
            )
        })?;
        let shown = self.shown(c.op);
        if out.timed_out {
            return Err(failure(
                FailureCode::ProviderTimeout,
                format!(
                    "providers.{name}: `{shown}` did not finish within its time limit (providers.{name}.timeout_ms); its process group {} was killed{}",
                    out.pgid,
                    stderr_suffix(&out.stderr_tail)
                ),
            ));
        }
        let status = out.status.expect("not timed out: the child was waited for");
        if out.stdout_truncated {
            return Err(failure(
                FailureCode::ProviderError,
                format!("providers.{name}: `{shown}` printed more than {} bytes; return a smaller output or an artifactPath", 4 * MAX_OUTPUT),
            ));
        }
        if status.success() {
            return parse_handle(&out.stdout, c.op).map_err(|e| {
                failure(
                    FailureCode::ProviderError,
                    format!(
                        "providers.{name}: `{shown}` exited 0 but printed an invalid handle: {e}; it must print one JSON object with providerJobId and state (docs/protocol.md §8.2). stdout was: {}{}",
                        show_stdout(&out.stdout),
                        stderr_suffix(&out.stderr_tail)
                    ),
                )
            });
        }
        let how = match (status.code(), std::os::unix::process::ExitStatusExt::signal(&status)) {
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(s)) => format!("was killed by {}", crate::platform::signal_name(s)),
            _ => "failed".to_string(),
        };
        match parse_failure(out.stdout.trim_ascii()) {
            Ok(f) => Err(f),
            Err(_) => Err(failure(
                FailureCode::ProviderError,
                format!(
                    "providers.{name}: `{shown}` {how}{}; stdout: {}",
                    stderr_suffix(&out.stderr_tail),
                    show_stdout(&out.stdout)
                ),
            )),
        }
    }

    fn marks(&self, c: &Call) -> Vec<String> {
        envs(&self.name, c).iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    fn check(&self) -> Result<String, CheckError> {
        find_executable(&self.argv[0]).map(|p| format!("{} is executable", p.display())).map_err(|e| {
            CheckError::Failed(format!("providers.{}.command[0]: {e}; install it or fix the path", self.name))
        })
    }
}

/// The variables a provider process gets (docs/external-jobs.md); `marks` finds its leftovers by them.
fn envs(name: &str, c: &Call) -> [(&'static str, String); 5] {
    let run_id = c.run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    [
        ("RUNSPOOL_PROVIDER", name.to_string()),
        ("RUNSPOOL_OPERATION", c.op.as_str().to_string()),
        ("RUNSPOOL_BRIDGE_REQUEST_ID", c.request_id.to_string()),
        ("RUNSPOOL_RUN_ID", run_id),
        ("RUNSPOOL_RUN_DIR", c.run_dir.display().to_string()),
    ]
}

fn stderr_suffix(tail: &str) -> String {
    match tail.trim() {
        "" => String::new(),
        t => format!("; stderr: {}", tail_text(t, 1500)),
    }
}

fn show_stdout(b: &[u8]) -> String {
    match String::from_utf8_lossy(b).trim() {
        "" => "(empty)".to_string(),
        t => format!("`{}`", tail_text(t, 500)),
    }
}
