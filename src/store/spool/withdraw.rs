//! A client's withdrawal of a request still in the spool (`runspool stop`).

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use serde_json::Value;

use crate::protocol::ids::RequestedRunId;
use crate::protocol::request::{Rejection, RejectionCode, MAX_REQUEST_BYTES};
use crate::store::fsutil::{self};
use crate::store::{Layout, Writer};

use super::check_entry;
use super::reject::{intent_body, intent_path, reject_entry, rejected_names};
use super::{classify_name, same_file, FileId, Name};

/// What [`withdraw`] did.
#[derive(Debug)]
pub enum Withdrawal {
    /// Moved to `entry` in rejected/ (code `withdrawn`, with its error file,
    /// and a `rejected` run when the body named a valid, unused run id): it
    /// never runs. `unfinished`: why its error file or run could not be
    /// written yet (a full disk); its intent marker stays, and the daemon
    /// finishes it (at its next start, or its next rescan when running).
    Withdrawn { entry: PathBuf, run_id: Option<crate::store::RunId>, unfinished: Option<String> },
    /// No longer in the spool, or no longer the same file: the daemon (or
    /// another client) settled it first; look for its run or its rejection.
    Gone,
    /// Its lock is held: the daemon is claiming it, or its writer is still
    /// at work (PROTOCOL §2.1). Look again shortly.
    Busy,
}

/// Withdraw the pending request `spool/<name>` (`runspool stop` of a request
/// not yet claimed), the client side of the claim's own procedure (PROTOCOL
/// §2.3): take the exclusive non-blocking flock the claim holds from its read
/// to its commit rename, check under it that `spool/<name>` is still the
/// locked file, and move it to rejected/ (code `withdrawn`) before letting go.
/// The claim and the withdrawal each take the entry out of the spool by a
/// rename under that lock, so exactly one of them happens and each side sees
/// which: a claim that opened the file first finds the name gone at its
/// commit and claims nothing.
///
/// Crash-safe: before the move, an intent marker (`reject::INTENT_PREFIX`)
/// naming the file and the message is on disk, so an entry found in rejected/
/// without its error file is finished as `withdrawn`, never re-checked into
/// another code. What is reported comes from where the entry is, not from
/// whichever step failed: an error after the move is a withdrawal (with what
/// is left `unfinished`), one before it withdrew nothing.
pub fn withdraw(l: &Layout, name: &str, message: &str) -> io::Result<Withdrawal> {
    if classify_name(name) != Name::Candidate {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("`{}` is not the name of a request in the spool (<name>.json)", name.escape_debug()),
        ));
    }
    let path = l.spool().join(name);
    let md = match std::fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Withdrawal::Gone),
        Err(e) => return Err(e),
    };
    // Not a request the daemon could claim: it rejects it on its own.
    check_entry(&path, &md).map_err(|r| io::Error::new(io::ErrorKind::InvalidInput, r.message))?;
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Withdrawal::Gone),
        Err(e) => return Err(e),
    };
    let seen = FileId::at(&path, &md);
    if !FileId::at(&path, &file.metadata()?).same(&seen) {
        return Ok(Withdrawal::Gone);
    }
    if !fsutil::flock(&file, true)? {
        return Ok(Withdrawal::Busy);
    }
    // Under the lock: a claim that held it before us has moved the entry.
    if !same_file(&path, &md) {
        return Ok(Withdrawal::Gone);
    }
    let mut raw = Vec::new();
    (&file).take(MAX_REQUEST_BYTES + 1).read_to_end(&mut raw)?;
    let body = serde_json::from_slice::<Value>(&raw).ok();
    let run_id = body
        .as_ref()
        .and_then(|b| b.get("runId"))
        .and_then(Value::as_str)
        .and_then(RequestedRunId::parse)
        .map(crate::store::RunId::from);
    // Before any daemon ran, the CLI makes what it writes into (0700, as the daemon would).
    for d in [l.rejected(), l.runs(), l.terminal()] {
        fsutil::mkdir_private_all(&d)?;
    }
    let intent = intent_path(l, name, &seen);
    write_intent(&intent, &intent_body(name, &seen, message))?;
    let forget_intent = || {
        let _ = std::fs::remove_file(&intent);
    };
    let mut w = Writer::new();
    let r = Rejection::new(RejectionCode::Withdrawn, message.to_string());
    let run = run_id.clone().zip(body);
    let mut unfinished = None;
    match reject_entry(&mut w, l, &path, name, &r, run, Some(seen)) {
        Ok(true) => {}
        Ok(false) => {
            forget_intent();
            return Ok(Withdrawal::Gone);
        }
        // Where the entry is says what happened, not the error.
        Err(e) if find_entry(l, name, &seen).is_some() => unfinished = Some(e.to_string()),
        Err(e) => {
            forget_intent();
            return Err(e);
        }
    }
    // The error file and the rejected run wait out a full disk like the daemon's.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while unfinished.is_none() && !w.flush() {
        if std::time::Instant::now() > deadline {
            unfinished = Some(format!(
                "its error file in {} could not be written for a full minute ({})",
                l.rejected().display(),
                w.last_error.clone().unwrap_or_default()
            ));
        } else {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
    let entry = find_entry(l, name, &seen).unwrap_or_else(|| l.rejected_entry(name));
    if unfinished.is_none() {
        forget_intent();
    }
    drop(file);
    Ok(Withdrawal::Withdrawn { entry, run_id, unfinished })
}

/// The entry in rejected/ that the spool's `name` (the file `seen`) was moved to.
fn find_entry(l: &Layout, name: &str, seen: &FileId) -> Option<PathBuf> {
    (0..1000)
        .map(|n| rejected_names(l, name, n).0)
        .find(|p| std::fs::symlink_metadata(p).is_ok_and(|m| FileId::at(p, &m).same(seen)))
}

/// The intent marker, on disk for good before the entry moves; a full disk
/// is waited out for a minute, then nothing is withdrawn.
fn write_intent(path: &std::path::Path, bytes: &[u8]) -> io::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match fsutil::write_atomic(path, bytes, true) {
            Ok(()) => return Ok(()),
            Err(e) if fsutil::is_capacity(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_secs(1))
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                    "nothing was withdrawn: cannot record the withdrawal in {} ({e}); free some space and try again",
                    path.display()
                ),
                ))
            }
        }
    }
}
