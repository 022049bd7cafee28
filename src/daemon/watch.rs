//! File events as hints (DESIGN principle 6): the watcher only says "look
//! here"; the periodic rescan is the source of truth, so a lost event costs
//! latency, never a request.
//!
//! The strategy is chosen at start by `choose()` (pure, unit-tested) from the
//! platform, the filesystem under the root and the config; a native watcher
//! that fails at run time is replaced (by polling if native fails again)
//! without a restart.

use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::store::layout::{RunPaths, BRIDGE_REQUESTS, CONTROL_DIR, STOP_REQUESTS_DIR};
use crate::store::{Layout, RunId};

use super::hint::Hint;

pub use crate::platform::watch::{choose, fs_type, is_remote_fs, native_backend, Backend, Choice, Strategy};

/// The running watcher of the chosen backend.
enum Active {
    Native(notify::RecommendedWatcher),
    Poll(notify::PollWatcher),
}

impl Active {
    fn watcher(&mut self) -> &mut dyn Watcher {
        match self {
            Active::Native(w) => w,
            Active::Poll(w) => w,
        }
    }
}

/// Who watches the control inboxes of queued runs.
enum Inboxes {
    /// Linux with native events: an inotify instance of our own, one map
    /// entry per run (notify's held two full paths per watch: 12 MiB for
    /// the 40,000 watches of a backlog of 20,000).
    #[cfg(target_os = "linux")]
    Own(crate::store::inbox_watch::InboxWatch),
    /// Elsewhere, and when polling: the backend, on both directories of
    /// each of these runs (re-added on replacement: ids, not their paths).
    Backend(HashSet<RunId>),
}

pub struct Watch {
    backend: Active,
    pub choice: Choice,
    /// Every directory we watch besides the spool and the control inboxes,
    /// re-added on replacement.
    dirs: BTreeSet<PathBuf>,
    /// Runs whose control inbox is watched (`watch_control`).
    inboxes: Inboxes,
    layout: Layout,
    tx: Sender<Hint>,
    poll_interval: Duration,
    spool_identity: Option<(u64, u64)>,
    native_failures: u32,
}

impl Watch {
    pub fn start(
        layout: &Layout,
        tx: Sender<Hint>,
        config: Strategy,
        poll_interval: Duration,
    ) -> Result<Watch, String> {
        let fs = fs_type(&layout.spool());
        let choice = choose(std::env::consts::OS, fs.as_deref(), config);
        let backend = match choice.strategy {
            Strategy::Native => match native(layout, tx.clone()) {
                Ok(b) => b,
                Err(e) if config == Strategy::Native => {
                    return Err(format!(
                        "watch.strategy = \"native\" but {} could not start: {e}; raise the limits (sysctl fs.inotify.max_user_instances and fs.inotify.max_user_watches) or set watch.strategy = \"auto\"",
                        choice.backend
                    ))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "native file events unavailable; polling instead");
                    let b = poll(layout, tx.clone(), poll_interval).map_err(|e| format!("polling could not start either: {e}"))?;
                    let choice = Choice { strategy: Strategy::Poll, backend: Backend::Poll, reason: format!("{} failed to start: {}", choice.backend, describe(&e)) };
                    return Ok(Watch::new(layout, tx, b, choice, poll_interval));
                }
            },
            Strategy::Poll | Strategy::Auto => {
                poll(layout, tx.clone(), poll_interval).map_err(|e| format!("polling could not start: {e}"))?
            }
        };
        Ok(Watch::new(layout, tx, backend, choice, poll_interval))
    }

    fn new(layout: &Layout, tx: Sender<Hint>, backend: Active, choice: Choice, poll_interval: Duration) -> Watch {
        tracing::info!(strategy = ?choice.strategy, backend = choice.backend.as_str(), reason = %choice.reason, "watching the spool");
        let inboxes = inboxes(matches!(backend, Active::Native(_)), &tx);
        Watch {
            backend,
            choice,
            dirs: BTreeSet::new(),
            inboxes,
            layout: layout.clone(),
            tx,
            poll_interval,
            spool_identity: identity(&layout.spool()),
            native_failures: 0,
        }
    }

    pub fn is_native(&self) -> bool {
        matches!(self.backend, Active::Native(_))
    }

    /// How often the loop must rescan by itself: the configured rescan
    /// interval natively; polling is done by the PollWatcher.
    pub fn strategy_name(&self) -> &'static str {
        self.choice.strategy.as_str()
    }

    /// Watch one more directory (non-recursively). Errors are logged: the
    /// periodic rescan covers a directory we failed to watch.
    pub fn add(&mut self, dir: &Path) {
        if self.dirs.insert(dir.to_path_buf()) {
            if let Err(e) = self.backend.watcher().watch(dir, RecursiveMode::NonRecursive) {
                tracing::debug!(dir = %dir.display(), error = %e, "cannot watch a directory; the rescan covers it");
            }
        }
    }

    pub fn remove(&mut self, dir: &Path) {
        if self.dirs.remove(dir) {
            let _ = self.backend.watcher().unwatch(dir);
        }
    }

    /// Watch a queued run's control inbox: `control/` and 0.67's
    /// `control/stop-requests/` (the caller creates both).
    pub fn watch_control(&mut self, run_id: &RunId) {
        match &mut self.inboxes {
            #[cfg(target_os = "linux")]
            Inboxes::Own(w) => {
                w.watch(run_id, &self.layout.run_dir(run_id));
            }
            Inboxes::Backend(controls) => {
                if controls.insert(run_id.clone()) {
                    add_control(&mut self.backend, &self.layout, run_id);
                }
            }
        }
    }

    pub fn unwatch_control(&mut self, run_id: &RunId) {
        match &mut self.inboxes {
            #[cfg(target_os = "linux")]
            Inboxes::Own(w) => w.unwatch(run_id),
            Inboxes::Backend(controls) => {
                if controls.remove(run_id) {
                    let dir = self.layout.run_dir(run_id);
                    let _ = self.backend.watcher().unwatch(&RunPaths::stop_requests(&dir));
                    let _ = self.backend.watcher().unwatch(&RunPaths::control(&dir));
                    // A set never shrinks by itself: give back what a backlog grew it to.
                    if controls.capacity() > 64 && controls.len() < controls.capacity() / 4 {
                        controls.shrink_to_fit();
                    }
                }
            }
        }
    }

    /// After a backlog drained: a new native watcher on the same
    /// directories in place of the one whose tables grew with the backlog
    /// (notify keeps two maps entry per watch, 40,000 entries for 20,000
    /// queued runs, and its maps never shrink). The new one watches
    /// everything before the old one is dropped: no event falls between.
    pub fn compact(&mut self) {
        let Inboxes::Backend(controls) = &self.inboxes else { return }; // ours shrink as runs leave
        if !self.is_native() {
            return;
        }
        let mut b = match native(&self.layout, self.tx.clone()) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %describe(&e), "keeping the file watcher as it is");
                return;
            }
        };
        for d in &self.dirs {
            let _ = b.watcher().watch(d, RecursiveMode::NonRecursive);
        }
        for id in controls {
            let dir = self.layout.run_dir(id);
            for d in [RunPaths::control(&dir), RunPaths::stop_requests(&dir)] {
                let _ = b.watcher().watch(&d, RecursiveMode::NonRecursive);
            }
        }
        self.backend = b;
        self.spool_identity = identity(&self.layout.spool());
    }

    /// Has the spool directory been replaced (removed and created again)
    /// since we started watching it? Then the watch is on a dead inode.
    pub fn spool_replaced(&self) -> bool {
        identity(&self.layout.spool()) != self.spool_identity
    }

    /// Replace the backend after a failure: native again (once), else poll.
    pub fn replace(&mut self, why: &str) {
        let _ = crate::store::fsutil::mkdir_private(&self.layout.spool());
        let want_native = self.choice.strategy == Strategy::Native && self.native_failures < 1;
        if self.is_native() {
            self.native_failures += 1;
        }
        let (backend, choice) = if want_native {
            match native(&self.layout, self.tx.clone()) {
                Ok(b) => (Some(b), self.choice.clone()),
                Err(e) => (
                    None,
                    Choice {
                        strategy: Strategy::Poll,
                        backend: Backend::Poll,
                        reason: format!("{} failed again: {}", self.choice.backend, describe(&e)),
                    },
                ),
            }
        } else {
            (
                None,
                Choice {
                    strategy: Strategy::Poll,
                    backend: Backend::Poll,
                    reason: format!("native watching failed: {why}"),
                },
            )
        };
        let backend = match backend {
            Some(b) => b,
            None => match poll(&self.layout, self.tx.clone(), self.poll_interval) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start polling; relying on the periodic rescan");
                    return;
                }
            },
        };
        tracing::warn!(reason = why, backend = choice.backend.as_str(), "replaced the file watcher");
        self.backend = backend;
        self.choice = choice;
        self.spool_identity = identity(&self.layout.spool());
        let dirs: Vec<PathBuf> = std::mem::take(&mut self.dirs).into_iter().collect();
        for d in dirs {
            self.add(&d);
        }
        let native = self.is_native();
        match &mut self.inboxes {
            // Our own inotify instance did not fail: it keeps watching, unless
            // the spool is polled now (then so are the inboxes).
            #[cfg(target_os = "linux")]
            Inboxes::Own(w) => {
                if !native {
                    let controls: HashSet<RunId> = w.runs().into_iter().collect();
                    for id in &controls {
                        add_control(&mut self.backend, &self.layout, id);
                    }
                    self.inboxes = Inboxes::Backend(controls);
                }
            }
            Inboxes::Backend(controls) => {
                for id in controls.iter() {
                    add_control(&mut self.backend, &self.layout, id);
                }
            }
        }
    }
}

fn add_control(backend: &mut Active, layout: &Layout, run_id: &RunId) {
    let dir = layout.run_dir(run_id);
    for d in [RunPaths::control(&dir), RunPaths::stop_requests(&dir)] {
        if let Err(e) = backend.watcher().watch(&d, RecursiveMode::NonRecursive) {
            tracing::debug!(dir = %d.display(), error = %e, "cannot watch a directory; the rescan covers it");
        }
    }
}

/// The inbox watcher that goes with a backend: our own inotify instance
/// with native events on Linux (the backend's otherwise, or when it cannot start).
fn inboxes(native: bool, tx: &Sender<Hint>) -> Inboxes {
    #[cfg(target_os = "linux")]
    if native {
        use crate::store::inbox_watch::{InboxEvent, InboxWatch};
        let tx = tx.clone();
        let report = move |e: InboxEvent| match e {
            InboxEvent::Changed(id) => tx.send(Hint::Control(id)).is_ok(),
            InboxEvent::Overflow => tx.send(Hint::Rescan("the control-inbox event queue overflowed".into())).is_ok(),
            InboxEvent::Failed(why) => {
                tracing::warn!(error = %why, "control inboxes are no longer watched; the periodic rescan covers them");
                let _ = tx.send(Hint::Rescan(why));
                false
            }
        };
        match InboxWatch::start(report) {
            Ok(w) => return Inboxes::Own(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the control-inbox watcher; the spool's watcher watches them")
            }
        }
    }
    let _ = (native, tx);
    Inboxes::Backend(HashSet::new())
}

fn identity(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

fn describe(e: &notify::Error) -> String {
    match &e.kind {
        notify::ErrorKind::MaxFilesWatch => "the inotify watch limit is reached (fs.inotify.max_user_watches)".into(),
        notify::ErrorKind::Io(io) if io.raw_os_error() == Some(libc::EMFILE) => {
            "the inotify instance limit is reached (fs.inotify.max_user_instances) or no file descriptors are left"
                .into()
        }
        notify::ErrorKind::Io(io) if io.raw_os_error() == Some(libc::ENOSPC) => {
            "the inotify watch limit is reached (fs.inotify.max_user_watches)".into()
        }
        notify::ErrorKind::Io(io) if io.raw_os_error() == Some(libc::ENOSYS) => {
            "inotify is not supported by this kernel".into()
        }
        _ => e.to_string(),
    }
}

fn handler(layout: &Layout, tx: Sender<Hint>) -> impl notify::EventHandler {
    let spool = layout.spool();
    let runs = layout.runs();
    let queue = crate::store::queue::path(layout);
    move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => {
            if ev.need_rescan() {
                let _ = tx.send(Hint::Rescan("the file-event queue overflowed".into()));
                return;
            }
            if !crate::platform::is_change(&ev.kind) {
                return; // our own listing of the spool opened it
            }
            for p in &ev.paths {
                if *p == queue {
                    let _ = tx.send(Hint::Queue);
                } else if let Some(h) = classify(&spool, &runs, p) {
                    let _ = tx.send(h);
                }
            }
        }
        // An error about one path (a dangling symlink the poller cannot stat)
        // only calls for a rescan; an error of the watcher itself replaces it.
        Err(e) if !e.paths.is_empty() => {
            let _ = tx.send(Hint::Rescan(format!("watcher error: {e}")));
        }
        Err(e) => {
            let _ = tx.send(Hint::WatchFailed(describe(&e)));
        }
    }
}

fn native(layout: &Layout, tx: Sender<Hint>) -> notify::Result<Active> {
    let mut w = notify::RecommendedWatcher::new(handler(layout, tx), notify::Config::default())?;
    w.watch(&layout.spool(), RecursiveMode::NonRecursive)?;
    Ok(Active::Native(w))
}

fn poll(layout: &Layout, tx: Sender<Hint>, interval: Duration) -> notify::Result<Active> {
    let cfg = notify::Config::default().with_poll_interval(interval).with_compare_contents(false);
    let mut w = notify::PollWatcher::new(handler(layout, tx), cfg)?;
    w.watch(&layout.spool(), RecursiveMode::NonRecursive)?;
    Ok(Active::Poll(w))
}

fn classify(spool: &Path, runs: &Path, p: &Path) -> Option<Hint> {
    if p == spool {
        return Some(Hint::Spool);
    }
    let parent = p.parent()?;
    // A run's `external-job-requests/` made in its watched directory.
    if p.file_name()? == BRIDGE_REQUESTS && parent.parent()? == runs {
        return Some(Hint::Bridge(parent.file_name()?.to_string_lossy().into_owned()));
    }
    if parent == spool {
        // Dot names are temps: only their rename to a real name matters.
        let name = p.file_name()?.to_string_lossy();
        return (!name.starts_with('.')).then_some(Hint::Spool);
    }
    if parent.file_name()? == BRIDGE_REQUESTS {
        let run_dir = parent.parent()?;
        let name = p.file_name()?.to_string_lossy();
        if run_dir.parent()? == runs && !name.starts_with('.') && name.ends_with(".json") {
            return Some(Hint::Bridge(run_dir.file_name()?.to_string_lossy().into_owned()));
        }
        return None;
    }
    // control/ itself, or 0.67's control/stop-requests/.
    let control = if parent.file_name()? == STOP_REQUESTS_DIR { parent.parent()? } else { parent };
    if control.file_name()? == CONTROL_DIR {
        let run_dir: PathBuf = control.parent()?.to_path_buf();
        if run_dir.parent()? == runs {
            return RunId::of_dir(&run_dir).map(Hint::Control);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_paths() {
        let spool = Path::new("/r/spool");
        let runs = Path::new("/r/async-subagent-runs");
        assert!(matches!(classify(spool, runs, Path::new("/r/spool/a.json")), Some(Hint::Spool)));
        assert!(classify(spool, runs, Path::new("/r/spool/.tmp")).is_none());
        assert!(matches!(
            classify(spool, runs, Path::new("/r/async-subagent-runs/x/control/stop.json")),
            Some(Hint::Control(id)) if id.as_str() == "x"
        ));
        assert!(matches!(
            classify(spool, runs, Path::new("/r/async-subagent-runs/x/control/stop-requests/1-u.json")),
            Some(Hint::Control(id)) if id.as_str() == "x"
        ));
        assert!(matches!(
            classify(spool, runs, Path::new("/r/async-subagent-runs/x/external-job-requests")),
            Some(Hint::Bridge(id)) if id == "x"
        ));
        assert!(matches!(
            classify(spool, runs, Path::new("/r/async-subagent-runs/x/external-job-requests/a-1.json")),
            Some(Hint::Bridge(id)) if id == "x"
        ));
        // The run's other files wake nobody.
        assert!(classify(spool, runs, Path::new("/r/async-subagent-runs/x/status.json")).is_none());
        assert!(classify(spool, runs, Path::new("/r/async-subagent-runs/x/output-0.log")).is_none());
    }
}
