//! `runspool/daemon.json` (PROTOCOL §10), the storage reserve that lets it
//! be written on a full filesystem, and the free-space rule the daemon and
//! the CLI share.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::watch::{self, Watch};
use crate::config::Config;
use crate::protocol::daemon::{ConfigInfo, DaemonStatus, QueueInfo, RunCounts, StewardInfo, StorageInfo, WatchInfo};
use crate::store::{Layout, Writer};

/// Run counts in daemon.json and STATUS= lag by at most this much.
const REPORT_EVERY: Duration = Duration::from_millis(250);
/// daemon.json is rewritten at least this often (its `updatedAt` says the daemon lives).
const REPORT_AT_LEAST: Duration = Duration::from_secs(60);

/// The queue objects are equal but for their counts.
fn same_control(a: &Option<QueueInfo>, b: &Option<QueueInfo>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.same_control(b),
        (a, b) => a == b,
    }
}

/// What the rest of the daemon knows that daemon.json reports.
pub struct Facts {
    pub runs: RunCounts,
    pub queue: QueueInfo,
    /// Why storage is `degraded`; None: `ok`.
    pub degraded: Option<String>,
    pub last_rescan_at: Option<i64>,
    pub min_free_bytes: u64,
    /// The configuration's `steward`.
    pub steward: bool,
}

/// The report part: daemon.json as last written, the reserve that lets it
/// be written on a full filesystem, and the systemd watchdog.
pub struct Reporter {
    status: DaemonStatus,
    reserve: Reserve,
    last_write: Instant,
    /// Counts changed but were written less than REPORT_EVERY ago.
    due: Option<Instant>,
    watchdog: Option<Duration>,
    last_watchdog: Instant,
}

impl Reporter {
    pub fn new(l: &Layout, cfg: &Config, config_path: Option<&Path>, w: &Watch) -> Reporter {
        let pid = std::process::id();
        let now = crate::now_ms();
        let status = DaemonStatus {
            version: 1,
            pid,
            hostname: crate::platform::hostname(),
            start_identity: crate::platform::start_identity(pid),
            started_at: now,
            updated_at: now,
            runspool_version: env!("CARGO_PKG_VERSION").to_string(),
            watch: WatchInfo {
                strategy: w.strategy_name().into(),
                backend: w.choice.backend.into(),
                reason: w.choice.reason.clone(),
                fs_type: watch::fs_type(&l.root),
                inotify: crate::platform::inotify_usage(),
            },
            storage: StorageInfo {
                state: "ok".into(),
                reason: None,
                since: None,
                min_free_bytes: Some(cfg.storage.min_free_bytes),
            },
            runs: RunCounts { queued: 0, running: 0 },
            last_rescan_at: None,
            config: Some(cfg.info(config_path)),
            queue: None,
            steward: Some(StewardInfo { enabled: cfg.steward }),
        };
        let reserve = Reserve::new(l);
        let now = Instant::now();
        Reporter { status, reserve, last_write: now, due: None, watchdog: watchdog_interval(), last_watchdog: now }
    }

    /// When this daemon started (daemon.json `startedAt`), ms since the epoch.
    pub fn started_at(&self) -> i64 {
        self.status.started_at
    }

    pub fn set_config(&mut self, info: ConfigInfo) {
        self.status.config = Some(info);
    }

    /// Write daemon.json (and STATUS=) when something changed: a change of
    /// storage, watch or queue state at once, run counts at most every
    /// REPORT_EVERY, and at least every minute. `force`: now, whatever changed.
    pub fn write(&mut self, w: &mut Writer, l: &Layout, watch: &Watch, facts: Facts, force: bool) {
        let mut r = self.status.clone();
        r.last_rescan_at = facts.last_rescan_at;
        if r.watch.backend != watch.choice.backend.as_str() {
            r.watch.inotify = crate::platform::inotify_usage();
        }
        r.watch.strategy = watch.strategy_name().into();
        r.watch.backend = watch.choice.backend.into();
        r.watch.reason = watch.choice.reason.clone();
        r.runs = facts.runs;
        r.queue = Some(facts.queue);
        r.steward = Some(StewardInfo { enabled: facts.steward });
        let min_free_bytes = Some(facts.min_free_bytes);
        r.storage = match facts.degraded {
            Some(reason) => StorageInfo {
                min_free_bytes,
                state: "degraded".into(),
                since: Some(
                    self.status
                        .storage
                        .since
                        .filter(|_| self.status.storage.state == "degraded")
                        .unwrap_or_else(crate::now_ms),
                ),
                reason: Some(reason),
            },
            None => StorageInfo { state: "ok".into(), reason: None, since: None, min_free_bytes },
        };
        if !force && r.same_as(&self.status) && self.last_write.elapsed() < REPORT_AT_LEAST {
            self.due = None;
            return;
        }
        // Perf: run counts change with every claim and every exit; in a burst,
        // rewriting daemon.json (and STATUS=) each time competed with the
        // runners for the CPU.
        let urgent = r.storage.state != self.status.storage.state
            || r.watch.backend != self.status.watch.backend
            || !same_control(&r.queue, &self.status.queue);
        if !force && !urgent && self.last_write.elapsed() < REPORT_EVERY {
            self.due = Some(self.last_write + REPORT_EVERY);
            return;
        }
        self.due = None;
        sd_notify(&format!(
            "STATUS=watching {}; {} running, {} queued; storage {}",
            r.watch.backend, r.runs.running, r.runs.queued, r.storage.state
        ));
        r.updated_at = crate::now_ms();
        let bytes = serde_json::to_vec_pretty(&r).unwrap_or_default();
        let path = l.daemon_json();
        if let Err(e) = w.write(&path, bytes, false) {
            tracing::warn!(error = %e, "cannot write daemon.json");
        }
        // A full filesystem must not keep daemon.json saying `ok`: spend the
        // reserve on it (docs/watching-and-storage.md).
        if w.pending_for(&path).is_some() && self.reserve.release() {
            w.flush_path(&path);
            self.reserve.take_back();
        }
        self.status = r;
        self.last_write = Instant::now();
    }

    /// Grow the reserve back once there is room (tried every 10 s), and feed
    /// the watchdog. It is fed from the loop itself, so a wedged loop gets
    /// restarted.
    pub fn turn(&mut self) {
        self.reserve.ensure();
        if self.watchdog.is_some_and(|w| self.last_watchdog.elapsed() >= w) {
            sd_notify("WATCHDOG=1");
            self.last_watchdog = Instant::now();
        }
    }

    pub fn next_wake(&self) -> Option<Instant> {
        [
            Some(self.last_write + REPORT_AT_LEAST),
            self.due,
            self.reserve.next_wake(),
            self.watchdog.map(|w| self.last_watchdog + w),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

pub use crate::store::fsutil::space_shortage;

/// Space preallocated in `runspool/storage-reserve` so that the daemon can
/// still write its own `daemon.json` (and say `degraded`) on a filesystem
/// someone else filled to the last byte: released (unlinked, which frees
/// its blocks and its inode) when a daemon.json write meets a capacity
/// error, and what that write left over taken back at once, so spending the
/// reserve gives nobody else room; grown back to full size once there is
/// room again.
pub struct Reserve {
    path: PathBuf,
    /// Bytes allocated now (0: no reserve file).
    size: u64,
    released: bool,
    next_try: Instant,
}

pub const RESERVE_BYTES: u64 = 64 * 1024;
const RESERVE_RETRY: Duration = Duration::from_secs(10);

impl Reserve {
    pub fn new(l: &Layout) -> Reserve {
        Reserve { path: l.storage_reserve(), size: 0, released: false, next_try: Instant::now() }
    }

    /// Bring the reserve to its full size when it is short (at most every 10 s).
    pub fn ensure(&mut self) {
        if self.size >= RESERVE_BYTES || Instant::now() < self.next_try {
            return;
        }
        match preallocate(&self.path, RESERVE_BYTES, self.size) {
            Ok(()) => {
                self.size = RESERVE_BYTES;
                if std::mem::take(&mut self.released) {
                    tracing::info!(path = %self.path.display(), "storage reserve recreated");
                }
            }
            Err(e) => {
                self.next_try = Instant::now() + RESERVE_RETRY;
                tracing::debug!(path = %self.path.display(), error = %e, "cannot grow the storage reserve yet");
            }
        }
    }

    /// When `ensure` should try again (None: the reserve is whole).
    pub fn next_wake(&self) -> Option<Instant> {
        (self.size < RESERVE_BYTES).then_some(self.next_try)
    }

    /// Give the reserve's space back. True when there was one to give.
    pub fn release(&mut self) -> bool {
        if self.size == 0 {
            return false;
        }
        self.size = 0;
        self.released = true;
        self.next_try = Instant::now() + RESERVE_RETRY;
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                tracing::warn!(path = %self.path.display(), "released the storage reserve to write daemon.json on a full filesystem");
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot release the storage reserve");
                false
            }
        }
    }

    /// Right after a release and the write it made room for: keep what the
    /// write did not use, so the release frees nothing for anyone else.
    pub fn take_back(&mut self) {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        let avail = crate::platform::free_space(dir).map(|(b, _)| b).unwrap_or(0);
        let len = avail.min(RESERVE_BYTES) / 4096 * 4096;
        if len > 0 && preallocate(&self.path, len, 0).is_ok() {
            self.size = len;
        }
    }
}

/// Allocate `len` bytes in the regular file at `path` (created 0600, never
/// through a symlink; an existing one is reused). On failure the file is
/// cut back to `keep` bytes, or removed when `keep` is 0.
fn preallocate(path: &Path, len: u64, keep: u64) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::other(format!("{} is not a regular file; remove it", path.display())));
    }
    let r = allocate(&f, len);
    if r.is_err() {
        if keep == 0 {
            let _ = std::fs::remove_file(path);
        } else {
            let _ = f.set_len(keep);
        }
    }
    r
}

#[cfg(target_os = "linux")]
fn allocate(f: &std::fs::File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    match unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) } {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(not(target_os = "linux"))]
fn allocate(mut f: &std::fs::File, len: u64) -> io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&vec![0u8; len as usize])?;
    f.sync_all()
}

static NOTIFY_SOCKET: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
static WATCHDOG: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();

/// Read what the service manager put in our environment (`NOTIFY_SOCKET`,
/// `WATCHDOG_*`), then remove every variable of `platform::SCRUBBED_ENV` from
/// it, so no child (runner, step, hook, provider) inherits them. Perf: with
/// nothing to remove, a runner is spawned without copying the environment.
/// Call it before any other thread starts (it changes the environment).
pub fn take_service_env() {
    let _ = notify_socket();
    let _ = watchdog_interval();
    for k in crate::platform::SCRUBBED_ENV {
        std::env::remove_var(k);
    }
}

fn notify_socket() -> Option<&'static std::ffi::OsString> {
    NOTIFY_SOCKET.get_or_init(|| std::env::var_os("NOTIFY_SOCKET")).as_ref()
}

/// sd_notify(3) without libsystemd: one datagram to `$NOTIFY_SOCKET`.
/// A no-op outside systemd (and under launchd).
pub fn sd_notify(state: &str) {
    let Some(path) = notify_socket() else { return };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(_) => return,
    };
    let bytes = path.as_encoded_bytes();
    let r = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
                .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = abstract_name;
            Ok(0)
        }
    } else {
        sock.send_to(state.as_bytes(), std::path::Path::new(path))
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Half the systemd watchdog period, when one is set for this process.
pub fn watchdog_interval() -> Option<std::time::Duration> {
    *WATCHDOG.get_or_init(watchdog_from_env)
}

fn watchdog_from_env() -> Option<std::time::Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok().and_then(|p| p.parse::<u32>().ok()) {
        if pid != std::process::id() {
            return None;
        }
    }
    Some(std::time::Duration::from_micros(usec / 2))
}
