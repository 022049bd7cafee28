//! `runspool top`: a live view of a root in the terminal. It reads the same
//! files every other command reads (the run indexes, status.json, the spool,
//! daemon.json) and acts through the commands' own functions (`stop`,
//! `hold`, `release`, `pause`, `resume`), so it writes nothing another
//! client could not.
//!
//! The terminal is driven by hand: raw mode through termios (libc) and a
//! few ANSI sequences (alternate screen, cursor, reverse video, colours).
//! It redraws when a watched file changes (notify, on the run indexes, the
//! spool, `runspool/` and the shown runs' directories), at most every
//! `MIN_GAP`, and every `TICK` for elapsed times and anything a watch missed;
//! it sleeps in poll(2) otherwise. The terminal is restored on every way
//! out: `q`, Ctrl-C, SIGINT/SIGTERM/SIGHUP, an error and a panic.
//!
//! Everything a file says is printed through `visible()`; a step's output,
//! shown as its last lines and in the log pane, loses its colour sequences
//! and has every other control character escaped.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::text::visible;
use crate::client::{self, Pending, Target};
use crate::protocol::daemon::DaemonStatus;
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout, RunId};

/// Redraws after file events are at least this far apart (a chatty step
/// writes its output many times a second).
const MIN_GAP: Duration = Duration::from_millis(200);
/// Elapsed times move, and a watch can miss what another host writes.
const TICK: Duration = Duration::from_secs(2);
/// Finished runs shown.
const RECENT: usize = 30;
/// Requests in the spool looked at (each body is read for its run id).
const MAX_PENDING: usize = 200;
/// Run directories watched (the active runs' and the log pane's).
const MAX_RUN_WATCHES: usize = 64;
/// How much of the end of a step's output the run rows read.
const TAIL_BYTES: u64 = 8 * 1024;
/// How much of the end of each step's output the log pane reads.
const PANE_BYTES: u64 = 256 * 1024;

pub fn top(layout: &Layout) -> anyhow::Result<i32> {
    use std::io::IsTerminal as _;
    if !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
        bail!(
            "`runspool top` needs a terminal on stdin and stdout; in a script use `runspool list` \
             (or `list --json`) and `runspool status --json`"
        );
    }
    // Signals that end top come through a socket pair into the poll loop, so
    // the terminal is restored by the same code as for `q`.
    let (quit_r, quit_w) = UnixStream::pair().context("cannot create a socket pair for signals")?;
    let (wake_r, wake_w) = UnixStream::pair().context("cannot create a socket pair for file events")?;
    for s in [&quit_r, &wake_r, &wake_w] {
        s.set_nonblocking(true)?;
    }
    let mut sig_ids = Vec::new();
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        sig_ids.push(signal_hook::low_level::pipe::register(sig, quit_w.try_clone()?)?);
    }
    sig_ids.push(signal_hook::low_level::pipe::register(libc::SIGWINCH, wake_w.try_clone()?)?);
    let result = {
        let _term = Terminal::enter()?;
        let mut app = App::new(layout.clone(), wake_w);
        app.run(&quit_r, &wake_r)
    };
    for id in sig_ids {
        signal_hook::low_level::unregister(id);
    }
    result
}

// ---------------------------------------------------------------- terminal

/// The terminal's settings before top changed them, and a descriptor of it,
/// for whichever way out comes first (`restore` takes them once).
static SAVED: Mutex<Option<(RawFd, libc::termios)>> = Mutex::new(None);

/// Alternate screen, cursor hidden, no line wrap (rows are cut to the width).
const ENTER: &[u8] = b"\x1b[?1049h\x1b[?25l\x1b[?7l\x1b[H\x1b[2J";
const LEAVE: &[u8] = b"\x1b[0m\x1b[?7h\x1b[?25h\x1b[?1049l";

/// Raw mode and the alternate screen while it lives.
struct Terminal;

impl Terminal {
    fn enter() -> anyhow::Result<Terminal> {
        // SAFETY: plain libc calls on descriptors 0 and 1 and on termios
        // structures owned here.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                bail!("cannot read the terminal's settings: {}", std::io::Error::last_os_error());
            }
            let orig = t;
            // A copy of the terminal's descriptor: a command's output may be
            // redirected from fd 1 when a panic wants the terminal back.
            let fd = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
            if fd < 0 {
                bail!("cannot duplicate the terminal's descriptor: {}", std::io::Error::last_os_error());
            }
            libc::cfmakeraw(&mut t);
            t.c_cc[libc::VMIN] = 1;
            t.c_cc[libc::VTIME] = 0;
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                libc::close(fd);
                bail!("cannot put the terminal in raw mode: {}", std::io::Error::last_os_error());
            }
            *SAVED.lock().unwrap_or_else(|e| e.into_inner()) = Some((fd, orig));
        }
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            prev(info);
        }));
        write_all_fd(1, ENTER);
        Ok(Terminal)
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        // The panic hook stays: `restore` does nothing a second time.
        restore();
    }
}

/// Leave the alternate screen and put the terminal's settings back (once).
fn restore() {
    let saved = SAVED.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some((fd, orig)) = saved {
        write_all_fd(fd, LEAVE);
        // SAFETY: restores settings read by tcgetattr; closes our own dup.
        unsafe {
            libc::tcsetattr(fd, libc::TCSANOW, &orig);
            libc::close(fd);
        }
    }
}

/// write(2) without std's stdout lock (a panic may come while it is held).
fn write_all_fd(fd: RawFd, mut b: &[u8]) {
    while !b.is_empty() {
        // SAFETY: writes from a live slice.
        let n = unsafe { libc::write(fd, b.as_ptr().cast(), b.len()) };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        b = &b[n as usize..];
    }
}

/// (columns, rows), 80×24 when the terminal does not say.
fn size() -> (usize, usize) {
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills the winsize it is given.
    let ok = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 && ws.ws_row > 0 {
        (ws.ws_col as usize, ws.ws_row as usize)
    } else {
        (80, 24)
    }
}

// ---------------------------------------------------------------- keys

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Char(char),
    Up,
    Down,
    PageUp,
    PageDown,
    Home,
    End,
    Esc,
    CtrlC,
}

/// The keys in what one read returned. A lone ESC at the end is the Esc key;
/// unknown sequences are skipped.
fn parse_keys(b: &[u8]) -> Vec<Key> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            0x03 => out.push(Key::CtrlC),
            0x1b if i + 1 >= b.len() => out.push(Key::Esc),
            0x1b if b[i + 1] == b'[' || b[i + 1] == b'O' => {
                // CSI / SS3: parameters, then one final byte in 0x40..=0x7e.
                let mut j = i + 2;
                while j < b.len() && !(0x40..=0x7e).contains(&b[j]) {
                    j += 1;
                }
                let params = &b[i + 2..j.min(b.len())];
                match (b.get(j), params) {
                    (Some(b'A'), _) => out.push(Key::Up),
                    (Some(b'B'), _) => out.push(Key::Down),
                    (Some(b'H'), _) => out.push(Key::Home),
                    (Some(b'F'), _) => out.push(Key::End),
                    (Some(b'~'), b"5") => out.push(Key::PageUp),
                    (Some(b'~'), b"6") => out.push(Key::PageDown),
                    (Some(b'~'), b"1" | b"7") => out.push(Key::Home),
                    (Some(b'~'), b"4" | b"8") => out.push(Key::End),
                    _ => {}
                }
                i = j;
            }
            0x1b => out.push(Key::Esc),
            c if c.is_ascii_graphic() || c == b' ' => out.push(Key::Char(c as char)),
            _ => {}
        }
        i += 1;
    }
    out
}

// ---------------------------------------------------------------- what is shown

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Running,
    Queued,
    Pending,
    Recent,
}

/// One row of the view: a run, or a request still in the spool.
struct Item {
    kind: Kind,
    id: RunId,
    status: Result<Status, String>,
    ours: bool,
    /// The spool entry of a pending request.
    pending: Option<Pending>,
    /// The last lines of a running run's current output.
    tail: Vec<String>,
}

#[derive(Default)]
struct Snapshot {
    alive: bool,
    daemon: Option<DaemonStatus>,
    storage: String,
    items: Vec<Item>,
    /// Why part of the view could not be read.
    problems: Vec<String>,
}

impl Snapshot {
    fn read(layout: &Layout, commands: &mut HashMap<RunId, String>) -> Snapshot {
        let mut snap = Snapshot { alive: client::daemon_running(layout), ..Default::default() };
        snap.daemon = super::health::read_report_nofollow(layout);
        // The daemon's word on storage, and the CLI's own free-space check
        // (a full disk may keep the daemon from saying so).
        let running = snap.daemon.as_ref().filter(|_| snap.alive);
        let min = running.and_then(|d| d.storage.min_free_bytes).unwrap_or(super::health::DEFAULT_MIN_FREE);
        let own = crate::store::fsutil::space_shortage(super::health::root_or_slash(layout), min);
        snap.storage = match (running.map(|d| &d.storage), own) {
            (Some(s), _) if s.state != "ok" => {
                format!("{}{}", s.state, s.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())
            }
            (_, Some(why)) => format!("degraded ({why})"),
            _ => "ok".into(),
        };
        match index::list_active(layout) {
            Ok(active) => {
                let (mut run, mut queued) = (Vec::new(), Vec::new());
                for x in active {
                    let kind = match &x.status {
                        Ok(s) if s.state == State::Queued => Kind::Queued,
                        _ => Kind::Running,
                    };
                    let mut it = Item {
                        kind,
                        id: x.run_id,
                        ours: x.ownership.is_ours(),
                        status: x.status,
                        pending: None,
                        tail: vec![],
                    };
                    if kind == Kind::Running {
                        if let Ok(s) = &it.status {
                            it.tail = current_tail(&layout.run_dir(&it.id), s);
                        }
                        run.push(it);
                    } else {
                        queued.push(it);
                    }
                }
                snap.items.extend(run);
                snap.items.extend(queued);
            }
            Err(e) => snap.problems.push(format!("cannot read {}: {e}", layout.active().display())),
        }
        let mut names = client::pending_names(layout);
        names.sort();
        names.truncate(MAX_PENDING);
        let mut pending: Vec<Pending> = names
            .iter()
            .filter_map(|n| match client::resolve(layout, n) {
                Ok(Target::Pending(p)) => Some(p),
                _ => None,
            })
            .collect();
        pending.sort_by(|a, b| (a.since_ms, &a.name).cmp(&(b.since_ms, &b.name)));
        for p in pending {
            let status = Err("pending in the spool".to_string());
            snap.items.push(Item {
                kind: Kind::Pending,
                id: p.run_id.clone(),
                status,
                ours: true,
                pending: Some(p),
                tail: vec![],
            });
        }
        match index::list_recent(layout, None, RECENT) {
            Ok(recent) => snap.items.extend(recent.into_iter().map(|x| Item {
                kind: Kind::Recent,
                id: x.run_id,
                ours: x.ownership.is_ours(),
                status: x.status,
                pending: None,
                tail: vec![],
            })),
            Err(e) => snap.problems.push(format!("cannot read {}: {e}", layout.terminal().display())),
        }
        // Commands of runs no longer shown are forgotten.
        let shown: HashSet<&RunId> = snap.items.iter().map(|i| &i.id).collect();
        commands.retain(|id, _| shown.contains(id));
        for it in &snap.items {
            if it.kind != Kind::Pending && !commands.contains_key(&it.id) {
                if let Ok(s) = &it.status {
                    commands.insert(it.id.clone(), super::inspect::command_of(&layout.run_dir(&it.id), s));
                }
            }
        }
        snap
    }
}

/// The steps a running run is at: those running, else its current step.
fn current_steps(s: &Status) -> Vec<usize> {
    let running: Vec<usize> =
        s.steps.iter().enumerate().filter(|(_, st)| st.status.as_str() == "running").map(|(i, _)| i).collect();
    if running.is_empty() {
        vec![s.current_step.min(s.steps.len().saturating_sub(1))]
    } else {
        running
    }
}

/// The last two lines of a running run's current output (one per step
/// when steps run in parallel).
fn current_tail(dir: &Path, s: &Status) -> Vec<String> {
    let steps = current_steps(s);
    let per = if steps.len() > 1 { 1 } else { 2 };
    let mut out = Vec::new();
    for i in steps.into_iter().take(2) {
        let lines = tail_lines(&RunPaths::output(dir, i), TAIL_BYTES, per);
        out.extend(lines.into_iter().map(|l| if per == 1 { format!("[{i}] {l}") } else { l }));
    }
    out
}

/// The last `n` non-blank lines of the last `max` bytes of `path`, made
/// printable. The output is the step's to write: opened without following
/// a link and never waiting on a FIFO (`fsutil::open_read`).
fn tail_lines(path: &Path, max: u64, n: usize) -> Vec<String> {
    let Ok(mut f) = fsutil::open_read(path) else { return vec![] };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return vec![];
    }
    let mut buf = Vec::with_capacity(max.min(len) as usize);
    if f.take(max).read_to_end(&mut buf).is_err() {
        return vec![];
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<&str> = text.split('\n').collect();
    if start > 0 && lines.len() > 1 {
        // Cut in the middle of a line.
        lines.remove(0);
    }
    let mut out: Vec<String> =
        lines.iter().rev().map(|l| printable(l)).filter(|l| !l.trim().is_empty()).take(n).collect();
    out.reverse();
    out
}

/// One line of a step's output as a terminal would leave it: what follows
/// its last carriage return (progress bars), without colour sequences (CSI),
/// every other control character escaped (`visible`).
fn printable(line: &str) -> String {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let line = line.rsplit('\r').next().unwrap_or(line);
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' && chars.peek() == Some(&'[') {
            chars.next();
            // Parameters and intermediates, then one final byte.
            for c in chars.by_ref() {
                if ('\x40'..='\x7e').contains(&c) {
                    break;
                }
            }
            continue;
        }
        plain.push(c);
    }
    visible(&plain)
}

/// `42s`, `3m05s`, `2h03m`, `4d02h`.
fn span(ms: i64) -> String {
    let s = (ms / 1000).max(0);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86400, s / 3600 % 24),
    }
}

/// The shortest prefix length (8 or more) that tells every shown id apart.
fn short_len(ids: &[&str]) -> usize {
    let mut sorted: Vec<&str> = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut len = 8;
    for w in sorted.windows(2) {
        let common = w[0].chars().zip(w[1].chars()).take_while(|(a, b)| a == b).count();
        len = len.max(common + 1);
    }
    len
}

fn short(id: &str, len: usize) -> String {
    id.chars().take(len).collect()
}

// ---------------------------------------------------------------- lines on screen

/// A screen line: pieces of text, each with an SGR style ("" for none).
#[derive(Default)]
struct Line(Vec<(String, &'static str)>);

impl Line {
    fn plain(text: impl Into<String>) -> Line {
        Line(vec![(text.into(), "")])
    }
    fn styled(text: impl Into<String>, style: &'static str) -> Line {
        Line(vec![(text.into(), style)])
    }
    fn push(&mut self, text: impl Into<String>, style: &'static str) -> &mut Line {
        self.0.push((text.into(), style));
        self
    }

    /// The line cut to `width` columns (one per character), padded to the
    /// width when `selected` (shown in reverse video), with its styles
    /// unless `colour` is off.
    fn render(&self, width: usize, selected: bool, colour: bool) -> String {
        let mut out = String::new();
        let base = if selected { "\x1b[7m" } else { "" };
        out.push_str(base);
        let mut left = width;
        for (text, style) in &self.0 {
            if left == 0 {
                break;
            }
            let n = text.chars().count();
            let piece: String = if n > left {
                let mut p: String = text.chars().take(left.saturating_sub(1)).collect();
                p.push('…');
                p
            } else {
                text.clone()
            };
            left -= piece.chars().count().min(left);
            if colour && !style.is_empty() {
                out.push_str(style);
                out.push_str(&piece);
                out.push_str("\x1b[0m");
                out.push_str(base);
            } else {
                out.push_str(&piece);
            }
        }
        if selected {
            out.push_str(&" ".repeat(left));
        }
        out.push_str("\x1b[0m");
        out
    }
}

const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";

fn state_style(state: &str) -> &'static str {
    match state {
        "complete" => "\x1b[32m",
        "failed" | "rejected" => "\x1b[31m",
        "running" => "\x1b[36m",
        "queued" | "pending" => "\x1b[34m",
        "stopped" | "paused" | "partial" => "\x1b[33m",
        _ => "",
    }
}

// ---------------------------------------------------------------- the app

enum View {
    Main,
    /// The log pane of a run: how many lines up from the end it is scrolled.
    Logs {
        id: RunId,
        up: usize,
    },
}

struct App {
    layout: Layout,
    snap: Snapshot,
    commands: HashMap<RunId, String>,
    /// The selected row's run id (kept as rows move), and its index.
    selected: Option<RunId>,
    index: usize,
    view: View,
    /// The last action's outcome, shown at the bottom.
    message: Option<(String, bool)>,
    colour: bool,
    watcher: Option<notify::RecommendedWatcher>,
    watched: HashSet<PathBuf>,
    /// The log pane's lines, read at each refresh.
    pane: Vec<Line>,
}

impl App {
    fn new(layout: Layout, wake: UnixStream) -> App {
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            // Our own reads are no news (`platform::is_change`).
            if res.is_ok_and(|ev| !crate::platform::is_change(&ev.kind)) {
                return;
            }
            // Non-blocking: when the socket is full a wake-up is pending anyway.
            let _ = (&wake).write(&[1]);
        })
        .ok();
        let colour = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        App {
            layout,
            snap: Snapshot::default(),
            commands: HashMap::new(),
            selected: None,
            index: 0,
            view: View::Main,
            message: None,
            colour,
            watcher,
            watched: HashSet::new(),
            pane: Vec::new(),
        }
    }

    fn run(&mut self, quit: &UnixStream, wake: &UnixStream) -> anyhow::Result<i32> {
        let mut last = Instant::now() - TICK;
        let mut dirty = true;
        loop {
            let since = last.elapsed();
            if (dirty && since >= MIN_GAP) || since >= TICK {
                self.refresh();
                self.draw()?;
                last = Instant::now();
                dirty = false;
            }
            let since = last.elapsed();
            let wait = if dirty { MIN_GAP.saturating_sub(since) } else { TICK.saturating_sub(since) };
            let mut fds = [
                libc::pollfd { fd: 0, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: quit.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: poll on an array of pollfd owned here.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e).context("poll on the terminal failed");
            }
            if fds[2].revents != 0 {
                return Ok(0);
            }
            if fds[1].revents != 0 {
                drain(wake);
                dirty = true;
            }
            if fds[0].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
                && fds[0].revents & libc::POLLIN == 0
            {
                // The terminal went away.
                return Ok(0);
            }
            if fds[0].revents & libc::POLLIN != 0 {
                let mut buf = [0u8; 256];
                // SAFETY: reads into a live buffer.
                let n = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
                if n == 0 {
                    return Ok(0);
                }
                if n < 0 {
                    continue;
                }
                for key in parse_keys(&buf[..n as usize]) {
                    match self.key(key) {
                        Step::Quit => return Ok(0),
                        Step::Redraw => self.draw()?,
                        Step::Reread => {
                            self.refresh();
                            self.draw()?;
                            last = Instant::now();
                            dirty = false;
                        }
                        Step::Nothing => {}
                    }
                }
            }
        }
    }

    fn refresh(&mut self) {
        self.snap = Snapshot::read(&self.layout, &mut self.commands);
        // Keep the selected run selected as rows move; else the same row.
        if let Some(i) = self.selected.as_ref().and_then(|id| self.snap.items.iter().position(|it| it.id == *id)) {
            self.index = i;
        }
        self.index = self.index.min(self.snap.items.len().saturating_sub(1));
        self.selected = self.snap.items.get(self.index).map(|it| it.id.clone());
        if let View::Logs { id, up } = &mut self.view {
            let before = self.pane.len();
            self.pane = pane_lines(&self.layout, id);
            // Scrolled up, the pane stays on the same lines as output comes.
            if *up > 0 {
                *up += self.pane.len().saturating_sub(before);
            }
        }
        self.sync_watches();
    }

    /// Watch the indexes, the spool, `runspool/` and the directories of the
    /// active runs (and of the log pane's run); a path not there yet is
    /// tried again at the next refresh.
    fn sync_watches(&mut self) {
        use notify::{RecursiveMode, Watcher as _};
        let Some(w) = self.watcher.as_mut() else { return };
        let l = &self.layout;
        let mut want: Vec<(PathBuf, RecursiveMode)> = vec![
            (l.root.clone(), RecursiveMode::NonRecursive),
            (l.spool(), RecursiveMode::NonRecursive),
            (l.daemon_dir(), RecursiveMode::NonRecursive),
            (l.active(), RecursiveMode::NonRecursive),
            // Terminal markers land in per-session directories.
            (l.terminal(), RecursiveMode::Recursive),
        ];
        let mut runs: Vec<&RunId> = self
            .snap
            .items
            .iter()
            .filter(|it| matches!(it.kind, Kind::Running | Kind::Queued))
            .map(|it| &it.id)
            .take(MAX_RUN_WATCHES)
            .collect();
        if let View::Logs { id, .. } = &self.view {
            runs.push(id);
        }
        // Run directories are real directories (never a link followed into).
        want.extend(
            runs.into_iter()
                .map(|id| l.run_dir(id))
                .filter(|d| fsutil::real_dir(d).is_ok())
                .map(|d| (d, RecursiveMode::NonRecursive)),
        );
        let wanted: HashSet<PathBuf> = want.iter().map(|(p, _)| p.clone()).collect();
        for gone in self.watched.iter().filter(|p| !wanted.contains(*p)).cloned().collect::<Vec<_>>() {
            let _ = w.unwatch(&gone);
            self.watched.remove(&gone);
        }
        for (p, mode) in want {
            if !self.watched.contains(&p) && w.watch(&p, mode).is_ok() {
                self.watched.insert(p);
            }
        }
    }

    fn key(&mut self, key: Key) -> Step {
        if let View::Logs { up, .. } = &mut self.view {
            let page = size().1.saturating_sub(3).max(1);
            match key {
                Key::Char('q') | Key::Char('l') | Key::Esc => {
                    self.view = View::Main;
                    self.pane.clear();
                    return Step::Reread;
                }
                Key::CtrlC => return Step::Quit,
                Key::Up | Key::Char('k') => *up += 1,
                Key::Down | Key::Char('j') => *up = up.saturating_sub(1),
                Key::PageUp => *up += page,
                Key::PageDown => *up = up.saturating_sub(page),
                Key::Home | Key::Char('g') => *up = usize::MAX / 2,
                Key::End | Key::Char('G') => *up = 0,
                _ => return Step::Nothing,
            }
            *up = (*up).min(self.pane.len());
            return Step::Redraw;
        }
        let n = self.snap.items.len();
        match key {
            Key::Char('q') | Key::CtrlC => return Step::Quit,
            Key::Up | Key::Char('k') => self.index = self.index.saturating_sub(1),
            Key::Down | Key::Char('j') => self.index = (self.index + 1).min(n.saturating_sub(1)),
            Key::PageUp => self.index = self.index.saturating_sub(10),
            Key::PageDown => self.index = (self.index + 10).min(n.saturating_sub(1)),
            Key::Home | Key::Char('g') => self.index = 0,
            Key::End | Key::Char('G') => self.index = n.saturating_sub(1),
            Key::Char('s') => return self.act("stop"),
            Key::Char('h') => return self.act("hold"),
            Key::Char('r') => return self.act("release"),
            Key::Char('p') => return self.pause_or_resume(),
            Key::Char('l') => {
                let Some(it) = self.snap.items.get(self.index) else {
                    self.message = Some(("no run selected".into(), true));
                    return Step::Redraw;
                };
                if it.kind == Kind::Pending {
                    self.message = Some((format!("{} is still in the spool: no output yet", it.id), true));
                    return Step::Redraw;
                }
                self.view = View::Logs { id: it.id.clone(), up: 0 };
                return Step::Reread;
            }
            _ => return Step::Nothing,
        }
        self.selected = self.snap.items.get(self.index).map(|it| it.id.clone());
        Step::Redraw
    }

    /// `s`, `h`, `r` on the selected row, through the commands' own code.
    fn act(&mut self, verb: &str) -> Step {
        let Some(it) = self.snap.items.get(self.index) else {
            self.message = Some(("no run selected".into(), true));
            return Step::Redraw;
        };
        let id = it.id.to_string();
        let layout = &self.layout;
        let (r, said) = capture(|| match verb {
            "stop" => super::inspect::stop(layout, &id, Some("stopped from runspool top".into()), false),
            "hold" => super::schedule::hold(layout, &id, true),
            _ => super::schedule::hold(layout, &id, false),
        });
        self.message = Some(outcome(r, &said, &format!("{verb} {id}: done")));
        Step::Reread
    }

    /// `p`: pause the queue, or resume it when queue.json says it is paused.
    fn pause_or_resume(&mut self) -> Step {
        let paused = match crate::store::queue::read(&crate::store::queue::path(&self.layout)) {
            Ok(Some(q)) => q.paused,
            Ok(None) => false,
            Err(_) => self.snap.daemon.as_ref().and_then(|d| d.queue.as_ref()).is_some_and(|q| q.paused),
        };
        let layout = &self.layout;
        let (r, said) = capture(|| {
            if paused {
                super::queue_cmd::resume(layout, false)
            } else {
                super::queue_cmd::pause(layout, Some("paused from runspool top".into()))
            }
        });
        self.message = Some(outcome(r, &said, if paused { "queue resumed" } else { "queue paused" }));
        Step::Reread
    }

    fn draw(&mut self) -> anyhow::Result<()> {
        let (width, height) = size();
        let lines: Vec<(Line, bool)> = match &self.view {
            View::Main => self.main_lines(height),
            View::Logs { id, up } => self.log_lines(id, *up, height),
        };
        let mut out = String::with_capacity(width * height * 2);
        out.push_str("\x1b[H");
        for (row, (line, sel)) in lines.iter().take(height).enumerate() {
            out.push_str(&format!("\x1b[{};1H", row + 1));
            out.push_str(&line.render(width, *sel, self.colour));
            out.push_str("\x1b[K");
        }
        if lines.len() < height {
            // Clear what the last frame had below.
            out.push_str(&format!("\x1b[{};1H\x1b[J", lines.len() + 1));
        }
        let mut so = std::io::stdout().lock();
        so.write_all(out.as_bytes()).and_then(|_| so.flush()).context("cannot write to the terminal")
    }

    /// The main view: header, the sections (scrolled so the selected row is
    /// shown), keys and the last action's outcome.
    fn main_lines(&self, height: usize) -> Vec<(Line, bool)> {
        let mut head = self.header();
        let mut foot = vec![(
            Line::styled("↑↓/jk select  s stop  h hold  r release  l logs  p pause/resume queue  q quit", DIM),
            false,
        )];
        if let Some((m, err)) = &self.message {
            foot.push((Line::styled(m.clone(), if *err { "\x1b[31m" } else { "" }), false));
        }
        for p in &self.snap.problems {
            head.push((Line::styled(visible(p), "\x1b[31m"), false));
        }
        let (body, sel_row) = self.body();
        let room = height.saturating_sub(head.len() + foot.len());
        // Scroll so the selected row (and the line under it) is shown.
        let first = match sel_row {
            Some(r) if r + 2 > room => (r + 2 - room).min(body.len().saturating_sub(room)),
            _ => 0,
        };
        let mut out = head;
        out.extend(body.into_iter().skip(first).take(room));
        while out.len() + foot.len() < height {
            out.push((Line::default(), false));
        }
        out.extend(foot);
        out
    }

    fn header(&self) -> Vec<(Line, bool)> {
        let s = &self.snap;
        let mut l1 = Line::styled("runspool top", BOLD);
        l1.push(format!("  {}  ", self.layout.root.display()), "");
        let live = s.daemon.as_ref().filter(|_| s.alive);
        match live {
            Some(d) => {
                let age = crate::now_ms() - d.updated_at;
                if age > super::health::STALE_AFTER_MS {
                    l1.push(
                        format!("daemon unresponsive (pid {}, daemon.json {} s old)", d.pid, age / 1000),
                        "\x1b[31m",
                    );
                } else {
                    l1.push(format!("daemon running (pid {}, {})", d.pid, visible(&d.runspool_version)), "");
                }
            }
            None => {
                l1.push("daemon not running (start it with `runspool daemon`)", "\x1b[31m");
            }
        }
        let counts = |m: &std::collections::BTreeMap<String, usize>| {
            m.iter().map(|(k, v)| format!("{} {v}", visible(k))).collect::<Vec<_>>().join(", ")
        };
        let pending = s.items.iter().filter(|i| i.kind == Kind::Pending).count();
        let mut l2 = Line::plain("queue    ");
        let mut l3 = Line::plain("lanes    ");
        match live.and_then(|d| d.queue.as_ref()) {
            Some(q) => {
                if q.paused {
                    let why = q.reason.as_deref().map(|r| format!(" ({})", visible(r))).unwrap_or_default();
                    l2.push(format!("paused{why}"), "\x1b[33m");
                } else {
                    l2.push("accepting", "");
                }
                let over = if q.max_running_override.is_some() { " (override)" } else { "" };
                l2.push(format!(" · max-running {}{over}", q.max_running), "");
                l2.push(format!(" · {pending} pending in the spool"), "");
                if let Some(e) = &q.error {
                    l2.push(format!(" · queue file ignored: {}", visible(e)), "\x1b[31m");
                }
                // Per lane: running and queued; then why the queued wait.
                let lanes: std::collections::BTreeSet<&String> =
                    q.running_by_lane.keys().chain(q.by_lane.keys()).collect();
                let per_lane: Vec<String> = lanes
                    .iter()
                    .map(|l| {
                        let r = q.running_by_lane.get(*l).copied().unwrap_or(0);
                        let w = q.by_lane.get(*l).copied().unwrap_or(0);
                        format!("{} {r} running {w} queued", visible(l))
                    })
                    .collect();
                l3.push(if per_lane.is_empty() { "idle".to_string() } else { per_lane.join(" · ") }, "");
                if !q.by_reason.is_empty() {
                    l3.push(format!("  waiting: {}", counts(&q.by_reason)), "\x1b[33m");
                }
            }
            None => {
                l2.push(
                    super::health::describe_file(&self.layout).map(|d| visible(&d)).unwrap_or_else(|| "-".into()),
                    "",
                );
                l2.push(format!(" · {pending} pending in the spool"), "");
                l3.push("-", "");
            }
        }
        let mut l4 = Line::plain("storage  ");
        l4.push(visible(&s.storage), if s.storage == "ok" { "" } else { "\x1b[31m" });
        if let Some(d) = live {
            l4.push(format!(" · watch {}", visible(&super::health::watch_text(d))), "");
        }
        vec![(l1, false), (l2, false), (l3, false), (l4, false), (Line::default(), false)]
    }

    /// The sections' lines and the index among them of the selected row.
    fn body(&self) -> (Vec<(Line, bool)>, Option<usize>) {
        let items = &self.snap.items;
        let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
        let w = short_len(&ids);
        let lane_w =
            items.iter().filter_map(|i| i.status.as_ref().ok()).map(|s| s.lane().len()).max().unwrap_or(7).max(4);
        let now = crate::now_ms();
        let mut out = Vec::new();
        let mut sel_row = None;
        for (kind, title) in [
            (Kind::Running, "RUNNING"),
            (Kind::Queued, "QUEUED"),
            (Kind::Pending, "PENDING IN SPOOL"),
            (Kind::Recent, "RECENT"),
        ] {
            let n = items.iter().filter(|i| i.kind == kind).count();
            if n == 0 && matches!(kind, Kind::Pending) {
                continue;
            }
            out.push((Line::styled(format!("{title} ({n})"), BOLD), false));
            for (idx, it) in items.iter().enumerate().filter(|(_, i)| i.kind == kind) {
                let sel = idx == self.index && self.selected.as_ref() == Some(&it.id);
                if sel {
                    sel_row = Some(out.len());
                }
                let mut line = Line::plain(format!("{}  ", visible(&short(it.id.as_str(), w))));
                let cmd = self.commands.get(&it.id).cloned().unwrap_or_default();
                match (&it.status, kind) {
                    (_, Kind::Pending) => {
                        let p = it.pending.as_ref();
                        line.push(format!("{:<8}  ", "pending"), state_style("pending"));
                        line.push(format!("{:<lane_w$}  ", "-"), "");
                        line.push(format!("{:>7}  ", p.map(|p| span(now - p.since_ms)).unwrap_or_default()), "");
                        let daemon = if self.snap.alive { "" } else { " (no daemon runs: nothing claims it)" };
                        line.push(format!("in spool: {}{daemon}", p.map(|p| visible(&p.name)).unwrap_or_default()), "");
                    }
                    (Ok(s), _) => {
                        let state = visible(s.state.as_str());
                        line.push(format!("{state:<8}  "), state_style(&state));
                        line.push(format!("{:<lane_w$}  ", visible(s.lane())), "");
                        match kind {
                            Kind::Running => {
                                line.push(format!("{:>7}  ", span(now - s.started_at)), "");
                                let cur = current_steps(s);
                                let i = cur.first().copied().unwrap_or(0);
                                let agent = s.steps.get(i).map(|st| visible(&st.agent)).unwrap_or_default();
                                line.push(format!("step {}/{} {agent}  ", i + 1, s.steps.len().max(1)), "");
                            }
                            Kind::Queued => {
                                line.push(format!("{:>7}  ", span(now - s.started_at)), "");
                                line.push(format!("{}  ", waiting(s, w, now)), "\x1b[33m");
                            }
                            _ => {
                                let exit = s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
                                let took = s.ended_at.map(|e| span(e - s.started_at)).unwrap_or_else(|| "-".into());
                                let ago = s.ended_at.map(|e| format!("{} ago", span(now - e))).unwrap_or_default();
                                line.push(format!("exit {exit:<4} took {took:<7} {ago:<10}  "), "");
                            }
                        }
                        if !it.ours {
                            line.push("(another host's) ", DIM);
                        }
                        line.push(cmd, "");
                    }
                    (Err(e), _) => {
                        line.push(format!("{:<8}  ", "?"), "");
                        line.push(format!("status unreadable: {}", visible(e)), "\x1b[31m");
                    }
                }
                out.push((line, sel));
                for t in &it.tail {
                    out.push((Line::styled(format!("{:w$}  │ {t}", ""), DIM), false));
                }
            }
            out.push((Line::default(), false));
        }
        (out, sel_row)
    }

    fn log_lines(&self, id: &RunId, up: usize, height: usize) -> Vec<(Line, bool)> {
        let state = self
            .snap
            .items
            .iter()
            .find(|i| i.id == *id)
            .and_then(|i| i.status.as_ref().ok())
            .map(|s| visible(s.state.as_str()))
            .unwrap_or_else(|| "?".into());
        let mut head = Line::styled(format!("logs of {}", visible(id.as_str())), BOLD);
        head.push(format!("  ({state})  "), state_style(&state));
        head.push("↑↓/jk PgUp/PgDn scroll  g/G top/end  q/Esc/l back", DIM);
        let room = height.saturating_sub(1);
        let total = self.pane.len();
        let up = up.min(total.saturating_sub(room));
        let end = total - up;
        let start = end.saturating_sub(room);
        let mut out = vec![(head, false)];
        out.extend(self.pane[start..end].iter().map(|l| (Line(l.0.clone()), false)));
        if total == 0 {
            out.push((Line::styled("(no output yet)", DIM), false));
        }
        out
    }
}

enum Step {
    Quit,
    Redraw,
    Reread,
    Nothing,
}

/// Why a queued run waits, from its status (PROTOCOL §15: `waiting`,
/// `waitingFor`, `notBefore`, `held`).
fn waiting(s: &Status, w: usize, now: i64) -> String {
    let word = s.extra.get("waiting").and_then(|v| v.as_str()).map(visible);
    let held = s.held();
    match word.as_deref() {
        Some("dependencies") => {
            let on: Vec<String> = s
                .extra
                .get("waitingFor")
                .and_then(|v| v.as_array())
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .map(|d| visible(&short(d, w)))
                .collect();
            if on.is_empty() {
                "waiting: dependencies".into()
            } else {
                format!("waiting: dependencies ({})", on.join(", "))
            }
        }
        Some("not-before") => match s.extra.get("notBefore").and_then(|v| v.as_i64()) {
            Some(t) if t > now => format!("waiting: not-before (in {})", span(t - now)),
            _ => "waiting: not-before".into(),
        },
        Some("lane") => format!("waiting: lane ({} is full)", visible(s.lane())),
        Some(w) => format!("waiting: {w}{}", if held && w != "held" { " (held)" } else { "" }),
        None if held => "waiting: held".into(),
        None => "waiting".into(),
    }
}

/// The log pane's lines: each step's output (its last `PANE_BYTES`), under
/// a header per step.
fn pane_lines(layout: &Layout, id: &RunId) -> Vec<Line> {
    let dir = layout.run_dir(id);
    let Ok(Some(s)) = run::read_status(&dir) else {
        return vec![Line::styled(format!("cannot read {}", RunPaths::status(&dir).display()), "\x1b[31m")];
    };
    let mut out = Vec::new();
    for (i, st) in s.steps.iter().enumerate() {
        let path = RunPaths::output(&dir, i);
        let lines = tail_lines_all(&path, PANE_BYTES);
        if s.steps.len() > 1 {
            out.push(Line::styled(
                format!("==> step {i} ({}, {}) <==", visible(&st.agent), visible(st.status.as_str())),
                BOLD,
            ));
        }
        out.extend(lines.into_iter().map(Line::plain));
    }
    out
}

/// Every line of the last `max` bytes of `path` (see `tail_lines`).
fn tail_lines_all(path: &Path, max: u64) -> Vec<String> {
    let Ok(mut f) = fsutil::open_read(path) else { return vec![] };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return vec![];
    }
    let mut buf = Vec::new();
    if f.take(max).read_to_end(&mut buf).is_err() {
        return vec![];
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<&str> = text.split('\n').collect();
    if start > 0 && lines.len() > 1 {
        lines.remove(0);
    }
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines.into_iter().map(printable).collect()
}

fn drain(s: &UnixStream) {
    let mut buf = [0u8; 256];
    while matches!((&*s).read(&mut buf), Ok(n) if n > 0) {}
}

/// What an action's function printed (stdout and stderr), kept off the
/// screen: fds 1 and 2 go into a socket read by a thread while `f` runs.
fn capture(f: impl FnOnce() -> anyhow::Result<i32>) -> (anyhow::Result<i32>, String) {
    struct Back([RawFd; 2]);
    impl Drop for Back {
        fn drop(&mut self) {
            let _ = std::io::stdout().flush();
            // SAFETY: puts back the descriptors saved below and closes the copies.
            unsafe {
                libc::dup2(self.0[0], 1);
                libc::dup2(self.0[1], 2);
                libc::close(self.0[0]);
                libc::close(self.0[1]);
            }
        }
    }
    let _ = std::io::stdout().flush();
    let Ok((mut r, w)) = UnixStream::pair() else { return (f(), String::new()) };
    // SAFETY: dup of the standard descriptors, checked.
    let saved = unsafe { [libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3), libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3)] };
    if saved.iter().any(|&fd| fd < 0) {
        for fd in saved.into_iter().filter(|&fd| fd >= 0) {
            unsafe { libc::close(fd) };
        }
        return (f(), String::new());
    }
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = r.read_to_end(&mut b);
        String::from_utf8_lossy(&b).into_owned()
    });
    let result = {
        // SAFETY: points fds 1 and 2 at the socket; `Back` restores them.
        unsafe {
            libc::dup2(w.as_raw_fd(), 1);
            libc::dup2(w.as_raw_fd(), 2);
        }
        drop(w);
        let _back = Back(saved);
        f()
    };
    let said = reader.join().unwrap_or_default();
    (result, said)
}

/// The message line after an action: its error, else the last line it said.
fn outcome(r: anyhow::Result<i32>, said: &str, fallback: &str) -> (String, bool) {
    let last = said.lines().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim_start_matches("runspool: "));
    match r {
        Ok(0) => (visible(last.unwrap_or(fallback)), false),
        Ok(code) => (visible(&format!("exit {code}: {}", last.unwrap_or(fallback))), true),
        Err(e) => (visible(&format!("{e:#}")), true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(parse_keys(b"jk\x1b[A\x1b[B"), vec![Key::Char('j'), Key::Char('k'), Key::Up, Key::Down]);
        assert_eq!(parse_keys(b"\x1bOA\x1b[5~\x1b[6~\x03"), vec![Key::Up, Key::PageUp, Key::PageDown, Key::CtrlC]);
        assert_eq!(parse_keys(b"\x1b"), vec![Key::Esc]);
        assert_eq!(parse_keys(b"\x1b[1;5Cq"), vec![Key::Char('q')]);
    }

    #[test]
    fn output_lines_are_printable() {
        assert_eq!(printable("\x1b[32mok\x1b[0m done\r"), "ok done");
        assert_eq!(printable("10%\r50%\r100%"), "100%");
        assert_eq!(printable("a\x1b]0;title\x07b"), "a\\x1b]0;title\\x07b");
    }

    #[test]
    fn short_ids_tell_shown_runs_apart() {
        assert_eq!(short_len(&["3f2a9c1e-aaaa", "77777777-bbbb"]), 8);
        assert_eq!(short_len(&["3f2a9c1e-aaaa", "3f2a9c1e-abbb"]), 11);
        assert_eq!(short("build-42", 8), "build-42");
    }

    #[test]
    fn rows_are_cut_to_the_width() {
        let mut l = Line::plain("abcdef");
        l.push("ghij", "\x1b[31m");
        assert_eq!(l.render(8, false, false), "abcdefg…\x1b[0m");
        assert_eq!(l.render(20, false, false), "abcdefghij\x1b[0m");
        assert_eq!(Line::plain("ab").render(4, true, false), "\x1b[7mab  \x1b[0m");
    }
}
