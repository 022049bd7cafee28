//! The service manager's side channel (sd_notify(3), systemd's watchdog),
//! without libsystemd: what it put in our environment is read once and
//! removed, so no child inherits it. A no-op outside systemd (and under launchd).

use std::time::{Duration, Instant};

static NOTIFY_SOCKET: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
static WATCHDOG: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();

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
pub fn watchdog_interval() -> Option<Duration> {
    *WATCHDOG.get_or_init(watchdog_from_env)
}

fn watchdog_from_env() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok().and_then(|p| p.parse::<u32>().ok()) {
        if pid != std::process::id() {
            return None;
        }
    }
    Some(Duration::from_micros(usec / 2))
}

/// The systemd watchdog: fed (`WATCHDOG=1`) at half its period when one is
/// set for this process. Fed from the daemon's loop itself, so a wedged
/// loop gets restarted.
pub struct Watchdog {
    every: Option<Duration>,
    last: Instant,
}

impl Watchdog {
    pub fn new() -> Watchdog {
        Watchdog { every: watchdog_interval(), last: Instant::now() }
    }

    /// Feed the watchdog when it is due.
    pub fn feed(&mut self) {
        if self.every.is_some_and(|w| self.last.elapsed() >= w) {
            sd_notify("WATCHDOG=1");
            self.last = Instant::now();
        }
    }

    pub fn next_wake(&self) -> Option<Instant> {
        self.every.map(|w| self.last + w)
    }
}

impl Default for Watchdog {
    fn default() -> Self {
        Watchdog::new()
    }
}
