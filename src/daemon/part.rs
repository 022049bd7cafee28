//! What the daemon's parts share: the `Env` they work with, and the
//! `Effect`s they hand back to the loop instead of calling each other.

use crate::config::Config;
use crate::protocol::status::Status;
use crate::providers::Providers;
use crate::store::{Layout, RunId, Writer};

use super::watch::Watch;

/// What every part works with: the root, the configuration, the one writer
/// (every capacity retry goes through it), the watcher and the providers
/// built from the configuration.
pub struct Env<'a> {
    pub layout: &'a Layout,
    pub cfg: &'a Config,
    pub w: &'a mut Writer,
    pub watch: &'a mut Watch,
    pub providers: &'a Providers,
}

/// What a part wants of the others; the loop applies it (`Daemon::apply`).
#[derive(Debug)]
pub enum Effect {
    /// A run to queue (claimed or recovered); its hooks follow it.
    Queue(RunId, Box<Status>),
    /// A run whose runner is not ours to spawn (re-adopted, or its lock is
    /// held): supervise it; its hooks follow it.
    Adopt(RunId),
    /// A supervised run ended: its hooks fire.
    Ended(RunId),
    /// A run of ours found ended at start-up that the previous daemon may
    /// not have seen end: its end is logged and counted.
    EndedUnseen(RunId),
    /// A terminal run of ours that another host ended (PROTOCOL §12): its
    /// leftover processes and external jobs are cleaned up.
    EndedElsewhere(RunId, Box<Status>),
    /// A claim committed but cut short: finished by its run directory.
    Unfinished(RunId),
    /// Look at the spool again now.
    ClaimAgain,
    /// This write (daemon.json) must not wait for room: spend the storage
    /// reserve on it.
    SpendReserve(std::path::PathBuf),
}

/// A real root in a temporary directory with everything an `Env` holds,
/// for the parts' unit tests.
#[cfg(test)]
pub mod testing {
    use std::sync::mpsc::{channel, Receiver};
    use std::time::Duration;

    use super::Env;
    use crate::config::Config;
    use crate::daemon::hint::Hint;
    use crate::daemon::watch::{Strategy, Watch};
    use crate::providers::Providers;
    use crate::store::{fsutil, Layout, RunId, Writer};

    pub struct Root {
        pub dir: tempfile::TempDir,
        pub layout: Layout,
        pub cfg: Config,
        pub w: Writer,
        pub watch: Watch,
        pub providers: Providers,
        /// The watcher's hints (kept, so the watcher's channel stays open).
        _hints: Receiver<Hint>,
    }

    impl Root {
        pub fn new() -> Root {
            Root::with(Config::default())
        }

        pub fn with(cfg: Config) -> Root {
            let dir = tempfile::tempdir().unwrap();
            let layout = Layout::new(dir.path());
            for d in layout.dirs() {
                fsutil::mkdir_private_all(&d).unwrap();
            }
            let (tx, hints) = channel();
            let watch = Watch::start(&layout, tx, Strategy::Poll, Duration::from_millis(100)).unwrap();
            let providers = crate::providers::build_all(&cfg);
            Root { dir, layout, cfg, w: Writer::new(), watch, providers, _hints: hints }
        }

        pub fn env(&mut self) -> Env<'_> {
            Env {
                layout: &self.layout,
                cfg: &self.cfg,
                w: &mut self.w,
                watch: &mut self.watch,
                providers: &self.providers,
            }
        }

        /// Drop a request for one `sh -c script` step into the spool as `<id>.json`.
        pub fn drop_request(&self, id: &str, script: &str) -> RunId {
            let body = serde_json::json!({
                "version": 1, "runId": id, "cwd": self.dir.path(),
                "steps": [{"agent": "t", "command": ["sh", "-c", script]}],
            });
            let tmp = self.layout.spool().join(format!(".{id}.tmp"));
            std::fs::write(&tmp, serde_json::to_vec(&body).unwrap()).unwrap();
            std::fs::rename(&tmp, self.layout.spool().join(format!("{id}.json"))).unwrap();
            RunId::parse(id).unwrap()
        }

        pub fn status(&self, id: &RunId) -> crate::protocol::status::Status {
            crate::store::run::read_status(&self.layout.run_dir(id)).unwrap().unwrap()
        }
    }
}
