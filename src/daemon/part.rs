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
