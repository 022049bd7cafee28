//! Servicing the external-job bridge (PROTOCOL §8.2) for every active run.
//!
//! The loop only looks at files and claims; every provider operation runs on
//! its own worker thread with its time limit and reports back through the
//! loop's channel (`Hint::BridgeDone`). A start is claimed by renaming a
//! complete `<id>.claim.tmp-<uuid>/` to `<id>.claim`; its `handle.json` is
//! saved before the response and `completed.json` is kept as a tombstone, so
//! no crash or restart ever dispatches the same start twice.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::hint::Hint;
use super::part::Env;
use super::watch::Watch;
use crate::protocol::bridge::{parse_request, Failure, FailureCode, Handle, Operation, Request, MAX_REQUEST_BYTES};
use crate::protocol::ids::BridgeRequestId;
use crate::providers::{self, Providers};
use crate::store::dirfd::{DirFd, Kind};
use crate::store::fsutil::{self};
use crate::store::layout::{ClaimPaths, RunPaths, BRIDGE_REQUESTS, CLAIM_SUFFIX, CLAIM_TMP_INFIX};
use crate::store::{Layout, RunId, Writer};

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
/// Bytes of request files read per loop turn, over all runs (each file
/// counts at least `READ_MIN_CHARGE`): a flood of 4 MiB requests is read a
/// slice per turn, and the loop's other work runs between the slices.
const READ_BUDGET: u64 = 8 * 1024 * 1024;
const READ_MIN_CHARGE: u64 = 4096;
/// Requests left alone remembered at most (`LeftAlone`); beyond that, new
/// ones are read again at each sweep, within the read budget.
const MAX_LEFT_ALONE: usize = 65_536;

/// Who we are, as written into `owner.json`.
#[derive(Clone)]
struct Me {
    pid: u32,
    hostname: String,
    identity: Option<String>,
}

pub struct Bridge {
    tx: Sender<Hint>,
    me: Me,
    inflight: HashSet<RequestKey>,
    dirty: BTreeSet<String>,
    next_full: Instant,
    retry_at: HashMap<RequestKey, Instant>,
    /// Runs whose `external-job-requests/` is watched.
    watched: HashSet<String>,
    /// Runs whose directory is watched (native events only) until their
    /// `external-job-requests/` appears: the runner makes it with its first
    /// request, which is then served on its event, not on the next sweep.
    awaiting: HashSet<String>,
    /// Runs of ours whose request has no external-job step: they never write
    /// a bridge request, so their directory is not watched (perf: each of
    /// the runner's writes there would wake the watcher). The once-a-second
    /// sweep still looks at them.
    quiet: HashSet<String>,
    launched: HashMap<String, bool>,
    /// Request entries that are not regular files and could not be removed
    /// (a non-empty directory): answered once, then skipped while the same
    /// entry (device, inode) stays in place.
    refused: HashSet<(RequestKey, EntryId)>,
    /// Requests answered on the loop whose response, or what follows it,
    /// still waits in the writer for space: not answered again meanwhile.
    /// A non-regular entry carries its (device, inode), to be `refused` if
    /// it is still in place once the writer is done.
    deferred: HashMap<RequestKey, Option<EntryId>>,
    /// Requests of runs we did not launch, for providers we lack (§8.2:
    /// left alone), by run and request id, with the file's identity when
    /// it was read: not read, parsed and hashed again while it stays the same.
    left_alone: HashMap<String, HashMap<String, FileId>>,
    left_alone_len: usize,
    /// What is left of this turn's `READ_BUDGET`.
    budget: u64,
}

/// One bridge request: the run it is in and its id (its file name without `.json`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct RequestKey {
    run_id: String,
    id: String,
}

impl RequestKey {
    fn new(run_id: &str, id: &str) -> RequestKey {
        RequestKey { run_id: run_id.to_string(), id: id.to_string() }
    }
}

/// Which file a directory entry is: its device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct EntryId {
    dev: u64,
    ino: u64,
}

impl EntryId {
    fn of(md: &std::fs::Metadata) -> EntryId {
        EntryId { dev: md.dev(), ino: md.ino() }
    }
}

/// A request file's identity from its `lstat` before the read: a file
/// replaced (rename) or written again (size, times) no longer matches.
#[derive(Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileId {
    fn of(md: &std::fs::Metadata) -> FileId {
        FileId {
            dev: md.dev(),
            ino: md.ino(),
            size: md.len(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
            ctime_ns: md.ctime() as i128 * 1_000_000_000 + md.ctime_nsec() as i128,
        }
    }
}

impl Bridge {
    pub fn new(tx: Sender<Hint>) -> Bridge {
        let pid = std::process::id();
        Bridge {
            tx,
            me: Me { pid, hostname: crate::platform::hostname(), identity: crate::platform::start_identity(pid) },
            inflight: HashSet::new(),
            dirty: BTreeSet::new(),
            next_full: Instant::now(),
            retry_at: HashMap::new(),
            watched: HashSet::new(),
            awaiting: HashSet::new(),
            quiet: HashSet::new(),
            launched: HashMap::new(),
            refused: HashSet::new(),
            deferred: HashMap::new(),
            left_alone: HashMap::new(),
            left_alone_len: 0,
            budget: READ_BUDGET,
        }
    }

    /// The providers were rebuilt from a reloaded configuration (operations
    /// in flight keep the provider they started with): sweep everything now.
    pub fn providers_changed(&mut self) {
        self.next_full = Instant::now();
        // A provider added now may serve what was left alone.
        self.left_alone.clear();
        self.left_alone_len = 0;
    }

    /// A file event in a run's `external-job-requests/`.
    pub fn hint(&mut self, run_id: String) {
        self.dirty.insert(run_id);
    }

    /// A worker finished (or a recovery lookup failed and should be retried later).
    pub fn done(&mut self, run_id: String, id: String, retry: bool) {
        let key = RequestKey { run_id: run_id.clone(), id };
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
    /// Answers written on the loop go through `w`, the daemon's writer.
    /// `ours`: the runs this daemon supervises; `foreign`: other hosts' active runs (§14).
    pub fn turn<'a>(
        &mut self,
        env: &mut Env,
        ours: impl Iterator<Item = &'a RunId>,
        foreign: impl Iterator<Item = &'a RunId>,
    ) {
        let Env { w, layout, watch, providers, .. } = env;
        let ours: HashSet<&str> = ours.map(|r| r.as_str()).collect();
        let mut running = ours.clone();
        running.extend(foreign.map(|r| r.as_str()));
        let now = Instant::now();
        if now >= self.next_full {
            self.dirty.extend(running.iter().map(|s| s.to_string()));
            self.next_full = now + FULL_SWEEP;
        }
        self.watched.retain(|r| {
            let keep = running.contains(r.as_str());
            if let (false, Some(id)) = (keep, RunId::parse(r)) {
                watch.remove(&RunPaths::bridge_requests(&layout.run_dir(&id)));
            }
            keep
        });
        self.awaiting.retain(|r| {
            let keep = running.contains(r.as_str());
            if let (false, Some(id)) = (keep, RunId::parse(r)) {
                watch.remove(&layout.run_dir(&id));
            }
            keep
        });
        self.quiet.retain(|r| running.contains(r.as_str()));
        if watch.is_native() {
            for r in &running {
                if !self.watched.contains(*r) && !self.awaiting.contains(*r) && !self.quiet.contains(*r) {
                    self.await_requests(layout, r, watch, ours.contains(r));
                }
            }
        }
        self.launched.retain(|r, _| running.contains(r.as_str()));
        self.retry_at.retain(|k, _| running.contains(k.run_id.as_str()));
        self.refused.retain(|(k, _)| running.contains(k.run_id.as_str()));
        if w.is_idle() {
            self.settle_deferred(layout);
        }
        self.deferred.retain(|k, _| running.contains(k.run_id.as_str()));
        self.left_alone.retain(|r, _| running.contains(r.as_str()));
        self.left_alone_len = self.left_alone.values().map(HashMap::len).sum();
        self.budget = READ_BUDGET;
        for run_id in std::mem::take(&mut self.dirty) {
            let Some(id) = RunId::parse(&run_id).filter(|_| running.contains(run_id.as_str())) else { continue };
            // This turn's reading is done: the rest waits for the next turn, at once.
            if self.budget == 0 || self.sweep(w, layout, providers, &id, watch) {
                self.dirty.insert(run_id);
            }
        }
    }

    /// Watch a run that has just started (or was adopted, or is another
    /// host's) for its `external-job-requests/`: its directory until that
    /// appears (`watch::classify` turns its creation into a hint), and a
    /// sweep now, which watches the requests directory if it is there
    /// already. Watches that cannot be added (the inotify limit) leave the
    /// run to the sweep once a second.
    fn await_requests(&mut self, layout: &Layout, run_id: &str, watch: &mut Watch, ours: bool) {
        let Some(id) = RunId::parse(run_id) else { return };
        let dir = layout.run_dir(&id);
        // Never a watch through a run directory replaced by a symbolic link (§3).
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return;
        }
        if ours && !may_ask_the_bridge(&dir) {
            self.quiet.insert(run_id.to_string());
            return;
        }
        watch.add(&dir);
        self.awaiting.insert(run_id.to_string());
        self.dirty.insert(run_id.to_string());
    }

    /// One sweep of one run. True when entries were left for the next turn.
    fn sweep(
        &mut self,
        w: &mut Writer,
        layout: &Layout,
        providers: &Providers,
        run_id: &RunId,
        watch: &mut Watch,
    ) -> bool {
        let dir = layout.run_dir(run_id);
        // A run is its directory: a run directory replaced by a symbolic
        // link (or anything but a directory) is never followed (§3).
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return false;
        }
        let run_id = run_id.as_str();
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
        // Watched before it is listed: a request written in between has its event.
        if self.watched.insert(run_id.to_string()) {
            watch.add(&reqdir);
            if self.awaiting.remove(run_id) {
                watch.remove(&dir);
            }
        }
        // Listed through descriptors opened O_NOFOLLOW|O_DIRECTORY from the
        // run directory down: a directory swapped for a link since the checks
        // above is not listed.
        let listed = DirFd::open(&dir).and_then(|d| d.open_sub(BRIDGE_REQUESTS)).and_then(|d| Listing::of(&d));
        let listing = match listed {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return false,
            Err(e) => {
                tracing::warn!(run_id, error = %e, path = %reqdir.display(), "cannot list bridge requests");
                return false;
            }
        };
        let Listing { requests, mut claims, tmps } = listing;
        let mut taken = 0;
        let mut left = 0;
        let mut capped = false;
        claims.sort();
        for id in &claims {
            let key = RequestKey::new(run_id, id);
            if self.inflight.contains(&key)
                || self.deferred.contains_key(&key)
                || ClaimPaths::completed(&RunPaths::bridge_claim(&dir, id)).exists()
            {
                continue; // finished claims are skipped, not counted
            }
            if taken >= PER_SWEEP || self.inflight.len() >= MAX_INFLIGHT {
                capped |= self.inflight.len() >= MAX_INFLIGHT;
                left += 1;
                continue;
            }
            if self.recover_claim(w, providers, run_id, &dir, id) {
                taken += 1;
            }
        }
        for t in tmps {
            self.clean_tmp_claim(&t);
        }
        let (todo, unread) = self.waiting(run_id, &dir, requests);
        left += unread;
        for Waiting { id, parsed, mtime, file, .. } in todo {
            if taken >= PER_SWEEP || self.inflight.len() >= MAX_INFLIGHT {
                capped |= self.inflight.len() >= MAX_INFLIGHT;
                left += 1;
                continue;
            }
            taken += 1;
            self.take_request(w, providers, run_id, &dir, &id, parsed, (mtime, file));
        }
        if taken > 0 || left > 0 {
            tracing::debug!(run_id, taken, left, in_flight = self.inflight.len(), "bridge sweep");
        }
        // At the in-flight cap, completions wake us; otherwise come back at once.
        left > 0 && !capped
    }

    /// Read the waiting requests not in flight, oldest file first, within
    /// what is left of the turn's read budget; return them in the order
    /// they are taken (starts first, then oldest first, so a flood of
    /// status polls never starves a start), and how many were left unread.
    /// A request left alone before and unchanged since is not read again.
    fn waiting(&mut self, run_id: &str, dir: &Path, requests: Vec<String>) -> (Vec<Waiting>, usize) {
        let known = self.left_alone.remove(run_id).unwrap_or_default();
        let mut alone = HashMap::new();
        let mut found = Vec::new();
        for id in requests {
            let key = RequestKey::new(run_id, &id);
            if self.inflight.contains(&key) || self.deferred.contains_key(&key) {
                continue;
            }
            let path = RunPaths::bridge_request(dir, &id);
            let Ok(md) = std::fs::symlink_metadata(&path) else { continue };
            if self.refused.contains(&(RequestKey::new(run_id, &id), EntryId::of(&md))) {
                continue;
            }
            let file = FileId::of(&md);
            if known.get(&id) == Some(&file) {
                alone.insert(id, file);
                continue;
            }
            found.push((md.mtime() * 1000 + md.mtime_nsec() / 1_000_000, id, md));
        }
        // Entries whose file is gone or changed are forgotten.
        self.left_alone_len -= known.len() - alone.len();
        if !alone.is_empty() {
            self.left_alone.insert(run_id.to_string(), alone);
        }
        found.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let mut todo: Vec<Waiting> = Vec::new();
        let mut unread = 0;
        for (mtime, id, md) in found {
            if self.budget == 0 {
                unread += 1;
                continue;
            }
            let file = FileId::of(&md);
            let path = RunPaths::bridge_request(dir, &id);
            if md.is_file() {
                let charge = md.len().clamp(READ_MIN_CHARGE, MAX_REQUEST_BYTES + 1);
                self.budget = self.budget.saturating_sub(charge);
            }
            let parsed = if !md.is_file() {
                Err(format!("{} is not a regular file; write requests as regular files", path.display()))
            } else {
                match fsutil::read_nofollow(&path, MAX_REQUEST_BYTES + 1) {
                    Ok(b) if b.len() as u64 > MAX_REQUEST_BYTES => {
                        Err(format!("the request is larger than {MAX_REQUEST_BYTES} bytes; shorten the prompt"))
                    }
                    Ok(b) => parse_request(&b, &id, run_id).map_err(|e| e.to_string()),
                    Err(_) => continue, // gone meanwhile (another servicer)
                }
            };
            let is_start = matches!(&parsed, Ok(r) if r.operation.is_dispatch());
            let created = parsed.as_ref().map(|r| r.created_at).unwrap_or(mtime);
            todo.push(Waiting { later: !is_start, created, id, parsed, mtime, file });
        }
        todo.sort_by(|a, b| (a.later, a.created, &a.id).cmp(&(b.later, b.created, &b.id)));
        (todo, unread)
    }

    /// Remember a request left alone, unchanged since `file` (bounded).
    fn leave_alone(&mut self, run_id: &str, id: &str, file: FileId) {
        if self.left_alone_len >= MAX_LEFT_ALONE {
            return;
        }
        let prev = self.left_alone.entry(run_id.to_string()).or_default().insert(id.to_string(), file);
        if prev.is_none() {
            self.left_alone_len += 1;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn take_request(
        &mut self,
        w: &mut Writer,
        providers: &Providers,
        run_id: &str,
        dir: &Path,
        id: &str,
        parsed: Result<Request, String>,
        (mtime, file): (i64, FileId),
    ) {
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
                let f = providers::failure(FailureCode::MalformedRequest, format!("{}: {msg}", path.display()));
                self.answer_and_remove(w, Answer { run_id, dir, id, op: &op, provider: &prov }, Err(f));
                return;
            }
        };
        let Some((provider, limit)) = providers.get(&req.provider).cloned() else {
            if self.launched_by_us(run_id, dir) {
                let f = providers::failure(
                    FailureCode::ProviderUnavailable,
                    format!(
                        "provider `{}` is not configured in this runspool daemon; add [providers.{}] to its config file and send SIGHUP",
                        req.provider, req.provider
                    ),
                );
                let a = Answer { run_id, dir, id, op: req.operation.as_str(), provider: &req.provider };
                self.answer_and_remove(w, a, Err(f));
            } else {
                // Another host may own the run: its requests are left alone,
                // and not read again while they stay the same.
                self.leave_alone(run_id, id, file);
            }
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
                let key = RequestKey::new(run_id, id);
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
    fn answer_and_remove(&mut self, w: &mut Writer, a: Answer<'_>, r: Result<Handle, Failure>) {
        let Answer { run_id, dir, id, op, provider } = a;
        let path = &RunPaths::bridge_request(dir, id);
        let lock = match fsutil::open_read(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => return self.answer_non_regular(w, a, r),
            Err(_) => return,
        };
        if !matches!(fsutil::flock(&lock, true), Ok(true)) {
            return;
        }
        match respond_in_loop(w, dir, id, op, provider, r) {
            Ok(true) => {
                let _ = fsutil::remove_if_exists(path);
            }
            Ok(false) => {
                // Removed once the response lands, under the lock taken again then.
                drop(lock);
                remove_answered(w, dir, id, true);
                self.deferred.insert(RequestKey::new(run_id, id), None);
            }
            Err(_) => {}
        }
    }

    /// A request entry that is not a regular file (FIFO, socket, device,
    /// symlink, directory) has no lock to take and nothing to read: answer it,
    /// then unlink it (`rmdir` for a directory, which removes only an empty
    /// one). What cannot be removed is remembered and not answered again.
    fn answer_non_regular(&mut self, w: &mut Writer, a: Answer<'_>, r: Result<Handle, Failure>) {
        let Answer { run_id, dir, id, op, provider } = a;
        let path = &RunPaths::bridge_request(dir, id);
        let Ok(md) = std::fs::symlink_metadata(path) else { return };
        if md.is_file() {
            return; // replaced by a regular file meanwhile: the next sweep reads it
        }
        match respond_in_loop(w, dir, id, op, provider, r) {
            Ok(true) => {}
            Ok(false) => {
                remove_answered(w, dir, id, false);
                self.deferred.insert(RequestKey::new(run_id, id), Some(EntryId::of(&md)));
                return;
            }
            Err(_) => return,
        }
        let removed = if md.is_dir() { std::fs::remove_dir(path) } else { std::fs::remove_file(path) };
        if let Err(e) = removed {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(run_id, request = id, path = %path.display(), error = %e,
                    "cannot remove a bridge request that is not a regular file; answered once, ignored from now on");
                self.refused.insert((RequestKey::new(run_id, id), EntryId::of(&md)));
            }
        }
    }

    /// The writer has landed every deferred answer (and run what follows
    /// each): forget them; a non-regular entry still in place could not be
    /// removed, so it is answered once and ignored from now on, as when its
    /// answer is written at once (`answer_non_regular`).
    fn settle_deferred(&mut self, layout: &Layout) {
        for (key, entry) in self.deferred.drain() {
            let Some(entry) = entry else { continue };
            let Some(rid) = RunId::parse(&key.run_id) else { continue };
            let path = RunPaths::bridge_request(&layout.run_dir(&rid), &key.id);
            if std::fs::symlink_metadata(&path).is_ok_and(|m| EntryId::of(&m) == entry) {
                self.refused.insert((key, entry));
            }
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

/// A request the loop answers itself (no provider involved): whose, where,
/// and what it asked, for the response.
#[derive(Clone, Copy)]
struct Answer<'a> {
    run_id: &'a str,
    dir: &'a Path,
    id: &'a str,
    op: &'a str,
    provider: &'a str,
}

/// The entries of a run's `external-job-requests/` by kind; dot names and
/// names outside the grammar are not looked at.
struct Listing {
    requests: Vec<String>,
    claims: Vec<String>,
    tmps: Vec<PathBuf>,
}

impl Listing {
    fn of(d: &DirFd) -> io::Result<Listing> {
        let mut l = Listing { requests: Vec::new(), claims: Vec::new(), tmps: Vec::new() };
        for name in d.names()? {
            if name.starts_with('.') {
                continue;
            }
            if let Some(stem) = name.strip_suffix(".json") {
                if BridgeRequestId::is_valid(stem) {
                    l.requests.push(stem.to_string());
                }
            } else if !d.kind(&name).is_ok_and(|k| k == Kind::Dir) {
                // A claim is a directory of ours; a file or a symlink (to a
                // directory anywhere) by that name is none: never answered,
                // never written through.
            } else if let Some(stem) = name.strip_suffix(CLAIM_SUFFIX) {
                l.claims.push(stem.to_string());
            } else if name.contains(CLAIM_TMP_INFIX) {
                l.tmps.push(d.path().join(&name));
            }
        }
        Ok(l)
    }
}

/// A request file waiting in a sweep: starts first (`later` false), then oldest first.
struct Waiting {
    later: bool,
    created: i64,
    id: String,
    parsed: Result<Request, String>,
    mtime: i64,
    file: FileId,
}

mod claims;
mod work;

use work::{remove_answered, respond_in_loop, spawn_worker, Work};

/// Can this run of ours write bridge requests: does its request have an
/// external-job step? Read from the claimed request.json (bounded, not
/// followed); anything unreadable counts as yes, so the run is watched. A
/// key spelled with JSON escapes reads as no: that run is then served by the
/// sweep, as every run is when watching is not native.
fn may_ask_the_bridge(dir: &std::path::Path) -> bool {
    match fsutil::read_nofollow(&RunPaths::request(dir), crate::protocol::request::MAX_REQUEST_BYTES) {
        Ok(raw) => raw.windows(13).any(|w| w == b"\"externalJob\""),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;
    use crate::daemon::part::Effect;
    use crate::daemon::spool::intake::{Gate, Intake};

    #[test]
    fn a_request_for_a_provider_not_configured_is_answered_and_removed() {
        let mut r = Root::new();
        let id = r.drop_request("bridge-1", "true");
        let mut out = Vec::new();
        Intake::default().turn(&mut r.env(), Gate::Open, &mut out);
        assert!(matches!(&out[..], [Effect::Queue(..)]), "{out:?}");
        let dir = r.layout.run_dir(&id);
        fsutil::mkdir_private_all(&RunPaths::bridge_requests(&dir)).unwrap();
        let req = serde_json::json!({"id": "q1", "operation": "status", "provider": "nowhere",
            "providerJobId": "7", "createdAt": crate::now_ms()});
        std::fs::write(RunPaths::bridge_request(&dir, "q1"), serde_json::to_vec(&req).unwrap()).unwrap();

        let (tx, _rx) = std::sync::mpsc::channel();
        let mut bridge = Bridge::new(tx);
        bridge.hint(id.to_string());
        assert!(bridge.wants_turn());
        bridge.turn(&mut r.env(), [&id].into_iter(), std::iter::empty());
        assert!(r.w.flush());
        let resp: Value =
            serde_json::from_slice(&std::fs::read(RunPaths::bridge_response(&dir, "q1")).unwrap()).unwrap();
        assert_eq!(resp["id"], "q1");
        assert_eq!(
            (resp["ok"].as_bool(), resp["code"].as_str()),
            (Some(false), Some(FailureCode::ProviderUnavailable.as_str())),
            "{resp}"
        );
        assert!(resp["message"].as_str().is_some_and(|m| m.contains("[providers.nowhere]")), "{resp}");
        assert!(!RunPaths::bridge_request(&dir, "q1").exists(), "an answered request is removed");
        assert_eq!(bridge.in_flight(), 0);
    }

    #[test]
    fn runs_not_bridged_are_not_swept() {
        let mut r = Root::new();
        let id = r.drop_request("bridge-2", "true");
        let mut out = Vec::new();
        Intake::default().turn(&mut r.env(), Gate::Open, &mut out);
        let dir = r.layout.run_dir(&id);
        fsutil::mkdir_private_all(&RunPaths::bridge_requests(&dir)).unwrap();
        let req = serde_json::json!({"id": "q2", "operation": "status", "provider": "nowhere",
            "providerJobId": "7", "createdAt": crate::now_ms()});
        std::fs::write(RunPaths::bridge_request(&dir, "q2"), serde_json::to_vec(&req).unwrap()).unwrap();
        let (tx, _rx) = std::sync::mpsc::channel();
        let mut bridge = Bridge::new(tx);
        bridge.hint(id.to_string());
        // Not among the bridged runs (its dead runner is being cleaned up, say).
        bridge.turn(&mut r.env(), std::iter::empty(), std::iter::empty());
        assert!(RunPaths::bridge_request(&dir, "q2").exists());
        assert!(!RunPaths::bridge_response(&dir, "q2").exists());
    }
}
