//! `wait`: follow a run (or a request still in the spool, through its claim)
//! to its end, with a live progress line on a terminal.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;

use super::target::{daemon_running, resolve, Target};
use super::text::visible;
use crate::protocol::status::{State, Status, StepState};
use crate::store::{fsutil, run, Layout, RunId};

/// `wait` for any target: a pending request is waited on through its claim.
pub(crate) fn wait(layout: &Layout, arg: &str, timeout: Option<Duration>, json: bool) -> anyhow::Result<i32> {
    match resolve(layout, arg)? {
        Target::Run(id) => wait_run(layout, &id, timeout, None, json),
        Target::Pending(p) => wait_run(layout, &p.run_id, timeout, Some(&p.name), json),
        Target::Rejected { name, .. } => {
            // A spool name's stem is in the run-id grammar: the run a rejection may have made.
            let id = RunId::parse(name.trim_end_matches(".json"))
                .with_context(|| format!("{name} names no run; see `runspool status {name}`"))?;
            wait_run(layout, &id, timeout, Some(&name), json)
        }
    }
}

/// Wait for a terminal state. `spool_name`: the request as published, so a
/// rejection (which may create no run) ends the wait too. On a terminal the
/// wait keeps one live line (state, steps done, current step, elapsed); else
/// it prints a plain line whenever the state or the current step changes.
/// `json`: print the final status.json on stdout.
pub(crate) fn wait_run(
    layout: &Layout,
    id: &RunId,
    timeout: Option<Duration>,
    spool_name: Option<&str>,
    json: bool,
) -> anyhow::Result<i32> {
    let start = Instant::now();
    let tty = !json && unsafe { libc::isatty(2) } == 1;
    let mut progress = Progress { tty, last_plain: String::new(), drawn: false };
    let dir = layout.run_dir(id);
    // Ctrl-C ends the wait, not the run: say so instead of vanishing silently.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _ = signal_hook::flag::register(libc::SIGINT, interrupted.clone());
    loop {
        if interrupted.load(std::sync::atomic::Ordering::Relaxed) {
            progress.clear();
            eprintln!(
                "runspool: stopped waiting; {id} goes on (`runspool status {id}`, `runspool stop {id}` to stop it)"
            );
            return Ok(130);
        }
        if let Some(s) = run::read_status(&dir).ok().flatten() {
            if !s.state.is_active() {
                progress.clear();
                return ended(id, &s, json);
            }
            progress.show(id, &s, start.elapsed());
        } else if let Some(name) = spool_name {
            if let Some(code) = rejected(layout, name, json, &mut progress)? {
                return Ok(code);
            }
            // A claim usually follows within milliseconds: say nothing for the first second.
            if start.elapsed() >= Duration::from_secs(1) {
                let why = if daemon_running(layout) {
                    "the daemon has not claimed it yet; `runspool status` shows why"
                } else {
                    "no daemon is running: start one with `runspool daemon` or `runspool service start`"
                };
                progress.line(&format!("{id} waiting to be claimed ({why})"), start.elapsed());
            }
        }
        if let Some(t) = timeout.filter(|t| start.elapsed() >= *t) {
            progress.clear();
            return Ok(gave_up(layout, id, t, spool_name));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The run `id` ended as `s`: say how, print it with `json`; its exit code.
fn ended(id: &str, s: &Status, json: bool) -> anyhow::Result<i32> {
    let took = fmt_elapsed(((s.ended_at.unwrap_or(s.last_update) - s.started_at).max(0) / 1000) as u64);
    eprintln!(
        "runspool: {}",
        visible(&format!("{id} {} (exit {}) after {took}", s.state.as_str(), s.exit_code.unwrap_or(1)))
    );
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

/// The request published as `name` was rejected (its error file exists): say
/// why, print the error file with `json`; Some(2). None while there is none.
fn rejected(layout: &Layout, name: &str, json: bool, progress: &mut Progress) -> anyhow::Result<Option<i32>> {
    let stem = name.trim_end_matches(".json");
    let err = layout.rejected_error_file(stem);
    let Ok(b) = fsutil::read_nofollow(&err, 1 << 20) else { return Ok(None) };
    progress.clear();
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
    Ok(Some(2))
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
