//! After the claim's commit (PROTOCOL §2.3 step 8): the queued status and
//! event, the active marker, and finishing a claim a crash cut short (a run
//! directory with `request.json` and no status). The daemon's claim
//! (`daemon::spool`) and its start-up recovery both finish claims so.

use std::io;
use std::path::Path;

use serde_json::{json, Value};

use super::reject::rejected_run;
use crate::protocol::request::{self, Context, Rejection, RejectionCode, Request, MAX_REQUEST_BYTES};
use crate::protocol::status::Status;
use crate::store::fsutil::{self, is_capacity};
use crate::store::layout::RunPaths;
use crate::store::{index, run, Layout, RunId, Writer};

/// Step 8: queued status and queued event. Also finishes a half-claimed run
/// (request.json without status.json) at daemon start. The active marker
/// follows with `mark_claimed`, once the runner has been started when a slot
/// is free (perf: one file creation fewer between the drop and the runner).
pub fn finish_claim(w: &mut Writer, l: &Layout, run_id: &RunId, req: &Request) -> io::Result<Status> {
    let dir = l.run_dir(run_id);
    let now = crate::now_ms();
    let queued = Status::queued(req, run_id, &dir, now);
    let s = run::update_status(w, &dir, |cur| match cur {
        Some(_) => None, // already written (a racing finisher): keep it
        None => Some(queued),
    })?
    .expect("status exists after update");
    if s.state.is_active() {
        ensure_queued_event(w, &dir, run_id, s.queue.priority);
    }
    Ok(s)
}

/// Finish a run directory holding `request.json` and no `status.json` (a
/// claim whose step 8 was cut short by a crash or a capacity error): the
/// request is validated again with the claim's own validator (G4: a run
/// never executes bytes that were not validated), then the run is queued;
/// one that fails validation becomes a `rejected` run with the code and
/// message (PROTOCOL §2.3). `Ok(None)`: rejected, or nothing left to do.
pub fn finish_half_claim(w: &mut Writer, l: &Layout, run_id: &RunId, ctx: &dyn Context) -> io::Result<Option<Status>> {
    let dir = l.run_dir(run_id);
    let path = RunPaths::request(&dir);
    if RunPaths::status(&dir).exists() && !remove_torn_status(&dir)? {
        return Ok(None);
    }
    let raw = fsutil::read_nofollow(&path, MAX_REQUEST_BYTES + 1)?;
    let checked = if raw.len() as u64 > MAX_REQUEST_BYTES {
        Err(Rejection::new(RejectionCode::TooLarge, format!("{} is over {MAX_REQUEST_BYTES} bytes", path.display())))
    } else {
        request::parse(&raw).and_then(|v| request::validate(&raw, &v, ctx)).and_then(|req| match &req.run_id {
            Some(id) if !run_id.names(id) => Err(Rejection::new(
                RejectionCode::InvalidField,
                format!(
                    "field `runId` is `{id}` but the request is in {}; a run's request names its own run",
                    dir.display()
                ),
            )),
            _ => Ok(req),
        })
    };
    match checked {
        Ok(req) => finish_claim(w, l, run_id, &req).map(|s| Some(s).filter(|s| s.state.is_active())),
        Err(r) => {
            tracing::warn!(
                run_id = %run_id,
                code = r.code.as_str(),
                "the request of a half-done claim fails validation: rejected: {}",
                r.message
            );
            let body = serde_json::from_slice::<Value>(&raw).unwrap_or(Value::Null);
            rejected_run(w, l, run_id, &body, &r)?;
            Ok(None)
        }
    }
}

/// Is `<dir>/status.json` what a power loss leaves of a status written
/// without fsync (the queued one, or a runner's update): empty or zero-filled?
/// Every writer renames a complete temp into place, so nothing else writes
/// such a file.
pub fn status_is_torn(dir: &Path) -> bool {
    fsutil::read_nofollow(&RunPaths::status(dir), 16 * 1024 * 1024).is_ok_and(|b| b.iter().all(|&x| x == 0))
}

/// Remove a torn status.json (`status_is_torn`) of a run whose runner is not
/// alive, under the status lock, so the claim is finished again as if the
/// unsynced write had been lost whole. True when removed.
fn remove_torn_status(dir: &Path) -> io::Result<bool> {
    let _lock = fsutil::lock(&RunPaths::status_lock(dir), false)?;
    if !status_is_torn(dir) || fsutil::lock_held(&RunPaths::runner_lock(dir))? {
        return Ok(false);
    }
    tracing::warn!(dir = %dir.display(), "status.json is empty or zero-filled (a power loss before it was durable): the claim is finished again");
    std::fs::remove_file(RunPaths::status(dir))?;
    Ok(true)
}

/// Append `subagent.run.queued` unless events.jsonl already has it: the
/// daemon may have died between the queued status and the event (claim, or
/// a half-claim finished at start), and the event is written once, never
/// twice. Unlike other events it is not dropped on a capacity error: it
/// waits in the writer, like the status it follows.
pub fn ensure_queued_event(w: &mut Writer, dir: &Path, run_id: &str, priority: i64) {
    let (dir, id) = (dir.to_path_buf(), run_id.to_string());
    let op = move || -> io::Result<()> {
        let path = RunPaths::events(&dir);
        // A queued run's events are a line or two: the first MiB holds the queued one if any.
        match fsutil::read_nofollow(&path, 1024 * 1024) {
            Ok(raw) => {
                let has = raw.split(|b| *b == b'\n').any(|line| {
                    serde_json::from_slice::<Value>(line)
                        .is_ok_and(|v| v.get("type").and_then(Value::as_str) == Some("subagent.run.queued"))
                });
                if has {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) if is_capacity(&e) => return Err(e),
            Err(e) => {
                // Not a readable regular file: appending could only duplicate or fail.
                tracing::warn!(run_id = %id, error = %e, "cannot read {} to check for the queued event", path.display());
                return Ok(());
            }
        }
        let ev = json!({"type": "subagent.run.queued", "ts": crate::now_ms(), "runId": id, "priority": priority});
        match fsutil::append_line(&path, &serde_json::to_vec(&ev).unwrap_or_default()) {
            Err(e) if is_capacity(&e) => Err(e),
            Err(e) => {
                tracing::warn!(run_id = %id, error = %e, "could not append the queued event to {}", path.display());
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    };
    if let Err(e) = w.then(format!("queued event {run_id}"), Box::new(op)) {
        tracing::warn!(run_id, error = %e, "could not write the queued event");
    }
}

/// The active marker of a claimed run (PROTOCOL §2.3 step 8), created under
/// the status lock and only while the run is active, since its runner may
/// already be at work; queued behind deferred writes on a full disk.
pub fn mark_claimed(w: &mut Writer, l: &Layout, run_id: &RunId) -> io::Result<()> {
    let (l2, id) = (l.clone(), run_id.clone());
    w.then(format!("active marker {run_id}"), Box::new(move || index::mark_active_if_active(&l2, &id).map(|_| ())))
}
