//! File events as hints (DESIGN principle 6): the watcher only says "look
//! here"; the periodic rescan is the source of truth, so a lost event costs
//! latency, never a request.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;

use notify::{RecursiveMode, Watcher};

use crate::store::Layout;

#[derive(Debug)]
pub enum Hint {
    /// Something changed in the spool.
    Spool,
    /// Something changed in a run's control inbox.
    Control(String),
    /// The watcher lost events or failed: rescan everything.
    Rescan(String),
    /// A signal (SIGTERM, SIGINT, SIGHUP, SIGCHLD).
    Signal(i32),
}

pub struct Watch {
    native: Option<notify::RecommendedWatcher>,
    pub strategy: &'static str,
    pub backend: &'static str,
    pub reason: String,
    controls: HashSet<String>,
    layout: Layout,
}

const NATIVE_BACKEND: &str = if cfg!(target_os = "linux") {
    "inotify"
} else if cfg!(target_os = "macos") {
    "fsevents"
} else {
    "kqueue"
};

impl Watch {
    /// Start native watching of the spool unless the config asks for polling
    /// or the native backend fails; polling means the daemon loop rescans the
    /// spool every `poll_interval_ms`.
    pub fn start(layout: &Layout, tx: Sender<Hint>, strategy: &str) -> Result<Watch, String> {
        let mut w = Watch {
            native: None,
            strategy: "poll",
            backend: "poll",
            reason: String::new(),
            controls: HashSet::new(),
            layout: layout.clone(),
        };
        if strategy == "poll" {
            w.reason = "watch.strategy = \"poll\" in the config".into();
            return Ok(w);
        }
        match native(layout, tx) {
            Ok(n) => {
                w.native = Some(n);
                w.strategy = "native";
                w.backend = NATIVE_BACKEND;
                w.reason = format!("{NATIVE_BACKEND} is available");
            }
            Err(e) if strategy == "native" => {
                return Err(format!(
                    "watch.strategy = \"native\" but {NATIVE_BACKEND} could not start: {e}; raise the limits (sysctl fs.inotify.max_user_watches / max_user_instances) or use strategy = \"auto\""
                ))
            }
            Err(e) => {
                tracing::warn!(error = %e, "native file events unavailable; polling the spool");
                w.reason = format!("{NATIVE_BACKEND} failed: {e}");
            }
        }
        Ok(w)
    }

    pub fn is_native(&self) -> bool {
        self.native.is_some()
    }

    pub fn watch_control(&mut self, run_id: &str) {
        if self.controls.contains(run_id) {
            return;
        }
        if let Some(n) = self.native.as_mut() {
            let dir = self.layout.run_dir(run_id).join("control");
            if n.watch(&dir, RecursiveMode::NonRecursive).is_ok() {
                self.controls.insert(run_id.to_string());
            }
        }
    }

    pub fn unwatch_control(&mut self, run_id: &str) {
        if self.controls.remove(run_id) {
            if let Some(n) = self.native.as_mut() {
                let _ = n.unwatch(&self.layout.run_dir(run_id).join("control"));
            }
        }
    }
}

fn native(layout: &Layout, tx: Sender<Hint>) -> notify::Result<notify::RecommendedWatcher> {
    let spool = layout.spool();
    let runs = layout.runs();
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => {
            if ev.need_rescan() {
                let _ = tx.send(Hint::Rescan("the watcher lost events".into()));
                return;
            }
            for p in &ev.paths {
                if let Some(h) = classify(&spool, &runs, p) {
                    let _ = tx.send(h);
                }
            }
        }
        Err(e) => {
            let _ = tx.send(Hint::Rescan(format!("watcher error: {e}")));
        }
    })?;
    w.watch(&layout.spool(), RecursiveMode::NonRecursive)?;
    Ok(w)
}

fn classify(spool: &Path, runs: &Path, p: &Path) -> Option<Hint> {
    let parent = p.parent()?;
    if parent == spool {
        // Dot names are temps: only their rename to a real name matters.
        let name = p.file_name()?.to_string_lossy();
        return (!name.starts_with('.')).then_some(Hint::Spool);
    }
    if parent.file_name()? == "control" {
        let run_dir: PathBuf = parent.parent()?.to_path_buf();
        if run_dir.parent()? == runs {
            return Some(Hint::Control(run_dir.file_name()?.to_string_lossy().into_owned()));
        }
    }
    None
}
