//! Start claims (PROTOCOL §8.2): committing one, taking over a dead
//! servicer's, removing one never committed.

use std::path::Path;
use std::time::{Duration, Instant};

use super::work::{complete_after, respond_in_loop, spawn_worker, to_json, Work};
use super::{Bridge, RequestKey};
use crate::protocol::bridge::{ClaimOwner, FailureCode, Handle, Operation, Request, MAX_REQUEST_BYTES};
use crate::providers::{self, Provider, Providers};
use crate::store::fsutil::{self, is_capacity};
use crate::store::layout::{ClaimPaths, RunPaths};
use crate::store::Writer;

impl Bridge {
    pub(super) fn claim_start(
        &mut self,
        run_id: &str,
        dir: &Path,
        req: Request,
        provider: std::sync::Arc<dyn Provider>,
        limit: Duration,
    ) {
        let reqdir = RunPaths::bridge_requests(dir);
        let id = req.id.clone();
        let path = RunPaths::bridge_request(dir, &id);
        let claim = RunPaths::bridge_claim(dir, &id);
        if claim.exists() {
            // Already claimed (a servicer died before removing the request): the claim owns it.
            let _ = fsutil::remove_if_exists(&path);
            return;
        }
        let tmp = RunPaths::bridge_claim_tmp(dir, &id, &uuid::Uuid::new_v4().to_string());
        let now = crate::now_ms();
        let owner = ClaimOwner {
            version: 1,
            pid: self.me.pid,
            hostname: self.me.hostname.clone(),
            claimed_at: now,
            process_start_identity: self.me.identity.clone(),
        };
        let mut copy = req.clone();
        copy.claimed_at = Some(now);
        let made = fsutil::mkdir_private(&tmp)
            .and_then(|_| fsutil::write_atomic(&ClaimPaths::owner(&tmp), &to_json(&owner), true))
            .and_then(|_| fsutil::write_atomic(&ClaimPaths::request(&tmp), &to_json(&copy), true));
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&tmp);
            tracing::warn!(run_id, request = %id, error = %e, capacity = is_capacity(&e), "cannot prepare a start claim; will retry");
            return;
        }
        match crate::platform::rename_noreplace(&tmp, &claim) {
            Ok(()) => {
                let _ = fsutil::fsync_dir(&reqdir);
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) {
                    tracing::info!(run_id, request = %id, "start already claimed by another servicer");
                    let _ = fsutil::remove_if_exists(&path);
                } else {
                    tracing::warn!(run_id, request = %id, error = %e, "cannot commit a start claim; will retry");
                }
                return;
            }
        }
        let _ = fsutil::remove_if_exists(&path);
        tracing::info!(run_id, request = %id, provider = %req.provider, op = req.operation.as_str(), "claimed a dispatch request");
        let key = RequestKey::new(run_id, &id);
        self.inflight.insert(key.clone());
        let work = Work {
            tx: self.tx.clone(),
            run_id: run_id.into(),
            dir: dir.to_path_buf(),
            id: id.clone(),
            provider,
            limit,
        };
        if !spawn_worker(run_id, &id, move || work.start(req)) {
            self.inflight.remove(&key);
        }
    }

    /// Is the servicer that holds `claim` (its `owner.json`, if readable)
    /// gone, so the claim is ours to finish? Another host's never is.
    fn servicer_gone(&self, claim: &Path, owner: Option<&ClaimOwner>) -> bool {
        match owner {
            Some(o) if o.hostname != self.me.hostname => false, // another host's servicer
            // Ours but no longer in flight: the worker ended without its tombstone.
            Some(o) if o.pid == self.me.pid && o.process_start_identity == self.me.identity => true,
            Some(o) => {
                let alive = crate::platform::pid_alive(o.pid)
                    && (o.process_start_identity.is_none()
                        || crate::platform::start_identity(o.pid) == o.process_start_identity);
                !alive
            }
            None => {
                // owner.json is written before the rename, so this claim is not
                // of our making; give its writer a minute before judging it.
                let age = std::fs::metadata(claim).ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok());
                age.is_some_and(|a| a >= Duration::from_secs(60))
            }
        }
    }

    /// A start claim without `completed.json`. True when we acted on it.
    pub(super) fn recover_claim(
        &mut self,
        w: &mut Writer,
        providers: &Providers,
        run_id: &str,
        dir: &Path,
        id: &str,
    ) -> bool {
        let claim = RunPaths::bridge_claim(dir, id);
        let owner: Option<ClaimOwner> = fsutil::read_nofollow(&ClaimPaths::owner(&claim), 64 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if !self.servicer_gone(&claim, owner.as_ref()) {
            return false;
        }
        let key = RequestKey::new(run_id, id);
        if self.retry_at.get(&key).is_some_and(|t| Instant::now() < *t) {
            return false;
        }
        let dead = owner
            .as_ref()
            .map(|o| format!("pid {} on {}", o.pid, o.hostname))
            .unwrap_or_else(|| "an unknown servicer".into());
        let _ = fsutil::remove_if_exists(&RunPaths::bridge_request(dir, id));
        let handle: Option<Handle> = fsutil::read_nofollow(&ClaimPaths::handle(&claim), 2 * 1024 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let creq: Option<Request> = fsutil::read_nofollow(&ClaimPaths::request(&claim), MAX_REQUEST_BYTES)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let provider_name = creq.as_ref().map(|r| r.provider.clone()).unwrap_or_else(|| "unknown".into());
        // start or follow-up; 0.67 names the abandonment after it (`<op>-dispatch-abandoned`).
        let op = creq.as_ref().map(|r| r.operation).filter(|o| o.is_dispatch()).unwrap_or(Operation::Start);
        if let Some(h) = handle {
            tracing::warn!(run_id, request = id, owner = %dead, job = %h.provider_job_id, "dispatch servicer died after saving the handle: answering with it");
            if !RunPaths::bridge_response(dir, id).exists()
                && respond_in_loop(w, dir, id, op.as_str(), &provider_name, Ok(h)).is_err()
            {
                return true; // answered again at the next sweep
            }
            self.complete_in_loop(w, run_id, id, &claim);
            return true;
        }
        // Take the claim over, so another servicer sees a live owner meanwhile.
        let owner = ClaimOwner {
            version: 1,
            pid: self.me.pid,
            hostname: self.me.hostname.clone(),
            claimed_at: crate::now_ms(),
            process_start_identity: self.me.identity.clone(),
        };
        let _ = fsutil::write_atomic(&ClaimPaths::owner(&claim), &to_json(&owner), true);
        let abandoned = |why: &str| {
            providers::failure(
                FailureCode::dispatch_abandoned(op),
                format!(
                    "the servicer of {op} request {id} ({dead}) died before saving the job handle, and {why}; runspool never dispatches a {op} twice. \
                     Check the engine for a job of run {run_id} and cancel it if it still runs",
                    op = op.as_str()
                ),
            )
        };
        let (Some(creq), Some((provider, limit))) =
            (creq.clone(), creq.as_ref().and_then(|r| providers.get(&r.provider).cloned()))
        else {
            let why = if creq.is_none() {
                format!("its claim copy {} is unreadable", ClaimPaths::request(&claim).display())
            } else {
                format!("provider `{provider_name}` is not configured here to look the job up")
            };
            if respond_in_loop(w, dir, id, op.as_str(), &provider_name, Err(abandoned(&why))).is_ok() {
                self.complete_in_loop(w, run_id, id, &claim);
            }
            return true;
        };
        tracing::warn!(run_id, request = id, owner = %dead, "start servicer died before saving the handle: asking the provider for a job it may have started");
        self.inflight.insert(key.clone());
        let work =
            Work { tx: self.tx.clone(), run_id: run_id.into(), dir: dir.to_path_buf(), id: id.into(), provider, limit };
        let msg = abandoned("the provider finds no job it started for it");
        if !spawn_worker(run_id, id, move || work.recover(creq, msg)) {
            self.inflight.remove(&key);
        }
        true
    }

    /// A claim that never got committed: remove it once its maker is gone.
    pub(super) fn clean_tmp_claim(&self, tmp: &Path) {
        let owner: Option<ClaimOwner> = fsutil::read_nofollow(&ClaimPaths::owner(tmp), 64 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let gone = match owner {
            Some(o) if o.hostname == self.me.hostname => o.pid == self.me.pid || !crate::platform::pid_alive(o.pid),
            Some(_) => false,
            None => std::fs::metadata(tmp)
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|a| a > Duration::from_secs(60)),
        };
        if gone {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }

    /// The tombstone of a claim answered on the loop, behind its response in
    /// the writer; the claim is not looked at again until both have landed.
    fn complete_in_loop(&mut self, w: &mut Writer, run_id: &str, id: &str, claim: &Path) {
        complete_after(w, claim);
        if !w.is_idle() {
            self.deferred.insert(RequestKey::new(run_id, id), None);
        }
    }
}
