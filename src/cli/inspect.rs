//! `status`, `list`, `wait`, `stop`, `logs`: readers of the run files.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::json;

use crate::protocol::status::{State, Status, StepState};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout};

pub fn resolve(layout: &Layout, run: &str) -> anyhow::Result<String> {
    super::resolve_run(layout, run)
}

fn load(layout: &Layout, id: &str) -> anyhow::Result<Status> {
    run::read_status(&layout.run_dir(id))?
        .with_context(|| format!("{} has no status.json yet", layout.run_dir(id).display()))
}

fn ago(ms: i64) -> String {
    let s = ((crate::now_ms() - ms) / 1000).max(0);
    match s {
        0..=59 => format!("{s}s ago"),
        60..=3599 => format!("{}m ago", s / 60),
        3600..=86399 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// Who launched a run, as `list` and `status` show it: runspool supervises
/// only its own runs; the others are shown read-only (PROTOCOL §14).
fn launched_by(o: run::Ownership) -> &'static str {
    if o.is_ours() {
        "runspool"
    } else {
        "other"
    }
}

/// One `list --json` row: the run's status.json with `launchedBy`
/// ("runspool" or "other"), or for a status that cannot be read, its run id
/// and `statusError`.
fn listed_json(x: &index::Listed) -> serde_json::Value {
    let mut v = match &x.status {
        Ok(s) => serde_json::to_value(s).unwrap_or_else(|_| json!({})),
        Err(e) => json!({"runId": x.run_id, "statusError": e}),
    };
    v["launchedBy"] = json!(launched_by(x.ownership));
    v
}

pub fn status(layout: &Layout, run: &str, json: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    if json {
        let raw = fsutil::read_nofollow(&RunPaths::status(&layout.run_dir(&id)), 64 * 1024 * 1024)?;
        std::io::stdout().write_all(&raw)?;
        println!();
        return Ok(0);
    }
    let dir = layout.run_dir(&id);
    let s = match load(layout, &id) {
        Ok(s) => s,
        Err(e) if !run::ownership(&dir, None).is_ours() => {
            // Another host's run whose status runspool cannot read: report it, touch nothing.
            println!("run       {id}");
            println!("launched  by another host (runspool only reads this run)");
            println!("status    unreadable: {e:#}");
            println!("dir       {}", dir.display());
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    println!("run       {}", s.run_id);
    if !run::ownership(&dir, Some(&s)).is_ours() {
        println!("launched  by another host (runspool only reads this run)");
    }
    println!("state     {}{}", s.state.as_str(), s.exit_code.map(|c| format!(" (exit {c})")).unwrap_or_default());
    println!("mode      {}", s.mode);
    println!("session   {}", s.session_id);
    println!("cwd       {}", s.cwd);
    println!("started   {}", ago(s.started_at));
    if let Some(e) = s.ended_at {
        println!("ended     {} (took {} ms)", ago(e), e - s.started_at);
    }
    if let Some(e) = &s.error {
        println!("error     {e}");
    }
    println!("dir       {}", layout.run_dir(&id).display());
    if let Some(r) = &s.runner {
        let how = r.containment.as_deref().map(|c| format!(", containment {c}")).unwrap_or_default();
        println!("runner    pid {} on {}{how}", r.pid, r.hostname);
    }
    for (i, st) in s.steps.iter().enumerate() {
        let code = st.exit_code.map(|c| format!("exit {c}")).unwrap_or_default();
        println!("  step {i:<3} {:<20} {:<9} {code}", st.agent, st.status.as_str());
    }
    Ok(0)
}

pub fn list(
    layout: &Layout,
    active: bool,
    recent: Option<usize>,
    session: Option<&str>,
    json: bool,
) -> anyhow::Result<i32> {
    let mut out: Vec<index::Listed> = Vec::new();
    if recent.is_none() {
        out.extend(
            index::list_active(layout)
                .with_context(|| format!("cannot read {}", layout.active().display()))?
                .into_iter()
                .filter(|x| session.is_none_or(|want| x.ok().is_none_or(|s| s.session_id == want))),
        );
    }
    if !active {
        out.extend(index::list_recent(layout, session, recent.unwrap_or(20))?);
    }
    if json {
        let rows: Vec<serde_json::Value> = out.iter().map(listed_json).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    if out.is_empty() {
        eprintln!("no runs under {}", layout.runs().display());
        return Ok(0);
    }
    println!("{:<38} {:<9} {:<8} {:>5} {:<12} {:<10} SESSION", "RUN", "STATE", "MODE", "EXIT", "UPDATED", "BY");
    for x in out {
        let by = launched_by(x.ownership);
        match &x.status {
            Ok(s) => println!(
                "{:<38} {:<9} {:<8} {:>5} {:<12} {:<10} {}",
                s.run_id,
                s.state.as_str(),
                s.mode.as_str(),
                s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                ago(s.ended_at.unwrap_or(if s.last_update > 0 { s.last_update } else { s.started_at })),
                by,
                s.session_id
            ),
            Err(e) => println!("{:<38} {:<9} {:<8} {:>5} {:<12} {:<10} ({e})", x.run_id, "?", "?", "-", "-", by),
        }
    }
    Ok(0)
}

/// Wait for a terminal state. `spool_name`: the request as published, so a
/// rejection (which may create no run) ends the wait too. On a terminal the
/// wait keeps one live line (state, steps done, current step, elapsed); else
/// it prints a plain line whenever the state or the current step changes.
/// `json`: print the final status.json on stdout.
pub fn wait(
    layout: &Layout,
    id: &str,
    timeout: Option<Duration>,
    spool_name: Option<&str>,
    json: bool,
) -> anyhow::Result<i32> {
    let start = Instant::now();
    let tty = !json && unsafe { libc::isatty(2) } == 1;
    let mut progress = Progress { tty, last_plain: String::new(), drawn: false };
    let dir = layout.run_dir(id);
    loop {
        if let Some(s) = run::read_status(&dir).ok().flatten() {
            if !s.state.is_active() {
                progress.clear();
                let took = fmt_elapsed(((s.ended_at.unwrap_or(s.last_update) - s.started_at).max(0) / 1000) as u64);
                eprintln!("runspool: {id} {} (exit {}) after {took}", s.state.as_str(), s.exit_code.unwrap_or(1));
                if let Some(e) = &s.error {
                    if s.state != State::Complete {
                        eprintln!("runspool: {e}");
                    }
                }
                if json {
                    println!("{}", serde_json::to_string_pretty(&s)?);
                }
                return Ok(s.exit_code.unwrap_or(1));
            }
            progress.show(id, &s, start.elapsed());
        } else if let Some(name) = spool_name {
            let stem = name.trim_end_matches(".json");
            let err = layout.rejected().join(format!("{stem}.error.json"));
            if let Ok(b) = std::fs::read(&err) {
                progress.clear();
                let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or(json!({}));
                eprintln!(
                    "runspool: the request was rejected ({}): {} (see {})",
                    v["code"].as_str().unwrap_or("?"),
                    v["message"].as_str().unwrap_or("see the error file"),
                    err.display()
                );
                if json {
                    println!("{}", serde_json::to_string_pretty(&v)?);
                }
                return Ok(2);
            }
            progress.line(
                &format!("{id} waiting to be claimed (is the daemon running? `runspool status`)"),
                start.elapsed(),
            );
        }
        if let Some(t) = timeout {
            if start.elapsed() >= t {
                progress.clear();
                eprintln!(
                    "runspool: gave up waiting for {id} after {}; it goes on (see `runspool status {id}`)",
                    fmt_elapsed(t.as_secs())
                );
                return Ok(124);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
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

pub fn stop(layout: &Layout, run: &str, reason: Option<String>, interrupt: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    let s = load(layout, &id)?;
    if !run::ownership(&layout.run_dir(&id), Some(&s)).is_ours() {
        bail!(
            "run {id} was launched by another host (pi-subagents), not by runspool; runspool never writes into it. \
             Stop it from the host that launched it"
        );
    }
    if !s.state.is_active() {
        bail!("run {id} already ended ({}); nothing to stop", s.state.as_str());
    }
    let dir = layout.run_dir(&id);
    let kind = if interrupt { "interrupt" } else { "stop" };
    let ts = crate::now_ms();
    let mut body = json!({"type": kind, "ts": ts, "source": "runspool-cli"});
    if let Some(r) = reason {
        body["reason"] = json!(r);
    }
    // A stop in pi-subagents 0.67's form (control/stop-requests/<ts>-<uuid>.json),
    // which 0.67 runners and runspool's both consume; an interrupt in the one
    // form both know, control/interrupt.json.
    let path = if interrupt {
        let control = RunPaths::control(&dir);
        super::ensure_dir(&control)?;
        control.join("interrupt.json")
    } else {
        let inbox = RunPaths::stop_requests(&dir);
        super::ensure_dir(&inbox)?;
        inbox.join(crate::protocol::control::stop_request_name(ts, &uuid::Uuid::new_v4().to_string()))
    };
    fsutil::write_atomic(&path, &serde_json::to_vec(&body)?, false)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("runspool: asked {id} to {kind} ({})", path.display());
    Ok(0)
}

pub fn logs(layout: &Layout, run: &str, step: Option<usize>, follow: bool, json_out: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    let dir = layout.run_dir(&id);
    let s = load(layout, &id)?;
    let steps: Vec<usize> = match step {
        Some(i) if i < s.steps.len() => vec![i],
        Some(i) => bail!("run {id} has {} steps; --step {i} is out of range", s.steps.len()),
        None => (0..s.steps.len()).collect(),
    };
    if json_out {
        let v: Vec<serde_json::Value> = steps
            .iter()
            .map(|&i| {
                let path = RunPaths::output(&dir, i);
                let bytes = std::fs::read(&path).unwrap_or_default();
                json!({
                    "step": i, "agent": s.steps[i].agent, "status": s.steps[i].status, "exitCode": s.steps[i].exit_code,
                    "outputFile": path.display().to_string(), "bytes": bytes.len(),
                    "output": String::from_utf8_lossy(&bytes),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let mut offsets = vec![0u64; s.steps.len()];
    let mut out = std::io::stdout();
    loop {
        for &i in &steps {
            let path = RunPaths::output(&dir, i);
            let Ok(mut f) = std::fs::File::open(&path) else { continue };
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len > offsets[i] {
                if steps.len() > 1 && !follow {
                    writeln!(out, "==> step {i} ({}) <==", s.steps[i].agent)?;
                }
                f.seek(SeekFrom::Start(offsets[i]))?;
                let mut buf = Vec::new();
                f.take(len - offsets[i]).read_to_end(&mut buf)?;
                out.write_all(&buf)?;
                offsets[i] = len;
            }
        }
        out.flush()?;
        if !follow || run::read_status(&dir).ok().flatten().is_some_and(|s| !s.state.is_active()) {
            // One more pass after the end so the last lines are not lost.
            if follow {
                follow_tail(&dir, &steps, &mut offsets)?;
            }
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn follow_tail(dir: &std::path::Path, steps: &[usize], offsets: &mut [u64]) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    for &i in steps {
        if let Ok(mut f) = std::fs::File::open(RunPaths::output(dir, i)) {
            f.seek(SeekFrom::Start(offsets[i]))?;
            let mut buf = Vec::new();
            f.read_to_end(&mut buf)?;
            out.write_all(&buf)?;
        }
    }
    Ok(())
}
