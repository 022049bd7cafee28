//! Waiting on conditions with generous deadlines: the harness never trusts
//! timing. A timed-out wait panics with what it waited for and the daemon log.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{is_terminal_state, list_names, read_json, TestEnv, LONG};

/// Poll `f` every 50 ms until it returns true; panic naming `what` after `timeout`.
pub fn wait_until<F: FnMut() -> bool>(timeout: Duration, what: &str, mut f: F) {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {:?} waiting for: {}", timeout, what);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Like `wait_until` but returns whether the condition became true.
pub fn poll_until<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl TestEnv {
    /// Wait until the run's status is terminal; returns it.
    pub fn wait_terminal(&self, id: &str) -> Value {
        self.wait_terminal_for(id, LONG)
    }

    pub fn wait_terminal_for(&self, id: &str, timeout: Duration) -> Value {
        let mut last = None;
        let ok = poll_until(timeout, || {
            last = self.status(id);
            // The result file lands just after the terminal status (PROTOCOL §7):
            // a run is settled for a client once both are there.
            last.as_ref().and_then(|s| s["state"].as_str()).map(is_terminal_state).unwrap_or(false)
                && self.result_path(id).exists()
        });
        if !ok {
            panic!(
                "run {} not terminal after {:?}; last status: {}\n{}\nrunner stderr:\n{}",
                id,
                timeout,
                last.map(|v| v.to_string()).unwrap_or_else(|| "<none>".into()),
                self.log_tail(60),
                fs::read_to_string(self.run_dir(id).join("runner.stderr.log")).unwrap_or_default()
            );
        }
        last.unwrap()
    }

    /// Wait until the run's state equals `state`.
    pub fn wait_state(&self, id: &str, state: &str) -> Value {
        let mut last = None;
        let ok = poll_until(LONG, || {
            last = self.status(id);
            last.as_ref().and_then(|s| s["state"].as_str()) == Some(state)
        });
        if !ok {
            panic!(
                "run {} never reached state {}; last status: {}\n{}",
                id,
                state,
                last.map(|v| v.to_string()).unwrap_or_else(|| "<none>".into()),
                self.log_tail(60)
            );
        }
        last.unwrap()
    }

    /// Wait until a file exists (a step signals readiness through one).
    pub fn wait_file(&self, p: &Path) {
        wait_until(LONG, &format!("file {} to exist\n{}", p.display(), self.log_tail(40)), || p.exists());
    }

    /// The `<name>.error.json` of a rejected entry, once it exists.
    pub fn wait_rejection(&self, name: &str) -> Value {
        let p = self.rejected().join(format!("{}.error.json", name));
        let mut v = None;
        let ok = poll_until(LONG, || {
            v = read_json(&p);
            v.is_some()
        });
        if !ok {
            panic!(
                "no rejection for {} after {:?}; spool: {:?}; rejected: {:?}\n{}",
                name,
                LONG,
                self.pending_spool(),
                list_names(&self.rejected()),
                self.log_tail(60)
            );
        }
        v.unwrap()
    }
}
