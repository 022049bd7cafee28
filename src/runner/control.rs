//! The control inbox (PROTOCOL §9): legacy stop/timeout/interrupt files and
//! pi-subagents 0.67's stop requests, turned into the run's halt or stops of
//! single steps; and the run's own deadline. Owns the halt: the other parts
//! are told it by the `Runner`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::post::{Msg, Post};
use crate::protocol::outcome::Halt;
use crate::protocol::status::{Status, StepState};
use crate::store::inbox;
use crate::store::layout::{self, RunPaths};

/// The run "deadline" of a run without a time limit (`timeoutMs` 0): ten years.
const NO_LIMIT_MS: u64 = 10 * 365 * 86_400_000;

pub(super) struct Control {
    dir: PathBuf,
    run_id: String,
    timeout_ms: u64,
    halt: Option<Halt>,
    halt_reason: String,
    /// Steps a stop request named by `targetIndex` (0.67), with the reason.
    step_stop: BTreeMap<usize, String>,
    run_deadline: Instant,
    watcher: Option<notify::RecommendedWatcher>,
    /// When to start watching the control inbox (None: started or given up).
    watch_at: Option<Instant>,
}

impl Control {
    pub(super) fn new(dir: PathBuf, status: &Status) -> Control {
        let limit = if status.timeout_ms > 0 { status.timeout_ms } else { NO_LIMIT_MS };
        Control {
            dir,
            run_id: status.run_id.clone(),
            timeout_ms: status.timeout_ms,
            halt: None,
            halt_reason: String::new(),
            step_stop: BTreeMap::new(),
            run_deadline: Instant::now() + Duration::from_millis(limit),
            watcher: None,
            // Perf: the inbox is polled for the first 50 ms and watched after that, so a
            // short run never pays for the watcher thread and the slow inotify close at exit.
            watch_at: Some(Instant::now() + Duration::from_millis(50)),
        }
    }

    pub(super) fn halt(&self) -> Option<Halt> {
        self.halt
    }

    pub(super) fn halt_reason(&self) -> &str {
        &self.halt_reason
    }

    /// The steps a stop request named alone, with its reason.
    pub(super) fn step_stops(&self) -> &BTreeMap<usize, String> {
        &self.step_stop
    }

    /// The nearest of the run's deadline (while not halted) and the start of the watch.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        [self.halt.is_none().then_some(self.run_deadline), self.watch_at].into_iter().flatten().min()
    }

    /// A turn of the loop: start the watch when due and a step is still
    /// running (`steps_running`), read the inbox, halt the run at its
    /// deadline. Returns the `subagent.run.stop_requested` events' fields,
    /// for the record.
    pub(super) fn turn(&mut self, now: Instant, post: &Post, status: &Status, steps_running: bool) -> Vec<Value> {
        // Perf: a watch set up after the last step ended would only be torn
        // down again (a mkdir, inotify, epoll and a thread for nothing); the
        // check below reads what is there, and the next step's start sees
        // the watch started on the turn after it.
        if steps_running && self.watch_at.is_some_and(|t| now >= t) {
            self.watch_at = None;
            self.watch(post); // the check below sees what landed before the watch
        }
        let events = self.check(status);
        let now = Instant::now();
        if self.halt.is_none() && now >= self.run_deadline {
            let msg = format!("run timed out after {} ms", self.timeout_ms);
            self.request_halt(Halt::Timeout, msg);
        }
        events
    }

    fn watch(&mut self, post: &Post) {
        use notify::Watcher;
        let control = RunPaths::control(&self.dir);
        // A symlinked inbox is never watched: a recursive watch would walk
        // the directory it points at (`prepare` logs it once).
        if !inbox::prepare(&self.dir) {
            return;
        }
        let post = post.clone();
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            // Our own reads of control/ are no news (`platform::is_change`).
            if res.is_ok_and(|ev| !crate::platform::is_change(&ev.kind)) {
                return;
            }
            post.send(Msg::Control);
        });
        match watcher {
            // Recursive: 0.67's stop requests land in control/stop-requests/.
            Ok(mut wt) => match wt.watch(&control, notify::RecursiveMode::Recursive) {
                Ok(()) => self.watcher = Some(wt),
                Err(e) => crate::note!("watching {} failed ({e}); checking it every second", control.display()),
            },
            Err(e) => crate::note!("no file watcher ({e}); checking the control inbox every second"),
        }
    }

    /// Perf: drop the inotify watch before the terminal writes; closing an
    /// inotify fd that still has a watch waits for an RCU grace period
    /// (~10 ms) at exit, delaying the daemon's reaping.
    pub(super) fn unwatch(&mut self) {
        if let Some(w) = self.watcher.as_mut() {
            use notify::Watcher;
            let _ = w.unwatch(&RunPaths::control(&self.dir));
        }
    }

    /// Consume control files: pi-subagents 0.67's stop requests in `ts`
    /// order, then the legacy `stop.json`, `timeout.json`, `interrupt.json`.
    pub(super) fn check(&mut self, status: &Status) -> Vec<Value> {
        let mut events = Vec::new();
        // Opened without following: a symlinked control/ or stop-requests/
        // is no inbox (logged once), and nothing it points at is read or removed.
        let Some(control) = inbox::open(&self.dir) else { return events };
        for r in inbox::take_stop_requests(&control, |_| true, usize::MAX) {
            events.push(self.on_stop_request(r, status));
        }
        for (name, kind) in [
            (layout::CONTROL_STOP, Halt::Stop),
            (layout::CONTROL_TIMEOUT, Halt::Timeout),
            (layout::CONTROL_INTERRUPT, Halt::Interrupt),
        ] {
            // Only a regular file is a request (any body); anything else there is removed unopened.
            let Some(bytes) = inbox::legacy(&control, name) else { continue };
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(json!({}));
            let reason = body.get("reason").and_then(|v| v.as_str()).map(str::to_string);
            let source = body.get("source").and_then(|v| v.as_str()).unwrap_or("control inbox").to_string();
            let msg = match kind {
                Halt::Stop => format!("stopped by {source}"),
                Halt::Timeout => format!("timed out by {source}"),
                Halt::Interrupt => format!("interrupted by {source}"),
            };
            let msg = match reason {
                Some(r) => format!("{msg}: {r}"),
                None => msg,
            };
            self.request_halt(kind, msg);
            inbox::remove_legacy(&control, name);
        }
        events
    }

    /// A stop request stops the step `targetIndex` names when that step has
    /// not ended yet, else the whole run; the event says which. A `childId`
    /// names none of runspool's steps (they carry no child ids).
    fn on_stop_request(&mut self, r: crate::protocol::control::StopRequest, status: &Status) -> Value {
        let msg = crate::protocol::control::describe(&r, "a stop request");
        let n = status.steps.len();
        let step = r.target_index.map(|t| t as usize).filter(|&t| t < n);
        let open = |s: &StepState| matches!(s, StepState::Pending | StepState::Running);
        let (scope, note) = match (step, &r.child_id) {
            (Some(i), _) if open(&status.steps[i].status) => {
                self.step_stop.entry(i).or_insert(msg.clone());
                ("step", format!("stopping step {i}"))
            }
            (Some(i), _) => ("none", format!("step {i} already ended; nothing to stop")),
            (None, _) if r.target_index.is_some() => (
                "run",
                format!(
                    "targetIndex {} names no step of this run ({n} steps); stopping the run",
                    r.target_index.unwrap_or(0)
                ),
            ),
            (None, Some(c)) => ("run", format!("childId `{c}` names no step of this run; stopping the run")),
            (None, None) => ("run", "stopping the run".to_string()),
        };
        let fields = json!({"scope": scope, "stepIndex": step, "targetIndex": r.target_index, "childId": r.child_id,
                   "source": r.source, "reason": r.reason, "message": note});
        if scope == "run" {
            self.request_halt(Halt::Stop, msg);
        }
        fields
    }

    fn request_halt(&mut self, kind: Halt, reason: String) {
        if self.halt.is_some_and(|h| h >= kind) {
            return;
        }
        tracing::info!(run_id = %self.run_id, "halting: {reason}");
        self.halt = Some(kind);
        self.halt_reason = reason;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(dir: &std::path::Path, timeout_ms: u64) -> Status {
        let body = json!({"version": 1, "cwd": dir.display().to_string(), "timeoutMs": timeout_ms,
                          "steps": [{"command": ["true"]}]});
        let req = serde_json::from_value(body).unwrap();
        Status::queued(&req, "run-control-test", dir, crate::now_ms())
    }

    #[test]
    fn a_legacy_request_halts_the_run_once_and_a_stronger_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let s = status(dir.path(), 600_000);
        let mut c = Control::new(dir.path().to_path_buf(), &s);
        assert!(c.check(&s).is_empty() && c.halt().is_none(), "no inbox: no halt");
        assert!(inbox::prepare(dir.path()));
        let interrupt = RunPaths::control_file(dir.path(), layout::CONTROL_INTERRUPT);
        std::fs::write(&interrupt, r#"{"source": "test"}"#).unwrap();
        c.check(&s);
        assert_eq!((c.halt(), c.halt_reason()), (Some(Halt::Interrupt), "interrupted by test"));
        assert!(!interrupt.exists(), "a request is consumed");
        let stop = RunPaths::control_file(dir.path(), layout::CONTROL_STOP);
        std::fs::write(&stop, r#"{"source": "test", "reason": "enough"}"#).unwrap();
        c.check(&s);
        assert_eq!((c.halt(), c.halt_reason()), (Some(Halt::Stop), "stopped by test: enough"));
        std::fs::write(&interrupt, "{}").unwrap();
        c.check(&s);
        assert_eq!(c.halt(), Some(Halt::Stop), "a weaker halt never replaces a stronger one");
        assert_eq!(c.next_wake(), c.watch_at, "a halted run's deadline no longer wakes the loop");
    }

    #[test]
    fn the_run_deadline_halts_the_run_as_timed_out() {
        let dir = tempfile::tempdir().unwrap();
        let s = status(dir.path(), 1);
        let mut c = Control::new(dir.path().to_path_buf(), &s);
        std::thread::sleep(Duration::from_millis(5));
        let (tx, _rx) = std::sync::mpsc::channel();
        let (_a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let post = Post { tx, wake: std::sync::Arc::new(b) };
        c.turn(Instant::now(), &post, &s, true);
        assert_eq!((c.halt(), c.halt_reason()), (Some(Halt::Timeout), "run timed out after 1 ms"));
        c.unwatch();
    }
}
