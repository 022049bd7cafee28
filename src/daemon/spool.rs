//! The spool (PROTOCOL §2): scan, claim exactly once, reject with a reason.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::platform::rename_noreplace;
use crate::protocol::is_id;
use crate::protocol::request::{self, Context, Rejection, Request, MAX_REQUEST_BYTES};
use crate::protocol::status::{State, Status, StepState};
use crate::store::fsutil::{self, fsync_dir, is_capacity, mkdir_private};
use crate::store::layout::RunPaths;
use crate::store::{index, results, run, Layout, Writer};

/// How long a file that does not parse may still be a writer's work in progress.
const WRITE_GRACE_MS: i64 = 2000;

/// What a spool entry name means.
#[derive(Debug, PartialEq, Eq)]
pub enum Name {
    /// `<name>.json` with `<name>` in the grammar: a request to claim.
    Candidate,
    /// A dot name, or a grammatical name not ending in `.json`: never read.
    Ignored,
    /// Neither grammatical nor a dot name: moved to rejected/ (`bad-name`).
    Bad,
}

pub fn classify_name(name: &str) -> Name {
    if name.starts_with('.') {
        return Name::Ignored;
    }
    if let Some(stem) = name.strip_suffix(".json") {
        if is_id(stem, 200) {
            return Name::Candidate;
        }
    }
    if is_id(name, 200) {
        Name::Ignored
    } else {
        Name::Bad
    }
}

pub enum Outcome {
    Claimed(Box<Status>),
    Rejected,
    /// Left in place for a later look (busy, still being written, raced).
    Later,
    /// A capacity error: stop claiming until storage recovers.
    Capacity(io::Error),
    /// Committed (the run directory owns the request) but its queued status
    /// could not be written: the caller finishes the run by its directory
    /// (`finish_half_claim`), never by the spool name, which is gone.
    Unfinished {
        run_id: String,
        error: io::Error,
    },
}

pub struct Claimer<'a> {
    pub layout: &'a Layout,
    pub w: &'a mut Writer,
    pub ctx: &'a dyn Context,
    pub grace: &'a mut Grace,
}

/// When the daemon first saw each unparsable entry in its current form
/// (device, inode, size, mtime). The 2 s grace for writers still at work
/// runs from the mtime or from that first sighting, whichever is earlier:
/// an mtime in the future (a clock skew, a `touch -d`) cannot keep an
/// unparsable file from its rejection, and the daemon never rereads it
/// twice a second forever.
#[derive(Default)]
pub struct Grace {
    first_seen: std::collections::HashMap<String, (FileId, std::time::Instant)>,
}

impl Grace {
    /// Is the entry `name`, now `id`, still within its grace?
    fn pending(&mut self, name: &str, id: FileId, mtime_ms: i64) -> bool {
        let now = std::time::Instant::now();
        let seen = match self.first_seen.get(name) {
            Some((prev, at)) if *prev == id => *at,
            _ => {
                self.first_seen.insert(name.to_string(), (id, now));
                now
            }
        };
        let by_mtime = crate::now_ms() - mtime_ms < WRITE_GRACE_MS;
        let by_sighting = now.duration_since(seen) < std::time::Duration::from_millis(WRITE_GRACE_MS as u64);
        by_mtime && by_sighting
    }

    fn forget(&mut self, name: &str) {
        self.first_seen.remove(name);
    }

    /// Forget entries no longer in the spool (called with each fresh listing).
    pub fn retain(&mut self, listed: &std::collections::HashSet<&str>) {
        self.first_seen.retain(|n, _| listed.contains(n.as_str()));
    }
}

fn reject_early(code: &'static str, msg: String) -> Result<(), Rejection> {
    Err(Rejection::new(code, msg))
}

/// PROTOCOL §2.3 step 1: checks on the lstat of a spool entry.
pub fn check_entry(path: &Path, md: &std::fs::Metadata) -> Result<(), Rejection> {
    let p = path.display();
    let ft = md.file_type();
    if !ft.is_file() {
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_symlink() {
            "a symbolic link"
        } else {
            "not a regular file (FIFO, socket or device)"
        };
        return reject_early("not-regular-file", format!("{p} is {kind}; publish requests as regular files"));
    }
    let uid = nix::unistd::geteuid().as_raw();
    if md.uid() != uid {
        return reject_early(
            "bad-owner",
            format!(
                "{p} is owned by uid {}, not by the daemon's uid {uid}; only the daemon's own user may submit requests",
                md.uid()
            ),
        );
    }
    if md.nlink() != 1 {
        return reject_early(
            "not-regular-file",
            format!("{p} has {} hard links; publish a fresh file (write a dot file, then rename it)", md.nlink()),
        );
    }
    if md.mode() & 0o022 != 0 {
        return reject_early(
            "bad-permissions",
            format!("{p} has mode {:o}, writable by group or others; create it with mode 0600", md.mode() & 0o7777),
        );
    }
    if md.len() > MAX_REQUEST_BYTES {
        return reject_early(
            "too-large",
            format!("{p} is {} bytes; a request may be at most {MAX_REQUEST_BYTES} bytes", md.len()),
        );
    }
    Ok(())
}

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
                return self.reject(&path, name, Rejection::new("bad-name", msg), None);
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
        // Step 2: open without following, without blocking, and check it is the same file.
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if is_capacity(&e) => return Outcome::Capacity(e),
            Err(_) => return Outcome::Later, // replaced or removed meanwhile: look again
        };
        let Ok(fmd) = file.metadata() else { return Outcome::Later };
        if !FileId::at(&path, &fmd).same(&FileId::at(&path, &md)) {
            return Outcome::Later;
        }
        // Step 3: the writer may still hold it.
        match fsutil::flock(&file, true) {
            Ok(true) => {}
            Ok(false) => return Outcome::Later,
            Err(e) => {
                tracing::warn!(request = name, error = %e, "cannot lock a spool entry; will retry");
                return Outcome::Later;
            }
        }
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
            let r = Rejection::new("too-large", format!("{} grew past {MAX_REQUEST_BYTES} bytes", path.display()));
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
                let run_id = value.get("runId").and_then(Value::as_str).filter(|s| is_id(s, 128)).map(str::to_string);
                return self.reject_seen(&path, name, r, run_id.map(|id| (id, value.clone())), seen);
            }
        };
        self.claim(&path, name, file, req, &raw)
    }

    /// Steps 6 to 8.
    fn claim(&mut self, path: &Path, name: &str, lock: File, req: Request, raw: &[u8]) -> Outcome {
        let Ok(held) = lock.metadata() else { return Outcome::Later };
        let (run_id, generated) = match &req.run_id {
            Some(id) => (id.clone(), false),
            None => (claim_id(&held, name), true),
        };
        let mut dir = self.layout.run_dir(&run_id);
        // A generated id is a pure function of the spool entry, so a claim
        // retried after a crash between mkdir and the commit reuses its own
        // directory instead of leaving an orphan. Should it ever meet a real
        // run (a reused inode with the same ctime), a random id is taken.
        let run_id = if generated && (RunPaths::request(&dir).exists() || RunPaths::status(&dir).exists()) {
            let id = uuid::Uuid::new_v4().to_string();
            dir = self.layout.run_dir(&id);
            id
        } else {
            run_id
        };
        let created = match std::fs::DirBuilder::new().mode_private().create(&dir) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                // Only a real directory can be the trace of an interrupted claim: a
                // symlink there could redirect the request out of the root.
                let real_dir = std::fs::symlink_metadata(&dir).map(|m| m.file_type().is_dir()).unwrap_or(false);
                if !real_dir {
                    let r = Rejection::new(
                        "duplicate-run-id",
                        format!("run id `{run_id}` is taken by {}, which is not a run directory; choose another runId or omit it", dir.display()),
                    );
                    return self.reject(path, name, r, None);
                }
                // Nothing is created in a run directory before the commit, so the
                // trace of an interrupted claim is empty. Anything else there is
                // another run's, possibly another host's (§14): never move into it.
                let empty = std::fs::read_dir(&dir).map(|mut rd| rd.next().is_none()).unwrap_or(false);
                if !empty {
                    let r = Rejection::new(
                        "duplicate-run-id",
                        format!(
                            "run id `{run_id}` is already used by {}; choose another runId or omit it",
                            dir.display()
                        ),
                    );
                    return self.reject(path, name, r, None);
                }
                false // an interrupted claim of this same request: carry on
            }
            Err(e) if is_capacity(&e) => return Outcome::Capacity(e),
            Err(e) => {
                tracing::error!(request = name, run_id, error = %e, "cannot create the run directory; will retry");
                return Outcome::Later;
            }
        };
        let undo = |e: io::Error| {
            if created {
                let _ = std::fs::remove_dir_all(&dir);
            }
            e
        };
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
        let _ = fsync_dir(&dir);
        let _ = fsync_dir(&self.layout.spool());
        tracing::info!(run_id = %run_id, request = name, queue_priority = req.priority, "claimed");
        match finish_claim(self.w, self.layout, &run_id, &req) {
            Ok(s) => Outcome::Claimed(Box::new(s)),
            Err(error) => Outcome::Unfinished { run_id, error },
        }
    }

    /// Move an entry to rejected/ with its error file (and a rejected run
    /// when the body carried a valid, unused run id).
    fn reject(&mut self, path: &Path, name: &str, r: Rejection, run: Option<(String, Value)>) -> Outcome {
        self.reject_seen(path, name, r, run, None)
    }

    /// `reject` of the file identified by `seen` (device, inode): if the name
    /// was replaced meanwhile, the newcomer goes back to the spool instead.
    fn reject_seen(
        &mut self,
        path: &Path,
        name: &str,
        r: Rejection,
        run: Option<(String, Value)>,
        seen: Option<FileId>,
    ) -> Outcome {
        match reject_entry_seen(self.w, self.layout, path, name, &r, run, seen) {
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

/// Step 8: queued status and queued event. Also finishes a half-claimed run
/// (request.json without status.json) at daemon start. The active marker
/// follows with `mark_claimed`, once the runner has been started when a slot
/// is free (perf: one file creation fewer between the drop and the runner).
pub fn finish_claim(w: &mut Writer, l: &Layout, run_id: &str, req: &Request) -> io::Result<Status> {
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
pub fn finish_half_claim(w: &mut Writer, l: &Layout, run_id: &str, ctx: &dyn Context) -> io::Result<Option<Status>> {
    let dir = l.run_dir(run_id);
    let path = RunPaths::request(&dir);
    if RunPaths::status(&dir).exists() {
        return Ok(None);
    }
    let raw = fsutil::read_nofollow(&path, MAX_REQUEST_BYTES + 1)?;
    let checked = if raw.len() as u64 > MAX_REQUEST_BYTES {
        Err(Rejection::new("too-large", format!("{} is over {MAX_REQUEST_BYTES} bytes", path.display())))
    } else {
        request::parse(&raw).and_then(|v| request::validate(&raw, &v, ctx)).and_then(|req| match &req.run_id {
            Some(id) if id != run_id => Err(Rejection::new(
                "invalid-field",
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
                run_id,
                code = r.code,
                "the request of a half-done claim fails validation: rejected: {}",
                r.message
            );
            let body = serde_json::from_slice::<Value>(&raw).unwrap_or(Value::Null);
            rejected_run(w, l, run_id, &body, &r)?;
            Ok(None)
        }
    }
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
pub fn mark_claimed(w: &mut Writer, l: &Layout, run_id: &str) -> io::Result<()> {
    let (l2, id) = (l.clone(), run_id.to_string());
    w.then(format!("active marker {run_id}"), Box::new(move || index::mark_active_if_active(&l2, &id).map(|_| ())))
}

/// Pick free names `<base>[-N].json` / `<base>[-N].error.json` in rejected/.
fn rejected_names(l: &Layout, name: &str, n: u32) -> (PathBuf, PathBuf) {
    let (base, ext) = match name.strip_suffix(".json") {
        Some(b) => (b.to_string(), ".json"),
        None => (name.to_string(), ""),
    };
    let base = if n == 0 { base } else { format!("{base}-{n}") };
    let entry = format!("{base}{ext}");
    let mut err = format!("{base}.error.json");
    if err.len() > 255 {
        err = format!("~sha256-{}.error.json", crate::protocol::seg::sha256_hex(entry.as_bytes()));
    }
    (l.rejected().join(entry), l.rejected().join(err))
}

pub fn reject_entry(
    w: &mut Writer,
    l: &Layout,
    path: &Path,
    name: &str,
    r: &Rejection,
    run: Option<(String, Value)>,
) -> io::Result<()> {
    reject_entry_seen(w, l, path, name, r, run, None).map(|_| ())
}

/// Which file a spool entry is, to notice one replaced under us: device and
/// inode. FUSE and a few network filesystems may report a different inode
/// number for the same file on each lookup (`platform::inode_numbers_stable`);
/// there, and only there, an equal size and mtime (which a rename keeps) count
/// as the same file, and the claim compares the committed bytes with the
/// validated ones before the run owns them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    /// On a filesystem with unstable inode numbers.
    loose: bool,
}

impl FileId {
    /// The identity of `md`, the metadata of `path`.
    pub fn at(path: &Path, md: &std::fs::Metadata) -> FileId {
        let dir = path.parent().unwrap_or(path);
        FileId {
            dev: md.dev(),
            ino: md.ino(),
            size: md.len(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
            loose: !crate::platform::inode_numbers_stable(dir),
        }
    }
    pub fn same(&self, o: &FileId) -> bool {
        self.dev == o.dev
            && (self.ino == o.ino || (self.loose && o.loose && self.size == o.size && self.mtime_ns == o.mtime_ns))
    }
}

/// Does `path` (not followed) name the same file as `md`?
fn same_file(path: &Path, md: &std::fs::Metadata) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| FileId::at(path, &m).same(&FileId::at(path, md)))
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

/// Put an entry that was replaced under us back into the spool, under its
/// own name if free, else under a fresh valid name: never lose it, never
/// reject it for another file's reason.
fn republish(from: &Path, spool: &Path, name: &str) -> io::Result<()> {
    let stem = name.strip_suffix(".json").unwrap_or(name);
    let mut candidates = vec![name.to_string()];
    candidates.extend((1..=8).map(|n| format!("{stem}-{n}")).filter(|s| is_id(s, 200)).map(|s| s + ".json"));
    candidates.push(format!("r{}.json", uuid::Uuid::new_v4().simple()));
    let mut last = io::Error::other("no free name in the spool");
    for c in candidates {
        match rename_noreplace(from, &spool.join(&c)) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Ok(false): the entry at `path` was not the one `seen` described (replaced
/// between the check and the move) and was put back for a fresh look.
#[allow(clippy::too_many_arguments)]
fn reject_entry_seen(
    w: &mut Writer,
    l: &Layout,
    path: &Path,
    name: &str,
    r: &Rejection,
    run: Option<(String, Value)>,
    seen: Option<FileId>,
) -> io::Result<bool> {
    // rejected/ must be a real directory of ours, or the move could leave the root.
    let rd = std::fs::symlink_metadata(l.rejected())?;
    if !rd.file_type().is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a real directory (a symlink?); replace it with one (mkdir -m 700)",
            l.rejected().display()
        )));
    }
    let mut n = 0;
    let (entry, err) = loop {
        let (entry, err) = rejected_names(l, name, n);
        if !err.exists() {
            match rename_noreplace(path, &entry) {
                Ok(()) => break (entry, err),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        n += 1;
    };
    if let Some(id) = seen {
        let now = std::fs::symlink_metadata(&entry)?;
        if !FileId::at(&entry, &now).same(&id) {
            tracing::warn!(request = name, "spool entry replaced while being rejected; it gets a fresh look");
            republish(&entry, &l.spool(), name)?;
            return Ok(false);
        }
    }
    let file = entry.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    write_error_file(w, &err, &file, r)?;
    tracing::warn!(
        request = name,
        run_id = run.as_ref().map(|(id, _)| id.as_str()),
        code = r.code,
        "rejected: {}",
        r.message
    );
    if let Some((run_id, body)) = run {
        // Not `exists()`: a dangling symlink there must not be written through.
        if std::fs::symlink_metadata(l.run_dir(&run_id)).is_err() {
            rejected_run(w, l, &run_id, &body, r)?;
        }
    }
    Ok(true)
}

/// Through the writer: on a full disk the entry is already in rejected/ and
/// its error file must follow as soon as space returns. Not fsynced: a lost
/// error file is rewritten at the next start (recover_rejected).
fn write_error_file(w: &mut Writer, err: &Path, file: &str, r: &Rejection) -> io::Result<()> {
    let body = json!({"version": 1, "file": file, "code": r.code, "message": r.message, "rejectedAt": crate::now_ms()});
    w.write(err, serde_json::to_vec_pretty(&body).map_err(io::Error::other)?, false)
}

/// Name prefix of the directories a `rejected` run is built in before it is
/// renamed into place; leftovers are removed at start (retention's sweep).
pub const STAGING_PREFIX: &str = ".rejected-run-";

/// A run directory in state `rejected`, so a client waiting on its run id learns the outcome.
fn rejected_run(w: &mut Writer, l: &Layout, run_id: &str, body: &Value, r: &Rejection) -> io::Result<()> {
    let dir = l.run_dir(run_id);
    let now = crate::now_ms();
    let text = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
    let mode = match body.get("steps").and_then(Value::as_array).map(|a| a.as_slice()) {
        Some([one]) if one.get("parallel").is_some() => crate::protocol::request::Mode::Parallel,
        Some([_]) => crate::protocol::request::Mode::Single,
        _ => crate::protocol::request::Mode::Chain,
    };
    let mut status = Status {
        run_id: run_id.to_string(),
        session_id: text("sessionId").filter(|s| s.len() <= 4096).unwrap_or_else(|| "default".into()),
        tool_call_id: text("toolCallId").filter(|s| s.len() <= 4096),
        completion_owner_id: text("completionOwnerId").filter(|s| s.len() <= 256),
        mode,
        state: State::Rejected,
        started_at: now,
        last_update: now,
        ended_at: Some(now),
        timeout_ms: 0,
        deadline_at: None,
        timed_out: false,
        stopped: false,
        error: Some(format!("{}: {}", r.code, r.message)),
        exit_code: Some(1),
        pid: None,
        runner: None,
        cwd: text("cwd").unwrap_or_default(),
        current_step: 0,
        chain_step_count: 0,
        parallel_groups: vec![],
        queue: Default::default(),
        output_file: None,
        steps: vec![],
        extra: Default::default(),
    };
    status.mark_launched_by_runspool();
    // One idempotent operation, retried by the writer while storage is full:
    // the entry is already in rejected/, so the run must follow.
    let (l, run_id, code, message) = (l.clone(), run_id.to_string(), r.code, r.message.clone());
    w.then(
        format!("rejected run {run_id}"),
        Box::new(move || {
            match run::read_status(&dir) {
                Ok(Some(cur)) if !(cur.state == State::Rejected && cur.launched_by_runspool()) => return Ok(()), // not ours to touch
                Ok(Some(_)) => {}
                Ok(None) if run::claimed(&dir) => {
                    // A half-done claim whose request failed validation: the
                    // directory is ours already (request.json), so are temps in it.
                    let bytes = serde_json::to_vec_pretty(&status).map_err(io::Error::other)?;
                    fsutil::write_atomic(&RunPaths::status(&dir), &bytes, true)?;
                    let mut ev = Writer::new();
                    run::event(
                        &mut ev,
                        &dir,
                        &run_id,
                        "subagent.run.rejected",
                        json!({"code": code, "message": message}),
                    );
                }
                Ok(None) => {
                    // Built complete in a dot-named staging directory, then
                    // renamed into place: a rejected run has no request.json,
                    // so a temp file left inside its directory by a crash
                    // could not be told from another host's; a leftover
                    // staging directory is ours (`STAGING_PREFIX`).
                    // The builder's pid in the name: a leftover of a dead builder is
                    // removed at the next start, a live one's (a CLI at work) kept.
                    let stage =
                        l.runs().join(format!("{STAGING_PREFIX}{}-{}", std::process::id(), uuid::Uuid::new_v4()));
                    let built = mkdir_private(&stage).and_then(|_| {
                        let bytes = serde_json::to_vec_pretty(&status).map_err(io::Error::other)?;
                        fsutil::write_atomic(&RunPaths::status(&stage), &bytes, true)?;
                        let mut ev = Writer::new();
                        run::event(
                            &mut ev,
                            &stage,
                            &run_id,
                            "subagent.run.rejected",
                            json!({"code": code, "message": message}),
                        );
                        std::fs::rename(&stage, &dir)?;
                        fsync_dir(&l.runs())
                    });
                    if let Err(e) = built {
                        let _ = std::fs::remove_dir_all(&stage);
                        // Taken meanwhile (another host's run): not ours to publish.
                        if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) {
                            return Ok(());
                        }
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            results::publish_result(&l, &status)?;
            index::mark_terminal(&l, &status)?;
            index::unmark_active(&l, &run_id, status.tool_call_id.as_deref())
        }),
    )
}

/// At start, finish rejections cut short by a crash, for entries moved into
/// rejected/ since `since_ms`: a missing error file is written again (the
/// checks are deterministic, so re-checking finds the reason), and a missing
/// `rejected` run for a body with a valid, unused run id is created.
pub fn recover_rejected(w: &mut Writer, l: &Layout, ctx: &dyn Context, since_ms: i64) {
    let Ok(rd) = std::fs::read_dir(l.rejected()) else { return };
    let names: Vec<String> = rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect();
    let set: std::collections::HashSet<&String> = names.iter().collect();
    for name in &names {
        if name.starts_with('.') || name.ends_with(".error.json") {
            continue;
        }
        let stem = name.strip_suffix(".json").unwrap_or(name);
        let (entry, err) = (l.rejected().join(name), format!("{stem}.error.json"));
        let Ok(md) = std::fs::symlink_metadata(&entry) else { continue };
        // The rename into rejected/ set the ctime: older entries were settled by an earlier start.
        if md.ctime() * 1000 + md.ctime_nsec() / 1_000_000 < since_ms || err.len() > 255 {
            continue;
        }
        // A client withdrawing this entry (`withdraw`) holds its lock from the
        // move until its error file and run are written: leave it to them,
        // and look at the error file again once the lock is ours.
        let _held = match md.is_file().then(|| fsutil::open_read(&entry)) {
            Some(Ok(f)) => match fsutil::flock(&f, true) {
                Ok(false) => continue,
                _ => Some(f),
            },
            _ => None,
        };
        let r = if set.contains(&err) || l.rejected().join(&err).exists() {
            match fsutil::read_nofollow(&l.rejected().join(&err), 64 * 1024)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            {
                Some(v) => Rejection::new(
                    code_of(v["code"].as_str().unwrap_or("")),
                    v["message"].as_str().unwrap_or("").to_string(),
                ),
                None => continue,
            }
        } else {
            let r = recheck(&entry, name, ctx);
            match write_error_file(w, &l.rejected().join(&err), name, &r) {
                Ok(()) => tracing::info!(request = %name, code = r.code, "wrote the missing rejection file"),
                Err(e) => {
                    tracing::warn!(request = %name, error = %e, "could not write a missing rejection file");
                    continue;
                }
            }
            r
        };
        if r.code == "duplicate-run-id" || check_entry(&entry, &md).is_err() {
            continue;
        }
        let Ok(raw) = fsutil::read_nofollow(&entry, MAX_REQUEST_BYTES + 1) else { continue };
        let Ok(body) = serde_json::from_slice::<Value>(&raw) else { continue };
        let Some(id) = body.get("runId").and_then(Value::as_str).filter(|s| is_id(s, 128)) else { continue };
        if RunPaths::status(&l.run_dir(id)).exists() || RunPaths::request(&l.run_dir(id)).exists() {
            continue;
        }
        match rejected_run(w, l, id, &body, &r) {
            Ok(()) => tracing::info!(run_id = id, request = %name, "created the missing rejected run"),
            Err(e) => tracing::warn!(run_id = id, error = %e, "could not create the missing rejected run"),
        }
    }
}

/// The static code string for a code read back from an error file.
fn code_of(code: &str) -> &'static str {
    const CODES: [&str; 12] = [
        "bad-name",
        "not-regular-file",
        "bad-owner",
        "bad-permissions",
        "too-large",
        "invalid-json",
        "unsupported-version",
        "invalid-field",
        "duplicate-run-id",
        "cwd-missing",
        "unknown-provider",
        "withdrawn",
    ];
    CODES.iter().find(|c| **c == code).copied().unwrap_or("invalid-field")
}

fn recheck(path: &Path, name: &str, ctx: &dyn Context) -> Rejection {
    let unknown = || {
        Rejection::new(
            "invalid-json",
            "the reason for this rejection was lost in a crash; resubmit the request".to_string(),
        )
    };
    if classify_name(name) == Name::Bad {
        return Rejection::new("bad-name", format!("the name `{}` is not a valid request name", name.escape_debug()));
    }
    let Ok(md) = std::fs::symlink_metadata(path) else { return unknown() };
    if let Err(r) = check_entry(path, &md) {
        return r;
    }
    let Ok(raw) = fsutil::read_nofollow(path, MAX_REQUEST_BYTES + 1) else { return unknown() };
    match request::parse(&raw).and_then(|v| request::validate(&raw, &v, ctx)) {
        Err(r) => r,
        Ok(req) => match req.run_id {
            Some(id) => Rejection::new("duplicate-run-id", format!("run id `{id}` was already used")),
            None => unknown(),
        },
    }
}

/// The run id of a request without `runId`: UUID v4-shaped bits drawn from
/// the entry's identity (device, inode, ctime to the nanosecond, name), which
/// stay fixed while the entry waits in the spool and change when a new file
/// takes the name. FNV-1a rather than std's hasher: the id must not change
/// when the daemon is rebuilt with another Rust between a crash and a retry.
pub fn claim_id(md: &std::fs::Metadata, name: &str) -> String {
    fn fnv(seed: u64, parts: &[&[u8]]) -> u64 {
        let mut h = seed;
        for b in parts.iter().flat_map(|p| p.iter().chain(&[0xff])) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }
    let (dev, ino) = (md.dev().to_le_bytes(), md.ino().to_le_bytes());
    let (cs, cn) = (md.ctime().to_le_bytes(), md.ctime_nsec().to_le_bytes());
    let parts: [&[u8]; 5] = [&dev, &ino, &cs, &cn, name.as_bytes()];
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325, &parts).to_le_bytes());
    bytes[8..].copy_from_slice(&fnv(0x6c62_272e_07bb_0142, &parts).to_le_bytes());
    uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()
}

/// What [`withdraw`] did.
#[derive(Debug)]
pub enum Withdrawal {
    /// Moved to `entry` in rejected/ (code `withdrawn`, with its error file,
    /// and a `rejected` run when the body named a valid, unused run id): it
    /// never runs.
    Withdrawn { entry: PathBuf, run_id: Option<String> },
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
        .map(str::to_string);
    // Before any daemon ran, the CLI makes what it writes into (0700, as the daemon would).
    for d in [l.rejected(), l.runs(), l.terminal()] {
        fsutil::mkdir_private_all(&d)?;
    }
    let mut w = Writer::new();
    let r = Rejection::new("withdrawn", message.to_string());
    let run = run_id.clone().zip(body);
    if !reject_entry_seen(&mut w, l, &path, name, &r, run, Some(seen))? {
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
    let entry = (0..1000)
        .map(|n| rejected_names(l, name, n).0)
        .find(|p| std::fs::symlink_metadata(p).is_ok_and(|m| FileId::at(p, &m).same(&seen)))
        .unwrap_or_else(|| l.rejected().join(name));
    drop(file);
    Ok(Withdrawal::Withdrawn { entry, run_id })
}

/// Is this run directory a claim that stopped between commit and status?
pub fn is_half_claimed(dir: &Path) -> bool {
    RunPaths::request(dir).exists() && !RunPaths::status(dir).exists()
}

/// Steps that never ran, for runs ended before starting.
pub fn skip_all(s: &mut Status, status: StepState, msg: &str) {
    for st in s.steps.iter_mut().filter(|s| matches!(s.status, StepState::Pending | StepState::Running)) {
        st.status = status.clone();
        st.exit_code = Some(-1);
        st.duration_ms = Some(0);
        st.error = Some(msg.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn names() {
        assert_eq!(classify_name("a.json"), Name::Candidate);
        assert_eq!(classify_name(".a.json"), Name::Ignored);
        assert_eq!(classify_name("rejected"), Name::Ignored);
        assert_eq!(classify_name("x.txt"), Name::Ignored);
        assert_eq!(classify_name("bad name.json"), Name::Bad);
        assert_eq!(classify_name("-x.json"), Name::Bad);
        assert_eq!(classify_name(&format!("{}.json", "a".repeat(200))), Name::Candidate);
        assert_eq!(classify_name(&format!("{}.json", "a".repeat(201))), Name::Bad);
    }

    #[test]
    fn same_size_and_mtime_is_another_file_where_inodes_are_stable() {
        let d = tempfile::tempdir().unwrap();
        assert!(crate::platform::inode_numbers_stable(d.path()), "local filesystems keep inode numbers");
        let (a, b) = (d.path().join("a.json"), d.path().join("b.json"));
        std::fs::write(&a, "{\"x\":1}").unwrap();
        std::fs::write(&b, "{\"x\":2}").unwrap();
        let t =
            std::fs::FileTimes::new().set_modified(std::time::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5));
        for p in [&a, &b] {
            std::fs::File::options().write(true).open(p).unwrap().set_times(t).unwrap();
        }
        let (ma, mb) = (std::fs::metadata(&a).unwrap(), std::fs::metadata(&b).unwrap());
        assert_eq!((ma.len(), ma.mtime_nsec()), (mb.len(), mb.mtime_nsec()));
        assert!(!FileId::at(&a, &ma).same(&FileId::at(&b, &mb)), "only dev and inode identify a file here");
        assert!(FileId::at(&a, &ma).same(&FileId::at(&a, &std::fs::metadata(&a).unwrap())));
    }

    #[test]
    fn generated_ids_are_stable_per_entry_and_fresh_per_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        std::fs::write(&p, "{}").unwrap();
        let md = std::fs::metadata(&p).unwrap();
        let id = claim_id(&md, "a.json");
        // A retried claim of the same entry lands in the same directory.
        assert_eq!(id, claim_id(&std::fs::metadata(&p).unwrap(), "a.json"));
        let u = uuid::Uuid::parse_str(&id).unwrap();
        assert_eq!(u.get_version_num(), 4, "{id} must look like the UUID v4 PROTOCOL §2.2 promises");
        assert!(is_id(&id, 128));
        assert_ne!(id, claim_id(&md, "b.json"));
        // A new file under the same name is a new request.
        let keep = d.path().join("keep");
        std::fs::rename(&p, &keep).unwrap();
        std::fs::write(&p, "{}").unwrap();
        assert_ne!(id, claim_id(&std::fs::metadata(&p).unwrap(), "a.json"));
    }
}
