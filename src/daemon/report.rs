//! `runspool/daemon.json` (PROTOCOL §10).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DaemonStatus {
    pub version: u32,
    pub pid: u32,
    pub hostname: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_identity: Option<String>,
    pub started_at: i64,
    pub updated_at: i64,
    pub runspool_version: String,
    pub watch: WatchInfo,
    pub storage: StorageInfo,
    pub runs: RunCounts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rescan_at: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WatchInfo {
    pub strategy: String,
    pub backend: String,
    pub reason: String,
    /// The filesystem type under the root (runspool extension).
    #[serde(default, rename = "fsType", skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    /// Inotify limits and this user's use at the last watcher (re)start (runspool extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inotify: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StorageInfo {
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunCounts {
    pub queued: usize,
    pub running: usize,
}

impl DaemonStatus {
    /// Equal apart from `updatedAt`. A rescan changes `lastRescanAt`, which
    /// is rewritten too (§10: on every change of these fields): clients tell
    /// from it that a rescan happened, at one small write per rescan.
    pub fn same_as(&self, o: &DaemonStatus) -> bool {
        let mut a = self.clone();
        a.updated_at = o.updated_at;
        &a == o
    }
}

static NOTIFY_SOCKET: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
static WATCHDOG: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();

/// Read what the service manager put in our environment (`NOTIFY_SOCKET`,
/// `WATCHDOG_*`), then remove every variable of `runner::SCRUBBED_ENV` from
/// it, so no child (runner, step, hook, provider) inherits them. Perf: with
/// nothing to remove, a runner is spawned without copying the environment.
/// Call it before any other thread starts (it changes the environment).
pub fn take_service_env() {
    let _ = notify_socket();
    let _ = watchdog_interval();
    for k in crate::runner::SCRUBBED_ENV {
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
