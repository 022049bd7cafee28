//! Every path of docs/protocol.md §1 in one place.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Layout { root: root.into() }
    }

    /// PROTOCOL §1: `--root`, `$RUNSPOOL_ROOT`, `$PI_SUBAGENTS_TEMP_ROOT`,
    /// else `<$TMPDIR or /tmp>/pi-subagents-uid-<uid>`.
    pub fn resolve(flag: Option<&Path>, config_root: Option<&Path>) -> Self {
        if let Some(p) = flag {
            return Layout::new(p);
        }
        for var in ["RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"] {
            if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                return Layout::new(PathBuf::from(v));
            }
        }
        if let Some(p) = config_root {
            return Layout::new(p);
        }
        let tmp =
            std::env::var_os("TMPDIR").filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
        Layout::new(tmp.join(format!("pi-subagents-uid-{}", nix::unistd::getuid())))
    }

    /// What chooses the root ahead of the config file's `root` key (PROTOCOL
    /// §1, same order as `resolve`): `--root DIR` or `VAR=value`, or None
    /// when the config's `root` (or the default) decides.
    pub fn root_override(flag: Option<&Path>) -> Option<String> {
        if let Some(p) = flag {
            return Some(format!("--root {}", p.display()));
        }
        ["RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"].into_iter().find_map(|var| {
            std::env::var_os(var).filter(|v| !v.is_empty()).map(|v| format!("{var}={}", v.to_string_lossy()))
        })
    }

    pub fn spool(&self) -> PathBuf {
        self.root.join("spool")
    }
    pub fn rejected(&self) -> PathBuf {
        self.root.join("spool/rejected")
    }
    pub fn runs(&self) -> PathBuf {
        self.root.join("async-subagent-runs")
    }
    /// `<runs>/<id>`: the only way to a run's directory (a run is its
    /// directory; see `RunId`).
    pub fn run_dir(&self, id: &RunId) -> PathBuf {
        self.runs().join(id.as_str())
    }
    /// `<runs>/.active-runs/<id>`, the run's active marker (PROTOCOL §6.1).
    pub fn active_marker(&self, id: &RunId) -> PathBuf {
        self.active().join(id.as_str())
    }
    /// `<results>/<id>.json`, the run's public result file (PROTOCOL §7).
    pub fn result_file(&self, id: &RunId) -> PathBuf {
        self.results().join(format!("{id}.json"))
    }
    pub fn active(&self) -> PathBuf {
        self.runs().join(".active-runs")
    }
    pub fn terminal(&self) -> PathBuf {
        self.runs().join(".terminal-runs")
    }
    pub fn results(&self) -> PathBuf {
        self.root.join("async-subagent-results")
    }
    pub fn daemon_dir(&self) -> PathBuf {
        self.root.join("runspool")
    }
    pub fn daemon_lock(&self) -> PathBuf {
        self.root.join("runspool/daemon.lock")
    }
    pub fn daemon_json(&self) -> PathBuf {
        self.root.join("runspool/daemon.json")
    }
    /// `runspool/queue.json`: pause and max-running of the queue (PROTOCOL §15).
    pub fn queue_json(&self) -> PathBuf {
        self.root.join("runspool/queue.json")
    }
    /// `runspool/queue.lock`: held by a client's read-modify-write of queue.json.
    pub fn queue_lock(&self) -> PathBuf {
        self.root.join("runspool/queue.lock")
    }
    /// `runspool/storage-reserve`: the space the daemon keeps for a full disk.
    pub fn storage_reserve(&self) -> PathBuf {
        self.root.join("runspool/storage-reserve")
    }
    /// `runspool/hooks-pending/`: hooks owed by runs that ended.
    pub fn hooks_pending(&self) -> PathBuf {
        self.root.join("runspool/hooks-pending")
    }
    /// `runspool/hooks-running/`: hooks started and not yet finished.
    pub fn hooks_running(&self) -> PathBuf {
        self.root.join("runspool/hooks-running")
    }
    /// `runspool/recent-cache/`: the newest names of large directories.
    pub fn recent_cache(&self) -> PathBuf {
        self.root.join("runspool/recent-cache")
    }
    /// `<active>/tool-calls/`: the active runs by tool call (PROTOCOL §6.1).
    pub fn tool_call_aliases(&self) -> PathBuf {
        self.active().join("tool-calls")
    }
    /// `<results>/result-pending/`: result payloads staged before their promotion (PROTOCOL §7).
    pub fn result_pending(&self) -> PathBuf {
        self.results().join("result-pending")
    }
    /// `<results>/result-index/`: the indexes of the result files (PROTOCOL §7).
    pub fn result_index(&self) -> PathBuf {
        self.results().join("result-index")
    }
    /// `<results>/result-index/sessions/`: results by session.
    pub fn result_index_sessions(&self) -> PathBuf {
        self.result_index().join("sessions")
    }
    /// `<results>/result-index/runs/`: results by run.
    pub fn result_index_runs(&self) -> PathBuf {
        self.result_index().join("runs")
    }
    /// `<results>/result-index/tool-calls/`: results by tool call.
    pub fn result_index_tool_calls(&self) -> PathBuf {
        self.result_index().join("tool-calls")
    }
    /// `<results>/result-index/observers/mission/`: results of runs with a mission.
    pub fn result_index_mission(&self) -> PathBuf {
        self.result_index().join("observers/mission")
    }

    /// `spool/rejected/<name>`: a rejected entry, or its error file.
    pub fn rejected_entry(&self, name: &str) -> PathBuf {
        self.rejected().join(name)
    }

    /// `spool/rejected/<stem>.error.json`, the error file of the entry
    /// `<stem>.json` (a name over 255 bytes gets a hashed one, see spool's
    /// `rejected_names`).
    pub fn rejected_error_file(&self, stem: &str) -> PathBuf {
        self.rejected().join(format!("{stem}{ERROR_FILE_SUFFIX}"))
    }

    /// A directory a `rejected` run is built in before it is renamed into
    /// place (`REJECTED_STAGING_PREFIX`, the builder's pid, a unique tail).
    pub fn rejected_run_staging(&self, pid: u32, unique: &str) -> PathBuf {
        self.runs().join(format!("{REJECTED_STAGING_PREFIX}{pid}-{unique}"))
    }

    /// Directories the daemon creates (0700) in this order.
    pub fn dirs(&self) -> Vec<PathBuf> {
        vec![
            self.root.clone(),
            self.spool(),
            self.rejected(),
            self.runs(),
            self.active(),
            self.terminal(),
            self.results(),
            self.daemon_dir(),
        ]
    }
}

/// A run's identity: the name of its directory under the runs root, in the
/// run-id grammar (`[A-Za-z0-9][A-Za-z0-9._-]{0,254}`: one path component,
/// never `.`, `..` or a dot name). A run is its directory: a `RunId` is made
/// from a directory entry of the runs root, a marker or spool name, a claim's
/// validated request, or an argument a user typed, and it is the only thing
/// `Layout::run_dir` takes. A `runId` read out of a status, marker or event
/// is data to compare with a `RunId` (`RunId::names`), never one itself: a
/// copied or crafted file must not steer runspool to another directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(String);

impl RunId {
    /// Longest run-directory name (a file name's limit; requests allow 128).
    pub const MAX: usize = crate::protocol::ids::RUN_ID_MAX;

    /// `s` when it is a valid run-directory name, else None.
    pub fn parse(s: &str) -> Option<RunId> {
        crate::protocol::ids::run_id_grammar(s).then(|| RunId(s.to_string()))
    }

    /// The run of `dir`, the path of a run directory: its last component
    /// must be a valid id (a path such as `..` or `/` names no run).
    pub fn of_dir(dir: &Path) -> Option<RunId> {
        dir.file_name().and_then(|n| n.to_str()).and_then(RunId::parse)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// True when an id read from a file (`runId` of a status, a marker, an
    /// event) names this run.
    pub fn names(&self, claimed: &str) -> bool {
        self.0 == claimed
    }
}

/// The run a launch request asks for by its `runId` (a spool body or a
/// claim's request, PROTOCOL §2.3): its grammar is a run directory's, shorter.
impl From<crate::protocol::ids::RequestedRunId> for RunId {
    fn from(id: crate::protocol::ids::RequestedRunId) -> RunId {
        RunId(id.into_string())
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for RunId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl std::ops::Deref for RunId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for RunId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for RunId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Name suffix of a rejection's error file in spool/rejected/ (PROTOCOL §2.3).
pub const ERROR_FILE_SUFFIX: &str = ".error.json";

/// Name prefix of the directories a `rejected` run is built in before it is
/// renamed into place; leftovers are removed at start (retention's sweep).
pub const REJECTED_STAGING_PREFIX: &str = ".rejected-run-";

/// A run's bridge directories (PROTOCOL §8.2).
pub const BRIDGE_REQUESTS: &str = "external-job-requests";
pub const BRIDGE_RESPONSES: &str = "external-job-responses";
/// `<id>.claim`: a committed start claim in `external-job-requests/`.
pub const CLAIM_SUFFIX: &str = ".claim";
/// `<id>.claim.tmp-<uuid>`: a start claim being built.
pub const CLAIM_TMP_INFIX: &str = ".claim.tmp-";

/// The control inbox of a run, and pi-subagents 0.67's stop inbox in it (PROTOCOL §9).
pub const CONTROL_DIR: &str = "control";
pub const STOP_REQUESTS_DIR: &str = "stop-requests";
/// The files of the control inbox `control/` (PROTOCOL §9).
pub const CONTROL_STOP: &str = "stop.json";
pub const CONTROL_TIMEOUT: &str = "timeout.json";
pub const CONTROL_INTERRUPT: &str = "interrupt.json";
/// Hold and release of a queued run (PROTOCOL §15), acted on by the daemon.
pub const CONTROL_HOLD: &str = "hold.json";
pub const CONTROL_RELEASE: &str = "release.json";

/// Files of one run directory (PROTOCOL §3).
pub struct RunPaths;
impl RunPaths {
    pub fn request(d: &Path) -> PathBuf {
        d.join("request.json")
    }
    pub fn status(d: &Path) -> PathBuf {
        d.join("status.json")
    }
    pub fn status_lock(d: &Path) -> PathBuf {
        d.join(".status.lock")
    }
    pub fn events(d: &Path) -> PathBuf {
        d.join("events.jsonl")
    }
    pub fn runner_lock(d: &Path) -> PathBuf {
        d.join("runner.lock")
    }
    pub fn control(d: &Path) -> PathBuf {
        d.join(CONTROL_DIR)
    }
    /// pi-subagents 0.67's stop inbox: `control/stop-requests/<ts>-<uuid>.json`.
    pub fn stop_requests(d: &Path) -> PathBuf {
        d.join(CONTROL_DIR).join(STOP_REQUESTS_DIR)
    }
    pub fn output(d: &Path, i: usize) -> PathBuf {
        d.join(format!("output-{i}.log"))
    }
    /// The record of the run's end-of-run hook, and the hook's output.
    pub fn hook_json(d: &Path) -> PathBuf {
        d.join("hook.json")
    }
    pub fn hook_log(d: &Path) -> PathBuf {
        d.join("hook.log")
    }
    /// `mission.json`: a pi run with a mission (its result is indexed for the observer).
    pub fn mission(d: &Path) -> PathBuf {
        d.join("mission.json")
    }
    /// Slurm: the batch script of step `i`'s start, of a follow-up, and the
    /// job's output (`%j` for sbatch to fill in, or the job id).
    pub fn slurm_script(d: &Path, i: usize) -> PathBuf {
        d.join(format!("external-job-{i}.sbatch"))
    }
    pub fn slurm_follow_up_script(d: &Path, i: usize, tag: &str) -> PathBuf {
        d.join(format!("external-job-{i}-fu-{tag}.sbatch"))
    }
    pub fn slurm_output(d: &Path, job: &str) -> PathBuf {
        d.join(format!("slurm-{job}.out"))
    }
    /// An external step's result, when the provider gives no `artifactPath` (PROTOCOL §8.3).
    pub fn external_result(d: &Path, i: usize) -> PathBuf {
        d.join(format!("external-job-{i}.result.md"))
    }
    /// The runner's own stdout and stderr.
    pub fn runner_stdout_log(d: &Path) -> PathBuf {
        d.join("runner.stdout.log")
    }
    pub fn runner_stderr_log(d: &Path) -> PathBuf {
        d.join("runner.stderr.log")
    }
    /// `control/<name>`, `name` one of `CONTROL_STOP`, `CONTROL_TIMEOUT`, `CONTROL_INTERRUPT`.
    pub fn control_file(d: &Path, name: &str) -> PathBuf {
        d.join(CONTROL_DIR).join(name)
    }
    pub fn bridge_requests(d: &Path) -> PathBuf {
        d.join(BRIDGE_REQUESTS)
    }
    pub fn bridge_responses(d: &Path) -> PathBuf {
        d.join(BRIDGE_RESPONSES)
    }
    /// `external-job-requests/<id>.json`.
    pub fn bridge_request(d: &Path, id: &str) -> PathBuf {
        d.join(BRIDGE_REQUESTS).join(format!("{id}.json"))
    }
    /// `external-job-responses/<id>.json`.
    pub fn bridge_response(d: &Path, id: &str) -> PathBuf {
        d.join(BRIDGE_RESPONSES).join(format!("{id}.json"))
    }
    /// `external-job-requests/<id>.claim/`, the committed start claim of request `id`.
    pub fn bridge_claim(d: &Path, id: &str) -> PathBuf {
        d.join(BRIDGE_REQUESTS).join(format!("{id}{CLAIM_SUFFIX}"))
    }
    /// `external-job-requests/<id>.claim.tmp-<unique>/`, a claim being built.
    pub fn bridge_claim_tmp(d: &Path, id: &str, unique: &str) -> PathBuf {
        d.join(BRIDGE_REQUESTS).join(format!("{id}{CLAIM_TMP_INFIX}{unique}"))
    }
}

/// Files of a start claim directory `external-job-requests/<id>.claim/`
/// (or of one being built), PROTOCOL §8.2.
pub struct ClaimPaths;
impl ClaimPaths {
    /// Who holds the claim (`ClaimOwner`), written before the commit.
    pub fn owner(claim: &Path) -> PathBuf {
        claim.join("owner.json")
    }
    /// The claimed request, copied before the commit.
    pub fn request(claim: &Path) -> PathBuf {
        claim.join("request.json")
    }
    /// The job handle, durable before the response is written.
    pub fn handle(claim: &Path) -> PathBuf {
        claim.join("handle.json")
    }
    /// The tombstone: the claim is finished, never dispatched again.
    pub fn completed(claim: &Path) -> PathBuf {
        claim.join("completed.json")
    }
}
