//! A client's withdrawal of a request still in the spool (`runspool stop`).

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use serde_json::Value;

use crate::protocol::is_id;
use crate::protocol::request::{Rejection, RejectionCode, MAX_REQUEST_BYTES};
use crate::store::fsutil::{self};
use crate::store::{Layout, Writer};

use super::check_entry;
use super::reject::{reject_entry, rejected_names};
use super::{classify_name, same_file, FileId, Name};

/// What [`withdraw`] did.
#[derive(Debug)]
pub enum Withdrawal {
    /// Moved to `entry` in rejected/ (code `withdrawn`, with its error file,
    /// and a `rejected` run when the body named a valid, unused run id): it
    /// never runs.
    Withdrawn { entry: PathBuf, run_id: Option<crate::store::RunId> },
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
        .filter(|s| is_id(s, 128))
        .and_then(crate::store::RunId::parse);
    // Before any daemon ran, the CLI makes what it writes into (0700, as the daemon would).
    for d in [l.rejected(), l.runs(), l.terminal()] {
        fsutil::mkdir_private_all(&d)?;
    }
    let mut w = Writer::new();
    let r = Rejection::new(RejectionCode::Withdrawn, message.to_string());
    let run = run_id.clone().zip(body);
    if !reject_entry(&mut w, l, &path, name, &r, run, Some(seen))? {
        return Ok(Withdrawal::Gone);
    }
    // The error file and the rejected run wait out a full disk like the daemon's.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !w.flush() {
        if std::time::Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "withdrew {name} but could not write its error file in {} for a full minute ({}); free some space",
                l.rejected().display(),
                w.last_error.clone().unwrap_or_default()
            )));
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    let (entry, err) = (0..1000)
        .map(|n| rejected_names(l, name, n))
        .find(|(p, _)| std::fs::symlink_metadata(p).is_ok_and(|m| FileId::at(p, &m).same(&seen)))
        .unwrap_or_else(|| rejected_names(l, name, 0));
    // Barrier: the error file is durable before the client is told the
    // request was withdrawn. The move itself was made durable by
    // `reject_entry`; a lost error file would be rewritten at the next daemon
    // start, but by re-checking the request, which cannot tell `withdrawn`.
    fsutil::open_read(&err).and_then(|f| f.sync_all()).and_then(|()| fsutil::fsync_dir(&l.rejected())).map_err(
        |e| {
            io::Error::new(
                e.kind(),
                format!("withdrew {name}, but could not make {} durable ({e}); check the file system", err.display()),
            )
        },
    )?;
    drop(file);
    Ok(Withdrawal::Withdrawn { entry, run_id })
}
