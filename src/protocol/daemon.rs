//! `runspool/daemon.json` (PROTOCOL §10): what the daemon reports about
//! itself, read by the CLI (`status`, `doctor`, `providers`) and by clients.

use std::collections::BTreeMap;

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
    /// The configuration the daemon runs with (runspool extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigInfo>,
    /// Queue control as applied from `runspool/queue.json` (runspool extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueInfo>,
    /// Whether the steward (PROTOCOL §14.1) is on (runspool extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steward: Option<StewardInfo>,
}

/// `daemon.json` `steward`: whether the daemon reconciles pi-subagents runs
/// whose runner is gone (`steward` in the configuration).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StewardInfo {
    pub enabled: bool,
}

/// `daemon.json` `queue`: whether claiming and starting are paused (since
/// when, why), the effective `maxRunning` and the queue file's override of
/// the config's, and why a queue file present is ignored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct QueueInfo {
    pub paused: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub max_running: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running_override: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Queued runs per lane (PROTOCOL §15; lanes with none left out).
    #[serde(default)]
    pub by_lane: BTreeMap<String, usize>,
    /// Queued runs per `waiting` reason: `held`, `dependencies`,
    /// `not-before`, `paused`, `lane`, `max_running`.
    #[serde(default)]
    pub by_reason: BTreeMap<String, usize>,
    /// Runs with a live runner per lane.
    #[serde(default)]
    pub running_by_lane: BTreeMap<String, usize>,
}

impl QueueInfo {
    /// Equal apart from the counts (which change with every claim and start).
    pub fn same_control(&self, o: &QueueInfo) -> bool {
        let strip = |q: &QueueInfo| QueueInfo {
            by_lane: BTreeMap::new(),
            by_reason: BTreeMap::new(),
            running_by_lane: BTreeMap::new(),
            ..q.clone()
        };
        strip(self) == strip(o)
    }
}

/// `daemon.json` `config`: the file the daemon loaded (null: none, the
/// defaults) and the providers it configures, so `runspool providers`
/// describes the running daemon's rather than whatever file the CLI finds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ConfigInfo {
    pub path: Option<String>,
    pub providers: Vec<ProviderInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProviderInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
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
    pub inotify: Option<InotifyUsage>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StorageInfo {
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<i64>,
    /// The daemon's `storage.min_free_bytes`, so the CLI checks free space
    /// against the same floor (runspool extension).
    #[serde(default, rename = "minFreeBytes", skip_serializing_if = "Option::is_none")]
    pub min_free_bytes: Option<u64>,
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

/// Inotify limits (`/proc/sys/fs/inotify`, None where unreadable) and this
/// user's use: instances and watches (runspool extension).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InotifyUsage {
    pub max_user_instances: Option<u64>,
    pub max_user_watches: Option<u64>,
    pub max_queued_events: Option<u64>,
    pub instances: u64,
    pub watches: u64,
}
