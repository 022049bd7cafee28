//! The control inboxes of queued runs (PROTOCOL §9), watched on Linux with
//! one raw inotify instance of our own instead of the `notify` crate's: a
//! backlog of 20,000 queued runs is 40,000 watched directories, and notify
//! keeps two maps with a full path per watch (about 12 MiB of the daemon's
//! heap). Here a watched run costs one map entry: its id and the numbers of
//! its two watches (about 70 bytes; 1.1 MiB for 20,000 runs).
//!
//! One thread blocks in poll(2) on the inotify descriptor (an idle daemon
//! is not woken by it) and reports a change of a run's inbox as
//! [`InboxEvent::Changed`]; a queue overflow as [`InboxEvent::Overflow`]
//! (the caller rescans). Events are hints: the periodic rescan still looks
//! at every inbox, so a watch that could not be added (the watch limit,
//! a directory gone) costs latency, never a stop.
//!
//! Symlinks are never followed: both directories are opened the way
//! `store::inbox` opens them ([`DirFd`]: `O_NOFOLLOW`, each relative to its
//! parent), and the watch is added on the opened directory itself through
//! `/proc/self/fd/<fd>`, so a `control/` or `stop-requests/` that is (or is
//! swapped for) a symlink gets no watch; the rescan finds no inbox there.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::store::dirfd::DirFd;
use crate::store::layout::{CONTROL_DIR, STOP_REQUESTS_DIR};
use crate::store::RunId;

/// What the reader thread reports.
#[derive(Debug)]
pub enum InboxEvent {
    /// Something was written, renamed into or created in this run's
    /// `control/` or `control/stop-requests/`, or one of them was removed.
    Changed(RunId),
    /// The kernel's event queue overflowed: events were lost.
    Overflow,
    /// Reading the inotify descriptor failed; no more events come.
    Failed(String),
}

/// The watches, shared with the reader thread: run → its watches of
/// `control/` and `stop-requests/` (-1: none), one entry per watched run.
///
/// Perf: there is no second map from watch to run. Runs enter and leave
/// it by the thousand in a backlog, while an event (a client writing to a
/// queued run's inbox) is rare: the reader thread finds an event's run by
/// going through the table (some microseconds for 20,000 runs; identical
/// events coalesce in the kernel while it is busy), and a second map would
/// cost a backlog of 20,000 runs another MiB. The kernel's IN_IGNORED for a
/// watch we removed ourselves is not looked up at all.
#[derive(Default)]
struct Table {
    runs: HashMap<Arc<str>, [i32; 2]>,
}

impl Table {
    /// The run a watch belongs to.
    fn run_of(&self, wd: i32) -> Option<&Arc<str>> {
        self.runs.iter().find(|(_, wds)| wds.contains(&wd)).map(|(id, _)| id)
    }

    /// Forget a run; its watches.
    fn remove(&mut self, id: &str) -> Option<[i32; 2]> {
        let wds = self.runs.remove(id)?;
        // A map never shrinks by itself: give back what a backlog grew it to.
        if self.runs.capacity() > 64 && self.runs.len() < self.runs.capacity() / 4 {
            self.runs.shrink_to_fit();
        }
        Some(wds)
    }

    /// How many directories are watched.
    fn watches(&self) -> usize {
        self.runs.values().flatten().filter(|&&w| w >= 0).count()
    }
}

/// The magic link `/proc/self/fd/<fd>` is followed to the opened directory;
/// a watch by path would follow a symlinked `control/` on the way to
/// `control/stop-requests/` (IN_DONT_FOLLOW guards the last component only).
const MASK: AddWatchFlags = AddWatchFlags::IN_ONLYDIR
    .union(AddWatchFlags::IN_CREATE)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_CLOSE_WRITE)
    .union(AddWatchFlags::IN_DELETE_SELF);

pub struct InboxWatch {
    inotify: Arc<Inotify>,
    table: Arc<Mutex<Table>>,
    /// The write end of a pipe the reader thread also polls: dropping it
    /// (with the `InboxWatch`) ends the thread, which closes the instance.
    _stop: OwnedFd,
    /// The watch limit was reached once (logged once).
    limit_logged: bool,
}

impl InboxWatch {
    /// A new inotify instance and its reader thread, which passes every
    /// event to `report` (it ends when `report` returns false).
    pub fn start(report: impl Fn(InboxEvent) -> bool + Send + 'static) -> io::Result<InboxWatch> {
        if !Path::new("/proc/self/fd").is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "/proc/self/fd is missing (watches are added through it); mount /proc",
            ));
        }
        let inotify = Arc::new(Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?);
        let (stop_r, stop_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let table = Arc::new(Mutex::new(Table::default()));
        let (ino, tab) = (inotify.clone(), table.clone());
        std::thread::Builder::new()
            .name("inbox-watch".into())
            .stack_size(64 * 1024)
            .spawn(move || read_loop(&ino, &tab, &stop_r, &report))?;
        Ok(InboxWatch { inotify, table, _stop: stop_w, limit_logged: false })
    }

    /// Watch the `control/` and `control/stop-requests/` of `run_dir`, the
    /// directory of `run` (the caller creates both). False when neither
    /// could be watched (missing, a symlink, the watch limit): the rescan
    /// covers that inbox.
    pub fn watch(&mut self, run: &RunId, run_dir: &Path) -> bool {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if t.runs.contains_key(run.as_str()) {
            return true;
        }
        let dirs = match DirFd::open(run_dir).and_then(|d| d.open_sub(CONTROL_DIR)) {
            Ok(control) => {
                let stop = control.open_sub(STOP_REQUESTS_DIR);
                [Ok(control), stop]
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot watch a control inbox; the rescan covers it");
                return false;
            }
        };
        let mut wds = [-1i32; 2];
        for (slot, dir) in dirs.into_iter().enumerate() {
            let dir = match dir {
                Ok(d) => d,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot watch a control inbox; the rescan covers it");
                    continue;
                }
            };
            let by_fd = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
            // A directory watched for another run already (a run directory
            // swapped under us) gets that watch's number: whichever run
            // leaves first removes it, and the rescan covers the other.
            match self.inotify.add_watch(by_fd.as_str(), MASK) {
                Ok(wd) => wds[slot] = wd.as_raw(),
                Err(Errno::ENOSPC) => {
                    if !self.limit_logged {
                        self.limit_logged = true;
                        tracing::warn!(
                            "the inotify watch limit is reached (fs.inotify.max_user_watches): the control inboxes of some queued runs are looked at by the periodic rescan only; raise the limit with sysctl fs.inotify.max_user_watches"
                        );
                    }
                }
                Err(e) => {
                    tracing::debug!(dir = %dir.path().display(), error = %e, "cannot watch a control inbox; the rescan covers it");
                }
            }
        }
        if wds == [-1, -1] {
            return false;
        }
        t.runs.insert(Arc::from(run.as_str()), wds);
        true
    }

    /// Stop watching a run's inbox (it left the queue).
    pub fn unwatch(&mut self, run: &RunId) {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let Some(wds) = t.remove(run.as_str()) else { return };
        for wd in wds.into_iter().filter(|&wd| wd >= 0) {
            // SAFETY: inotify_rm_watch takes two integers; an unknown `wd` is EINVAL.
            unsafe { libc::inotify_rm_watch(self.inotify.as_fd().as_raw_fd(), wd) };
        }
    }

    pub fn contains(&self, run: &RunId) -> bool {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).runs.contains_key(run.as_str())
    }

    /// The runs watched, e.g. to move them to another watcher.
    pub fn runs(&self) -> Vec<RunId> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.runs.keys().filter_map(|id| RunId::parse(id)).collect()
    }

    /// How many directories are watched.
    pub fn watches(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).watches()
    }
}

fn read_loop(ino: &Inotify, table: &Mutex<Table>, stop: &OwnedFd, report: &dyn Fn(InboxEvent) -> bool) {
    loop {
        let mut fds = [PollFd::new(ino.as_fd(), PollFlags::POLLIN), PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                report(InboxEvent::Failed(format!("poll on the inotify descriptor failed: {e}")));
                return;
            }
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            return; // the InboxWatch was dropped
        }
        loop {
            let events = match ino.read_events() {
                Ok(ev) => ev,
                Err(Errno::EAGAIN) => break,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    report(InboxEvent::Failed(format!("reading the inotify descriptor failed: {e}")));
                    return;
                }
            };
            for ev in events {
                if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    if !report(InboxEvent::Overflow) {
                        return;
                    }
                    continue;
                }
                // A watch gone: removed by us (the run left the queue), or
                // its directory was (IN_DELETE_SELF said so first). The
                // number is never handed out again soon (the kernel counts
                // up), so one left in the table until the run leaves is harmless.
                if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                    continue;
                }
                // Dot names are temps of writers at work: only their rename counts.
                if ev.name.as_ref().is_some_and(|n| n.as_encoded_bytes().starts_with(b".")) {
                    continue;
                }
                let run = table
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .run_of(ev.wd.as_raw())
                    .and_then(|id| RunId::parse(id));
                if let Some(run) = run {
                    if !report(InboxEvent::Changed(run)) {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn inbox(root: &Path, id: &str) -> (RunId, std::path::PathBuf, std::path::PathBuf) {
        let run = root.join(id);
        let control = run.join("control");
        let stop = control.join("stop-requests");
        std::fs::create_dir_all(&stop).unwrap();
        (RunId::parse(id).unwrap(), control, stop)
    }

    fn run_dir(control: &Path) -> &Path {
        control.parent().unwrap()
    }

    fn started() -> (InboxWatch, mpsc::Receiver<InboxEvent>) {
        let (tx, rx) = mpsc::channel();
        let w = InboxWatch::start(move |e| tx.send(e).is_ok()).unwrap();
        (w, rx)
    }

    /// The next run reported within a generous deadline, skipping nothing.
    fn next_run(rx: &mpsc::Receiver<InboxEvent>) -> Option<String> {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(InboxEvent::Changed(id)) => Some(id.as_str().to_string()),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => None,
        }
    }

    #[test]
    fn a_file_in_either_directory_names_its_run() {
        let tmp = tempfile::tempdir().unwrap();
        let (w, rx) = started();
        let mut w = w;
        let (a, a_control, a_stop) = inbox(tmp.path(), "run-a");
        let (b, b_control, b_stop) = inbox(tmp.path(), "run-b");
        assert!(w.watch(&a, run_dir(&a_control)));
        assert!(w.watch(&b, run_dir(&b_control)));
        assert_eq!(w.watches(), 4);

        std::fs::write(b_stop.join("1-x.json"), b"{}").unwrap();
        assert_eq!(next_run(&rx).as_deref(), Some("run-b"));
        while rx.recv_timeout(Duration::from_millis(200)).is_ok() {} // its close-write too
        std::fs::write(a_control.join("stop.json"), b"{}").unwrap();
        assert_eq!(next_run(&rx).as_deref(), Some("run-a"));
        while rx.recv_timeout(Duration::from_millis(200)).is_ok() {}
        // A temp being written wakes nobody; its rename into place does.
        std::fs::write(a_stop.join(".tmp"), b"{}").unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        std::fs::rename(a_stop.join(".tmp"), a_stop.join("2-y.json")).unwrap();
        assert_eq!(next_run(&rx).as_deref(), Some("run-a"));
    }

    #[test]
    fn a_symlinked_inbox_is_neither_watched_nor_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let (mut w, rx) = started();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir_all(elsewhere.join("stop-requests")).unwrap();
        let run = tmp.path().join("run-s");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&elsewhere, run.join("control")).unwrap();
        let id = RunId::parse("run-s").unwrap();
        assert!(!w.watch(&id, &run));
        assert!(!w.contains(&id));
        assert_eq!(w.watches(), 0);
        std::fs::write(elsewhere.join("stop.json"), b"{}").unwrap();
        std::fs::write(elsewhere.join("stop-requests").join("1-x.json"), b"{}").unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err(), "the link's target was watched");
    }

    #[test]
    fn unwatching_frees_the_watches() {
        let tmp = tempfile::tempdir().unwrap();
        let (mut w, rx) = started();
        let (a, control, stop) = inbox(tmp.path(), "run-a");
        assert!(w.watch(&a, run_dir(&control)));
        assert_eq!(w.watches(), 2);
        w.unwatch(&a);
        assert_eq!(w.watches(), 0);
        assert!(!w.contains(&a));
        assert!(w.runs().is_empty());
        std::fs::write(control.join("stop.json"), b"{}").unwrap();
        std::fs::write(stop.join("1-x.json"), b"{}").unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err(), "an unwatched inbox still reports");
        // The kernel's side too: this instance holds no watch any more.
        let fd = w.inotify.as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        assert!(!info.contains("inotify wd:"), "{info}");
        // A removed inbox says so (its run is looked at), and unwatching it then is harmless.
        assert!(w.watch(&a, run_dir(&control)));
        std::fs::remove_dir_all(tmp.path().join("run-a")).unwrap();
        assert_eq!(next_run(&rx).as_deref(), Some("run-a"));
        w.unwatch(&a);
        assert!(!w.contains(&a));
        assert_eq!(w.watches(), 0);
    }

    #[test]
    fn dropping_it_ends_the_thread() {
        let (tx, rx) = mpsc::channel::<()>();
        let w = InboxWatch::start(move |_| {
            let _keep = &tx;
            true
        })
        .unwrap();
        drop(w);
        // The thread owned the only sender: its end disconnects the channel.
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Err(mpsc::RecvTimeoutError::Disconnected));
    }
}
