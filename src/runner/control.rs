//! The control inbox (PROTOCOL §9): legacy stop/timeout/interrupt files and
//! pi-subagents 0.67's stop requests, turned into halts or step stops.

use serde_json::json;

use super::{Msg, Runner};
use crate::protocol::outcome::Halt;
use crate::protocol::status::StepState;
use crate::store::inbox;
use crate::store::layout::{self, RunPaths};

impl Runner {
    pub(super) fn watch_control(&mut self) {
        use notify::Watcher;
        let control = RunPaths::control(&self.dir);
        // A symlinked inbox is never watched: a recursive watch would walk
        // the directory it points at (`prepare` logs it once).
        if !inbox::prepare(&self.dir) {
            return;
        }
        let post = self.post.clone();
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
                Ok(()) => self._watcher = Some(wt),
                Err(e) => crate::note!("watching {} failed ({e}); checking it every second", control.display()),
            },
            Err(e) => crate::note!("no file watcher ({e}); checking the control inbox every second"),
        }
    }

    /// Consume control files: pi-subagents 0.67's stop requests in `ts`
    /// order, then the legacy `stop.json`, `timeout.json`, `interrupt.json`.
    pub(super) fn check_control(&mut self) {
        // Opened without following: a symlinked control/ or stop-requests/
        // is no inbox (logged once), and nothing it points at is read or removed.
        let Some(control) = inbox::open(&self.dir) else { return };
        for r in inbox::take_stop_requests(&control, |_| true, usize::MAX) {
            self.on_stop_request(r);
        }
        for (name, kind) in [
            (layout::CONTROL_STOP, Halt::Stop),
            (layout::CONTROL_TIMEOUT, Halt::Timeout),
            (layout::CONTROL_INTERRUPT, Halt::Interrupt),
        ] {
            // Only a regular file is a request (any body); anything else there is removed unopened.
            let Some(bytes) = inbox::legacy(&control, name) else { continue };
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(json!({}));
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
    }

    /// A stop request stops the step `targetIndex` names when that step has
    /// not ended yet, else the whole run; the event says which. A `childId`
    /// names none of runspool's steps (they carry no child ids).
    fn on_stop_request(&mut self, r: crate::protocol::control::StopRequest) {
        let msg = crate::protocol::control::describe(&r, "a stop request");
        let n = self.status.steps.len();
        let step = r.target_index.map(|t| t as usize).filter(|&t| t < n);
        let open = |s: &StepState| matches!(s, StepState::Pending | StepState::Running);
        let (scope, note) = match (step, &r.child_id) {
            (Some(i), _) if open(&self.status.steps[i].status) => {
                self.step_stop.entry(i).or_insert((msg.clone(), false));
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
        self.ev(
            "subagent.run.stop_requested",
            json!({"scope": scope, "stepIndex": step, "targetIndex": r.target_index, "childId": r.child_id,
                   "source": r.source, "reason": r.reason, "message": note}),
        );
        if scope == "run" {
            self.request_halt(Halt::Stop, msg);
        }
    }

    pub(super) fn request_halt(&mut self, kind: Halt, reason: String) {
        if self.halt.is_some_and(|h| h >= kind) {
            return;
        }
        tracing::info!(run_id = %self.status.run_id, "halting: {reason}");
        self.halt = Some(kind);
        self.halt_reason = reason;
    }
}
