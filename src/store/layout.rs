//! Every path of PROTOCOL §1 in one place.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Layout { root: root.into() }
    }

    /// PROTOCOL §1: `--root`, `$RUNSPOOL_ROOT`, `$PI_SUBAGENTS_TEMP_ROOT`,
    /// else `<$TMPDIR or /tmp>/pi-subagents-uid-<uid>`.
    pub fn resolve(flag: Option<&Path>, config_root: Option<&Path>) -> Self {
        if let Some(p) = flag {
            return Layout::new(p);
        }
        for var in ["RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"] {
            if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                return Layout::new(PathBuf::from(v));
            }
        }
        if let Some(p) = config_root {
            return Layout::new(p);
        }
        let tmp =
            std::env::var_os("TMPDIR").filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
        Layout::new(tmp.join(format!("pi-subagents-uid-{}", nix::unistd::getuid())))
    }

    /// What chooses the root ahead of the config file's `root` key (PROTOCOL
    /// §1, same order as `resolve`): `--root DIR` or `VAR=value`, or None
    /// when the config's `root` (or the default) decides.
    pub fn root_override(flag: Option<&Path>) -> Option<String> {
        if let Some(p) = flag {
            return Some(format!("--root {}", p.display()));
        }
        ["RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"].into_iter().find_map(|var| {
            std::env::var_os(var).filter(|v| !v.is_empty()).map(|v| format!("{var}={}", v.to_string_lossy()))
        })
    }

    pub fn spool(&self) -> PathBuf {
        self.root.join("spool")
    }
    pub fn rejected(&self) -> PathBuf {
        self.root.join("spool/rejected")
    }
    pub fn runs(&self) -> PathBuf {
        self.root.join("async-subagent-runs")
    }
    pub fn run_dir(&self, run_id: &str) -> PathBuf {
        self.runs().join(run_id)
    }
    pub fn active(&self) -> PathBuf {
        self.runs().join(".active-runs")
    }
    pub fn terminal(&self) -> PathBuf {
        self.runs().join(".terminal-runs")
    }
    pub fn results(&self) -> PathBuf {
        self.root.join("async-subagent-results")
    }
    pub fn daemon_dir(&self) -> PathBuf {
        self.root.join("runspool")
    }
    pub fn daemon_lock(&self) -> PathBuf {
        self.root.join("runspool/daemon.lock")
    }
    pub fn daemon_json(&self) -> PathBuf {
        self.root.join("runspool/daemon.json")
    }

    /// Directories the daemon creates (0700) in this order.
    pub fn dirs(&self) -> Vec<PathBuf> {
        vec![
            self.root.clone(),
            self.spool(),
            self.rejected(),
            self.runs(),
            self.active(),
            self.terminal(),
            self.results(),
            self.daemon_dir(),
        ]
    }
}

/// Files of one run directory (PROTOCOL §3).
pub struct RunPaths;
impl RunPaths {
    pub fn request(d: &Path) -> PathBuf {
        d.join("request.json")
    }
    pub fn status(d: &Path) -> PathBuf {
        d.join("status.json")
    }
    pub fn status_lock(d: &Path) -> PathBuf {
        d.join(".status.lock")
    }
    pub fn events(d: &Path) -> PathBuf {
        d.join("events.jsonl")
    }
    pub fn runner_lock(d: &Path) -> PathBuf {
        d.join("runner.lock")
    }
    pub fn control(d: &Path) -> PathBuf {
        d.join("control")
    }
    /// pi-subagents 0.67's stop inbox: `control/stop-requests/<ts>-<uuid>.json`.
    pub fn stop_requests(d: &Path) -> PathBuf {
        d.join("control").join("stop-requests")
    }
    pub fn output(d: &Path, i: usize) -> PathBuf {
        d.join(format!("output-{i}.log"))
    }
}
