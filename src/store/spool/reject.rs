//! Rejecting a spool entry (PROTOCOL §2.3): the move to rejected/, its error
//! file, the `rejected` run, and finishing rejections cut short by a crash.

use std::io::{self};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::platform::rename_noreplace;
use crate::protocol::ids::RequestedRunId;
use crate::protocol::request::{self, Context, Rejection, RejectionCode, MAX_REQUEST_BYTES};
use crate::protocol::status::{State, Status};
use crate::store::fsutil::{self, fsync_dir, mkdir_private};
use crate::store::layout::{RunPaths, ERROR_FILE_SUFFIX};
use crate::store::{index, results, run, Layout, RunId, Writer};

use super::check_entry;
use super::{classify_name, republish, FileId, Name};

/// Pick free names `<base>[-N].json` / `<base>[-N].error.json` in rejected/.
pub(super) fn rejected_names(l: &Layout, name: &str, n: u32) -> (PathBuf, PathBuf) {
    let (base, ext) = match name.strip_suffix(".json") {
        Some(b) => (b.to_string(), ".json"),
        None => (name.to_string(), ""),
    };
    let base = if n == 0 { base } else { format!("{base}-{n}") };
    let entry = format!("{base}{ext}");
    let mut err = format!("{base}{ERROR_FILE_SUFFIX}");
    if err.len() > 255 {
        err = format!("~sha256-{}{ERROR_FILE_SUFFIX}", crate::protocol::seg::sha256_hex(entry.as_bytes()));
    }
    (l.rejected_entry(&entry), l.rejected_entry(&err))
}

/// Move the spool entry at `path` (named `name`) to `rejected/` with its
/// error file, and publish the rejected run `run` when there is one.
/// With `seen`, Ok(false): the entry at `path` was not the one `seen`
/// described (replaced between the check and the move) and was put back
/// for a fresh look.
#[allow(clippy::too_many_arguments)]
pub fn reject_entry(
    w: &mut Writer,
    l: &Layout,
    path: &Path,
    name: &str,
    r: &Rejection,
    run: Option<(RunId, Value)>,
    seen: Option<FileId>,
) -> io::Result<bool> {
    // rejected/ must be a real directory of ours, or the move could leave the root.
    let rd = std::fs::symlink_metadata(l.rejected())?;
    if !rd.file_type().is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a real directory (a symlink?); replace it with one (mkdir -m 700)",
            l.rejected().display()
        )));
    }
    let mut n = 0;
    let (entry, err) = loop {
        let (entry, err) = rejected_names(l, name, n);
        if !err.exists() {
            match rename_noreplace(path, &entry) {
                Ok(()) => break (entry, err),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        n += 1;
    };
    if let Some(id) = seen {
        let now = std::fs::symlink_metadata(&entry)?;
        if !FileId::at(&entry, &now).same(&id) {
            tracing::warn!(request = name, "spool entry replaced while being rejected; it gets a fresh look");
            republish(&entry, &l.spool(), name)?;
            return Ok(false);
        }
    }
    // Barrier: the move is durable in both directories before the error file
    // or the rejected run is written. Otherwise a power loss could keep those
    // and lose the move: the request back in the spool next to its rejection,
    // to be claimed and run (a withdrawn one too), or rejected a second time.
    // Two directory fsyncs per rejection; rejections are rare.
    let _ = fsync_dir(&l.rejected());
    let _ = fsync_dir(&l.spool());
    let file = entry.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    // A withdrawal's intent marker goes once its error file is on disk for good.
    write_error_file(w, &err, &file, r, r.code == RejectionCode::Withdrawn)?;
    tracing::warn!(
        request = name,
        run_id = run.as_ref().map(|(id, _)| id.as_str()),
        code = r.code.as_str(),
        "rejected: {}",
        r.message
    );
    if let Some((run_id, body)) = run {
        // Not `exists()`: a dangling symlink there must not be written through.
        if std::fs::symlink_metadata(l.run_dir(&run_id)).is_err() {
            rejected_run(w, l, &run_id, &body, r)?;
        }
    }
    Ok(true)
}

/// Through the writer: on a full disk the entry is already in rejected/ and
/// its error file must follow as soon as space returns. A rejection's is not
/// fsynced: a lost one is rewritten at the next start (recover_rejected),
/// whose re-check finds the reason again. A withdrawal's is (`durable`): its
/// reason is only in its intent marker, removed once the error file is written.
fn write_error_file(w: &mut Writer, err: &Path, file: &str, r: &Rejection, durable: bool) -> io::Result<()> {
    let body = json!({"version": 1, "file": file, "code": r.code, "message": r.message, "rejectedAt": crate::now_ms()});
    w.write(err, serde_json::to_vec_pretty(&body).map_err(io::Error::other)?, durable)
}

/// Retention of rejected/ (PROTOCOL §12, `retention_days`): every entry
/// rejected before `cutoff` (its error file's `rejectedAt`, else the error
/// file's mtime) goes, the entry first and then its error file, and so do
/// error files left without their entry. An entry without its error file is
/// a rejection still being settled: it stays. Intent markers are not touched
/// here (a settled withdrawal's goes when it settles). Symlinks are removed
/// as links; a directory is left alone. The number of entries removed.
pub fn sweep_rejected(l: &Layout, cutoff: i64) -> usize {
    let Ok(rd) = std::fs::read_dir(l.rejected()) else { return 0 };
    let names: Vec<String> = rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect();
    let rejected_at = |err: &Path| -> Option<i64> {
        let md = std::fs::symlink_metadata(err).ok()?;
        let at = fsutil::read_nofollow(err, 64 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["rejectedAt"].as_i64());
        Some(at.unwrap_or(md.mtime() * 1000))
    };
    let is_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    let mut removed = 0;
    let mut kept_errors = std::collections::HashSet::new();
    for name in names.iter().filter(|n| !n.starts_with('.') && !n.ends_with(ERROR_FILE_SUFFIX)) {
        let (entry, err) = rejected_names(l, name, 0);
        let err_name = err.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let old = rejected_at(&err).is_some_and(|at| at < cutoff) && !is_dir(&entry) && !is_dir(&err);
        if old && std::fs::remove_file(&entry).is_ok() {
            removed += 1;
            let _ = std::fs::remove_file(&err);
        } else {
            kept_errors.insert(err_name);
        }
    }
    // Error files whose entry is gone (removed by hand, or a sweep cut short).
    for name in names.iter().filter(|n| !n.starts_with('.') && n.ends_with(ERROR_FILE_SUFFIX)) {
        let err = l.rejected_entry(name);
        if !kept_errors.contains(name) && !is_dir(&err) && rejected_at(&err).is_some_and(|at| at < cutoff) {
            let _ = std::fs::remove_file(&err);
        }
    }
    removed
}

/// Name prefix of a withdrawal's intent marker in rejected/:
/// `.withdrawing-<inode>-<spool name>`, written (and fsynced) by the
/// withdrawing client before it moves the entry, removed once the entry's
/// error file is on disk. An entry found in rejected/ without its error file
/// and with a marker naming its file was withdrawn by a client cut short
/// after its move (killed, out of space): recovery finishes it as `withdrawn`.
pub const INTENT_PREFIX: &str = ".withdrawing-";

/// A withdrawal's intent marker, read back.
pub(super) struct Intent {
    pub path: PathBuf,
    /// The entry's name in the spool.
    pub file: String,
    pub message: String,
    pub id: FileId,
    pub written_ms: i64,
}

/// Where the intent marker of withdrawing the spool entry `name` (identity `id`) goes.
pub(super) fn intent_path(l: &Layout, name: &str, id: &FileId) -> PathBuf {
    l.rejected_entry(&format!("{INTENT_PREFIX}{}-{name}", id.ino))
}

/// The marker's body: the entry's name, identity and the withdrawal's message.
pub(super) fn intent_body(name: &str, id: &FileId, message: &str) -> Vec<u8> {
    let v = json!({
        "version": 1, "file": name, "message": message, "dev": id.dev, "ino": id.ino,
        "size": id.size, "mtimeNs": id.mtime_ns.to_string(), "writtenAt": crate::now_ms(),
    });
    serde_json::to_vec_pretty(&v).unwrap_or_default()
}

/// Every intent marker among the `names` of rejected/ that reads back whole.
pub(super) fn read_intents(l: &Layout, names: &[String]) -> Vec<Intent> {
    let loose = !crate::platform::inode_numbers_stable(&l.rejected());
    names
        .iter()
        .filter(|n| n.starts_with(INTENT_PREFIX) && !n.ends_with(".tmp"))
        .filter_map(|n| {
            let path = l.rejected_entry(n);
            let v: Value = serde_json::from_slice(&fsutil::read_nofollow(&path, 64 * 1024).ok()?).ok()?;
            let id = FileId {
                dev: v["dev"].as_u64()?,
                ino: v["ino"].as_u64()?,
                size: v["size"].as_u64()?,
                mtime_ns: v["mtimeNs"].as_str()?.parse().ok()?,
                loose,
            };
            let file = v["file"].as_str()?.to_string();
            let message = v["message"].as_str()?.to_string();
            Some(Intent { path, file, message, id, written_ms: v["writtenAt"].as_i64().unwrap_or(0) })
        })
        .collect()
}

/// The intent whose file `entry` (named `name` in rejected/, metadata `md`) is.
fn intent_for<'a>(
    intents: &'a [Intent],
    l: &Layout,
    name: &str,
    entry: &Path,
    md: &std::fs::Metadata,
) -> Option<&'a Intent> {
    let id = FileId::at(entry, md);
    intents.iter().find(|i| {
        i.id.same(&id)
            && (0..1000).any(|n| rejected_names(l, &i.file, n).0.file_name() == Some(std::ffi::OsStr::new(name)))
    })
}

pub use crate::store::layout::REJECTED_STAGING_PREFIX as STAGING_PREFIX;

/// The status of a `rejected` run for `body`, its fields taken from the
/// body where they are present and within their limits.
fn rejected_status(run_id: &RunId, body: &Value, r: &Rejection) -> Status {
    let now = crate::now_ms();
    let text = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
    let mode = match body.get("steps").and_then(Value::as_array).map(|a| a.as_slice()) {
        Some([one]) if one.get("parallel").is_some() => crate::protocol::request::Mode::Parallel,
        Some([_]) => crate::protocol::request::Mode::Single,
        _ => crate::protocol::request::Mode::Chain,
    };
    let mut status = Status {
        run_id: run_id.to_string(),
        session_id: text("sessionId").filter(|s| s.len() <= 4096).unwrap_or_else(|| "default".into()),
        tool_call_id: text("toolCallId").filter(|s| s.len() <= 4096),
        completion_owner_id: text("completionOwnerId").filter(|s| s.len() <= 256),
        mode,
        state: State::Rejected,
        started_at: now,
        last_update: now,
        ended_at: Some(now),
        timeout_ms: 0,
        deadline_at: None,
        timed_out: false,
        stopped: false,
        error: Some(format!("{}: {}", r.code, r.message)),
        exit_code: Some(1),
        pid: None,
        runner: None,
        cwd: text("cwd").unwrap_or_default(),
        current_step: 0,
        chain_step_count: 0,
        parallel_groups: vec![],
        queue: Default::default(),
        output_file: None,
        steps: vec![],
        extra: Default::default(),
    };
    status.mark_launched_by_runspool();
    status
}

/// A run directory in state `rejected`, so a client waiting on its run id learns the outcome.
pub(crate) fn rejected_run(w: &mut Writer, l: &Layout, run_id: &RunId, body: &Value, r: &Rejection) -> io::Result<()> {
    let dir = l.run_dir(run_id);
    let status = rejected_status(run_id, body, r);
    // One idempotent operation, retried by the writer while storage is full:
    // the entry is already in rejected/, so the run must follow.
    let (l, run_id, code, message) = (l.clone(), run_id.clone(), r.code, r.message.clone());
    w.then(
        format!("rejected run {run_id}"),
        Box::new(move || {
            // The rejected run's files: its status and its one event.
            let write_into = |d: &Path| -> io::Result<()> {
                let bytes = serde_json::to_vec_pretty(&status).map_err(io::Error::other)?;
                fsutil::write_atomic(&RunPaths::status(d), &bytes, true)?;
                let mut ev = Writer::new();
                run::event(&mut ev, d, &run_id, "subagent.run.rejected", json!({"code": code, "message": message}));
                Ok(())
            };
            match run::read_status(&dir) {
                Ok(Some(cur)) if !(cur.state == State::Rejected && cur.launched_by_runspool()) => return Ok(()), // not ours to touch
                Ok(Some(_)) => {}
                Ok(None) if run::claimed(&dir) => {
                    // A half-done claim whose request failed validation: the
                    // directory is ours already (request.json), so are temps in it.
                    write_into(&dir)?;
                }
                Ok(None) => {
                    // Built complete in a dot-named staging directory, then
                    // renamed into place: a rejected run has no request.json,
                    // so a temp file left inside its directory by a crash
                    // could not be told from another host's; a leftover
                    // staging directory is ours (`STAGING_PREFIX`).
                    // The builder's pid in the name: a leftover of a dead builder is
                    // removed at the next start, a live one's (a CLI at work) kept.
                    let stage = l.rejected_run_staging(std::process::id(), &uuid::Uuid::new_v4().to_string());
                    let built = mkdir_private(&stage).and_then(|_| {
                        write_into(&stage)?;
                        std::fs::rename(&stage, &dir)?;
                        fsync_dir(&l.runs())
                    });
                    if let Err(e) = built {
                        let _ = std::fs::remove_dir_all(&stage);
                        // Taken meanwhile (another host's run): not ours to publish.
                        if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) {
                            return Ok(());
                        }
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            results::publish_result(&l, &run_id, &status)?;
            index::mark_terminal(&l, &status)?;
            index::unmark_active(&l, &run_id, status.tool_call_id.as_deref())
        }),
    )
}

/// At start, finish rejections cut short by a crash, for entries moved into
/// rejected/ since `since_ms`: a missing error file is written again (the
/// checks are deterministic, so re-checking finds the reason; a withdrawal's
/// reason is in its intent marker), and a missing `rejected` run for a body
/// with a valid, unused run id is created.
pub fn recover_rejected(w: &mut Writer, l: &Layout, ctx: &dyn Context, since_ms: i64) {
    settle_rejected(w, l, ctx, Some(since_ms));
}

/// While the daemon runs (its periodic rescan): finish the withdrawals whose
/// client was cut short after moving the entry (their intent marker is still
/// there), e.g. one that gave up on a full disk. Cheap when there is none:
/// one listing of rejected/.
pub fn finish_withdrawals(w: &mut Writer, l: &Layout, ctx: &dyn Context) {
    settle_rejected(w, l, ctx, None);
}

/// `since_ms` Some: every entry moved in since then (start-up); None: only
/// the entries of intent markers.
fn settle_rejected(w: &mut Writer, l: &Layout, ctx: &dyn Context, since_ms: Option<i64>) {
    let Ok(rd) = std::fs::read_dir(l.rejected()) else { return };
    let names: Vec<String> = rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect();
    let intents = read_intents(l, &names);
    if since_ms.is_none() && intents.is_empty() {
        return;
    }
    let set: std::collections::HashSet<&String> = names.iter().collect();
    // Markers whose entry is settled (or was never moved) go at the end.
    let mut matched: Vec<&Path> = Vec::new();
    for name in &names {
        if name.starts_with('.') || name.ends_with(ERROR_FILE_SUFFIX) {
            continue;
        }
        let stem = name.strip_suffix(".json").unwrap_or(name);
        let (entry, err) = (l.rejected_entry(name), format!("{stem}{ERROR_FILE_SUFFIX}"));
        let Ok(md) = std::fs::symlink_metadata(&entry) else { continue };
        let intent = if intents.is_empty() { None } else { intent_for(&intents, l, name, &entry, &md) };
        // The rename into rejected/ set the ctime: older entries were settled by an earlier start.
        let fresh = since_ms.is_some_and(|s| md.ctime() * 1000 + md.ctime_nsec() / 1_000_000 >= s);
        if !(fresh || intent.is_some()) || err.len() > 255 {
            continue;
        }
        // A client withdrawing this entry (`withdraw`) holds its lock from the
        // move until its error file and run are written: leave it to them,
        // and look at the error file again once the lock is ours.
        let _held = match md.is_file().then(|| fsutil::open_read(&entry)) {
            Some(Ok(f)) => match fsutil::flock(&f, true) {
                Ok(false) => continue,
                _ => Some(f),
            },
            _ => None,
        };
        let has_error_file = set.contains(&err) || l.rejected_entry(&err).exists();
        let r = if has_error_file {
            match fsutil::read_nofollow(&l.rejected_entry(&err), 64 * 1024)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            {
                Some(v) => Rejection::new(
                    // A code this daemon does not know is read back as `invalid-field`.
                    v["code"].as_str().and_then(RejectionCode::parse).unwrap_or(RejectionCode::InvalidField),
                    v["message"].as_str().unwrap_or("").to_string(),
                ),
                None => continue,
            }
        } else {
            // A withdrawal cut short after its move: its marker says so, and why.
            let r = match intent {
                Some(i) => Rejection::new(RejectionCode::Withdrawn, i.message.clone()),
                None => recheck(&entry, name, l, ctx),
            };
            match write_error_file(w, &l.rejected_entry(&err), name, &r, intent.is_some()) {
                Ok(()) => tracing::info!(request = %name, code = r.code.as_str(), "wrote the missing rejection file"),
                Err(e) => {
                    tracing::warn!(request = %name, error = %e, "could not write a missing rejection file");
                    continue;
                }
            }
            r
        };
        let finished = finish_rejected_run(w, l, name, &entry, &md, &r);
        if let Some(i) = intent {
            // Its error file is on disk (the writer holds nothing for it) and its run made.
            if finished && w.pending_for(&l.rejected_entry(&err)).is_none() {
                matched.push(&i.path);
            }
        }
    }
    // A marker with no entry in rejected/ is a withdrawal cut short before its
    // move (the request stayed in the spool and is claimed as usual); the
    // minute's grace spares a client between its marker and its move.
    let now = crate::now_ms();
    let unmoved = intents.iter().filter(|i| {
        now - i.written_ms > 60_000
            && !names.iter().any(|n| {
                !n.starts_with('.') && {
                    let p = l.rejected_entry(n);
                    std::fs::symlink_metadata(&p).is_ok_and(|m| FileId::at(&p, &m).same(&i.id))
                }
            })
    });
    for p in matched.into_iter().map(Path::to_path_buf).chain(unmoved.map(|i| i.path.clone())) {
        if let Err(e) = std::fs::remove_file(&p) {
            tracing::warn!(path = %p.display(), error = %e, "could not remove a settled withdrawal's intent marker");
        }
    }
}

/// The `rejected` run of a rejected entry whose body names a valid run id no
/// run has: made if missing. False when it could not be made now.
fn finish_rejected_run(
    w: &mut Writer,
    l: &Layout,
    name: &str,
    entry: &Path,
    md: &std::fs::Metadata,
    r: &Rejection,
) -> bool {
    // As the claim does: a bad name is refused before its body is read, and
    // a duplicate id names someone else's run; neither gets a run.
    if matches!(r.code, RejectionCode::DuplicateRunId | RejectionCode::BadName) || check_entry(entry, md).is_err() {
        return true;
    }
    let Ok(raw) = fsutil::read_nofollow(entry, MAX_REQUEST_BYTES + 1) else { return false };
    let Ok(body) = serde_json::from_slice::<Value>(&raw) else { return true };
    let Some(id) = body.get("runId").and_then(Value::as_str).and_then(RequestedRunId::parse).map(RunId::from) else {
        return true;
    };
    if std::fs::symlink_metadata(l.run_dir(&id)).is_ok() {
        return true; // taken (a run, or anything else): never written through
    }
    match rejected_run(w, l, &id, &body, r) {
        Ok(()) => {
            tracing::info!(run_id = %id, request = %name, "created the missing rejected run");
            w.is_idle()
        }
        Err(e) => {
            tracing::warn!(run_id = %id, error = %e, "could not create the missing rejected run");
            false
        }
    }
}

fn recheck(path: &Path, name: &str, l: &Layout, ctx: &dyn Context) -> Rejection {
    let unknown = || {
        Rejection::new(
            RejectionCode::InvalidJson,
            "the reason for this rejection was lost in a crash; resubmit the request".to_string(),
        )
    };
    if classify_name(name) == Name::Bad {
        return Rejection::new(
            RejectionCode::BadName,
            format!("the name `{}` is not a valid request name", name.escape_debug()),
        );
    }
    let Ok(md) = std::fs::symlink_metadata(path) else { return unknown() };
    if let Err(r) = check_entry(path, &md) {
        return r;
    }
    let Ok(raw) = fsutil::read_nofollow(path, MAX_REQUEST_BYTES + 1) else { return unknown() };
    match request::parse(&raw).and_then(|v| request::validate(&raw, &v, ctx)) {
        Err(r) => r,
        // A valid request is refused only for a run id already taken: with no
        // run of that id, it was moved here for another reason (a withdrawal
        // cut short by a client older than intent markers), now unknown.
        Ok(req) => match req.run_id {
            Some(id) if RunId::parse(&id).is_some_and(|id| std::fs::symlink_metadata(l.run_dir(&id)).is_ok()) => {
                Rejection::new(RejectionCode::DuplicateRunId, format!("run id `{id}` was already used"))
            }
            _ => unknown(),
        },
    }
}
