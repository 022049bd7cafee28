//! The loop's inbox: everything that wakes the daemon arrives as a `Hint`
//! on one channel (file events from the watcher, signals, bridge workers).
//! A hint only says "look here"; the turn that follows does the work.

use std::sync::mpsc::Sender;

#[derive(Debug)]
pub enum Hint {
    /// Something changed in the spool.
    Spool,
    /// `runspool/queue.json` changed (queue control).
    Queue,
    /// Something changed in a run's control inbox.
    Control(crate::store::RunId),
    /// Events may have been lost (queue overflow): rescan everything.
    Rescan(String),
    /// The watcher itself failed: replace it, then rescan.
    WatchFailed(String),
    /// A signal (SIGTERM, SIGINT, SIGHUP, SIGCHLD).
    Signal(i32),
    /// A request file appeared in a run's `external-job-requests/`.
    Bridge(String),
    /// A runner forked by the fork server exited, or the server is gone.
    RunnerExited,
    /// A bridge worker finished request `id` of `run_id` (`retry`: a recovery lookup failed).
    BridgeDone { run_id: String, id: String, retry: bool },
}

/// Forward SIGTERM, SIGINT, SIGHUP and SIGCHLD to the loop as hints
/// (`Daemon::start` does, first thing).
pub fn forward_signals(tx: Sender<Hint>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGCHLD, SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP, SIGCHLD])?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for s in signals.forever() {
            if tx.send(Hint::Signal(s)).is_err() {
                break;
            }
        }
    })?;
    Ok(())
}
