//! `status`, `list`, `wait`, `stop`, `logs`: readers of the run files.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::json;

use super::pending::Target;
use crate::protocol::status::{State, Status, StepState};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout};

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

/// `println!` of one line with every control character as a space: a run's
/// fields are another client's words, never terminal escapes.
macro_rules! say {
    ($($t:tt)*) => { println!("{}", one_line(&format!($($t)*))) };
}

pub fn status(layout: &Layout, run: &str, json: bool) -> anyhow::Result<i32> {
    let id = match super::pending::resolve(layout, run)? {
        Target::Run(id) => id,
        Target::Pending(p) => return super::pending::status(layout, &p, json),
        Target::Rejected { name, error_file } => return super::pending::rejected_status(&name, &error_file),
    };
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
            say!("run       {id}");
            say!("launched  by another host (runspool only reads this run)");
            say!("status    unreadable: {e:#}");
            say!("dir       {}", dir.display());
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    let style = Style::stdout();
    say!("run       {}", s.run_id);
    if !run::ownership(&dir, Some(&s)).is_ours() {
        say!("launched  by another host (runspool only reads this run)");
    }
    println!(
        "state     {}{} · {}",
        style.state(s.state.as_str(), &one_line(s.state.as_str())),
        s.exit_code.map(|c| format!(" (exit {c})")).unwrap_or_default(),
        duration(&s)
    );
    say!("command   {}", command_of(&dir, &s));
    say!("mode      {}", s.mode);
    say!("session   {}", s.session_id);
    say!("cwd       {}", s.cwd);
    say!("started   {}", ago(s.started_at));
    if let Some(e) = s.ended_at {
        say!("ended     {} (took {} ms)", ago(e), e - s.started_at);
    }
    if let Some(e) = &s.error {
        say!("error     {e}");
    }
    say!("dir       {}", layout.run_dir(&id).display());
    if let Some(r) = &s.runner {
        let how = r.containment.as_deref().map(|c| format!(", containment {c}")).unwrap_or_default();
        say!("runner    pid {} on {}{how}", r.pid, r.hostname);
    }
    for (i, st) in s.steps.iter().enumerate() {
        let code = st.exit_code.map(|c| format!("exit {c}")).unwrap_or_default();
        say!("  step {i:<3} {:<20} {:<9} {code}", st.agent, st.status.as_str());
    }
    Ok(0)
}

/// How a table is printed on stdout: colours only on a terminal and without
/// NO_COLOR (no-color.org); the terminal's width, when it is one.
struct Style {
    colour: bool,
    columns: Option<usize>,
}

impl Style {
    fn stdout() -> Style {
        use std::io::IsTerminal as _;
        let tty = std::io::stdout().is_terminal();
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        let columns = tty.then(terminal_columns).flatten();
        Style { colour: tty && !no_color, columns }
    }

    /// `text` (the state, padded) in the colour of `state`.
    fn state(&self, state: &str, text: &str) -> String {
        let code = match state {
            "complete" => "32",
            "failed" | "rejected" => "31",
            "running" => "36",
            "queued" => "34",
            "stopped" | "paused" | "partial" => "33",
            _ => "",
        };
        if !self.colour || code.is_empty() {
            return text.to_string();
        }
        let word = text.trim_end();
        format!("\x1b[{code}m{word}\x1b[0m{}", &text[word.len()..])
    }
}

fn terminal_columns() -> Option<usize> {
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills the winsize it is given.
    let ok = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_col > 0).then_some(ws.ws_col as usize)
}

/// `for 1m05s` (running), `took 3s` (`queued for …` before it starts).
fn duration(s: &Status) -> String {
    let span = |ms: i64| {
        let secs = (ms / 1000).max(0);
        match secs {
            0..=59 => format!("{secs}s"),
            60..=3599 => format!("{}m{:02}s", secs / 60, secs % 60),
            _ => format!("{}h{:02}m", secs / 3600, secs / 60 % 60),
        }
    };
    match (s.state.is_active(), s.ended_at) {
        (false, Some(end)) => format!("took {}", span(end - s.started_at)),
        (false, None) => "-".into(),
        (true, _) if s.state == State::Queued => format!("queued for {}", span(crate::now_ms() - s.started_at)),
        (true, _) => format!("for {}", span(crate::now_ms() - s.started_at)),
    }
}

/// The run's command as a user typed it: each step's argv (shell-quoted
/// where needed), steps joined by `; `, from the run's request.json (read
/// bounded, never through a link); a step without argv, or a run without a
/// readable request (another host's), by its agent name.
fn command_of(dir: &std::path::Path, s: &Status) -> String {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        for st in v.as_array().into_iter().flatten() {
            if let Some(p) = st.get("parallel") {
                let mut inner = Vec::new();
                walk(p, &mut inner);
                out.push(format!("[{}]", inner.join(" & ")));
            } else if let Some(argv) = st.get("command").and_then(|c| c.as_array()) {
                out.push(argv.iter().map(|a| quote(a.as_str().unwrap_or("?"))).collect::<Vec<_>>().join(" "));
            } else {
                out.push(st.get("agent").and_then(|a| a.as_str()).unwrap_or("?").to_string());
            }
        }
    }
    let req = fsutil::read_nofollow(&RunPaths::request(dir), 1 << 20)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let mut parts = Vec::new();
    if let Some(steps) = req.as_ref().and_then(|r| r.get("steps")) {
        walk(steps, &mut parts);
    }
    if parts.is_empty() {
        parts = s.steps.iter().map(|st| st.agent.clone()).collect();
    }
    one_line(&parts.join("; "))
}

/// `text` with every control character (newlines, escapes) as a space: one
/// table line, and nothing a terminal would act on.
fn one_line(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

fn quote(a: &str) -> String {
    let plain = !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

/// `text` cut to `max` characters, with `…` where it was cut.
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut t: String = text.chars().take(max.saturating_sub(1)).collect();
    t.push('…');
    t
}

/// How many finished runs `list` shows without `--recent`.
const DEFAULT_RECENT: usize = 20;

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
    // One more than shown, to know whether older finished runs were left out.
    let limit = recent.unwrap_or(DEFAULT_RECENT);
    let mut capped = false;
    if !active {
        let mut finished = index::list_recent(layout, session, limit.saturating_add(1))?;
        capped = finished.len() > limit;
        finished.truncate(limit);
        out.extend(finished);
    }
    if json {
        let rows: Vec<serde_json::Value> = out.iter().map(listed_json).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    if out.is_empty() {
        if active {
            eprintln!("no active runs (queued or running) under {}", layout.runs().display());
        } else if recent.is_some() {
            eprintln!("no finished runs under {}", layout.runs().display());
        } else {
            eprintln!("no runs under {}", layout.runs().display());
        }
        return Ok(0);
    }
    let style = Style::stdout();
    let rows: Vec<[String; 7]> = out
        .iter()
        .map(|x| {
            let by = launched_by(x.ownership).to_string();
            match &x.status {
                Ok(s) => [
                    s.run_id.clone(),
                    s.state.as_str().to_string(),
                    s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                    duration(s),
                    ago(s.ended_at.unwrap_or(if s.last_update > 0 { s.last_update } else { s.started_at })),
                    by,
                    s.session_id.clone(),
                ],
                Err(_) => [x.run_id.clone(), "?".into(), "-".into(), "-".into(), "-".into(), by, "-".into()],
            }
            // Another host's status.json may hold anything: never a terminal escape from it.
            .map(|c| one_line(&c))
        })
        .collect();
    let head = ["RUN", "STATE", "EXIT", "DURATION", "UPDATED", "BY", "SESSION"];
    let mut widths = head.map(str::len);
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let fixed: usize = widths.iter().map(|w| w + 2).sum();
    // The command gets what the terminal has left (at least 20 columns); piped, a generous fixed width.
    let room = style.columns.map(|c| c.saturating_sub(fixed).max(20)).unwrap_or(80);
    let cell = |i: usize, text: &str| format!("{text:<w$}  ", w = widths[i]);
    let mut line = String::new();
    for (i, h) in head.iter().enumerate() {
        line.push_str(&cell(i, h));
    }
    println!("{line}COMMAND");
    for (x, r) in out.iter().zip(&rows) {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            let text = cell(i, c);
            if i == 1 {
                line.push_str(&style.state(&r[1], &text));
            } else {
                line.push_str(&text);
            }
        }
        let command = match &x.status {
            Ok(s) => command_of(&layout.run_dir(&x.run_id), s),
            Err(e) => one_line(&format!("({e})")),
        };
        println!("{line}{}", shorten(&command, room));
    }
    if capped {
        eprintln!("showing the newest {limit} finished runs; --recent N for more");
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
            if let Ok(b) = fsutil::read_nofollow(&err, 1 << 20) {
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
            // A claim usually follows within milliseconds: say nothing for the first second.
            if start.elapsed() >= Duration::from_secs(1) {
                let why = if super::pending::daemon_running(layout) {
                    "the daemon has not claimed it yet; `runspool status` shows why"
                } else {
                    "no daemon is running: start one with `runspool daemon` or `runspool service start`"
                };
                progress.line(&format!("{id} waiting to be claimed ({why})"), start.elapsed());
            }
        }
        if let Some(t) = timeout {
            if start.elapsed() >= t && spool_name.is_some() && run::read_status(&dir).ok().flatten().is_none() {
                progress.clear();
                let name = spool_name.unwrap_or_default();
                if !super::pending::daemon_running(layout) {
                    eprintln!(
                        "runspool: gave up waiting for {id} after {}: no daemon runs under {}, so the request is \
                         still pending in {}; start one (`runspool daemon` or `runspool service start`) or withdraw it \
                         (`runspool stop {id}`)",
                        fmt_elapsed(t.as_secs()),
                        layout.root.display(),
                        layout.spool().join(name).display()
                    );
                    return Ok(3);
                }
                eprintln!(
                    "runspool: gave up waiting for {id} after {}: the request is still pending in {}; \
                     it runs when the daemon claims it (see `runspool status {id}`)",
                    fmt_elapsed(t.as_secs()),
                    layout.spool().join(name).display()
                );
                return Ok(124);
            }
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
    let id = match super::pending::resolve(layout, run)? {
        Target::Run(id) => id,
        // Not yet claimed: withdrawn (an interrupt too: there is nothing to pause), unless the daemon wins.
        Target::Pending(p) => match super::pending::stop(layout, &p, reason.as_deref())? {
            Some(id) => id,
            None => return Ok(0),
        },
        Target::Rejected { name, error_file } => {
            let (code, message) = super::pending::read_error(&error_file);
            bail!(
                "{name} was refused before it ran ({code}: {message}); nothing to stop (see {})",
                error_file.display()
            )
        }
    };
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

/// `logs`: every chosen step's output (with `lines`, only the last N lines of
/// each), streamed; with `follow`, until the run ends, then exit with the
/// run's code (0 for `complete`, else its exit code, 1 when it has none).
pub fn logs(
    layout: &Layout,
    run: &str,
    step: Option<usize>,
    follow: bool,
    lines: Option<usize>,
    json_out: bool,
) -> anyhow::Result<i32> {
    let id = match super::pending::resolve(layout, run)? {
        Target::Run(id) => id,
        Target::Pending(p) if follow => {
            if !super::pending::await_claim(layout, &p, None)? {
                let ef = super::pending::error_file(layout, &p.name);
                let (code, message) = super::pending::read_error(&ef);
                eprintln!("runspool: {} was refused before it ran ({code}): {message} (see {})", p.name, ef.display());
                return Ok(2);
            }
            p.run_id
        }
        Target::Pending(p) => {
            eprintln!(
                "runspool: {} is pending in the spool (for {}); no output yet (`runspool logs -f {}` waits for it)",
                p.run_id,
                super::pending::age(p.since_ms),
                p.run_id
            );
            return Ok(0);
        }
        Target::Rejected { name, error_file } => {
            let (code, message) = super::pending::read_error(&error_file);
            if follow {
                // As when the refusal comes while following: exit 2, whichever came first.
                eprintln!(
                    "runspool: {name} was refused before it ran ({code}): {message} (see {})",
                    error_file.display()
                );
                return Ok(2);
            }
            bail!(
                "{name} was refused before it ran ({code}: {message}); it has no output (see {})",
                error_file.display()
            )
        }
    };
    let dir = layout.run_dir(&id);
    let s = load(layout, &id)?;
    let steps: Vec<usize> = match step {
        Some(i) if i < s.steps.len() => vec![i],
        Some(i) => bail!("run {id} has {} steps; --step {i} is out of range", s.steps.len()),
        None => (0..s.steps.len()).collect(),
    };
    if json_out {
        return logs_json(&dir, &s, &steps);
    }
    let mut offsets = vec![0u64; s.steps.len()];
    if let Some(n) = lines {
        for &i in &steps {
            let path = RunPaths::output(&dir, i);
            if let Ok(mut f) = fsutil::open_read(&path) {
                offsets[i] = tail_start(&mut f, n)
                    .with_context(|| format!("cannot read the end of {} (was it truncated?)", path.display()))?;
            }
        }
    }
    let mut out = std::io::stdout();
    loop {
        for &i in &steps {
            let path = RunPaths::output(&dir, i);
            // The output is the step's to write: never follow a link or wait on a FIFO there.
            let Ok(mut f) = fsutil::open_read(&path) else { continue };
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len > offsets[i] {
                if steps.len() > 1 && !follow {
                    writeln!(out, "==> step {i} ({}) <==", s.steps[i].agent)?;
                }
                f.seek(SeekFrom::Start(offsets[i]))?;
                // Streamed: the output may be far larger than memory.
                offsets[i] += std::io::copy(&mut f.take(len - offsets[i]), &mut out)?;
            }
        }
        out.flush()?;
        if !follow {
            return Ok(0);
        }
        if let Some(end) = run::read_status(&dir).ok().flatten().filter(|s| !s.state.is_active()) {
            // One more pass after the end so the last lines are not lost.
            follow_tail(&dir, &steps, &mut offsets)?;
            let code = run_exit_code(&end);
            if code != 0 {
                // Said on stderr, so the output on stdout stays the steps' own.
                let why = end.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
                eprintln!("runspool: {id} {} (exit {code}){why}", end.state.as_str());
            }
            return Ok(code);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The exit code a command that followed a run to its end exits with: 0 for
/// `complete`, else the run's exit code (1 when it recorded none).
pub(crate) fn run_exit_code(s: &Status) -> i32 {
    if s.state == State::Complete {
        0
    } else {
        s.exit_code.filter(|&c| c != 0).unwrap_or(1)
    }
}

/// Where the last `n` lines of `f` start, found by reading backwards from the
/// end in bounded chunks (a final newline does not start an empty line).
fn tail_start(f: &mut std::fs::File, n: usize) -> std::io::Result<u64> {
    let len = f.metadata()?.len();
    if n == 0 {
        return Ok(len);
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut pos = len;
    let mut seen = 0usize;
    let mut last_byte = true;
    while pos > 0 {
        let chunk = (pos.min(buf.len() as u64)) as usize;
        pos -= chunk as u64;
        f.seek(SeekFrom::Start(pos))?;
        f.read_exact(&mut buf[..chunk])?;
        for j in (0..chunk).rev() {
            if buf[j] == b'\n' {
                if last_byte {
                    last_byte = false;
                    continue;
                }
                seen += 1;
                if seen == n {
                    return Ok(pos + j as u64 + 1);
                }
            }
            last_byte = false;
        }
    }
    Ok(0)
}

fn follow_tail(dir: &std::path::Path, steps: &[usize], offsets: &mut [u64]) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    for &i in steps {
        if let Ok(mut f) = fsutil::open_read(&RunPaths::output(dir, i)) {
            f.seek(SeekFrom::Start(offsets[i]))?;
            std::io::copy(&mut f, &mut out)?;
        }
    }
    Ok(())
}

/// `logs --json`: the array of steps, each with its whole output as a JSON
/// string. The output is streamed into the string (decoded like
/// `String::from_utf8_lossy`), so memory stays bounded whatever its size; the
/// rest of each object is small and printed by serde_json around it.
fn logs_json(dir: &std::path::Path, s: &Status, steps: &[usize]) -> anyhow::Result<i32> {
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut files = Vec::new();
    let v: Vec<serde_json::Value> = steps
        .iter()
        .map(|&i| {
            let path = RunPaths::output(dir, i);
            let f = fsutil::open_read(&path).ok();
            let bytes = f.as_ref().and_then(|f| f.metadata().ok()).map(|m| m.len()).unwrap_or(0);
            let marker = format!("@@runspool-output-{i}-{nonce}@@");
            files.push((serde_json::to_string(&marker).unwrap_or_default(), f, bytes));
            json!({
                "step": i, "agent": s.steps[i].agent, "status": s.steps[i].status, "exitCode": s.steps[i].exit_code,
                "outputFile": path.display().to_string(), "bytes": bytes, "output": marker,
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&v)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut rest = text.as_str();
    for (marker, f, bytes) in files {
        let Some(at) = rest.find(&marker) else { continue };
        out.write_all(&rest.as_bytes()[..at])?;
        match f {
            Some(f) => write_json_string_lossy(f.take(bytes), &mut out)?,
            None => out.write_all(b"\"\"")?,
        }
        rest = &rest[at + marker.len()..];
    }
    out.write_all(rest.as_bytes())?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(0)
}

/// Write what `r` yields as one JSON string, decoding it as
/// `String::from_utf8_lossy` would, one bounded chunk at a time.
fn write_json_string_lossy(mut r: impl Read, out: &mut impl Write) -> std::io::Result<()> {
    out.write_all(b"\"")?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut carry = 0; // the start of a UTF-8 sequence cut by the previous chunk
    loop {
        let n = match r.read(&mut buf[carry..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let (end, eof) = (carry + n, n == 0);
        let mut text = String::with_capacity(end);
        let mut start = 0;
        while start < end {
            match std::str::from_utf8(&buf[start..end]) {
                Ok(ok) => {
                    text.push_str(ok);
                    start = end;
                }
                Err(e) => {
                    let good = start + e.valid_up_to();
                    text.push_str(std::str::from_utf8(&buf[start..good]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            text.push('\u{FFFD}');
                            start = good + bad;
                        }
                        // A sequence cut at the end: complete it with the next chunk.
                        None if !eof => {
                            start = good;
                            break;
                        }
                        None => {
                            text.push('\u{FFFD}');
                            start = end;
                        }
                    }
                }
            }
        }
        let quoted = serde_json::to_string(&text).map_err(std::io::Error::other)?;
        out.write_all(&quoted.as_bytes()[1..quoted.len() - 1])?;
        if eof {
            break;
        }
        buf.copy_within(start..end, 0);
        carry = end - start;
    }
    out.write_all(b"\"")
}

#[cfg(test)]
mod tests {
    use super::write_json_string_lossy;

    #[test]
    fn streamed_json_string_matches_from_utf8_lossy() {
        let mut input = Vec::new();
        for i in 0..200_000u32 {
            input.extend_from_slice(["é", "a", "\"", "\n", "€", "😀", "\u{1}"][i as usize % 7].as_bytes());
            if i % 997 == 0 {
                input.push(0xff);
            }
        }
        input.extend_from_slice(&"😀".as_bytes()[..2]); // cut at the very end
        let mut out = Vec::new();
        write_json_string_lossy(&input[..], &mut out).unwrap();
        let back: String = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, String::from_utf8_lossy(&input));
        // Tiny reads cut every sequence.
        struct Slow<'a>(&'a [u8]);
        impl std::io::Read for Slow<'_> {
            fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
                let n = self.0.len().min(b.len()).min(3);
                b[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut out = Vec::new();
        write_json_string_lossy(Slow(&input[..5000]), &mut out).unwrap();
        let back: String = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, String::from_utf8_lossy(&input[..5000]));
    }
}
