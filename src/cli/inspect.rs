//! `status`, `list` and `stop` of runs: readers of the run files, and the
//! stop request's writer. `wait` and `logs` have their own files.

use std::io::Write;

use serde_json::json;

use super::text::age;
use crate::client::{Client, ListFilter, Stage, Stopped, Target};
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout};

/// `42s ago`, `3m ago`, `2h ago`, `1d ago`.
fn ago(ms: i64) -> String {
    format!("{} ago", age(ms))
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

/// `println!` of one line with every control character shown escaped: a run's
/// fields are another client's words, never terminal escapes.
macro_rules! say {
    ($($t:tt)*) => { println!("{}", one_line(&format!($($t)*))) };
}

pub fn status(layout: &Layout, run: &str, json: bool) -> anyhow::Result<i32> {
    let client = Client::from_layout(layout.clone());
    let id = match client.resolve(run)? {
        Target::Run(id) => id,
        Target::Pending(p) => return super::pending::status(layout, &p, json),
        Target::Rejected { name, error_file } => return super::pending::rejected_status(&name, &error_file),
    };
    let dir = layout.run_dir(&id);
    let stage = client.stage(&Target::Run(id.clone()));
    if let Ok(Stage::Claimed(_)) = stage {
        // Claimed a moment ago: its request is in its run, its status.json comes next.
        return super::pending::claimed_status(layout, &id, json);
    }
    if json {
        // Byte for byte, but never another run's status under this one's name.
        if let Err(e) = &stage {
            if e.downcast_ref::<std::io::Error>().is_some_and(run::is_identity_mismatch) {
                return stage.map(|_| 0);
            }
        }
        let raw = fsutil::read_nofollow(&RunPaths::status(&dir), 64 * 1024 * 1024)?;
        std::io::stdout().write_all(&raw)?;
        println!();
        return Ok(0);
    }
    let stage = match stage {
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
    let Some(s) = stage.status().cloned() else { unreachable!("a run directory's stage has a status or is claimed") };
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
    if let Some(old) = s.extra.get("restartOf").and_then(serde_json::Value::as_str) {
        say!("restart   of {old}");
    }
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
        // On a terminal its width; piped, $COLUMNS when set (as `ls` does).
        let env_columns =
            || std::env::var("COLUMNS").ok().and_then(|c| c.trim().parse::<usize>().ok()).filter(|c| *c > 0);
        let columns = if tty { terminal_columns().or_else(env_columns) } else { env_columns() };
        Style { colour: tty && !no_color, columns }
    }

    /// `text` (the state, padded) in the colour of `state`.
    fn state(&self, state: &str, text: &str) -> String {
        let code = match state {
            "complete" => "32",
            "failed" | "rejected" => "31",
            "running" => "36",
            "queued" | "pending" => "34",
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
pub(super) fn command_of(dir: &std::path::Path, s: &Status) -> String {
    let req = fsutil::read_nofollow(&RunPaths::request(dir), 1 << 20)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let mut command = command_from(req.as_ref().and_then(|r| r.get("steps")));
    if command.is_empty() {
        command = s.steps.iter().map(|st| st.agent.clone()).collect::<Vec<_>>().join("; ");
    }
    one_line(&command)
}

/// A request's `steps` as a user typed them (empty when there are none).
fn command_from(steps: Option<&serde_json::Value>) -> String {
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
    let mut parts = Vec::new();
    if let Some(steps) = steps {
        walk(steps, &mut parts);
    }
    parts.join("; ")
}

/// `text` with every control character (newlines, escapes) shown escaped:
/// one table line, and nothing a terminal would act on.
fn one_line(text: &str) -> String {
    super::text::visible(text)
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

pub fn list(
    layout: &Layout,
    active: bool,
    recent: Option<usize>,
    (session, lane): (Option<&str>, Option<&str>),
    wide: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let filter = ListFilter {
        active_only: active,
        recent,
        session: session.map(str::to_string),
        lane: lane.map(str::to_string),
    };
    let client = Client::from_layout(layout.clone());
    let listing = client.list(&filter)?;
    let (out, pending, capped) = (listing.runs, listing.pending, listing.capped);
    let limit = recent.unwrap_or(crate::client::DEFAULT_RECENT);
    // Active runs first, then the requests waiting to be claimed, then the finished runs.
    let n_active = out.iter().take_while(|x| x.ok().is_none_or(|s| s.state.is_active())).count();
    if json {
        let mut rows: Vec<serde_json::Value> = out[..n_active].iter().map(listed_json).collect();
        rows.extend(pending.iter().map(|p| pending_json(layout, p)));
        rows.extend(out[n_active..].iter().map(listed_json));
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    if out.is_empty() && pending.is_empty() {
        if active {
            eprintln!("no active runs (queued or running) or pending requests under {}", layout.root.display());
        } else if recent.is_some() {
            eprintln!("no runs (pending, active or finished) under {}", layout.root.display());
        } else {
            eprintln!("no runs under {}", layout.runs().display());
        }
        return Ok(0);
    }
    let mut rows: Vec<Row> = out[..n_active].iter().map(|x| Row::of_run(layout, x)).collect();
    rows.extend(pending.iter().map(|p| Row::of_pending(layout, p)));
    rows.extend(out[n_active..].iter().map(|x| Row::of_run(layout, x)));
    if !wide {
        let ids: Vec<&str> = rows.iter().map(|r| r.cells[0].as_str()).collect();
        let short = client.short_ids(&pending, &ids);
        for (r, s) in rows.iter_mut().zip(short) {
            r.cells[0] = s;
        }
    }
    print_table(&rows, wide);
    if capped {
        eprintln!("showing the newest {limit} finished runs; --recent N for more");
    }
    Ok(0)
}

/// One `list --json` row of a request still in the spool.
fn pending_json(layout: &Layout, p: &crate::client::Pending) -> serde_json::Value {
    let body = crate::client::pending_request(layout, p);
    let session = body.as_ref().and_then(|b| b.get("sessionId")).and_then(|v| v.as_str()).unwrap_or("default");
    json!({
        "runId": p.run_id, "state": "pending", "sessionId": session,
        "spoolFile": layout.spool().join(&p.name).display().to_string(),
        "publishedAt": p.since_ms, "launchedBy": "runspool",
    })
}

/// One row of `list`'s table: RUN, STATE, EXIT, DURATION, UPDATED, BY, SESSION, then the command.
struct Row {
    cells: [String; 7],
    command: String,
}

impl Row {
    fn of_run(layout: &Layout, x: &index::Listed) -> Row {
        let by = launched_by(x.ownership).to_string();
        let cells = match &x.status {
            Ok(s) => [
                x.run_id.to_string(),
                s.state.as_str().to_string(),
                s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                duration(s),
                ago(s.ended_at.unwrap_or(if s.last_update > 0 { s.last_update } else { s.started_at })),
                by,
                s.session_id.clone(),
            ],
            Err(_) => [x.run_id.to_string(), "?".into(), "-".into(), "-".into(), "-".into(), by, "-".into()],
        };
        let command = match &x.status {
            Ok(s) => command_of(&layout.run_dir(&x.run_id), s),
            Err(e) => one_line(&format!("({e})")),
        };
        // Another host's status.json may hold anything: never a terminal escape from it.
        Row { cells: cells.map(|c| one_line(&c)), command }
    }

    fn of_pending(layout: &Layout, p: &crate::client::Pending) -> Row {
        let body = crate::client::pending_request(layout, p);
        let session = body.as_ref().and_then(|b| b.get("sessionId")).and_then(|v| v.as_str()).unwrap_or("default");
        let cells = [
            p.run_id.to_string(),
            "pending".into(),
            "-".into(),
            format!("pending for {}", age(p.since_ms)),
            ago(p.since_ms),
            "runspool".into(),
            session.to_string(),
        ];
        let mut command = command_from(body.as_ref().and_then(|b| b.get("steps")));
        if command.is_empty() {
            command = format!("(unreadable request {})", p.name);
        }
        Row { cells: cells.map(|c| one_line(&c)), command: one_line(&command) }
    }
}

/// `list`'s table: one row per run, cut to the terminal's width (or
/// $COLUMNS): the command gets what the other columns leave, BY goes first
/// when every run is runspool's. `wide`: nothing cut.
fn print_table(rows: &[Row], wide: bool) {
    let style = Style::stdout();
    let columns = if wide { None } else { style.columns };
    let head = ["RUN", "STATE", "EXIT", "DURATION", "UPDATED", "BY", "SESSION"];
    let mut widths = head.map(str::len);
    for r in rows {
        for (w, c) in widths.iter_mut().zip(&r.cells) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut shown = [true; 7];
    let fixed =
        |shown: &[bool; 7]| -> usize { widths.iter().zip(shown).filter(|(_, s)| **s).map(|(w, _)| w + 2).sum() };
    const MIN_COMMAND: usize = 12;
    if let Some(c) = columns {
        if fixed(&shown) + MIN_COMMAND > c && rows.iter().all(|r| r.cells[5] == "runspool") {
            shown[5] = false;
        }
    }
    let fixed = fixed(&shown);
    // The command gets what the terminal has left; piped without $COLUMNS, a generous fixed width.
    let room = match columns {
        Some(c) => c.saturating_sub(fixed),
        None if wide => usize::MAX,
        None => 80,
    };
    let cell = |i: usize, text: &str| format!("{text:<w$}  ", w = widths[i]);
    let line = |cells: [&str; 7], command: &str, colour: bool| {
        let mut parts = Vec::new();
        for (i, c) in cells.iter().enumerate().filter(|(i, _)| shown[*i]) {
            parts.push((i, cell(i, c)));
        }
        let mut plain: String = parts.iter().map(|(_, t)| t.as_str()).collect();
        plain.push_str(&shorten(command, room));
        // Never wider than the terminal, whatever a column holds.
        let plain = match columns {
            Some(c) => shorten(plain.trim_end(), c),
            None => plain.trim_end().to_string(),
        };
        if !colour {
            return plain;
        }
        // The state's colour, on the state cell only (the second one, never cut at 80 columns).
        let run_w = parts[0].1.chars().count();
        let state_w = parts[1].1.chars().count();
        let chars: Vec<char> = plain.chars().collect();
        if chars.len() < run_w + state_w {
            return plain;
        }
        let a: String = chars[..run_w].iter().collect();
        let b: String = chars[run_w..run_w + state_w].iter().collect();
        let c: String = chars[run_w + state_w..].iter().collect();
        format!("{a}{}{c}", style.state(cells[1], &b))
    };
    println!("{}", line(head, "COMMAND", false));
    for r in rows {
        let cells = [0, 1, 2, 3, 4, 5, 6].map(|i| r.cells[i].as_str());
        println!("{}", line(cells, &r.command, true));
    }
}

/// `stop`: ask a run to stop or pause (a stop request in its control inbox),
/// or withdraw a request still in the spool.
pub fn stop(layout: &Layout, run: &str, reason: Option<String>, interrupt: bool) -> anyhow::Result<i32> {
    let client = Client::from_layout(layout.clone());
    let target = match client.resolve(run)? {
        // Not yet claimed: withdrawn (an interrupt too: there is nothing to pause), unless the daemon wins.
        Target::Pending(p) => match super::pending::stop(layout, &p, reason.as_deref())? {
            Some(id) => Target::Run(id),
            None => return Ok(0),
        },
        t => t,
    };
    match client.signal(&target, reason.as_deref(), interrupt)? {
        Stopped::Requested { run_id, request } => {
            let kind = if interrupt { "interrupt" } else { "stop" };
            eprintln!("runspool: asked {run_id} to {kind} ({})", request.display());
        }
        Stopped::Withdrawn(w) => super::pending::say_withdrawn(&w),
    }
    Ok(0)
}
