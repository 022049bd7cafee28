//! pi-subagents 0.67.0's `reconcileAsyncRun` (src/runs/background/
//! stale-run-reconciler.ts and what it calls), translated for the steward
//! (PROTOCOL §14.1): given a run's status.json bytes and a clock, decide what
//! 0.67 would do, and write exactly what it writes, in its order.
//!
//! Where reproducing 0.67 exactly would need more than this translation
//! (validators of workflow lanes and graphs, values JavaScript would coerce
//! from strings or objects, pending result files, symbolic links 0.67 would
//! follow), the run is left alone: a pi host reconciles it when it opens.
//! docs/protocol-notes.md lists those cases.

use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::protocol::jsjson::{self, js, jstr, number_to_string, JsObj, JsStr, JsVal};
use crate::protocol::seg::{seg, seg_aliases, seg_max};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, Layout, RunId};

/// 0.67's `staleAlivePidMs` default: a live pid whose status is older is failed.
const STALE_ALIVE_MS: f64 = 24.0 * 60.0 * 60.0 * 1000.0;
/// 0.67 reads at most this much of the end of `runner.stderr.log`.
const STDERR_MAX_BYTES: u64 = 64 * 1024;
/// 0.67's `THINKING_LEVELS` (src/shared/model-info.ts).
const THINKING_LEVELS: [&str; 7] = ["off", "minimal", "low", "medium", "high", "xhigh", "max"];
/// Largest file the steward reads (status, result, index entries).
const MAX_JSON_BYTES: u64 = 16 * 1024 * 1024;
/// 0.67's `MAX_JSON_FILE_STEM_BYTES` (255 minus `.json`).
const STEM_MAX: usize = 250;

/// Which of 0.67's repairs applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// A result file already exists for an active run: the status is ended from it.
    ResultPresent,
    /// `pid` is gone (ESRCH): the run is failed.
    DeadPid,
    /// `pid` answers, but the status is over 24 hours old: the run is failed.
    StaleLivePid,
}

impl Case {
    pub fn as_str(self) -> &'static str {
        match self {
            Case::ResultPresent => "result-present",
            Case::DeadPid => "dead-pid",
            Case::StaleLivePid => "stale-live-pid",
        }
    }
}

/// What 0.67 would do with a run now.
pub enum Verdict {
    /// Nothing (or nothing the steward can reproduce): why, for the debug log.
    Leave(String),
    Repair(Repair),
}

/// One write of a repair, in 0.67's order.
enum Op {
    /// `writeAtomicJson(path, value)`: JSON.stringify(v, null, 2), no newline.
    Json { path: PathBuf, text: String, critical: bool },
    /// `promotePendingResultFile`: rename the pending result to its public name.
    Promote { from: PathBuf, to: PathBuf },
    /// `releaseActiveRunIndex`: the marker, then every tool-call alias.
    Release,
    /// `appendJsonlBestEffort(events.jsonl, event)`.
    Event(String),
}

/// A repair 0.67 would make, ready to write.
pub struct Repair {
    pub case: Case,
    /// The state the status ends in.
    pub state: String,
    ops: Vec<Op>,
}

/// The run being looked at: its id and where 0.67 would see its files.
pub struct Run<'a> {
    pub layout: &'a Layout,
    pub id: &'a RunId,
}

impl Run<'_> {
    fn dir(&self) -> PathBuf {
        self.layout.run_dir(self.id)
    }
}

type R<T> = Result<T, String>;

/// `path.resolve(p)` as node prints it: absolute, `.`/`..`/`//` folded.
fn node_path(p: &Path) -> R<String> {
    let s = p.to_str().ok_or_else(|| format!("{} is not UTF-8", p.display()))?;
    let abs = if s.starts_with('/') {
        s.to_string()
    } else {
        let cwd = std::env::current_dir().map_err(|e| format!("current directory: {e}"))?;
        format!("{}/{s}", cwd.to_str().ok_or("the current directory is not UTF-8")?)
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in abs.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// ToNumber for the values 0.67 does arithmetic on; None where JavaScript
/// would coerce a string, array or object (not reproduced: left alone).
fn to_number(v: &JsVal) -> Option<f64> {
    match v {
        JsVal::Undefined => Some(f64::NAN),
        JsVal::Null => Some(0.0),
        JsVal::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        JsVal::Num(n) => Some(*n),
        _ => None,
    }
}

/// `Math.max(0, now - v)`.
fn elapsed(now: f64, v: &JsVal, what: &str) -> R<JsVal> {
    let n = to_number(v).ok_or_else(|| format!("{what} is not a number"))?;
    let d = now - n;
    Ok(JsVal::Num(if d.is_nan() { f64::NAN } else { d.max(0.0) }))
}

fn obj(pairs: Vec<(&str, JsVal)>) -> JsObj {
    let mut o = JsObj::new();
    for (k, v) in pairs {
        o.set(k, v);
    }
    o
}

fn concat(parts: &[&[u16]]) -> JsStr {
    parts.concat()
}

/// `arr[key]` for the `currentStep ?? 0` index of `buildFailedRepair`.
fn index<'a>(arr: &'a [JsVal], key: &JsVal) -> R<Option<&'a JsVal>> {
    let i = match key {
        JsVal::Undefined | JsVal::Null => Some(0usize),
        JsVal::Num(n) => (n.fract() == 0.0 && *n >= 0.0 && *n < 4294967295.0).then_some(*n as usize),
        JsVal::Str(s) => jsjson::is_index_key(s).map(|n| n as usize),
        JsVal::Bool(_) => None,
        JsVal::Arr(_) | JsVal::Obj(_) => return Err("currentStep is an array or object".into()),
    };
    Ok(i.and_then(|i| arr.get(i)))
}

/// `v?.[key]` on a value that is an object or missing.
fn field(v: Option<&JsVal>, key: &str) -> JsVal {
    match v {
        Some(JsVal::Obj(o)) => o.get(key).clone(),
        _ => JsVal::Undefined,
    }
}

/// The status as 0.67's readers and `reconcileAsyncRun` accept it, within
/// what the steward reproduces.
fn checked_status(run: &Run, bytes: &[u8]) -> R<JsObj> {
    let text = std::str::from_utf8(bytes).map_err(|_| "status.json is not UTF-8".to_string())?;
    let v = jsjson::parse(text).map_err(|e| format!("status.json: {e}"))?;
    let JsVal::Obj(s) = v else { return Err("status.json is not an object".into()) };
    // 0.67 uses `runId || basename(dir)` for the result's name: only a
    // status that is its directory's own is repaired.
    match s.get("runId").as_str().and_then(jsjson::rust_string) {
        Some(id) if run.id.names(&id) => {}
        _ => return Err("status.json's runId is not its directory's name".into()),
    }
    // validateAsyncStatusLaneMetadata / assertWorkflowGraphHostSteps: not reproduced.
    for k in ["lane", "workflowGraph"] {
        if s.has(k) {
            return Err(format!("status.json has '{k}' (0.67's validators for it are not reproduced)"));
        }
    }
    match s.get("steps") {
        JsVal::Undefined | JsVal::Null => {}
        JsVal::Arr(steps) => {
            for (i, st) in steps.iter().enumerate() {
                let JsVal::Obj(st) = st else { return Err(format!("steps[{i}] is not an object")) };
                for k in ["lane", "worktreePath", "branch"] {
                    if st.has(k) {
                        return Err(format!("steps[{i}] has '{k}' (0.67's validators for it are not reproduced)"));
                    }
                }
                for k in ["model", "thinking"] {
                    if st.has(k) && st.get(k).as_str().is_none() {
                        return Err(format!("steps[{i}].{k} is not a string (0.67 refuses the status)"));
                    }
                }
            }
        }
        _ => return Err("steps is not an array".into()),
    }
    for k in ["sessionId", "toolCallId"] {
        match s.get(k) {
            JsVal::Undefined => {}
            JsVal::Str(v) if jsjson::rust_string(v).is_some() => {}
            _ => return Err(format!("{k} is not a string")),
        }
    }
    Ok(s)
}

fn session_of(s: &JsObj) -> Option<String> {
    s.get("sessionId").as_str().and_then(jsjson::rust_string).filter(|v| !v.is_empty())
}

/// What is at `p`, never following a link: Ok(true) a regular file,
/// Ok(false) nothing; anything else is refused.
fn regular_or_absent(p: &Path) -> R<bool> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(_) => Err(format!("{} is not a regular file (0.67 would follow or trip on it)", p.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => Ok(false),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

fn read_json_file(p: &Path) -> R<JsVal> {
    let bytes = fsutil::read_nofollow(p, MAX_JSON_BYTES).map_err(|e| format!("{}: {e}", p.display()))?;
    let text = std::str::from_utf8(&bytes).map_err(|_| format!("{} is not UTF-8", p.display()))?;
    jsjson::parse(text).map_err(|e| format!("{}: {e}", p.display()))
}

struct Paths {
    /// `<results>/result-pending/` and `<results>/result-index/sessions/`.
    pending: PathBuf,
    index_sessions: PathBuf,
    result: PathBuf,
    /// The run directory as 0.67 names it (`asyncDir`).
    async_dir: String,
    /// `resultFilePath(resultsDir, runId)` as 0.67 names it.
    result_str: String,
}

fn paths(run: &Run) -> R<Paths> {
    let results = run.layout.results();
    let name = format!("{}.json", run.id.as_str());
    if name.len() > 255 {
        return Err("the result file's name would be too long".into());
    }
    Ok(Paths {
        result: results.join(&name),
        async_dir: node_path(&run.dir())?,
        result_str: format!("{}/{name}", node_path(&results)?),
        pending: run.layout.result_pending(),
        index_sessions: run.layout.result_index_sessions(),
    })
}

fn pending_aliases(p: &Paths, session: &str, run_id: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for s in seg_aliases(session, 255) {
        for r in seg_aliases(run_id, STEM_MAX) {
            out.push(p.pending.join(&s).join(format!("{r}.json")));
        }
    }
    out
}

/// The existing result 0.67 would find for the run
/// (`resultPayloadPathForSessionRun ?? regularFileExists(resultPath)`).
fn existing_result(p: &Paths, session: Option<&str>, run_id: &str) -> R<Option<PathBuf>> {
    if let Some(session) = session {
        // A pending result would be promoted or read by 0.67's lookup: not reproduced.
        for pending in pending_aliases(p, session, run_id) {
            if std::fs::symlink_metadata(&pending).is_ok() {
                return Err(format!("a pending result exists at {}", pending.display()));
            }
        }
        'entries: for s in seg_aliases(session, 255) {
            for r in seg_aliases(run_id, STEM_MAX) {
                let ip = p.index_sessions.join(&s).join(format!("{r}.json"));
                if !regular_or_absent(&ip)? {
                    continue;
                }
                let Ok(JsVal::Obj(e)) = read_json_file(&ip) else { continue };
                let valid = e.get("version").as_num() == Some(1.0)
                    && e.get("runId").as_str().is_some()
                    && e.get("sessionId").as_str().is_some()
                    && e.get("file").as_str().is_some()
                    && e.get("writtenAt").as_num().is_some();
                if !valid || !e.get("sessionId").is_str(session) || !e.get("runId").is_str(run_id) {
                    continue;
                }
                // The first valid entry decides.
                let file = e.get("file").as_str().and_then(jsjson::rust_string).unwrap_or_default();
                if file == format!("{run_id}.json") {
                    if regular_or_absent(&p.result)? {
                        return Ok(Some(p.result.clone()));
                    }
                } else if !file.contains('/') && file.ends_with(".json") {
                    return Err(format!("{} names another result file ({file})", ip.display()));
                }
                break 'entries;
            }
        }
    }
    Ok(regular_or_absent(&p.result)?.then(|| p.result.clone()))
}

/// 0.67's `readRunnerStartupDiagnostics`: the end of runner.stderr.log.
fn stderr_tail(run_dir: &Path) -> R<Option<JsStr>> {
    let p = RunPaths::runner_stderr_log(run_dir);
    if !regular_or_absent(&p)? {
        return Ok(None);
    }
    let f = fsutil::open_read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    let size = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?.len();
    if size == 0 {
        return Ok(None);
    }
    let n = size.min(STDERR_MAX_BYTES);
    let mut buf = vec![0u8; n as usize];
    let mut got = 0usize;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], size - n + got as u64) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("{}: {e}", p.display())),
        }
    }
    // Buffer.toString("utf-8"): invalid sequences become U+FFFD (maximal subparts).
    let text = js(&String::from_utf8_lossy(&buf));
    let content = jsjson::js_trim(&text);
    if content.is_empty() {
        return Ok(None);
    }
    // split(/\r?\n/).slice(-30).join("\n")
    let mut lines: Vec<&[u16]> = content.split(|&u| u == b'\n' as u16).collect();
    let last = lines.len() - 1;
    for l in lines.iter_mut().take(last) {
        if l.last() == Some(&(b'\r' as u16)) {
            *l = &l[..l.len() - 1];
        }
    }
    let keep = &lines[lines.len().saturating_sub(30)..];
    let joined = keep.join(&(b'\n' as u16));
    Ok(Some(if joined.len() > 4000 {
        concat(&[jsjson::slice_last(&joined, 4000), &js("\n[stderr tail truncated]")])
    } else {
        joined
    }))
}

/// `processTerminal` as 0.67 adds it to a lifecycle-v3 status whose own is
/// missing or pending.
fn process_terminal(s: &JsObj, run_id: &str, reason: &str) -> Option<JsVal> {
    let v3 = s.get("lifecycleArtifactVersion").as_num() == Some(3.0);
    let pt = s.get("processTerminal");
    let pending = !pt.truthy() || pt.as_obj().is_some_and(|o| o.get("state").is_str("pending"));
    (v3 && pending).then(|| {
        JsVal::Obj(obj(vec![
            ("version", JsVal::Num(1.0)),
            ("state", jstr("unknown")),
            ("runId", jstr(run_id)),
            ("runnerProcessInstanceId", jstr("observer-unavailable")),
            ("reason", jstr(reason)),
        ]))
    })
}

/// Decide what 0.67's `reconcileAsyncRun` would do with this run at `now`
/// (ms), and build its writes.
pub fn plan(run: &Run, status_bytes: &[u8], now: f64, pid_alive: impl Fn(i32) -> Liveness) -> Verdict {
    match plan_inner(run, status_bytes, now, pid_alive) {
        Ok(Some(r)) => Verdict::Repair(r),
        Ok(None) => Verdict::Leave("0.67 would leave it as it is".into()),
        Err(why) => Verdict::Leave(why),
    }
}

/// 0.67's `checkPidLiveness`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    Dead,
    Unknown,
}

/// `process.kill(pid, 0)`: nothing is sent, the kernel only says whether
/// the process exists.
pub fn kill0(pid: i32) -> Liveness {
    // SAFETY: signal 0 performs the existence and permission checks only.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return Liveness::Alive;
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ESRCH) => Liveness::Dead,
        _ => Liveness::Unknown,
    }
}

fn plan_inner(run: &Run, bytes: &[u8], now: f64, pid_alive: impl Fn(i32) -> Liveness) -> R<Option<Repair>> {
    let status = checked_status(run, bytes)?;
    let run_id = run.id.as_str();
    let p = paths(run)?;
    let session = session_of(&status);
    let state = status.get("state");
    let active = state.is_str("running") || state.is_str("queued");
    if let Some(result) = existing_result(&p, session.as_deref(), run_id)? {
        if active {
            return from_result(run, &status, &result, now).map(Some);
        }
        return Ok(None);
    }
    if status.has("displayDismissedAt") || !state.is_str("running") {
        return Ok(None);
    }
    let Some(pid) = status.get("pid").as_num() else { return Ok(None) };
    if pid.fract() != 0.0 || !(1.0..=i32::MAX as f64).contains(&pid) {
        return Err(format!("pid {} is not a process id the steward checks", number_to_string(pid)));
    }
    match pid_alive(pid as i32) {
        Liveness::Dead => failed_repair(run, &p, &status, now, None, Case::DeadPid).map(Some),
        Liveness::Alive | Liveness::Unknown => {
            let last = status.get("lastUpdate").or_else(|| status.get("startedAt").clone());
            let n = to_number(&last).ok_or("lastUpdate/startedAt is not a number")?;
            let since = now - n;
            // `now - lastUpdate <= staleAfterMs` (NaN is never <=).
            if since <= STALE_ALIVE_MS {
                return Ok(None);
            }
            let message = js(&format!(
                "Async runner process {} still has a live PID, but status has not updated for {}ms. Marked run failed by stale-run reconciliation because PID ownership cannot be verified.",
                number_to_string(pid),
                number_to_string(since)
            ));
            failed_repair(run, &p, &status, now, Some(message), Case::StaleLivePid).map(Some)
        }
    }
}

/// 0.67's `buildFailedRepair` + `writeFailedRepair`.
fn failed_repair(run: &Run, p: &Paths, status: &JsObj, now: f64, reason: Option<JsStr>, case: Case) -> R<Repair> {
    let run_id = run.id.as_str();
    let dir = run.dir();
    let pid = status.get("pid").as_num().map(number_to_string).unwrap_or_else(|| "unknown".into());
    let base = reason.unwrap_or_else(|| {
        js(&format!(
            "Async runner process {pid} exited or disappeared before writing a result. Marked run failed by stale-run reconciliation."
        ))
    });
    let message = match stderr_tail(&dir)? {
        Some(d) => concat(&[&base, &js("\n\nRunner stderr tail:\n"), &d]),
        None => base,
    };
    let steps: Vec<JsVal> = match status.get("steps") {
        JsVal::Arr(a) if !a.is_empty() => a.clone(),
        _ => vec![JsVal::Obj(obj(vec![("agent", jstr("subagent")), ("status", jstr("running"))]))],
    };
    let mut repaired = Vec::with_capacity(steps.len());
    for st in steps {
        let JsVal::Obj(o) = &st else {
            repaired.push(st);
            continue;
        };
        if !(o.get("status").is_str("running") || o.get("status").is_str("pending")) {
            repaired.push(st);
            continue;
        }
        let mut n = o.clone();
        n.set("status", jstr("failed"));
        n.set("activityState", JsVal::Undefined);
        n.set("endedAt", o.get("endedAt").or_else(|| JsVal::Num(now)));
        let duration = if o.has("startedAt") && !o.has("durationMs") {
            elapsed(now, o.get("startedAt"), "a step's startedAt")?
        } else {
            o.get("durationMs").clone()
        };
        n.set("durationMs", duration);
        n.set("exitCode", o.get("exitCode").or_else(|| JsVal::Num(1.0)));
        n.set("error", o.get("error").or_else(|| JsVal::Str(message.clone())));
        repaired.push(JsVal::Obj(n));
    }
    let mut new_status = status.clone();
    new_status.set("state", jstr("failed"));
    if let Some(pt) = process_terminal(status, run_id, "stale-repair") {
        new_status.set("processTerminal", pt);
    }
    new_status.set("activityState", JsVal::Undefined);
    new_status.set("lastUpdate", JsVal::Num(now));
    new_status.set("endedAt", JsVal::Num(now));
    new_status.set("steps", JsVal::Arr(repaired.clone()));

    let agent_of = |v: Option<&JsVal>| field(v, "agent");
    let agent = agent_of(index(&repaired, status.get("currentStep"))?)
        .or_else(|| agent_of(repaired.first()))
        .or_else(|| jstr("subagent"));
    let results: Vec<JsVal> = repaired
        .iter()
        .map(|st| {
            let get = |k: &str| field(Some(st), k);
            let done = get("status").is_str("complete") || get("status").is_str("completed");
            let mut r = JsObj::new();
            r.set("agent", get("agent"));
            if get("sessionName").truthy() {
                r.set("sessionName", get("sessionName"));
            }
            r.set("output", if done { jstr("") } else { JsVal::Str(message.clone()) });
            r.set("error", if done { JsVal::Undefined } else { get("error").or_else(|| JsVal::Str(message.clone())) });
            r.set("success", JsVal::Bool(done));
            for k in ["model", "attemptedModels", "modelAttempts", "contextOverflow", "sessionFile"] {
                r.set(k, get(k));
            }
            JsVal::Obj(r)
        })
        .collect();
    let mut result = obj(vec![("id", jstr(run_id)), ("agent", agent), ("mode", status.get("mode").clone())]);
    if status.get("completionOwnerId").truthy() {
        result.set("completionOwnerId", status.get("completionOwnerId").clone());
    }
    for (k, v) in [
        ("success", JsVal::Bool(false)),
        ("state", jstr("failed")),
        ("summary", JsVal::Str(message.clone())),
        ("results", JsVal::Arr(results)),
        ("exitCode", JsVal::Num(1.0)),
        ("timestamp", JsVal::Num(now)),
        ("durationMs", elapsed(now, status.get("startedAt"), "startedAt")?),
        ("asyncDir", jstr(&p.async_dir)),
        ("sessionId", status.get("sessionId").clone()),
        ("sessionFile", status.get("sessionFile").clone()),
    ] {
        result.set(k, v);
    }

    let session = session_of(status);
    let mut ops = Vec::new();
    if let Some(session) = &session {
        // writeAsyncResultFile: pending payload, indexes, then the promotion.
        let stem = format!("{}.json", seg_max(run_id, STEM_MAX));
        let pending = p.pending.join(seg(session)).join(&stem);
        ops.push(json_op(pending.clone(), &JsVal::Obj(result), true)?);
        ops.extend(result_index_ops(run, p, session, &stem, now)?);
        ops.push(Op::Promote { from: pending, to: p.result.clone() });
    }
    ops.push(json_op(RunPaths::status(&dir), &JsVal::Obj(new_status), true)?);
    ops.push(Op::Release);
    if let Some(session) = &session {
        ops.push(terminal_marker_op(run, session, now)?);
    }
    let mut event = obj(vec![
        ("type", jstr("subagent.run.repaired_stale")),
        ("ts", JsVal::Num(now)),
        ("runId", jstr(run_id)),
        ("pid", status.get("pid").clone()),
    ]);
    if session.is_some() {
        event.set("resultPath", jstr(&p.result_str));
    }
    event.set("message", JsVal::Str(message));
    // 0.67 appends to whatever is there (or creates it); a link or FIFO is refused.
    regular_or_absent(&RunPaths::events(&dir))?;
    ops.push(Op::Event(jsjson::stringify(&JsVal::Obj(event)).unwrap_or_default()));
    Ok(Repair { case, state: "failed".into(), ops })
}

fn json_op(path: PathBuf, v: &JsVal, critical: bool) -> R<Op> {
    let text = jsjson::stringify_pretty(v).ok_or("nothing to write")?;
    Ok(Op::Json { path, text, critical })
}

/// `writeResultIndexForData`: by session (its failure fails the repair), by
/// run, and for a run with `mission.json` under the mission observer. The
/// repair's result has no `toolCallId`, so no tool-call entry.
fn result_index_ops(run: &Run, p: &Paths, session: &str, stem: &str, now: f64) -> R<Vec<Op>> {
    let entry = JsVal::Obj(obj(vec![
        ("version", JsVal::Num(1.0)),
        ("runId", jstr(run.id.as_str())),
        ("sessionId", jstr(session)),
        ("file", jstr(&format!("{}.json", run.id.as_str()))),
        ("writtenAt", JsVal::Num(now)),
        ("asyncDir", jstr(&p.async_dir)),
    ]));
    let mut ops = vec![
        json_op(p.index_sessions.join(seg(session)).join(stem), &entry, true)?,
        json_op(run.layout.result_index_runs().join(stem), &entry, false)?,
    ];
    // fs.existsSync follows links: only whether something is there.
    if std::fs::metadata(RunPaths::mission(&run.dir())).is_ok() {
        ops.push(json_op(run.layout.result_index_mission().join(stem), &entry, false)?);
    }
    Ok(ops)
}

/// `updateTerminalRunIndex` after the terminal status is written.
fn terminal_marker_op(run: &Run, session: &str, ended_at: f64) -> R<Op> {
    let floor = ended_at.floor().max(0.0);
    let name = format!("{:0>16}-{}.json", number_to_string(floor), seg(run.id.as_str()));
    let entry = JsVal::Obj(obj(vec![
        ("version", JsVal::Num(1.0)),
        ("runId", jstr(run.id.as_str())),
        ("sessionId", jstr(session)),
        ("endedAt", JsVal::Num(ended_at)),
    ]));
    json_op(run.layout.terminal().join(seg(session)).join(name), &entry, false)
}

/// 0.67's `readResultRepairData`: the state and per-step outcomes of a result file.
fn result_repair_data(path: &Path) -> R<(String, Option<Vec<JsVal>>)> {
    let JsVal::Obj(data) = read_json_file(path)? else {
        return Err(format!("{} is not a JSON object", path.display()));
    };
    let st = data.get("state");
    let state = if data.get("success").truthy() {
        "complete"
    } else if st.is_str("stopped") {
        "stopped"
    } else if st.is_str("rejected") {
        "rejected"
    } else if st.is_str("partial") {
        "partial"
    } else if st.is_str("paused") || data.get("exitCode").as_num() == Some(0.0) {
        "paused"
    } else {
        "failed"
    };
    let results = match data.get("results") {
        JsVal::Arr(a) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, e) in a.iter().enumerate() {
                match e {
                    JsVal::Obj(c) => {
                        for k in ["model", "thinking"] {
                            if c.has(k) && c.get(k).as_str().is_none() {
                                return Err(format!("{}: results[{i}].{k} must be a string", path.display()));
                            }
                        }
                        out.push(e.clone());
                    }
                    _ => out.push(JsVal::Obj(JsObj::new())),
                }
            }
            Some(out)
        }
        _ => None,
    };
    Ok((state.to_string(), results))
}

/// 0.67's `resolveEffectiveThinking`.
fn effective_thinking(model: &JsVal, config: &JsVal) -> JsVal {
    let Some(m) = model.as_str().filter(|m| !m.is_empty()) else { return JsVal::Undefined };
    if let Some(colon) = m.iter().rposition(|&u| u == b':' as u16) {
        let suffix = &m[colon + 1..];
        if let Some(l) = THINKING_LEVELS.iter().find(|l| js(l) == suffix) {
            return jstr(l);
        }
    }
    THINKING_LEVELS.iter().find(|l| config.is_str(l)).map(|l| jstr(l)).unwrap_or(JsVal::Undefined)
}

/// 0.67's `terminalStatusFromResult` and what `reconcileAsyncRun` writes with it.
fn from_result(run: &Run, status: &JsObj, result: &Path, now: f64) -> R<Repair> {
    let (state, children) = result_repair_data(result)?;
    if !status.get("endedAt").is_nullish() && status.get("endedAt").as_num().is_none() {
        return Err("endedAt is not a number".into());
    }
    let steps: Vec<JsVal> = match status.get("steps") {
        JsVal::Arr(a) => a.clone(),
        _ => Vec::new(),
    };
    let mut new_steps = Vec::with_capacity(steps.len());
    for (i, st) in steps.into_iter().enumerate() {
        let JsVal::Obj(o) = &st else {
            new_steps.push(st);
            continue;
        };
        if !(o.get("status").is_str("running") || o.get("status").is_str("pending")) {
            new_steps.push(st);
            continue;
        }
        let child = children.as_ref().and_then(|c| c.get(i));
        let c = |k: &str| field(child, k);
        let s = match c("success") {
            JsVal::Bool(true) => "complete",
            JsVal::Bool(false) => "failed",
            _ => state.as_str(),
        };
        let model = c("model").or_else(|| o.get("model").clone());
        let thinking = effective_thinking(&model, &c("thinking").or_else(|| o.get("thinking").clone()));
        let mut n = o.clone();
        n.set("status", jstr(s));
        n.set("endedAt", o.get("endedAt").or_else(|| JsVal::Num(now)));
        let duration = if o.has("startedAt") && !o.has("durationMs") {
            elapsed(now, o.get("startedAt"), "a step's startedAt")?
        } else {
            o.get("durationMs").clone()
        };
        n.set("durationMs", duration);
        let code = if s == "complete" || s == "paused" { 0.0 } else { 1.0 };
        n.set("exitCode", o.get("exitCode").or_else(|| JsVal::Num(code)));
        let error = if matches!(s, "failed" | "partial" | "stopped") {
            o.get("error").or_else(|| c("error"))
        } else {
            o.get("error").clone()
        };
        n.set("error", error);
        n.set("stopped", if s == "stopped" { JsVal::Bool(true) } else { o.get("stopped").clone() });
        n.set("sessionName", o.get("sessionName").or_else(|| c("sessionName")));
        n.set("sessionFile", o.get("sessionFile").or_else(|| c("sessionFile")));
        n.set("model", model);
        n.set("thinking", thinking);
        for k in ["attemptedModels", "modelAttempts", "contextOverflow"] {
            n.set(k, c(k).or_else(|| o.get(k).clone()));
        }
        new_steps.push(JsVal::Obj(n));
    }
    let ended_at = status.get("endedAt").or_else(|| JsVal::Num(now));
    let mut new_status = status.clone();
    new_status.set("state", jstr(&state));
    if let Some(pt) = process_terminal(status, run.id.as_str(), "observer-unavailable") {
        new_status.set("processTerminal", pt);
    }
    if state == "stopped" {
        new_status.set("stopped", JsVal::Bool(true));
    }
    new_status.set("activityState", JsVal::Undefined);
    new_status.set("lastUpdate", JsVal::Num(now));
    new_status.set("endedAt", ended_at.clone());
    new_status.set("steps", JsVal::Arr(new_steps));
    new_status.remove("displayDismissedAt");
    let mut ops = vec![json_op(RunPaths::status(&run.dir()), &JsVal::Obj(new_status), true)?, Op::Release];
    if let Some(session) = session_of(status) {
        ops.push(terminal_marker_op(run, &session, ended_at.as_num().unwrap_or(now))?);
    }
    Ok(Repair { case: Case::ResultPresent, state, ops })
}

// ---------------------------------------------------------------------------
// Writing, as node's fs calls in 0.67 write
// ---------------------------------------------------------------------------

impl Repair {
    /// Write the repair. Each file is written as 0.67 writes it (mode 0666
    /// less the umask, a temp file renamed over the target); directories
    /// missing on the way are made (0777 less the umask) and symbolic links
    /// on the way are refused. A failure where 0.67 would throw ends the
    /// repair there; where 0.67 only logs, it is logged and the repair goes on.
    pub fn write(&self, run: &Run) -> io::Result<()> {
        let root = &run.layout.root;
        for op in &self.ops {
            match op {
                Op::Json { path, text, critical } => match write_json(root, path, text.as_bytes()) {
                    Ok(()) => {}
                    Err(e) if *critical => return Err(e),
                    Err(e) => {
                        tracing::warn!(run_id = %run.id, path = %path.display(), error = %e, "steward: could not write an index entry")
                    }
                },
                Op::Promote { from, to } => {
                    if let Err(e) = std::fs::rename(from, to) {
                        tracing::warn!(run_id = %run.id, path = %from.display(), error = %e, "steward: the result stays pending");
                    }
                }
                Op::Release => release_active(run)?,
                Op::Event(line) => {
                    if let Err(e) = append_event(&RunPaths::events(&run.dir()), line) {
                        tracing::warn!(run_id = %run.id, error = %e, "steward: could not append the repaired_stale event");
                    }
                }
            }
        }
        Ok(())
    }
}

/// `mkdir -p` of `dir` under `root`, refusing symbolic links and non-directories.
fn real_dirs(root: &Path, dir: &Path) -> io::Result<()> {
    let rel = dir.strip_prefix(root).map_err(|_| io::Error::other(format!("{} is outside the root", dir.display())))?;
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(io::Error::other(format!(
                    "{} is not a directory (a link or file); the steward writes nothing through it: remove it",
                    cur.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// 0.67's `writeAtomicJson`: `.<base>.<pid>.<ms>.<random>.tmp`, then rename.
fn write_json(root: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("no parent"))?;
    real_dirs(root, dir)?;
    let base = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let suffix = format!(".{}.{}.{}.tmp", std::process::id(), crate::now_ms(), uuid::Uuid::new_v4().simple());
    let mut name = format!(".{base}{suffix}");
    if name.len() > 255 {
        name = format!(".{}{suffix}", crate::protocol::seg::sha256_hex(base.as_bytes()));
    }
    let tmp = dir.join(name);
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// `fs.appendFileSync(events.jsonl, line + "\n")` (created 0666 less the umask).
fn append_event(path: &Path, line: &str) -> io::Result<()> {
    let mut f = fsutil::open_regular(path, std::fs::OpenOptions::new().append(true).create(true).mode(0o666))?;
    f.write_all(format!("{line}\n").as_bytes())
}

/// 0.67's `releaseActiveRunIndex`: remove the marker (an error other than
/// ENOENT fails the repair), then the run's entry under every tool-call
/// alias directory, and every alias directory left empty.
fn release_active(run: &Run) -> io::Result<()> {
    fsutil::remove_if_exists(&run.layout.active_marker(run.id))?;
    let root = run.layout.tool_call_aliases();
    if !std::fs::symlink_metadata(&root).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    let Ok(rd) = std::fs::read_dir(&root) else { return Ok(()) };
    for e in rd.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let alias = e.path().join(run.id.as_str());
        let removed = match std::fs::symlink_metadata(&alias) {
            Ok(m) if m.is_dir() => false, // rmSync(force) throws on a directory
            Ok(_) => std::fs::remove_file(&alias).is_ok(),
            Err(_) => true,
        };
        if removed {
            let _ = std::fs::remove_dir(e.path()); // only when empty
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `path.resolve` in node 20 for each input.
    #[test]
    fn paths_are_named_as_node_resolves_them() {
        assert_eq!(node_path(Path::new("/a//b/./c/../d/")).unwrap(), "/a/b/d");
        assert_eq!(node_path(Path::new("/../x")).unwrap(), "/x");
        assert_eq!(node_path(Path::new("/")).unwrap(), "/");
    }

    #[test]
    fn thinking_is_resolved_as_0_67_resolves_it() {
        let t = |m: &str, c: &str| effective_thinking(&jstr(m), &jstr(c));
        assert_eq!(t("anthropic/claude:high", "low"), jstr("high"));
        assert_eq!(t("a:b:max", ""), jstr("max"));
        assert_eq!(t("model:fast", "medium"), jstr("medium"));
        assert_eq!(t("model", "bogus"), JsVal::Undefined);
        assert_eq!(t("", "high"), JsVal::Undefined);
    }
}
