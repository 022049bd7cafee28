//! `wait`: follow a run (or a request still in the spool, through its claim)
//! to its end, with a live progress line on a terminal.

use std::io::Write;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use serde_json::json;

use super::text::visible;
use crate::client::{daemon_running, Client, Stage, Target, WaitError};
use crate::protocol::status::{State, Status, StepState};
use crate::store::{fsutil, run, Layout, RunId};

/// `wait` for any target: a pending request is waited on through its claim.
pub(crate) fn wait(layout: &Layout, arg: &str, timeout: Option<Duration>, json: bool) -> anyhow::Result<i32> {
    let target = Client::from_layout(layout.clone()).resolve(arg)?;
    wait_target(layout, &target, timeout, json)
}

/// Wait for a terminal state of `target` (`Client::wait_for`). On a
/// terminal the wait keeps one live line (state, steps done, current step,
/// elapsed); else it prints a plain line whenever the state or the current
/// step changes. `json`: print the final status.json (or the rejection's
/// error file) on stdout.
pub(crate) fn wait_target(
    layout: &Layout,
    target: &Target,
    timeout: Option<Duration>,
    json: bool,
) -> anyhow::Result<i32> {
    let client = Client::from_layout(layout.clone());
    let start = Instant::now();
    let tty = !json && unsafe { libc::isatty(2) } == 1;
    let mut progress = Progress { tty, last_plain: String::new(), drawn: false };
    let id = target.run_id().map(|i| i.to_string()).unwrap_or_default();
    // Ctrl-C ends the wait, not the run: say so instead of vanishing silently.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _ = signal_hook::flag::register(libc::SIGINT, interrupted.clone());
    let r = client.wait_for(target, timeout, |stage| {
        if interrupted.load(std::sync::atomic::Ordering::Relaxed) {
            return ControlFlow::Break(());
        }
        match stage {
            Stage::Queued(s) | Stage::Running(s) => progress.show(&id, s, start.elapsed()),
            // A claim usually follows within milliseconds: say nothing for the first second.
            Stage::Pending(_) | Stage::Claimed(_) if start.elapsed() >= Duration::from_secs(1) => {
                let why = if daemon_running(layout) {
                    "the daemon has not claimed it yet; `runspool status` shows why"
                } else {
                    "no daemon is running: start one with `runspool daemon` or `runspool service start`"
                };
                progress.line(&format!("{id} waiting to be claimed ({why})"), start.elapsed());
            }
            _ => {}
        }
        ControlFlow::Continue(())
    });
    progress.clear();
    match r {
        Ok(s) => ended(&id, &s, json),
        // Refused before it ran: 2; withdrawn (stopped before its claim): 1, as a stopped run.
        // The same with a `rejected` status or only an error file.
        Err(WaitError::Rejected { status: Some(s), .. }) => ended(&id, &s, json).map(|_| 2),
        Err(WaitError::Withdrawn { status: Some(s), .. }) => ended(&id, &s, json).map(|_| 1),
        Err(WaitError::Rejected { refusal, .. }) => rejected(&refusal.error_file, json).map(|_| 2),
        Err(WaitError::Withdrawn { refusal, .. }) => rejected(&refusal.error_file, json).map(|_| 1),
        Err(WaitError::Cancelled { .. }) => {
            eprintln!(
                "runspool: stopped waiting; {id} goes on (`runspool status {id}`, `runspool stop {id}` to stop it)"
            );
            Ok(130)
        }
        Err(WaitError::Timeout { after, stage, .. }) => {
            let spool_name = match (target, *stage) {
                (_, Stage::Pending(p)) => Some(p.name),
                (Target::Pending(p), _) => Some(p.name.clone()),
                _ => None,
            };
            let id = RunId::parse(&id).ok_or_else(|| anyhow::anyhow!("{target:?} names no run"))?;
            Ok(gave_up(layout, &id, after, spool_name.as_deref()))
        }
        Err(WaitError::Other(e)) => Err(e),
    }
}

/// The run `id` ended as `s`: say how, print it with `json`; its exit code.
fn ended(id: &str, s: &Status, json: bool) -> anyhow::Result<i32> {
    let took = fmt_elapsed(((s.ended_at.unwrap_or(s.last_update) - s.started_at).max(0) / 1000) as u64);
    if s.state == State::Rejected {
        eprintln!("runspool: {}", visible(&format!("{id} {} before it ran", s.state.as_str())));
    } else {
        eprintln!(
            "runspool: {}",
            visible(&format!("{id} {} (exit {}) after {took}", s.state.as_str(), s.exit_code.unwrap_or(1)))
        );
    }
    if let Some(e) = &s.error {
        if s.state != State::Complete {
            eprintln!("runspool: {}", visible(e));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(s)?);
    }
    Ok(s.exit_code.unwrap_or(1))
}

/// The request was rejected or withdrawn (its error file `err` exists): say
/// why, print the error file with `json`.
fn rejected(err: &std::path::Path, json: bool) -> anyhow::Result<i32> {
    let b = fsutil::read_nofollow(err, 1 << 20).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or(json!({}));
    eprintln!(
        "runspool: the request was rejected ({}): {} (see {})",
        visible(v["code"].as_str().unwrap_or("?")),
        visible(v["message"].as_str().unwrap_or("see the error file")),
        err.display()
    );
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(2)
}

/// `--timeout t` expired: say what goes on; the exit code. 3 when the
/// request is still in the spool and no daemon runs to claim it, else 124.
fn gave_up(layout: &Layout, id: &RunId, t: Duration, spool_name: Option<&str>) -> i32 {
    let unclaimed = run::read_status(&layout.run_dir(id)).ok().flatten().is_none();
    match spool_name.filter(|_| unclaimed) {
        Some(name) if !daemon_running(layout) => {
            eprintln!(
                "runspool: gave up waiting for {id} after {}: no daemon runs under {}, so the request is \
                 still pending in {}; start one (`runspool daemon` or `runspool service start`) or withdraw it \
                 (`runspool stop {id}`)",
                fmt_elapsed(t.as_secs()),
                layout.root.display(),
                layout.spool().join(name).display()
            );
            3
        }
        Some(name) => {
            eprintln!(
                "runspool: gave up waiting for {id} after {}: the request is still pending in {}; \
                 it runs when the daemon claims it (see `runspool status {id}`)",
                fmt_elapsed(t.as_secs()),
                layout.spool().join(name).display()
            );
            124
        }
        None => {
            eprintln!(
                "runspool: gave up waiting for {id} after {}; it goes on (see `runspool status {id}`)",
                fmt_elapsed(t.as_secs())
            );
            124
        }
    }
}

fn fmt_elapsed(secs: u64) -> String {
    if secs >= 3600 {
        format!("{}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
    } else {
        format!("{:02}:{:02}", secs / 60, secs % 60)
    }
}

/// The progress display of `wait`.
struct Progress {
    tty: bool,
    /// The last plain line printed (non-tty): print again only on a change.
    last_plain: String,
    drawn: bool,
}

impl Progress {
    fn show(&mut self, id: &str, s: &Status, waited: Duration) {
        let total = s.steps.len();
        let done = s.steps.iter().filter(|st| !matches!(st.status, StepState::Pending | StepState::Running)).count();
        let current: Vec<String> = s
            .steps
            .iter()
            .enumerate()
            .filter(|(_, st)| st.status == StepState::Running)
            .map(|(i, st)| format!("{} ({})", i, st.agent))
            .collect();
        let mut text = format!("{id} {} · {done}/{total} steps done", s.state.as_str());
        if !current.is_empty() {
            text.push_str(&format!(" · running step {}", current.join(", ")));
        }
        if s.state == State::Queued {
            text.push_str(&format!(" · priority {}", s.queue.priority));
        }
        let elapsed = if s.state == State::Running {
            (crate::now_ms() - s.started_at).max(0) as u64 / 1000
        } else {
            waited.as_secs()
        };
        self.line(&text, Duration::from_secs(elapsed));
    }

    fn line(&mut self, text: &str, elapsed: Duration) {
        let text: &str = &visible(text);
        if self.tty {
            let mut err = std::io::stderr();
            let _ = write!(err, "\r\x1b[K{text} · {}", fmt_elapsed(elapsed.as_secs()));
            let _ = err.flush();
            self.drawn = true;
        } else if text != self.last_plain {
            eprintln!("runspool: {text}");
            self.last_plain = text.to_string();
        }
    }

    fn clear(&mut self) {
        if self.drawn {
            eprint!("\r\x1b[K");
            self.drawn = false;
        }
    }
}
