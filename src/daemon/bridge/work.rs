//! Provider operations on worker threads, and the response and claim files
//! they write.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use crate::daemon::hint::Hint;
use crate::protocol::bridge::{validate_handle, Completed, Failure, FailureCode, Handle, Operation, Request, Response};
use crate::providers::{self, Call, Provider};
use crate::store::fsutil;
use crate::store::layout::{ClaimPaths, RunPaths};
use crate::store::Writer;

/// One provider operation on a worker thread.
pub(super) struct Work {
    pub(super) tx: Sender<Hint>,
    pub(super) run_id: String,
    pub(super) dir: PathBuf,
    pub(super) id: String,
    pub(super) provider: std::sync::Arc<dyn Provider>,
    pub(super) limit: Duration,
}

impl Work {
    fn call(&self, op: Operation, req: &Request, find: bool) -> Result<Option<Handle>, Failure> {
        let call = Call {
            op,
            request_id: &req.id,
            provider_job_id: req.provider_job_id.as_deref(),
            start: req.start.as_ref(),
            follow_up: req.follow_up.as_ref(),
            run_dir: &self.dir,
            deadline: Instant::now() + self.limit,
        };
        let p = self.provider.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if find {
                p.find_started(&call)
            } else {
                p.call(&call).map(Some)
            }
        }))
        .unwrap_or_else(|_| {
            Err(providers::failure(
                FailureCode::ProviderError,
                format!("provider `{}` panicked during {}", req.provider, op.as_str()),
            ))
        })?;
        match r {
            Some(h) => match validate_handle(&h, op) {
                Ok(()) => Ok(Some(h)),
                Err(e) => Err(providers::failure(
                    FailureCode::ProviderError,
                    format!("provider `{}` returned an invalid handle for {}: {e}", req.provider, op.as_str()),
                )),
            },
            None => Ok(None),
        }
    }

    pub(super) fn start(self, req: Request) {
        let claim = RunPaths::bridge_claim(&self.dir, &self.id);
        let r = self.call(req.operation, &req, false).map(|h| h.expect("call returns a handle"));
        if let Ok(h) = &r {
            // The handle is durable before anyone hears of it (§8.2).
            if let Err(e) = write_waiting(&ClaimPaths::handle(&claim), &to_json(h), true) {
                tracing::error!(error = %e, "cannot save the job handle");
            }
            tracing::info!(job = %h.provider_job_id, "external job started");
        }
        if let Err(f) = &r {
            tracing::warn!(code = %f.code, detail = %f.message, "external job start failed");
        }
        let _ = respond(&self.dir, &self.id, req.operation.as_str(), &req.provider, r);
        let _ = write_completed(&claim);
        self.finish(false);
    }

    pub(super) fn recover(self, req: Request, abandoned: Failure) {
        let claim = RunPaths::bridge_claim(&self.dir, &self.id);
        // The dead servicer's provider process got SIGKILL with it (run_bounded);
        // what it started that still carries its marks goes too, before the
        // engine is asked, so nothing submits the job after we looked.
        let call = Call {
            op: req.operation,
            request_id: &req.id,
            provider_job_id: None,
            start: req.start.as_ref(),
            follow_up: req.follow_up.as_ref(),
            run_dir: &self.dir,
            deadline: Instant::now() + self.limit,
        };
        let marks = self.provider.marks(&call);
        if !marks.is_empty() && !crate::platform::procs::kill_marked(&marks, Duration::from_secs(10)) {
            tracing::warn!("processes of a dead servicer's start survive SIGKILL; will look again");
            return self.finish(true);
        }
        let op = req.operation;
        match self.call(op, &req, true) {
            Ok(Some(h)) => {
                tracing::warn!(job = %h.provider_job_id, "adopted the job a dead servicer had started");
                let _ = write_waiting(&ClaimPaths::handle(&claim), &to_json(&h), true);
                let _ = respond(&self.dir, &self.id, op.as_str(), &req.provider, Ok(h));
                let _ = write_completed(&claim);
                self.finish(false);
            }
            Ok(None) => {
                let _ = respond(&self.dir, &self.id, op.as_str(), &req.provider, Err(abandoned));
                let _ = write_completed(&claim);
                self.finish(false);
            }
            Err(f) => {
                tracing::warn!(code = %f.code, detail = %f.message, "looking up a dead servicer's job failed; will ask again");
                self.finish(true);
            }
        }
    }

    pub(super) fn operation(self, req: Request, lock: File) {
        let path = RunPaths::bridge_request(&self.dir, &self.id);
        let resp = RunPaths::bridge_response(&self.dir, &self.id);
        // A servicer that died after answering: only the removal is left to do.
        if !resp.exists() {
            let r = self.call(req.operation, &req, false).map(|h| h.expect("call returns a handle"));
            if let Err(f) = &r {
                tracing::debug!(op = req.operation.as_str(), code = %f.code, "bridge operation failed");
            }
            if respond(&self.dir, &self.id, req.operation.as_str(), &req.provider, r).is_err() {
                drop(lock);
                return self.finish(false);
            }
        }
        let _ = fsutil::remove_if_exists(&path);
        drop(lock);
        self.finish(false);
    }

    fn finish(self, retry: bool) {
        let _ = self.tx.send(Hint::BridgeDone { run_id: self.run_id, id: self.id, retry });
    }
}

/// False when no thread could be started; the request stays on disk (a start
/// claim without a tombstone is recovered as ours) and is taken again later.
#[must_use]
pub(super) fn spawn_worker(run_id: &str, id: &str, f: impl FnOnce() + Send + 'static) -> bool {
    let name = format!("bridge-{}", id.chars().take(40).collect::<String>());
    // Everything the worker logs (the provider's lines too) carries the run
    // and request ids (RUN_ID= in the journal). Error level, so the span is
    // enabled whenever any of its events is.
    let span = tracing::error_span!("bridge", run_id = %run_id, request = %id);
    match std::thread::Builder::new().name(name).spawn(move || span.in_scope(f)) {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(run_id, request = id, error = %e, "cannot start a bridge worker thread; will retry");
            false
        }
    }
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(v).unwrap_or_default()
}

pub(super) fn write_completed(claim: &Path) -> io::Result<()> {
    write_waiting(&ClaimPaths::completed(claim), &to_json(&Completed { completed_at: crate::now_ms() }), true)
}

fn response_bytes(id: &str, op: &str, provider: &str, r: Result<Handle, Failure>) -> Vec<u8> {
    let now = crate::now_ms();
    let resp = match r {
        Ok(h) => Response::ok(id, op, provider, h, now),
        Err(f) => Response::err(id, op, provider, f, now),
    };
    to_json(&resp)
}

/// The responses directory of the run in `dir`, made if missing, never through a symlink.
fn responses_dir(dir: &Path) -> io::Result<()> {
    let rdir = RunPaths::bridge_responses(dir);
    fsutil::mkdir_private(&rdir)?;
    fsutil::real_dir(&rdir)
}

/// Write the response file for request `id` (on a worker thread).
pub(super) fn respond(dir: &Path, id: &str, op: &str, provider: &str, r: Result<Handle, Failure>) -> io::Result<()> {
    responses_dir(dir)?;
    write_waiting(&RunPaths::bridge_response(dir, id), &response_bytes(id, op, provider, r), false)
}

/// Write the response file for request `id` on the daemon's loop, through
/// its writer: on a full disk the writer keeps it and retries it on the
/// loop's turns, so no capacity retry ever sleeps the loop. Ok(true): on
/// disk now; Ok(false): waiting in the writer, and whatever must follow the
/// response goes behind it (`remove_answered`, `complete_after`).
pub(super) fn respond_in_loop(
    w: &mut Writer,
    dir: &Path,
    id: &str,
    op: &str,
    provider: &str,
    r: Result<Handle, Failure>,
) -> io::Result<bool> {
    responses_dir(dir)?;
    let path = RunPaths::bridge_response(dir, id);
    w.write(&path, response_bytes(id, op, provider, r), false).inspect_err(|e| {
        tracing::error!(path = %path.display(), error = %e, "cannot write a bridge file");
    })?;
    Ok(w.pending_for(&path).is_none())
}

/// The claim's tombstone, through the writer: written after every pending
/// write (the response among them) has landed, so a crash never leaves a
/// finished claim without its answer.
pub(super) fn complete_after(w: &mut Writer, claim: &Path) {
    let claim = claim.to_path_buf();
    let op = move || {
        let done = to_json(&Completed { completed_at: crate::now_ms() });
        fsutil::write_atomic(&ClaimPaths::completed(&claim), &done, true)
    };
    if let Err(e) = w.then("bridge claim tombstone", Box::new(op)) {
        tracing::error!(error = %e, "cannot write a bridge claim's tombstone");
    }
}

/// Remove the answered request entry `req` once its response is on disk:
/// run by the writer behind the response that waited for space. A response
/// the writer could not land after all (not on disk) leaves the request for
/// the next sweep to answer; a request locked by another servicer is theirs.
pub(super) fn remove_answered(w: &mut Writer, dir: &Path, id: &str, regular: bool) {
    let (req, resp) = (RunPaths::bridge_request(dir, id), RunPaths::bridge_response(dir, id));
    let op = move || -> io::Result<()> {
        if !std::fs::symlink_metadata(&resp).is_ok_and(|m| m.is_file()) {
            return Ok(());
        }
        if regular {
            let Ok(lock) = fsutil::open_read(&req) else { return Ok(()) };
            if !matches!(fsutil::flock(&lock, true), Ok(true)) {
                return Ok(());
            }
            return fsutil::remove_if_exists(&req);
        }
        let Ok(md) = std::fs::symlink_metadata(&req) else { return Ok(()) };
        if md.is_file() {
            return Ok(()); // replaced by a regular file meanwhile: the next sweep reads it
        }
        let removed = if md.is_dir() { std::fs::remove_dir(&req) } else { std::fs::remove_file(&req) };
        match removed {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                tracing::warn!(path = %req.display(), error = %e,
                    "cannot remove a bridge request that is not a regular file; answered once, ignored from now on");
                Ok(())
            }
            _ => Ok(()),
        }
    };
    if let Err(e) = w.then(format!("remove answered bridge request {id}"), Box::new(op)) {
        tracing::warn!(request = id, error = %e, "cannot remove an answered bridge request");
    }
}

/// An atomic write on a worker thread that waits out capacity errors
/// (PROTOCOL §11) through the writer's rule: the payload stays in memory and
/// is retried every second, on this thread, never on the loop's.
fn write_waiting(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    Writer::new().write_waiting(path, bytes, durable, Duration::from_secs(1)).inspect_err(|e| {
        tracing::error!(path = %path.display(), error = %e, "cannot write a bridge file");
    })
}
