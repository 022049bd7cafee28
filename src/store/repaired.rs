//! A run a repair ended (its runner died, PROTOCOL §12): the words of the
//! repair (its error and its event), and finishing again a terminal run's
//! publication that a crash cut short. Repair (the daemon's supervisor)
//! and recovery (at start-up) share these.

use std::io;
use std::path::Path;

use serde_json::{json, Value};

use super::fsutil::{self, is_capacity};
use super::layout::{Layout, RunId, RunPaths};
use super::{index, results, Writer};
use crate::protocol::status::{State, Status};

/// The error a repair writes is `runner process <pid> exited before
/// recording a result[: <runner's last stderr lines>]`: a failed run whose
/// error reads so is a repair's outcome.
pub const REPAIRED_PREFIX: &str = "runner process ";
pub const REPAIRED_SUFFIX: &str = " exited before recording a result";
const REPAIRED_EVENT: &str = "subagent.run.repaired_stale";

/// The pid of the runner a status names (0: none).
pub fn runner_pid(s: &Status) -> u32 {
    s.pid.or(s.runner.as_ref().map(|r| r.pid)).unwrap_or(0)
}

fn is_repair_outcome(s: &Status) -> bool {
    s.state == State::Failed
        && s.error.as_deref().and_then(|e| e.strip_prefix(REPAIRED_PREFIX)).is_some_and(|rest| {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            digits > 0 && rest[digits..].starts_with(REPAIRED_SUFFIX)
        })
}

/// Append `subagent.run.repaired_stale` for the repaired run `s` unless
/// events.jsonl already has it, behind the terminal status in the writer.
/// The repair writes it after the status; a daemon that died between the
/// two leaves it to recovery, which calls this again for every run ended
/// by a repair (`ensure_published_status`): written once, never twice.
pub fn ensure_repaired_event(w: &mut Writer, dir: &Path, s: &Status) {
    let (dir, id) = (dir.to_path_buf(), s.run_id.clone());
    let fields = json!({"pid": runner_pid(s), "message": s.error.clone().unwrap_or_default()});
    let op = move || -> io::Result<()> {
        let path = RunPaths::events(&dir);
        match has_event_near_end(&path, REPAIRED_EVENT) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) if is_capacity(&e) => return Err(e),
            Err(e) => {
                // Not a readable regular file: appending could only duplicate or fail.
                tracing::warn!(run_id = %id, error = %e, "cannot read {} to check for the repair event", path.display());
                return Ok(());
            }
        }
        let mut ev = json!({"type": REPAIRED_EVENT, "ts": crate::now_ms(), "runId": id});
        if let (Some(o), Value::Object(extra)) = (ev.as_object_mut(), &fields) {
            o.extend(extra.clone());
        }
        match fsutil::append_line(&path, &serde_json::to_vec(&ev).unwrap_or_default()) {
            Err(e) if is_capacity(&e) => Err(e),
            Err(e) => {
                tracing::warn!(run_id = %id, error = %e, "could not append the repair event to {}", path.display());
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    };
    if let Err(e) = w.then(format!("repair event {}", s.run_id), Box::new(op)) {
        tracing::warn!(run_id = %s.run_id, error = %e, "could not write the repair event");
    }
}

/// Does one of the lines in the last MiB of `path` have `"type": kind`?
/// The repair event is the last one a repaired run gets (its runner is
/// dead), so it is among them when it was written. A missing file has none.
fn has_event_near_end(path: &Path, kind: &str) -> io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 1024 * 1024;
    let mut f = match fsutil::open_read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
    let mut buf = Vec::new();
    f.take(TAIL).read_to_end(&mut buf)?;
    Ok(buf.split(|b| *b == b'\n').any(|line| {
        serde_json::from_slice::<Value>(line).is_ok_and(|v| v.get("type").and_then(Value::as_str) == Some(kind))
    }))
}

/// A terminal run whose publication may have been cut short (the runner or
/// the daemon died between the status and the indexes): finish it again.
pub fn ensure_published_status(w: &mut Writer, l: &Layout, id: &RunId, s: &Status) -> io::Result<()> {
    if s.state.is_active() {
        return Ok(());
    }
    let marker = index::terminal_marker_path(l, s);
    // The marker is written without fsync: one a power loss left empty or
    // zero-filled counts as missing, so the publication is done again.
    let marker_ok = fsutil::read_nofollow(&marker, 64 * 1024)
        .is_ok_and(|b| serde_json::from_slice::<crate::protocol::status::TerminalMarker>(&b).is_ok());
    if !marker_ok || l.active_marker(id).exists() {
        results::finish_terminal(w, l, id, s)?;
    }
    if is_repair_outcome(s) {
        ensure_repaired_event(w, &l.run_dir(id), s);
    }
    Ok(())
}
