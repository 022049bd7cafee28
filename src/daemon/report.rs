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
    /// Equal apart from the timestamps that change by themselves.
    pub fn same_as(&self, o: &DaemonStatus) -> bool {
        let mut a = self.clone();
        a.updated_at = o.updated_at;
        a.last_rescan_at = o.last_rescan_at;
        &a == o
    }
}
