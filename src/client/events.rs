//! Every run's events as one stream ([`Events`]): `runspool events`.
//!
//! Each run's `events.jsonl` (PROTOCOL §5) is append-only; the stream keeps,
//! per run directory, how far it has read, and reads only complete lines
//! (ending in `\n`), so a line being written is taken whole once it is
//! finished, never twice and never in halves. New run directories are
//! found by listing the runs root on every pass; a run directory removed
//! (retention, `runspool rm`) just stops, and one replaced under the same
//! name (device and inode) is read from its beginning. Directories and files
//! are opened by descriptor and never through a symlink (`store::dirfd`).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::store::dirfd::{DirFd, Kind};
use crate::store::{Layout, RunId};

/// How often a follow looks for new lines and new runs.
const POLL: Duration = Duration::from_millis(100);
/// The most read from one run in one pass (the rest comes in the next).
const MAX_PASS_BYTES: u64 = 4 << 20;
/// A run whose events file has not grown for this long is looked at only
/// every `SETTLED_EVERY` passes (nothing is lost: only later).
const SETTLED_AFTER: Duration = Duration::from_secs(10);
const SETTLED_EVERY: u64 = 10;

/// One event line of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The run whose `events.jsonl` holds it (its directory's name).
    pub run_id: RunId,
    /// The line as JSON text, without its newline: as in the file when its
    /// `runId` is the run's; otherwise re-serialized with `runId` set to
    /// the directory's name (a run is its directory).
    pub line: String,
    /// The line parsed.
    pub value: Value,
}

impl Event {
    /// Its `type` (`subagent.run.started`, ...).
    pub fn kind(&self) -> Option<&str> {
        self.value.get("type").and_then(Value::as_str)
    }

    /// Its `ts`, ms since the epoch.
    pub fn ts(&self) -> Option<i64> {
        self.value.get("ts").and_then(Value::as_i64)
    }
}

/// Where the stream is in one run's `events.jsonl`.
#[derive(Debug)]
struct Cursor {
    /// The run directory's (device, inode) when first seen.
    dir: (u64, u64),
    /// The events file's (device, inode), once seen.
    file: Option<(u64, u64)>,
    /// Bytes read and emitted: always just after a `\n`.
    offset: u64,
    /// When the file last grew (or the run was first seen).
    grew: Instant,
}

/// Every run's events ([`super::Client::events`]): an iterator of
/// [`Event`]s, each line of each run's `events.jsonl` exactly once, in file
/// order per run. Without follow it ends once what exists is read; with
/// follow it waits for more (for ever, or until [`Events::until`]).
/// Lines that are not JSON objects are skipped, and so, with `since`, are
/// lines without a numeric `ts`.
#[derive(Debug)]
pub struct Events {
    layout: Layout,
    since: Option<i64>,
    follow: bool,
    until: Option<Instant>,
    runs: BTreeMap<String, Cursor>,
    ready: VecDeque<io::Result<Event>>,
    passes: u64,
    done: bool,
}

impl Events {
    pub(super) fn new(layout: Layout, since: Option<i64>, follow: bool) -> Events {
        let mut e = Events {
            layout,
            since,
            follow,
            until: None,
            runs: BTreeMap::new(),
            ready: VecDeque::new(),
            passes: 0,
            done: false,
        };
        if follow && since.is_none() {
            // From now on: what the runs there hold now is not news.
            e.pass(true);
            e.ready.retain(|r| r.is_err());
        }
        e
    }

    /// End the iteration at `deadline` (a follow otherwise never ends).
    pub fn until(mut self, deadline: Instant) -> Events {
        self.until = Some(deadline);
        self
    }

    /// How many events are read and ready: the next this many calls of
    /// `next` return at once, without looking at any file. A writer can
    /// flush its output when none is left, before the iterator waits.
    pub fn buffered(&self) -> usize {
        self.ready.len()
    }

    /// One look at every run: new lines queued in `ready`. `skip`: record
    /// where each file ends without reading (the start of a follow from now).
    fn pass(&mut self, skip: bool) {
        self.passes += 1;
        let runs = self.layout.runs();
        let root = match DirFd::open(&runs) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return, // no run yet
            Err(e) => {
                self.ready.push_back(Err(e));
                return;
            }
        };
        let names = match root.names() {
            Ok(n) => n,
            Err(e) => {
                self.ready.push_back(Err(e));
                return;
            }
        };
        let listed: HashSet<&str> = names.iter().map(String::as_str).collect();
        // Removed (retention, rm): that run just stops.
        self.runs.retain(|n, _| listed.contains(n.as_str()));
        for name in &names {
            let Some(id) = RunId::parse(name) else { continue };
            let settled = self.runs.get(name).is_some_and(|c| c.grew.elapsed() > SETTLED_AFTER);
            if settled && !self.passes.is_multiple_of(SETTLED_EVERY) {
                continue;
            }
            if !matches!(root.kind(name), Ok(Kind::Dir)) {
                continue;
            }
            let Ok(dir) = root.open_sub(name) else { continue };
            let Ok(dir_id) = dir.identity() else { continue };
            let cursor = self.runs.entry(name.clone()).or_insert(Cursor {
                dir: dir_id,
                file: None,
                offset: 0,
                grew: Instant::now(),
            });
            if cursor.dir != dir_id {
                // Another directory under the same name: another run.
                *cursor = Cursor { dir: dir_id, file: None, offset: 0, grew: Instant::now() };
            }
            let Ok(mut f) = dir.open_file(EVENTS) else { continue };
            let Ok(md) = f.metadata() else { continue };
            let file_id = (md.dev(), md.ino());
            if cursor.file.is_some_and(|known| known != file_id) {
                cursor.offset = 0;
            }
            cursor.file = Some(file_id);
            let len = md.len();
            if skip {
                cursor.offset = complete_end(&mut f, len).unwrap_or(0);
                continue;
            }
            if len < cursor.offset {
                // Shorter than what was read (append-only says never): nothing repeated.
                cursor.offset = len;
            }
            if len == cursor.offset {
                continue;
            }
            let mut buf = Vec::new();
            let read = f
                .seek(SeekFrom::Start(cursor.offset))
                .and_then(|_| (&mut f).take((len - cursor.offset).min(MAX_PASS_BYTES)).read_to_end(&mut buf));
            if read.is_err() {
                continue;
            }
            // Only complete lines: a line being written is taken once finished.
            let Some(last_nl) = buf.iter().rposition(|&b| b == b'\n') else {
                if buf.len() as u64 >= MAX_PASS_BYTES {
                    // A "line" longer than a pass can hold is no event: skip it whole.
                    cursor.offset += buf.len() as u64;
                }
                continue;
            };
            cursor.offset += last_nl as u64 + 1;
            cursor.grew = Instant::now();
            for line in buf[..last_nl].split(|&b| b == b'\n') {
                if let Some(ev) = event(&id, line, self.since) {
                    self.ready.push_back(Ok(ev));
                }
            }
        }
    }
}

const EVENTS: &str = "events.jsonl";

/// Where the complete lines of a file of `len` bytes end: just after its
/// last `\n` (a line still being written is news when it is finished).
fn complete_end(f: &mut std::fs::File, len: u64) -> io::Result<u64> {
    let mut end = len;
    let mut buf = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let n = (end - start) as usize;
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// The event a line of run `id`'s events file is, if it is one (a JSON
/// object, at or after `since` when given).
fn event(id: &RunId, line: &[u8], since: Option<i64>) -> Option<Event> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut value: Value = serde_json::from_slice(line).ok()?;
    let obj = value.as_object_mut()?;
    if let Some(since) = since {
        if obj.get("ts").and_then(Value::as_i64)? < since {
            return None;
        }
    }
    let text = if obj.get("runId").and_then(Value::as_str) == Some(id.as_str()) {
        String::from_utf8(line.to_vec()).ok()?
    } else {
        obj.insert("runId".into(), Value::String(id.to_string()));
        serde_json::to_string(&value).ok()?
    };
    Some(Event { run_id: id.clone(), line: text, value })
}

impl Iterator for Events {
    type Item = io::Result<Event>;

    fn next(&mut self) -> Option<io::Result<Event>> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(e);
            }
            if self.done || self.until.is_some_and(|u| Instant::now() >= u) {
                return None;
            }
            if self.passes > 0 {
                if !self.follow {
                    self.done = true;
                    return None;
                }
                let nap = match self.until {
                    Some(u) => POLL.min(u.saturating_duration_since(Instant::now())),
                    None => POLL,
                };
                std::thread::sleep(nap);
            }
            self.pass(false);
        }
    }
}
