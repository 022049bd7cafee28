//! External-job providers (PROTOCOL §8.4): the `Provider` trait, the
//! `command` provider and the built-in `slurm` provider, plus the bounded
//! process runner both use (own process group, killed at the time limit).

pub mod command;
pub mod slurm;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config;
use crate::platform::exec;
use crate::protocol::bridge::{Failure, FollowUpInput, Handle, Operation, StartInput};

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

pub fn failure(code: &str, message: impl Into<String>) -> ProviderError {
    let mut message: String = message.into();
    if message.chars().count() > crate::protocol::bridge::MAX_MESSAGE {
        message = message.chars().take(crate::protocol::bridge::MAX_MESSAGE - 3).collect::<String>() + "...";
    }
    let message = match message.trim() {
        "" => "no message".to_string(),
        m => m.to_string(),
    };
    Failure { code: code.to_string(), message, blocking_job_id: None }
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

pub type Providers = BTreeMap<String, (Arc<dyn Provider>, Duration)>;

/// Build every configured provider with its time limit.
pub fn build_all(cfg: &config::Config) -> Providers {
    cfg.providers
        .iter()
        .map(|(name, p)| (name.clone(), (build(name, p), Duration::from_millis(p.timeout_ms))))
        .collect()
}

pub fn build(name: &str, p: &config::Provider) -> Arc<dyn Provider> {
    match p.kind.as_str() {
        "slurm" => Arc::new(slurm::Slurm::new(name)),
        _ => Arc::new(command::CommandProvider::new(name, p.command.clone())),
    }
}

/// What a bounded process run produced.
pub struct Output {
    pub status: Option<ExitStatus>,
    pub stdout: Vec<u8>,
    /// True when stdout exceeded the cap (the rest was drained and dropped).
    pub stdout_truncated: bool,
    /// The last 4 KiB of stderr, lossily decoded.
    pub stderr_tail: String,
    pub timed_out: bool,
    pub pgid: u32,
}

/// Run `argv` in its own process group with `stdin`, capturing at most
/// `max_stdout` bytes of stdout and the tail of stderr. At the deadline the
/// whole process group is killed (SIGKILL) and `timed_out` is set. The child
/// never outlives the daemon: it gets SIGKILL when the calling thread exits
/// (PR_SET_PDEATHSIG), and this function does not return before it is
/// reaped, so only the daemon's death can end that thread first.
/// (One function on purpose: spawn, the copy threads, the deadline loop and
/// the reap share the child and must not be split across early returns.)
pub fn run_bounded(
    argv: &[String],
    stdin: &[u8],
    envs: &[(&str, String)],
    deadline: Instant,
    max_stdout: usize,
) -> std::io::Result<Output> {
    let mut cmd = exec::command(&argv[0], exec::Detach { own_group: true, die_with_thread: true });
    cmd.args(&argv[1..]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn()?;
    let pgid = child.id();
    let mut sin = child.stdin.take().expect("piped");
    let input = stdin.to_vec();
    // A provider that never reads stdin must not block us: write from a thread.
    std::thread::spawn(move || {
        let _ = sin.write_all(&input);
    });
    let (otx, orx) = channel();
    let mut sout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        let mut keep = Vec::new();
        let mut truncated = false;
        let mut buf = [0u8; 8192];
        loop {
            match sout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let room = (max_stdout + 1).saturating_sub(keep.len());
                    keep.extend_from_slice(&buf[..n.min(room)]);
                    if keep.len() > max_stdout {
                        truncated = true;
                        keep.truncate(max_stdout);
                    }
                }
            }
        }
        let _ = otx.send((keep, truncated));
    });
    let (etx, erx) = channel();
    let mut serr = child.stderr.take().expect("piped");
    std::thread::spawn(move || {
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match serr.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    tail.extend_from_slice(&buf[..n]);
                    if tail.len() > 8192 {
                        tail.drain(..tail.len() - 4096);
                    }
                }
            }
        }
        let start = tail.len().saturating_sub(4096);
        let _ = etx.send(String::from_utf8_lossy(&tail[start..]).into_owned());
    });
    let mut timed_out = false;
    let status = loop {
        match child.try_wait()? {
            Some(st) => break Some(st),
            None if Instant::now() >= deadline => {
                timed_out = true;
                kill_group(pgid);
                break child.wait().ok();
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    if timed_out {
        kill_group(pgid);
    }
    // A background grandchild may hold the pipes open: wait for them only
    // until the deadline (plus a moment), then go on without the rest.
    let grace = deadline.max(Instant::now()) + Duration::from_millis(200);
    let (stdout, stdout_truncated) =
        orx.recv_timeout(grace.saturating_duration_since(Instant::now())).unwrap_or_default();
    let stderr_tail = erx
        .recv_timeout(grace.saturating_duration_since(Instant::now()) + Duration::from_millis(50))
        .unwrap_or_default();
    Ok(Output { status, stdout, stdout_truncated, stderr_tail, timed_out, pgid })
}

pub fn kill_group(pgid: u32) {
    if pgid > 1 {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), nix::sys::signal::Signal::SIGKILL);
    }
}

/// The last `max` characters of `s`, trimmed, for error messages.
pub fn tail_text(s: &str, max: usize) -> String {
    let t = s.trim();
    let n = t.chars().count();
    if n <= max {
        t.to_string()
    } else {
        format!("...{}", t.chars().skip(n - max).collect::<String>())
    }
}

/// `runspool providers`: list the configured providers and check each.
/// The config a running daemon on `layout` reports it loaded (daemon.json
/// `config`), with its pid; None when no daemon holds the lock or it does
/// not say.
fn running_daemon_config(layout: &crate::store::Layout) -> Option<(u64, crate::protocol::daemon::ConfigInfo)> {
    if !crate::store::fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false) {
        return None;
    }
    let bytes = crate::store::fsutil::read_nofollow(&layout.daemon_json(), 1 << 20).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let info = serde_json::from_value(v.get("config")?.clone()).ok()?;
    Some((v["pid"].as_u64().unwrap_or(0), info))
}

/// `runspool providers`: without `--config`, and with a daemon running on
/// the root, the providers of the config that daemon loaded.
pub fn cli_main(config_path: Option<&Path>, json: bool, layout: &crate::store::Layout) -> i32 {
    let daemon = if config_path.is_none() { running_daemon_config(layout) } else { None };
    let loaded = match &daemon {
        Some((pid, info)) => {
            let shown = info.path.as_deref().unwrap_or("no config file (the defaults)");
            eprintln!("runspool providers: the config of the running daemon (pid {pid}): {shown}");
            match &info.path {
                Some(p) => config::Config::load(Some(Path::new(p))),
                None => Ok(config::Config::default()),
            }
        }
        None => config::Config::load(config_path),
    };
    let cfg = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runspool providers: {e}");
            if let Some((pid, info)) = &daemon {
                let names: Vec<String> = info.providers.iter().map(|p| format!("{} ({})", p.name, p.kind)).collect();
                eprintln!(
                    "runspool providers: the daemon (pid {pid}) still runs with the providers it loaded before: {}",
                    if names.is_empty() { "none".to_string() } else { names.join(", ") }
                );
            }
            return 1;
        }
    };
    if let Some((pid, info)) = &daemon {
        if cfg.provider_infos() != info.providers {
            let names: Vec<String> = info.providers.iter().map(|p| format!("{} ({})", p.name, p.kind)).collect();
            eprintln!(
                "runspool providers: warning: the file changed since the daemon loaded it; the daemon runs with: {}; \
apply the file with `systemctl --user reload runspool` or `kill -HUP {pid}`",
                if names.is_empty() { "no providers".to_string() } else { names.join(", ") }
            );
        }
    }
    let checks: Vec<(String, &config::Provider, Result<String, String>)> = cfg
        .providers
        .iter()
        .map(|(name, p)| (name.clone(), p, build(name, p).check().map_err(|e| e.to_string())))
        .collect();
    let failed = checks.iter().filter(|c| c.2.is_err()).count();
    if json {
        let v: Vec<serde_json::Value> = checks
            .iter()
            .map(|(name, p, r)| {
                serde_json::json!({
                    "name": name, "type": p.kind, "command": p.command, "timeoutMs": p.timeout_ms,
                    "ok": r.is_ok(), "check": match r { Ok(t) | Err(t) => t },
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else if checks.is_empty() {
        println!("no providers configured; add [providers.NAME] tables to the config file (see docs/external-jobs.md)");
    } else {
        println!("{:<16} {:<8} {:>10}  CHECK", "NAME", "TYPE", "TIMEOUT");
        for (name, p, r) in &checks {
            let (mark, text) = match r {
                Ok(t) => ("ok", t),
                Err(e) => ("FAILED", e),
            };
            println!("{:<16} {:<8} {:>8}ms  {mark}: {text}", name, p.kind, p.timeout_ms);
        }
    }
    if failed > 0 {
        eprintln!("runspool providers: {failed} provider(s) failed their check");
        1
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_run_captures_and_kills() {
        let far = Instant::now() + Duration::from_secs(30);
        let argv: Vec<String> = ["sh", "-c", "cat; echo err >&2; exit 3"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"hello", &[], far, 1024).unwrap();
        assert_eq!(o.stdout, b"hello");
        assert_eq!(o.status.unwrap().code(), Some(3));
        assert_eq!(o.stderr_tail.trim(), "err");
        assert!(!o.timed_out);
        let argv: Vec<String> = ["sh", "-c", "sleep 30 & sleep 30"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"", &[], Instant::now() + Duration::from_millis(300), 1024).unwrap();
        assert!(o.timed_out);
        let argv: Vec<String> = ["sh", "-c", "head -c 5000 /dev/zero"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"", &[], far, 100).unwrap();
        assert!(o.stdout_truncated && o.stdout.len() == 100);
    }
}
