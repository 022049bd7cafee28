//! Servicing the external-job bridge (PROTOCOL §8.2) for every active run.
//!
//! The loop only looks at files and claims; every provider operation runs on
//! its own worker thread with its time limit and reports back through the
//! loop's channel (`Hint::BridgeDone`). A start is claimed by renaming a
//! complete `<id>.claim.tmp-<uuid>/` to `<id>.claim`; its `handle.json` is
//! saved before the response and `completed.json` is kept as a tombstone, so
//! no crash or restart ever dispatches the same start twice.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::watch::{Hint, Watch};
use crate::config::Config;
use crate::protocol::bridge::{
    parse_request, validate_handle, ClaimOwner, Completed, Failure, Handle, Operation, Request, Response,
    MAX_REQUEST_BYTES, MAX_REQUEST_ID,
};
use crate::providers::{self, Call, Provider, Providers};
use crate::store::fsutil::{self, is_capacity};
use crate::store::layout::{ClaimPaths, RunPaths, CLAIM_SUFFIX, CLAIM_TMP_INFIX};
use crate::store::Layout;

pub use crate::store::layout::{BRIDGE_REQUESTS as REQUESTS, BRIDGE_RESPONSES as RESPONSES};
/// Request entries taken per run per sweep (§8.2); finished claims are not counted.
pub const PER_SWEEP: usize = 100;
/// Provider operations in flight at once, over all runs; more wait in their files.
const MAX_INFLIGHT: usize = 128;
/// A request file that does not parse may still be a writer's work in progress.
const WRITE_GRACE_MS: i64 = 2000;
/// Every active run is swept at least this often, whatever the watcher says.
const FULL_SWEEP: Duration = Duration::from_secs(1);
/// After a failed lookup for a dead servicer's start, wait this long before asking again.
const RECOVERY_RETRY: Duration = Duration::from_secs(5);

/// Who we are, as written into `owner.json`.
#[derive(Clone)]
struct Me {
    pid: u32,
    hostname: String,
    identity: Option<String>,
}

pub struct Bridge {
    providers: Providers,
    tx: Sender<Hint>,
    me: Me,
    inflight: HashSet<(String, String)>,
    dirty: BTreeSet<String>,
    next_full: Instant,
    retry_at: HashMap<(String, String), Instant>,
    watched: HashSet<String>,
    launched: HashMap<String, bool>,
    /// Request entries that are not regular files and could not be removed
    /// (a non-empty directory): answered once, then skipped while the same
    /// entry (device, inode) stays in place.
    refused: HashSet<(String, String, u64, u64)>,
}

impl Bridge {
    pub fn new(cfg: &Config, tx: Sender<Hint>) -> Bridge {
        let pid = std::process::id();
        // Checks can take seconds (sinfo on an unreachable cluster): never in the loop.
        let checks: Vec<(String, std::sync::Arc<dyn Provider>)> =
            cfg.providers.iter().map(|(name, p)| (name.clone(), providers::build(name, p))).collect();
        let _ = std::thread::Builder::new().name("provider-checks".into()).spawn(move || {
            for (name, p) in checks {
                match p.check() {
                    Ok(what) => tracing::info!(provider = %name, kind = p.kind(), check = %what, "provider ready"),
                    Err(e) => tracing::warn!(provider = %name, error = %e, "provider check failed; its operations will fail until it is fixed"),
                }
            }
        });
        Bridge {
            providers: providers::build_all(cfg),
            tx,
            me: Me { pid, hostname: crate::platform::hostname(), identity: crate::platform::start_identity(pid) },
            inflight: HashSet::new(),
            dirty: BTreeSet::new(),
            next_full: Instant::now(),
            retry_at: HashMap::new(),
            watched: HashSet::new(),
            launched: HashMap::new(),
            refused: HashSet::new(),
        }
    }

    /// A reloaded configuration: operations in flight keep the provider they started with.
    pub fn set_providers(&mut self, cfg: &Config) {
        self.providers = providers::build_all(cfg);
        self.next_full = Instant::now();
    }

    /// The configured provider `name` with its time limit.
    pub fn provider(&self, name: &str) -> Option<(std::sync::Arc<dyn Provider>, Duration)> {
        self.providers.get(name).cloned()
    }

    /// A file event in a run's `external-job-requests/`.
    pub fn hint(&mut self, run_id: String) {
        self.dirty.insert(run_id);
    }

    /// A worker finished (or a recovery lookup failed and should be retried later).
    pub fn done(&mut self, run_id: String, id: String, retry: bool) {
        let key = (run_id.clone(), id);
        self.inflight.remove(&key);
        if retry {
            self.retry_at.insert(key, Instant::now() + RECOVERY_RETRY);
        }
        self.dirty.insert(run_id);
    }

    /// True when a sweep left work behind and the loop should turn again at once.
    pub fn wants_turn(&self) -> bool {
        !self.dirty.is_empty()
    }

    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Sweep the runs that asked for it (and every running run once a second).
    pub fn turn<'a>(&mut self, layout: &Layout, running: impl Iterator<Item = &'a String>, watch: &mut Watch) {
        let running: HashSet<&String> = running.collect();
        let now = Instant::now();
        if now >= self.next_full {
            self.dirty.extend(running.iter().map(|s| s.to_string()));
            self.next_full = now + FULL_SWEEP;
        }
        self.watched.retain(|r| {
            let keep = running.contains(r);
            if !keep {
                watch.remove(&RunPaths::bridge_requests(&layout.run_dir(r)));
            }
            keep
        });
        self.launched.retain(|r, _| running.contains(r));
        self.retry_at.retain(|(r, _), _| running.contains(r));
        self.refused.retain(|(r, ..)| running.contains(r));
        for run_id in std::mem::take(&mut self.dirty) {
            if !running.contains(&run_id) {
                continue;
            }
            if self.sweep(layout, &run_id, watch) {
                self.dirty.insert(run_id);
            }
        }
    }

    /// One sweep of one run. True when entries were left for the next turn.
    fn sweep(&mut self, layout: &Layout, run_id: &str, watch: &mut Watch) -> bool {
        let dir = layout.run_dir(run_id);
        let reqdir = RunPaths::bridge_requests(&dir);
        match fsutil::real_dir(&reqdir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return false,
            Err(e) => {
                // Debug: a step could otherwise fill the journal once a second.
                tracing::debug!(run_id, error = %e, "not sweeping the bridge requests");
                return false;
            }
        }
        // No answer could be written: leave the requests (and the log) alone.
        match fsutil::real_dir(&RunPaths::bridge_responses(&dir)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                tracing::debug!(run_id, error = %e, "not sweeping the bridge requests");
                return false;
            }
            _ => {}
        }
        let rd = match std::fs::read_dir(&reqdir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return false,
            Err(e) => {
                tracing::warn!(run_id, error = %e, path = %reqdir.display(), "cannot list bridge requests");
                return false;
            }
        };
        if self.watched.insert(run_id.to_string()) {
            watch.add(&reqdir);
        }
        let mut requests: Vec<String> = Vec::new();
        let mut claims: Vec<String> = Vec::new();
        let mut tmps: Vec<PathBuf> = Vec::new();
        for e in rd.flatten() {
            let Ok(name) = e.file_name().into_string() else { continue };
            if name.starts_with('.') {
                continue;
            }
            if let Some(stem) = name.strip_suffix(".json") {
                if crate::protocol::is_id(stem, MAX_REQUEST_ID) {
                    requests.push(stem.to_string());
                }
            } else if !e.file_type().is_ok_and(|t| t.is_dir()) {
                // A claim is a directory of ours; a file or a symlink (to a
                // directory anywhere) by that name is none: never answered,
                // never written through.
            } else if let Some(stem) = name.strip_suffix(CLAIM_SUFFIX) {
                claims.push(stem.to_string());
            } else if name.contains(CLAIM_TMP_INFIX) {
                tmps.push(e.path());
            }
        }
        let mut taken = 0;
        let mut left = 0;
        let mut capped = false;
        claims.sort();
        for id in &claims {
            if self.inflight.contains(&(run_id.to_string(), id.clone()))
                || ClaimPaths::completed(&RunPaths::bridge_claim(&dir, id)).exists()
            {
                continue; // finished claims are skipped, not counted
            }
            if taken >= PER_SWEEP || self.inflight.len() >= MAX_INFLIGHT {
                capped |= self.inflight.len() >= MAX_INFLIGHT;
                left += 1;
                continue;
            }
            if self.recover_claim(run_id, &dir, id) {
                taken += 1;
            }
        }
        for t in tmps {
            self.clean_tmp_claim(&t);
        }
        // Read every waiting request: starts go first, then oldest first, so a
        // flood of status polls never starves a start.
        let mut todo: Vec<Waiting> = Vec::new();
        for id in requests {
            if self.inflight.contains(&(run_id.to_string(), id.clone())) {
                continue;
            }
            let path = RunPaths::bridge_request(&dir, &id);
            let Ok(md) = std::fs::symlink_metadata(&path) else { continue };
            if self.refused.contains(&(run_id.to_string(), id.clone(), md.dev(), md.ino())) {
                continue;
            }
            let mtime = md.mtime() * 1000 + md.mtime_nsec() / 1_000_000;
            let parsed = if !md.is_file() {
                Err(format!("{} is not a regular file; write requests as regular files", path.display()))
            } else {
                match fsutil::read_nofollow(&path, MAX_REQUEST_BYTES + 1) {
                    Ok(b) if b.len() as u64 > MAX_REQUEST_BYTES => {
                        Err(format!("the request is larger than {MAX_REQUEST_BYTES} bytes; shorten the prompt"))
                    }
                    Ok(b) => parse_request(&b, &id, run_id),
                    Err(_) => continue, // gone meanwhile (another servicer)
                }
            };
            let is_start = matches!(&parsed, Ok(r) if r.operation.is_dispatch());
            let created = parsed.as_ref().map(|r| r.created_at).unwrap_or(mtime);
            todo.push(Waiting { later: !is_start, created, id, parsed, mtime });
        }
        todo.sort_by(|a, b| (a.later, a.created, &a.id).cmp(&(b.later, b.created, &b.id)));
        for Waiting { id, parsed, mtime, .. } in todo {
            if taken >= PER_SWEEP || self.inflight.len() >= MAX_INFLIGHT {
                capped |= self.inflight.len() >= MAX_INFLIGHT;
                left += 1;
                continue;
            }
            taken += 1;
            self.take_request(run_id, &dir, &id, parsed, mtime);
        }
        if taken > 0 || left > 0 {
            tracing::debug!(run_id, taken, left, in_flight = self.inflight.len(), "bridge sweep");
        }
        // At the in-flight cap, completions wake us; otherwise come back at once.
        left > 0 && !capped
    }

    fn take_request(&mut self, run_id: &str, dir: &Path, id: &str, parsed: Result<Request, String>, mtime: i64) {
        let path = RunPaths::bridge_request(dir, id);
        let req = match parsed {
            Ok(r) => r,
            Err(msg) => {
                if crate::now_ms() - mtime < WRITE_GRACE_MS {
                    return; // maybe still being written; the next full sweep looks again
                }
                let raw: Value = fsutil::read_nofollow(&path, MAX_REQUEST_BYTES)
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or(Value::Null);
                let op = raw.get("operation").and_then(Value::as_str).unwrap_or("unknown").to_string();
                let prov = raw.get("provider").and_then(Value::as_str).unwrap_or("unknown").to_string();
                tracing::warn!(run_id, request = id, error = %msg, "malformed bridge request");
                let f = providers::failure("malformed-request", format!("{}: {msg}", path.display()));
                self.answer_and_remove(run_id, dir, id, &op, &prov, Err(f), &path);
                return;
            }
        };
        let Some((provider, limit)) = self.providers.get(&req.provider).cloned() else {
            if self.launched_by_us(run_id, dir) {
                let f = providers::failure(
                    "provider-unavailable",
                    format!(
                        "provider `{}` is not configured in this runspool daemon; add [providers.{}] to its config file and send SIGHUP",
                        req.provider, req.provider
                    ),
                );
                self.answer_and_remove(run_id, dir, id, req.operation.as_str(), &req.provider, Err(f), &path);
            }
            // Otherwise another host may own the run: its requests are left alone.
            return;
        };
        match req.operation {
            Operation::Start | Operation::FollowUp => self.claim_start(run_id, dir, req, provider, limit),
            _ => {
                // Swapped for something else since the read: the next sweep sees it.
                let Ok(lock) = fsutil::open_read(&path) else { return };
                match fsutil::flock(&lock, true) {
                    Ok(true) => {}
                    _ => return, // another servicer holds it
                }
                // Serviced and removed by someone else between our read and the lock?
                if !path.exists() {
                    return;
                }
                let key = (run_id.to_string(), id.to_string());
                self.inflight.insert(key.clone());
                let work = Work {
                    tx: self.tx.clone(),
                    run_id: run_id.into(),
                    dir: dir.to_path_buf(),
                    id: id.into(),
                    provider,
                    limit,
                };
                if !spawn_worker(run_id, id, move || work.operation(req, lock)) {
                    self.inflight.remove(&key);
                }
            }
        }
    }

    /// Answer in the loop (no provider involved), then remove the request under its lock.
    /// Never blocks: the request is opened through `fsutil::open_regular`.
    #[allow(clippy::too_many_arguments)]
    fn answer_and_remove(
        &mut self,
        run_id: &str,
        dir: &Path,
        id: &str,
        op: &str,
        provider: &str,
        r: Result<Handle, Failure>,
        path: &Path,
    ) {
        let lock = match fsutil::open_read(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                return self.answer_non_regular(run_id, dir, id, op, provider, r, path)
            }
            Err(_) => return,
        };
        if !matches!(fsutil::flock(&lock, true), Ok(true)) {
            return;
        }
        if respond(dir, id, op, provider, r).is_ok() {
            let _ = fsutil::remove_if_exists(path);
        }
    }

    /// A request entry that is not a regular file (FIFO, socket, device,
    /// symlink, directory) has no lock to take and nothing to read: answer it,
    /// then unlink it (`rmdir` for a directory, which removes only an empty
    /// one). What cannot be removed is remembered and not answered again.
    #[allow(clippy::too_many_arguments)]
    fn answer_non_regular(
        &mut self,
        run_id: &str,
        dir: &Path,
        id: &str,
        op: &str,
        provider: &str,
        r: Result<Handle, Failure>,
        path: &Path,
    ) {
        let Ok(md) = std::fs::symlink_metadata(path) else { return };
        if md.is_file() {
            return; // replaced by a regular file meanwhile: the next sweep reads it
        }
        if respond(dir, id, op, provider, r).is_err() {
            return;
        }
        let removed = if md.is_dir() { std::fs::remove_dir(path) } else { std::fs::remove_file(path) };
        if let Err(e) = removed {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(run_id, request = id, path = %path.display(), error = %e,
                    "cannot remove a bridge request that is not a regular file; answered once, ignored from now on");
                self.refused.insert((run_id.to_string(), id.to_string(), md.dev(), md.ino()));
            }
        }
    }

    fn claim_start(
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
        let key = (run_id.to_string(), id.clone());
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

    /// A start claim without `completed.json`. True when we acted on it.
    fn recover_claim(&mut self, run_id: &str, dir: &Path, id: &str) -> bool {
        let claim = RunPaths::bridge_claim(dir, id);
        let owner: Option<ClaimOwner> = fsutil::read_nofollow(&ClaimPaths::owner(&claim), 64 * 1024)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        match &owner {
            Some(o) if o.hostname != self.me.hostname => return false, // another host's servicer
            Some(o) if o.pid == self.me.pid && o.process_start_identity == self.me.identity => {
                // Ours but no longer in flight: the worker ended without its tombstone.
            }
            Some(o) => {
                let alive = crate::platform::pid_alive(o.pid)
                    && (o.process_start_identity.is_none()
                        || crate::platform::start_identity(o.pid) == o.process_start_identity);
                if alive {
                    return false;
                }
            }
            None => {
                // owner.json is written before the rename, so this claim is not
                // of our making; give its writer a minute before judging it.
                let age = std::fs::metadata(&claim).ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok());
                if age.is_none_or(|a| a < Duration::from_secs(60)) {
                    return false;
                }
            }
        }
        let key = (run_id.to_string(), id.to_string());
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
            if !RunPaths::bridge_response(dir, id).exists() {
                let _ = respond(dir, id, op.as_str(), &provider_name, Ok(h));
            }
            let _ = write_completed(&claim);
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
                &format!("{}-dispatch-abandoned", op.as_str()),
                format!(
                    "the servicer of {op} request {id} ({dead}) died before saving the job handle, and {why}; runspool never dispatches a {op} twice. \
                     Check the engine for a job of run {run_id} and cancel it if it still runs",
                    op = op.as_str()
                ),
            )
        };
        let (Some(creq), Some((provider, limit))) =
            (creq.clone(), creq.as_ref().and_then(|r| self.providers.get(&r.provider).cloned()))
        else {
            let why = if creq.is_none() {
                format!("its claim copy {} is unreadable", ClaimPaths::request(&claim).display())
            } else {
                format!("provider `{provider_name}` is not configured here to look the job up")
            };
            let _ = respond(dir, id, op.as_str(), &provider_name, Err(abandoned(&why)));
            let _ = write_completed(&claim);
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
    fn clean_tmp_claim(&self, tmp: &Path) {
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

    /// Runs this daemon launched: claimed from our spool (request.json) and
    /// run by a runner on this host. Only those get `provider-unavailable`.
    fn launched_by_us(&mut self, run_id: &str, dir: &Path) -> bool {
        if let Some(v) = self.launched.get(run_id) {
            return *v;
        }
        let v = crate::store::run::claimed(dir)
            && match crate::store::run::read_status(dir) {
                Ok(Some(s)) => s.runner.as_ref().is_none_or(|r| r.hostname == self.me.hostname),
                _ => false,
            };
        self.launched.insert(run_id.to_string(), v);
        v
    }
}

/// A request file waiting in a sweep: starts first (`later` false), then oldest first.
struct Waiting {
    later: bool,
    created: i64,
    id: String,
    parsed: Result<Request, String>,
    mtime: i64,
}

/// One provider operation on a worker thread.
struct Work {
    tx: Sender<Hint>,
    run_id: String,
    dir: PathBuf,
    id: String,
    provider: std::sync::Arc<dyn Provider>,
    limit: Duration,
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
                "provider-error",
                format!("provider `{}` panicked during {}", req.provider, op.as_str()),
            ))
        })?;
        match r {
            Some(h) => match validate_handle(&h, op) {
                Ok(()) => Ok(Some(h)),
                Err(e) => Err(providers::failure(
                    "provider-error",
                    format!("provider `{}` returned an invalid handle for {}: {e}", req.provider, op.as_str()),
                )),
            },
            None => Ok(None),
        }
    }

    fn start(self, req: Request) {
        let claim = RunPaths::bridge_claim(&self.dir, &self.id);
        let r = self.call(req.operation, &req, false).map(|h| h.expect("call returns a handle"));
        if let Ok(h) = &r {
            // The handle is durable before anyone hears of it (§8.2).
            if let Err(e) = write_retrying(&ClaimPaths::handle(&claim), &to_json(h), true) {
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

    fn recover(self, req: Request, abandoned: Failure) {
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
                let _ = write_retrying(&ClaimPaths::handle(&claim), &to_json(&h), true);
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

    fn operation(self, req: Request, lock: File) {
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
fn spawn_worker(run_id: &str, id: &str, f: impl FnOnce() + Send + 'static) -> bool {
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

fn to_json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(v).unwrap_or_default()
}

fn write_completed(claim: &Path) -> io::Result<()> {
    write_retrying(&ClaimPaths::completed(claim), &to_json(&Completed { completed_at: crate::now_ms() }), true)
}

/// Write the response file for request `id`.
fn respond(dir: &Path, id: &str, op: &str, provider: &str, r: Result<Handle, Failure>) -> io::Result<()> {
    let now = crate::now_ms();
    let resp = match r {
        Ok(h) => Response::ok(id, op, provider, h, now),
        Err(f) => Response::err(id, op, provider, f, now),
    };
    let rdir = RunPaths::bridge_responses(dir);
    fsutil::mkdir_private(&rdir)?;
    fsutil::real_dir(&rdir)?;
    write_retrying(&RunPaths::bridge_response(dir, id), &to_json(&resp), false)
}

/// An atomic write that waits out capacity errors (PROTOCOL §11): the payload
/// stays in memory and is retried every second. Other errors are returned.
fn write_retrying(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let mut logged = false;
    loop {
        match fsutil::write_atomic(path, bytes, durable) {
            Ok(()) => return Ok(()),
            Err(e) if is_capacity(&e) => {
                if !logged {
                    tracing::warn!(path = %path.display(), error = %e, "storage full: keeping the bridge file in memory and retrying every second");
                    logged = true;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot write a bridge file");
                return Err(e);
            }
        }
    }
}
