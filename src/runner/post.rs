//! The runner loop's mailbox for its other threads (external-job drivers,
//! the control inbox watcher), and what they post to it.

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use serde_json::Value;

pub(super) enum Msg {
    /// News from the driver of external-job step `.0`.
    External(usize, Report),
    /// The control inbox changed.
    Control,
}

/// What an external-job step's driver reports.
pub(super) enum Report {
    /// `steps[i].externalJob` changed; `line` goes to the step's output log.
    Update { job: Value, line: Option<String> },
    /// The driver ended: whether the job completed (else why not, in
    /// `note`), its last record, and the output file the job named.
    Done { completed: bool, note: Option<String>, job: Value, output_file: Option<String> },
}

/// A message, then a byte on the wake socket, which SIGCHLD also writes
/// to. Perf: the loop sleeps in poll(2) on that socket and reaps its steps
/// with `try_wait`, so a step costs no waiter thread (a clone, a stack and
/// a malloc arena in every runner).
#[derive(Clone)]
pub(super) struct Post {
    pub(super) tx: Sender<Msg>,
    pub(super) wake: Arc<UnixStream>,
}

impl Post {
    pub(super) fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
        // A full socket already holds a wake-up.
        let _ = (&*self.wake).write(&[1]);
    }
}
