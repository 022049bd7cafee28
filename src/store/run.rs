//! One run directory: status.json under `.status.lock`, and events.jsonl.

use std::io;
use std::path::Path;

use serde_json::{json, Value};

use super::fsutil::{self, is_capacity};
use super::layout::RunPaths;
use super::{RunId, Writer};
use crate::protocol::status::{State, Status};

/// Whose run a directory is (PROTOCOL §14). runspool supervises only runs it
/// launched; every other run under the root (a pi-subagents host's) is
/// read-only to it, except for the external-job bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// Claimed from runspool's spool: the claim renamed the request to
    /// `<runDir>/request.json`, which no other launcher writes.
    Claimed,
    /// A `rejected` run runspool created for a refused request (§2.3): no
    /// request.json, a `rejected` status that says `launchedBy: "runspool"`.
    Rejection,
    /// Anything else: another host's run, or not a run at all.
    Foreign,
}

impl Ownership {
    pub fn is_ours(self) -> bool {
        self != Ownership::Foreign
    }
}

/// True when `<runDir>/request.json` is a regular file (never followed) in
/// a run directory that is itself no symbolic link.
pub fn claimed(run_dir: &Path) -> bool {
    std::fs::symlink_metadata(run_dir).is_ok_and(|m| m.is_dir())
        && std::fs::symlink_metadata(RunPaths::request(run_dir)).is_ok_and(|m| m.file_type().is_file())
}

/// Whose run `run_dir` is, given its status when the caller has read it.
pub fn ownership(run_dir: &Path, status: Option<&Status>) -> Ownership {
    if claimed(run_dir) {
        return Ownership::Claimed;
    }
    let read;
    let s = match status {
        Some(s) => Some(s),
        None => {
            read = read_status(run_dir).ok().flatten();
            read.as_ref()
        }
    };
    match s {
        Some(s) if s.state == crate::protocol::status::State::Rejected && s.launched_by_runspool() => {
            Ownership::Rejection
        }
        _ => Ownership::Foreign,
    }
}

/// Read status.json (or None if missing). A status that does not parse is
/// an error, and so is one that is not this directory's own: a run is its
/// directory, so a status whose `runId` is not the directory's name (a
/// copy, `cp -r run run.bak`, or a crafted file) or a run directory that is
/// a symbolic link is reported as `InvalidData`, and every reader, writer,
/// repair and publication built on this function leaves such a directory
/// alone.
pub fn read_status(run_dir: &Path) -> io::Result<Option<Status>> {
    let path = RunPaths::status(run_dir);
    let Some(id) = RunId::of_dir(run_dir) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: not a run directory (its name is outside the run-id grammar)", run_dir.display()),
        ));
    };
    if std::fs::symlink_metadata(run_dir).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is a symbolic link, not a run directory; runspool never follows it (remove the link)",
                run_dir.display()
            ),
        ));
    }
    let bytes = match fsutil::read_nofollow(&path, 16 * 1024 * 1024) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let s: Status = serde_json::from_slice(&bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
    if !id.names(&s.run_id) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, IdentityMismatch { path, run_id: s.run_id }));
    }
    Ok(Some(s))
}

/// A status.json whose `runId` is not the name of the directory it lives in.
#[derive(Debug, thiserror::Error)]
#[error(
    "{}: names run {run_id:?}, but a run is its directory; runspool leaves this directory alone (it was copied or \
     edited: move it out of the runs root, or restore its own status.json)",
    .path.display()
)]
pub struct IdentityMismatch {
    pub path: std::path::PathBuf,
    pub run_id: String,
}

/// True when `e` (from `read_status`) is a status that is not its directory's own.
pub fn is_identity_mismatch(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<IdentityMismatch>())
}

/// Read, merge and write status.json holding `.status.lock` (PROTOCOL §4).
/// `f` returns false to skip the write. A terminal state is never replaced by
/// an active one. The base is the newest payload the writer still holds for
/// this path (full disk), else the file.
pub fn update_status(
    w: &mut Writer,
    run_dir: &Path,
    f: impl FnOnce(Option<Status>) -> Option<Status>,
) -> io::Result<Option<Status>> {
    let lock = lock_status(run_dir)?;
    let s = update_status_locked(w, run_dir, f);
    drop(lock);
    s
}

/// Take `.status.lock` (PROTOCOL §4), held while the file lives. None: no
/// inode or fd to spare for the lock; the caller goes on without it (the
/// writer keeps the payload).
pub fn lock_status(run_dir: &Path) -> io::Result<Option<std::fs::File>> {
    match fsutil::lock(&RunPaths::status_lock(run_dir), false) {
        Ok(l) => Ok(l),
        Err(e) if is_capacity(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `update_status` for a caller that holds the status lock (`lock_status`).
pub fn update_status_locked(
    w: &mut Writer,
    run_dir: &Path,
    f: impl FnOnce(Option<Status>) -> Option<Status>,
) -> io::Result<Option<Status>> {
    let path = RunPaths::status(run_dir);
    let base = match w.pending_for(&path) {
        Some(b) => serde_json::from_slice(b).ok(),
        None => read_status(run_dir)?,
    };
    let was_terminal = base.as_ref().map(|s: &Status| !s.state.is_active()).unwrap_or(false);
    let Some(mut new) = f(base.clone()) else { return Ok(base) };
    if was_terminal && new.state.is_active() {
        return Ok(base);
    }
    new.last_update = crate::now_ms().max(new.last_update.saturating_add(1));
    // Terminal states are durable (PROTOCOL §11), and so is the first
    // `running`: a power loss must never bring a started run back as
    // `queued`, to be started a second time (docs/durability.md).
    let starting = base.as_ref().is_some_and(|b| b.state == State::Queued) && new.state == State::Running;
    let durable = !new.state.is_active() || starting;
    let bytes = serde_json::to_vec_pretty(&new).map_err(io::Error::other)?;
    w.write(&path, bytes, durable)?;
    Ok(Some(new))
}

/// One event's line (`type`, `ts`, `runId` plus `fields`), without its newline.
pub fn event_line(run_id: &str, kind: &str, fields: Value) -> Vec<u8> {
    let mut ev = json!({ "type": kind, "ts": crate::now_ms(), "runId": run_id });
    if let (Some(o), Value::Object(extra)) = (ev.as_object_mut(), fields) {
        o.extend(extra);
    }
    serde_json::to_vec(&ev).unwrap_or_default()
}

/// Append one event (`type`, `ts`, `runId` plus `fields`). Events are
/// diagnostics: on a full disk they are dropped and counted, never retried.
pub fn event(w: &mut Writer, run_dir: &Path, run_id: &str, kind: &str, fields: Value) {
    let line = event_line(run_id, kind, fields);
    match fsutil::append_line(&RunPaths::events(run_dir), &line) {
        Ok(()) => {}
        Err(e) if is_capacity(&e) => w.dropped_event(&e),
        Err(e) => tracing::warn!(run_id, error = %e, "could not append event {kind}"),
    }
}

/// Take `runner.lock` if no live runner holds it. Holding it proves the
/// runner is gone and keeps a new one from starting while we repair or
/// end the run.
pub fn take_runner_lock(run_dir: &Path) -> io::Result<Option<std::fs::File>> {
    fsutil::lock(&RunPaths::runner_lock(run_dir), true)
}
