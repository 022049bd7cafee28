//! File events as hints (DESIGN principle 6): the watcher only says "look
//! here"; the periodic rescan is the source of truth, so a lost event costs
//! latency, never a request.
//!
//! The strategy is chosen at start by `choose()` (pure, unit-tested) from the
//! platform, the filesystem under the root and the config; a native watcher
//! that fails at run time is replaced (by polling if native fails again)
//! without a restart.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::store::layout::{RunPaths, BRIDGE_REQUESTS, CONTROL_DIR, STOP_REQUESTS_DIR};
use crate::store::{Layout, RunId};

use super::hint::Hint;

/// How to watch: `watch.strategy` of the config (`Auto`, `Native`,
/// `Poll`), and the strategy a `Choice` settled on (`Native` or `Poll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Auto,
    Native,
    Poll,
}

impl Strategy {
    /// `watch.strategy` as config.rs keeps it (it refuses anything but
    /// auto, native and poll; anything else counts as auto).
    pub fn from_config(s: &str) -> Strategy {
        match s {
            "native" => Strategy::Native,
            "poll" => Strategy::Poll,
            _ => Strategy::Auto,
        }
    }

    /// The name in the config and in daemon.json's `watch.strategy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Native => "native",
            Strategy::Poll => "poll",
        }
    }
}

/// The watcher behind the chosen strategy, as daemon.json's `watch.backend`
/// names it: a platform's native events, or polling (notify's `PollWatcher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Inotify,
    FsEvents,
    Kqueue,
    /// Native events of a platform without a name of its own here.
    Native,
    Poll,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Inotify => "inotify",
            Backend::FsEvents => "fsevents",
            Backend::Kqueue => "kqueue",
            Backend::Native => "native",
            Backend::Poll => "poll",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// daemon.json keeps the backend as a string.
impl From<Backend> for String {
    fn from(b: Backend) -> String {
        b.as_str().to_string()
    }
}

/// The outcome of the strategy choice, as shown in daemon.json.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// `Native` or `Poll`, never `Auto`.
    pub strategy: Strategy,
    pub backend: Backend,
    pub reason: String,
}

/// The native backend of a platform (`std::env::consts::OS` names).
pub fn native_backend(os: &str) -> Backend {
    match os {
        "linux" | "android" => Backend::Inotify,
        "macos" | "ios" => Backend::FsEvents,
        "freebsd" | "openbsd" | "netbsd" | "dragonfly" => Backend::Kqueue,
        _ => Backend::Native,
    }
}

/// Filesystems whose changes made elsewhere (another host, a FUSE daemon
/// writing to its backing store) produce no local file events.
pub fn is_remote_fs(fs: &str) -> bool {
    matches!(
        fs,
        "nfs"
            | "nfs4"
            | "smb"
            | "smbfs"
            | "smb2"
            | "cifs"
            | "fuse"
            | "fuseblk"
            | "9p"
            | "afs"
            | "ceph"
            | "gfs2"
            | "ocfs2"
            | "glusterfs"
            | "lustre"
            | "coda"
            | "ncpfs"
            | "webdav"
            | "osxfuse"
            | "macfuse"
            | "vboxsf"
            | "virtiofs"
    ) || fs.starts_with("fuse.")
}

/// Choose the watch strategy. `fs` is the filesystem type name under the
/// watched root (`None` if unknown); `config` is `watch.strategy`.
pub fn choose(os: &str, fs: Option<&str>, config: Strategy) -> Choice {
    let backend = native_backend(os);
    let poll = |reason: String| Choice { strategy: Strategy::Poll, backend: Backend::Poll, reason };
    match config {
        Strategy::Poll => poll("watch.strategy = \"poll\" in the config".into()),
        Strategy::Native => Choice { strategy: Strategy::Native, backend, reason: "watch.strategy = \"native\" in the config".into() },
        Strategy::Auto => match fs {
            Some(f) if is_remote_fs(f) => poll(format!(
                "the root is on {f}, a network or FUSE filesystem whose changes made elsewhere raise no {backend} events"
            )),
            Some(f) => Choice { strategy: Strategy::Native, backend, reason: format!("{backend} on a local filesystem ({f})") },
            None => Choice { strategy: Strategy::Native, backend, reason: format!("{backend} (filesystem type unknown)") },
        },
    }
}

/// The filesystem type name under `path` (statfs magic on Linux, the type
/// name elsewhere).
pub fn fs_type(path: &Path) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let s = nix::sys::statfs::statfs(path).ok()?;
        let magic = s.filesystem_type().0 as u64;
        Some(
            match magic {
                0x6969 => "nfs",
                0x517B => "smb",
                0xFE534D42 => "smb2",
                0xFF534D42 => "cifs",
                0x65735546 => "fuse",
                0x01021997 => "9p",
                0x5346414F | 0x6B414653 => "afs",
                0x00C36400 => "ceph",
                0x01161970 => "gfs2",
                0x7461636f => "ocfs2",
                0x0BD00BD0 => "lustre",
                0x73757245 => "coda",
                0x786F4256 => "vboxsf",
                0x6a656a63 => "virtiofs",
                0x01021994 => "tmpfs",
                0xEF53 => "ext4",
                0x58465342 => "xfs",
                0x9123683E => "btrfs",
                0x794C7630 => "overlayfs",
                0x2FC12FC1 => "zfs",
                0xF2F52010 => "f2fs",
                _ => return Some(format!("0x{magic:x}")),
            }
            .to_string(),
        )
    }
    #[cfg(not(target_os = "linux"))]
    {
        let s = nix::sys::statfs::statfs(path).ok()?;
        Some(s.filesystem_type_name().to_string())
    }
}

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

pub struct Watch {
    backend: Active,
    pub choice: Choice,
    /// Every directory we watch besides the spool, re-added on replacement.
    dirs: BTreeSet<PathBuf>,
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
        Watch {
            backend,
            choice,
            dirs: BTreeSet::new(),
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
        let dir = self.layout.run_dir(run_id);
        self.add(&RunPaths::control(&dir));
        self.add(&RunPaths::stop_requests(&dir));
    }

    pub fn unwatch_control(&mut self, run_id: &RunId) {
        let dir = self.layout.run_dir(run_id);
        self.remove(&RunPaths::stop_requests(&dir));
        self.remove(&RunPaths::control(&dir));
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
    }
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
    let queue = super::queue::path(layout);
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
    fn native_per_platform() {
        assert_eq!(choose("linux", Some("ext4"), Strategy::Auto).backend, Backend::Inotify);
        assert_eq!(choose("macos", Some("apfs"), Strategy::Auto).backend, Backend::FsEvents);
        assert_eq!(choose("freebsd", Some("ufs"), Strategy::Auto).backend, Backend::Kqueue);
        assert_eq!(choose("linux", None, Strategy::Auto).strategy, Strategy::Native);
    }

    #[test]
    fn network_and_fuse_poll() {
        for fs in ["nfs", "cifs", "smb2", "fuse", "fuse.bindfs", "9p", "afs", "ceph", "macfuse"] {
            let c = choose("linux", Some(fs), Strategy::Auto);
            assert_eq!(c.strategy, Strategy::Poll, "{fs}");
            assert!(c.reason.contains(fs), "{}", c.reason);
        }
        assert_eq!(choose("linux", Some("tmpfs"), Strategy::Auto).strategy, Strategy::Native);
    }

    #[test]
    fn config_wins() {
        assert_eq!(choose("linux", Some("ext4"), Strategy::Poll).strategy, Strategy::Poll);
        assert_eq!(choose("linux", Some("nfs"), Strategy::Native).strategy, Strategy::Native);
    }

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
    }
}
