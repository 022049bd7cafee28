//! Claiming a spool entry (PROTOCOL §2.3 steps 1 to 8) and finishing a
//! claim cut short.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use serde_json::Value;

use crate::platform::rename_noreplace;
use crate::protocol::ids::RequestedRunId;
use crate::protocol::request::{self, Rejection, RejectionCode, Request, MAX_REQUEST_BYTES};
use crate::store::deps::Dep;
use crate::store::fsutil::{self, fsync_dir, is_capacity};
use crate::store::layout::RunPaths;
use crate::store::RunId;

use super::reject::reject_entry;
use super::{check_entry, claim_id, classify_name, republish, same_file, Claimer, FileId, Name, Outcome};
use crate::store::spool::claimed::finish_claim;

impl Claimer<'_> {
    /// Process one spool entry by name.
    pub fn process(&mut self, name: &str) -> Outcome {
        let path = self.layout.spool().join(name);
        match classify_name(name) {
            Name::Ignored => return Outcome::Later,
            Name::Bad => {
                let msg = format!(
                    "the name `{}` is not a valid request name; use <name>.json with <name> matching [A-Za-z0-9][A-Za-z0-9._-]{{0,199}}",
                    name.escape_debug()
                );
                return self.reject(&path, name, Rejection::new(RejectionCode::BadName, msg), None);
            }
            Name::Candidate => {}
        }
        let md = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Outcome::Later,
            Err(e) if is_capacity(&e) => return Outcome::Capacity(e),
            Err(e) => {
                tracing::warn!(request = name, error = %e, "cannot lstat a spool entry; will retry");
                return Outcome::Later;
            }
        };
        let seen = Some(FileId::at(&path, &md));
        if let Err(r) = check_entry(&path, &md) {
            return self.reject_seen(&path, name, r, None, seen);
        }
        let file = match open_locked(&path, name, &md) {
            Ok(f) => f,
            Err(o) => return o,
        };
        // Re-check after the lock: an in-place writer may have grown it or changed its mode.
        let Ok(fmd) = file.metadata() else { return Outcome::Later };
        if let Err(r) = check_entry(&path, &fmd) {
            return self.reject_seen(&path, name, r, None, seen);
        }
        // Step 4: read (bounded) and parse.
        let mut raw = Vec::with_capacity(fmd.len() as usize);
        if let Err(e) = (&file).take(MAX_REQUEST_BYTES + 1).read_to_end(&mut raw) {
            if is_capacity(&e) {
                return Outcome::Capacity(e);
            }
            return Outcome::Later;
        }
        if raw.len() as u64 > MAX_REQUEST_BYTES {
            let r = Rejection::new(
                RejectionCode::TooLarge,
                format!("{} grew past {MAX_REQUEST_BYTES} bytes", path.display()),
            );
            return self.reject_seen(&path, name, r, None, seen);
        }
        let value = match request::parse(&raw) {
            Ok(v) => {
                self.grace.forget(name);
                v
            }
            Err(r) => {
                if self.grace.pending(name, FileId::at(&path, &fmd), mtime_ms(&fmd)) {
                    return Outcome::Later;
                }
                self.grace.forget(name);
                return self.reject_seen(&path, name, r, None, seen);
            }
        };
        // Step 5: validate.
        let req = match request::validate(&raw, &value, self.ctx) {
            Ok(r) => r,
            Err(r) => {
                let run_id =
                    value.get("runId").and_then(Value::as_str).and_then(RequestedRunId::parse).map(RunId::from);
                return self.reject_seen(&path, name, r, run_id.map(|id| (id, value.clone())), seen);
            }
        };
        if let Err(r) = self.check_dependencies(&req) {
            let run_id = req.run_id.as_deref().and_then(RunId::parse);
            return self.reject_seen(&path, name, r, run_id.map(|id| (id, value.clone())), seen);
        }
        self.claim(&path, name, file, req, &raw)
    }

    /// Every `after` entry names a run (any state, any host's) or a request
    /// still in the spool (PROTOCOL §15); else `unknown-dependency`.
    fn check_dependencies(&mut self, req: &Request) -> Result<(), Rejection> {
        for (i, dep) in req.after.iter().flatten().enumerate() {
            let known = RunId::parse(dep)
                .is_some_and(|id| crate::store::deps::look(self.layout, &id, self.pending) != Dep::Gone);
            if !known {
                return Err(Rejection::new(
                    RejectionCode::UnknownDependency,
                    format!(
                        "field `after[{i}]` names `{dep}`, which is neither a run under {} nor a request in {}; \
                         submit that run first, or fix the id",
                        self.layout.runs().display(),
                        self.layout.spool().display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Steps 6 to 8.
    fn claim(&mut self, path: &Path, name: &str, lock: File, req: Request, raw: &[u8]) -> Outcome {
        let Ok(held) = lock.metadata() else { return Outcome::Later };
        // The validator admits only ids of the run-id grammar, and `claim_id` is a UUID.
        let (run_id, generated) = match &req.run_id {
            Some(id) => (RunId::parse(id).expect("a validated runId is a run id"), false),
            None => (claim_id(&held, name), true),
        };
        let mut dir = self.layout.run_dir(&run_id);
        // A generated id is a pure function of the spool entry, so a claim
        // retried after a crash between mkdir and the commit reuses its own
        // directory instead of leaving an orphan. Should it ever meet a real
        // run (a reused inode with the same ctime), a random id is taken.
        let run_id = if generated && (RunPaths::request(&dir).exists() || RunPaths::status(&dir).exists()) {
            let id = RunId::parse(&uuid::Uuid::new_v4().to_string()).expect("a UUID is a run id");
            dir = self.layout.run_dir(&id);
            id
        } else {
            run_id
        };
        let created = match self.make_run_dir(path, name, &dir, &run_id) {
            Ok(c) => c,
            Err(o) => return o,
        };
        let undo = |e: io::Error| {
            if created {
                let _ = std::fs::remove_dir_all(&dir);
            }
            e
        };
        // Barrier: the run directory's entry in the runs root is durable before
        // the request moves into it. Without it a power loss could keep the
        // commit (the spool entry gone, fsynced below) and lose the directory
        // holding request.json: the request would be lost. One directory fsync
        // per claim; on a retried claim (`created` false) the directory may
        // still be only in the page cache of the crashed daemon's kernel, so it
        // is synced then too. With no descriptor free to open the directory
        // (EMFILE, ENFILE) the claim goes on without the barrier, as it did
        // before it existed: only a power loss during that shortage is exposed,
        // and the post-commit work keeps its own capacity handling.
        match fsync_dir(&self.layout.runs()) {
            Err(e) if !is_capacity(&e) => {
                undo(e);
                return Outcome::Later;
            }
            _ => {}
        }
        // Perf: nothing else is created before the commit. On ext4 a file
        // creation costs 0.02 to 0.8 ms depending on the directory's block group,
        // so the files a run needs are created by whoever needs them first, off
        // the path from drop to runner: the runner makes its lock, logs and step
        // outputs (waiting out a full disk), `finish_claim` the status and event,
        // and the daemon the active marker once the runner is on its way.
        // Step 7: the commit.
        if let Err(e) = rename_noreplace(path, &RunPaths::request(&dir)) {
            let e = undo(e);
            return if is_capacity(&e) { Outcome::Capacity(e) } else { Outcome::Later };
        }
        // The name may have been replaced between our read and the rename: the
        // run must own the bytes that were validated, nothing else. Where
        // inode numbers are unstable, identity is only a hint: compare bytes.
        if !same_file(&RunPaths::request(&dir), &held) || !committed_bytes_are(&RunPaths::request(&dir), &held, raw) {
            tracing::warn!(request = name, run_id = %run_id, "request replaced while being claimed; it gets a fresh look");
            if let Err(e) = republish(&RunPaths::request(&dir), &self.layout.spool(), name) {
                tracing::error!(request = name, error = %e, "cannot put a replaced request back into the spool");
                return if is_capacity(&e) { Outcome::Capacity(e) } else { Outcome::Later };
            }
            if created {
                let _ = std::fs::remove_dir_all(&dir);
            }
            return Outcome::Later;
        }
        drop(lock);
        // Barrier: the commit is durable on both sides (request.json in the run
        // directory, the name gone from the spool) before status.json is
        // written: a status that reached the disk without its request.json
        // would be a run no one claimed (§14: another host's), with the request
        // still in the spool to be claimed again.
        let _ = fsync_dir(&dir);
        let _ = fsync_dir(&self.layout.spool());
        tracing::info!(run_id = %run_id, request = name, queue_priority = req.priority, "claimed");
        match finish_claim(self.w, self.layout, &run_id, &req) {
            Ok(s) => Outcome::Claimed(run_id, Box::new(s)),
            Err(error) => Outcome::Unfinished { run_id, error },
        }
    }

    /// Step 6: the run directory, made private. Ok(true): created now;
    /// Ok(false): the empty trace of an interrupted claim of this request;
    /// Err: what to do instead (a rejection, or a retry later).
    fn make_run_dir(&mut self, path: &Path, name: &str, dir: &Path, run_id: &RunId) -> Result<bool, Outcome> {
        match std::fs::DirBuilder::new().mode_private().create(dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // Only a real directory can be the trace of an interrupted claim: a
                // symlink there could redirect the request out of the root.
                let real_dir = std::fs::symlink_metadata(dir).map(|m| m.file_type().is_dir()).unwrap_or(false);
                if !real_dir {
                    let r = Rejection::new(
                        RejectionCode::DuplicateRunId,
                        format!("run id `{run_id}` is taken by {}, which is not a run directory; choose another runId or omit it", dir.display()),
                    );
                    return Err(self.reject(path, name, r, None));
                }
                // Nothing is created in a run directory before the commit, so the
                // trace of an interrupted claim is empty. Anything else there is
                // another run's, possibly another host's (§14): never move into it.
                let empty = std::fs::read_dir(dir).map(|mut rd| rd.next().is_none()).unwrap_or(false);
                if !empty {
                    let r = Rejection::new(
                        RejectionCode::DuplicateRunId,
                        format!(
                            "run id `{run_id}` is already used by {}; choose another runId or omit it",
                            dir.display()
                        ),
                    );
                    return Err(self.reject(path, name, r, None));
                }
                Ok(false) // an interrupted claim of this same request: carry on
            }
            Err(e) if is_capacity(&e) => Err(Outcome::Capacity(e)),
            Err(e) => {
                tracing::error!(request = name, run_id = %run_id, error = %e, "cannot create the run directory; will retry");
                Err(Outcome::Later)
            }
        }
    }

    /// Move an entry to rejected/ with its error file (and a rejected run
    /// when the body carried a valid, unused run id).
    fn reject(&mut self, path: &Path, name: &str, r: Rejection, run: Option<(RunId, Value)>) -> Outcome {
        self.reject_seen(path, name, r, run, None)
    }

    /// `reject` of the file identified by `seen` (device, inode): if the name
    /// was replaced meanwhile, the newcomer goes back to the spool instead.
    fn reject_seen(
        &mut self,
        path: &Path,
        name: &str,
        r: Rejection,
        run: Option<(RunId, Value)>,
        seen: Option<FileId>,
    ) -> Outcome {
        match reject_entry(self.w, self.layout, path, name, &r, run, seen) {
            Ok(true) => Outcome::Rejected,
            Ok(false) => Outcome::Later,
            Err(e) if is_capacity(&e) => Outcome::Capacity(e),
            Err(e) => {
                tracing::error!(request = name, error = %e, "cannot move a rejected request; will retry");
                Outcome::Later
            }
        }
    }
}

/// Steps 2 and 3: open without following, without blocking, check it is
/// the file `md` describes, and take the lock its writer may still hold.
fn open_locked(path: &Path, name: &str, md: &std::fs::Metadata) -> Result<File, Outcome> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if is_capacity(&e) => return Err(Outcome::Capacity(e)),
        Err(_) => return Err(Outcome::Later), // replaced or removed meanwhile: look again
    };
    let Ok(fmd) = file.metadata() else { return Err(Outcome::Later) };
    if !FileId::at(path, &fmd).same(&FileId::at(path, md)) {
        return Err(Outcome::Later);
    }
    match fsutil::flock(&file, true) {
        Ok(true) => Ok(file),
        Ok(false) => Err(Outcome::Later),
        Err(e) => {
            tracing::warn!(request = name, error = %e, "cannot lock a spool entry; will retry");
            Err(Outcome::Later)
        }
    }
}

trait DirBuilderPrivate {
    fn mode_private(&mut self) -> &mut Self;
}
impl DirBuilderPrivate for std::fs::DirBuilder {
    fn mode_private(&mut self) -> &mut Self {
        use std::os::unix::fs::DirBuilderExt;
        self.mode(0o700)
    }
}

fn mtime_ms(md: &std::fs::Metadata) -> i64 {
    md.mtime() * 1000 + md.mtime_nsec() / 1_000_000
}

/// After the commit: unless `path` is the very inode that was read (same
/// device and inode number), do its bytes equal the validated `raw`?
fn committed_bytes_are(path: &Path, held: &std::fs::Metadata, raw: &[u8]) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.dev() == held.dev() && m.ino() == held.ino() => true,
        Ok(_) => fsutil::read_nofollow(path, MAX_REQUEST_BYTES + 1).is_ok_and(|b| b == raw),
        Err(_) => false,
    }
}
