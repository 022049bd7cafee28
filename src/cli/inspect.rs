//! `status`, `list`, `wait`, `stop`, `logs`: readers of the run files.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::json;

use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout};

pub fn resolve(layout: &Layout, run: &str) -> anyhow::Result<String> {
    super::resolve_run(layout, run)
}

fn load(layout: &Layout, id: &str) -> anyhow::Result<Status> {
    run::read_status(&layout.run_dir(id))?.with_context(|| format!("{} has no status.json yet", layout.run_dir(id).display()))
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

pub fn status(layout: &Layout, run: &str, json: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    if json {
        let raw = fsutil::read_nofollow(&RunPaths::status(&layout.run_dir(&id)), 64 * 1024 * 1024)?;
        std::io::stdout().write_all(&raw)?;
        println!();
        return Ok(0);
    }
    let s = load(layout, &id)?;
    println!("run       {}", s.run_id);
    println!("state     {}{}", s.state.as_str(), s.exit_code.map(|c| format!(" (exit {c})")).unwrap_or_default());
    println!("mode      {:?}", s.mode);
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
    for (i, st) in s.steps.iter().enumerate() {
        let code = st.exit_code.map(|c| format!("exit {c}")).unwrap_or_default();
        println!("  step {i:<3} {:<20} {:<9} {code}", st.agent, format!("{:?}", st.status).to_lowercase());
    }
    Ok(0)
}

pub fn list(layout: &Layout, active: bool, recent: Option<usize>, session: Option<&str>, json: bool) -> anyhow::Result<i32> {
    let mut out: Vec<Status> = Vec::new();
    if recent.is_none() {
        out.extend(
            index::list_active(layout)
                .with_context(|| format!("cannot read {}", layout.active().display()))?
                .into_iter()
                .filter(|s| session.is_none_or(|x| s.session_id == x)),
        );
    }
    if !active {
        out.extend(index::list_recent(layout, session, recent.unwrap_or(20))?);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(0);
    }
    if out.is_empty() {
        eprintln!("no runs under {}", layout.runs().display());
        return Ok(0);
    }
    println!("{:<38} {:<9} {:<8} {:>5} {:<12} SESSION", "RUN", "STATE", "MODE", "EXIT", "UPDATED");
    for s in out {
        println!(
            "{:<38} {:<9} {:<8} {:>5} {:<12} {}",
            s.run_id,
            s.state.as_str(),
            format!("{:?}", s.mode).to_lowercase(),
            s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            ago(s.ended_at.unwrap_or(s.last_update)),
            s.session_id
        );
    }
    Ok(0)
}

/// Wait for a terminal state. `spool_name`: the request as published, so a
/// rejection (which may create no run) ends the wait too.
pub fn wait(layout: &Layout, id: &str, timeout: Option<Duration>, spool_name: Option<&str>) -> anyhow::Result<i32> {
    let start = Instant::now();
    let mut last: Option<State> = None;
    let dir = layout.run_dir(id);
    loop {
        if let Some(s) = run::read_status(&dir).ok().flatten() {
            if last != Some(s.state) {
                eprintln!("runspool: {id} is {}", s.state.as_str());
                last = Some(s.state);
            }
            if !s.state.is_active() {
                if let Some(e) = &s.error {
                    if s.state != State::Complete {
                        eprintln!("runspool: {e}");
                    }
                }
                return Ok(s.exit_code.unwrap_or(1));
            }
        } else if let Some(name) = spool_name {
            let stem = name.trim_end_matches(".json");
            let err = layout.rejected().join(format!("{stem}.error.json"));
            if let Ok(b) = std::fs::read(&err) {
                let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or(json!({}));
                eprintln!(
                    "runspool: the request was rejected ({}): {}",
                    v["code"].as_str().unwrap_or("?"),
                    v["message"].as_str().unwrap_or("see the error file")
                );
                return Ok(2);
            }
        }
        if let Some(t) = timeout {
            if start.elapsed() >= t {
                eprintln!("runspool: gave up waiting for {id} after {} ms", t.as_millis());
                return Ok(124);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn stop(layout: &Layout, run: &str, reason: Option<String>, interrupt: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    let s = load(layout, &id)?;
    if !s.state.is_active() {
        bail!("run {id} already ended ({}); nothing to stop", s.state.as_str());
    }
    let control = RunPaths::control(&layout.run_dir(&id));
    super::ensure_dir(&control)?;
    let kind = if interrupt { "interrupt" } else { "stop" };
    let mut body = json!({"type": kind, "ts": crate::now_ms(), "source": "runspool-cli"});
    if let Some(r) = reason {
        body["reason"] = json!(r);
    }
    let path = control.join(format!("{kind}.json"));
    fsutil::write_atomic(&path, &serde_json::to_vec(&body)?, false).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("runspool: asked {id} to {kind} ({})", path.display());
    Ok(0)
}

pub fn logs(layout: &Layout, run: &str, step: Option<usize>, follow: bool) -> anyhow::Result<i32> {
    let id = resolve(layout, run)?;
    let dir = layout.run_dir(&id);
    let s = load(layout, &id)?;
    let steps: Vec<usize> = match step {
        Some(i) if i < s.steps.len() => vec![i],
        Some(i) => bail!("run {id} has {} steps; --step {i} is out of range", s.steps.len()),
        None => (0..s.steps.len()).collect(),
    };
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
