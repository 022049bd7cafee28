//! The capacity-resilient writer (PROTOCOL §11): a write that meets ENOSPC,
//! EDQUOT, EMFILE or ENFILE keeps the newest payload for its path in memory
//! and is retried by `flush()`; follow-up operations (index updates, result
//! publication) wait behind every pending write.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::fsutil::{is_capacity, write_atomic};

type Op = Box<dyn FnMut() -> io::Result<()> + Send>;

#[derive(Default)]
pub struct Writer {
    pending: BTreeMap<PathBuf, (Vec<u8>, bool)>,
    ops: VecDeque<(String, Op)>,
    /// When the current run of capacity errors began (None: healthy).
    pub degraded_since: Option<i64>,
    /// Last capacity error text, for daemon.json and logs.
    pub last_error: Option<String>,
    /// Diagnostics (events) dropped because of capacity errors.
    pub dropped_events: u64,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    fn note_capacity(&mut self, what: &Path, e: &io::Error) {
        if self.degraded_since.is_none() {
            tracing::warn!(path = %what.display(), error = %e, "storage capacity error: keeping the newest payload in memory and retrying every second");
            self.degraded_since = Some(crate::now_ms());
        }
        self.last_error = Some(format!("{e} writing {}", what.display()));
    }

    /// Write atomically, or defer on a capacity error. Other errors are returned.
    pub fn write(&mut self, path: &Path, bytes: Vec<u8>, durable: bool) -> io::Result<()> {
        // A newer payload replaces an older deferred one; order behind other pending writes is irrelevant
        // because each path holds a whole file.
        match write_atomic(path, &bytes, durable) {
            Ok(()) => {
                self.pending.remove(path);
                Ok(())
            }
            Err(e) if is_capacity(&e) => {
                self.note_capacity(path, &e);
                self.pending.insert(path.to_path_buf(), (bytes, durable));
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// For a thread off the daemon's loop that cannot go on before `path` is
    /// on disk (a bridge worker saving a job handle before its response):
    /// write atomically, waiting out capacity errors `pause` at a time on
    /// this thread; the payload is kept meanwhile. Other errors are returned.
    /// Never call it on the loop: there, `write` defers instead.
    pub fn write_waiting(&mut self, path: &Path, bytes: &[u8], durable: bool, pause: Duration) -> io::Result<()> {
        loop {
            match write_atomic(path, bytes, durable) {
                Ok(()) => {
                    self.outside_ok();
                    return Ok(());
                }
                Err(e) if is_capacity(&e) => {
                    self.note_capacity(path, &e);
                    std::thread::sleep(pause);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Retry the deferred write of `path` alone, now (space was just freed
    /// for it). True when nothing is left pending for it.
    pub fn flush_path(&mut self, path: &Path) -> bool {
        let Some((bytes, durable)) = self.pending.get(path).cloned() else { return true };
        match write_atomic(path, &bytes, durable) {
            Ok(()) => {
                self.pending.remove(path);
                true
            }
            Err(e) => {
                if is_capacity(&e) {
                    self.note_capacity(path, &e);
                }
                false
            }
        }
    }

    /// The newest payload not yet on disk for `path`, if any.
    pub fn pending_for(&self, path: &Path) -> Option<&[u8]> {
        self.pending.get(path).map(|(b, _)| b.as_slice())
    }

    /// Run `op` now if nothing is pending, else after the pending writes land.
    /// A capacity error inside `op` queues it for retry.
    pub fn then(&mut self, label: impl Into<String>, mut op: Op) -> io::Result<()> {
        if self.pending.is_empty() && self.ops.is_empty() {
            match op() {
                Ok(()) => return Ok(()),
                Err(e) if is_capacity(&e) => self.note_capacity(Path::new("index"), &e),
                Err(e) => return Err(e),
            }
        }
        self.ops.push_back((label.into(), op));
        Ok(())
    }

    /// Retry everything pending. True when nothing is left.
    pub fn flush(&mut self) -> bool {
        let paths: Vec<PathBuf> = self.pending.keys().cloned().collect();
        for p in paths {
            let (bytes, durable) = self.pending[&p].clone();
            match write_atomic(&p, &bytes, durable) {
                Ok(()) => {
                    self.pending.remove(&p);
                }
                Err(e) if is_capacity(&e) => {
                    self.note_capacity(&p, &e);
                    return false;
                }
                Err(e) => {
                    // Not a capacity problem: the path itself is bad (its run was removed, say).
                    tracing::error!(path = %p.display(), error = %e, "dropping a deferred write that can no longer succeed");
                    self.pending.remove(&p);
                }
            }
        }
        while let Some((label, mut op)) = self.ops.pop_front() {
            match op() {
                Ok(()) => {}
                Err(e) if is_capacity(&e) => {
                    self.note_capacity(Path::new(&label), &e);
                    self.ops.push_front((label, op));
                    return false;
                }
                Err(e) => tracing::error!(op = %label, error = %e, "deferred index update failed"),
            }
        }
        self.recovered();
        true
    }

    fn recovered(&mut self) {
        if let Some(since) = self.degraded_since.take() {
            tracing::info!(degraded_ms = crate::now_ms() - since, "storage recovered: all deferred writes landed");
            self.last_error = None;
        }
    }

    /// The operation that met a capacity error outside the writer (see
    /// `capacity_error`) has now succeeded. With nothing deferred either, the
    /// storage is healthy again: without this, an error in the claim path,
    /// which leaves nothing pending, kept daemon.json `degraded` for good.
    pub fn outside_ok(&mut self) {
        if self.is_idle() {
            self.recovered();
        }
    }

    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.ops.is_empty()
    }

    /// Record a capacity error met outside the writer (the claim path).
    pub fn capacity_error(&mut self, what: &Path, e: &io::Error) {
        self.note_capacity(what, e);
    }

    pub fn dropped_event(&mut self, e: &io::Error) {
        if self.dropped_events == 0 {
            tracing::warn!(error = %e, "dropping diagnostic events while storage is full (counted, logged once)");
        }
        self.dropped_events += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outside_capacity_error_ends_when_its_operation_succeeds() {
        let mut w = Writer::new();
        let e = io::Error::from_raw_os_error(libc::EDQUOT);
        w.capacity_error(Path::new("/spool/a.json"), &e);
        assert!(w.last_error.is_some() && w.is_idle());
        w.outside_ok();
        assert_eq!(w.last_error, None);
        assert_eq!(w.degraded_since, None);
    }

    #[test]
    fn a_waiting_write_lands_and_leaves_the_writer_healthy() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        let mut w = Writer::new();
        w.write_waiting(&p, b"{}", false, Duration::from_millis(1)).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
        assert!(w.is_idle() && w.last_error.is_none());
        // Not a capacity error (no such directory): returned, not waited out.
        assert!(w.write_waiting(&d.path().join("no/a.json"), b"{}", false, Duration::from_millis(1)).is_err());
    }

    #[test]
    fn deferred_writes_keep_the_writer_degraded() {
        let mut w = Writer::new();
        w.capacity_error(Path::new("/spool/a.json"), &io::Error::from_raw_os_error(libc::ENOSPC));
        // A deferred op stands for a write still waiting on space.
        w.ops.push_back(("index".into(), Box::new(|| Err(io::Error::from_raw_os_error(libc::ENOSPC)))));
        w.outside_ok();
        assert!(w.last_error.is_some(), "still degraded while an index update waits");
        assert!(!w.flush());
        assert!(w.last_error.is_some());
        w.ops.clear();
        assert!(w.flush());
        assert_eq!(w.last_error, None);
    }
}
