//! A run's step output, read as it grows ([`Follow`]): what `runspool logs`
//! and `logs -f` print.

use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;

use crate::protocol::status::Status;
use crate::store::layout::RunPaths;
use crate::store::{fsutil, run, RunId};

/// The most one [`Output`] holds: a step's output may be far larger than memory.
const CHUNK: u64 = 64 * 1024;

/// Output a step wrote: the bytes that followed the previous [`Output`] of
/// the same step (any length up to 64 KiB; not cut at line ends, see
/// [`Follow::lines`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The flat step index (PROTOCOL §3).
    pub step: usize,
    /// The bytes, as the step wrote them.
    pub data: Vec<u8>,
}

/// The output of a run's steps ([`super::Client::follow`],
/// [`super::Client::output`]): an iterator over what each step wrote, step
/// by step; following, until the run ends (then [`Follow::ended`] holds its
/// terminal status and the iterator is done, with nothing lost from the
/// steps' last writes).
#[derive(Debug)]
pub struct Follow {
    dir: PathBuf,
    id: RunId,
    status: Status,
    steps: Vec<usize>,
    offsets: Vec<u64>,
    follow: bool,
    /// The step being read in this pass, and how far it is read in it.
    cursor: usize,
    limit: Option<u64>,
    final_pass: bool,
    done: bool,
    end: Option<Status>,
}

impl Follow {
    pub(super) fn new(dir: PathBuf, id: RunId, status: Status, follow: bool) -> Follow {
        let n = status.steps.len();
        Follow {
            dir,
            id,
            status,
            steps: (0..n).collect(),
            offsets: vec![0; n],
            follow,
            cursor: 0,
            limit: None,
            final_pass: false,
            done: false,
            end: None,
        }
    }

    /// The run followed.
    pub fn run_id(&self) -> &RunId {
        &self.id
    }

    /// The run's status when the reading began (its steps, their agents).
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// The steps read, in order.
    pub fn steps(&self) -> &[usize] {
        &self.steps
    }

    /// Its terminal status, once a follow has seen the run end.
    pub fn ended(&self) -> Option<&Status> {
        self.end.as_ref()
    }

    /// Only the flat step `i`; an error when the run has no such step.
    pub fn only_step(mut self, i: usize) -> anyhow::Result<Follow> {
        if i >= self.status.steps.len() {
            bail!("run {} has {} steps; --step {i} is out of range", self.id, self.status.steps.len());
        }
        self.steps = vec![i];
        Ok(self)
    }

    /// Start at the last `n` lines of each step's output (a final newline
    /// does not start an empty line) rather than at its beginning.
    pub fn tail(mut self, n: usize) -> anyhow::Result<Follow> {
        use anyhow::Context as _;
        for &i in &self.steps {
            let path = RunPaths::output(&self.dir, i);
            if let Ok(mut f) = fsutil::open_read(&path) {
                self.offsets[i] = tail_start(&mut f, n)
                    .with_context(|| format!("cannot read the end of {} (was it truncated?)", path.display()))?;
            }
        }
        Ok(self)
    }

    /// The same output cut into lines (each with its `\n`; a last line
    /// without one comes when the output ends).
    pub fn lines(self) -> Lines {
        Lines { inner: self, partial: Vec::new(), ready: std::collections::VecDeque::new() }
    }

    /// The next piece of step `i`'s output in this pass, if any.
    fn read_step(&mut self, i: usize) -> io::Result<Option<Vec<u8>>> {
        let path = RunPaths::output(&self.dir, i);
        // The output is the step's to write: never follow a link or wait on a FIFO there.
        let Ok(mut f) = fsutil::open_read(&path) else { return Ok(None) };
        let len = f.metadata()?.len();
        // Once read in a pass, a step's output is read up to its length then
        // (so a step that never stops writing cannot hold a pass), except in
        // the last pass, which reads to the end.
        let limit = if self.final_pass { len } else { *self.limit.get_or_insert(len) };
        let at = self.offsets[i];
        if limit <= at {
            return Ok(None);
        }
        f.seek(SeekFrom::Start(at))?;
        let mut data = Vec::new();
        f.take((limit - at).min(CHUNK)).read_to_end(&mut data)?;
        if data.is_empty() {
            return Ok(None);
        }
        self.offsets[i] += data.len() as u64;
        Ok(Some(data))
    }
}

impl Iterator for Follow {
    type Item = io::Result<Output>;

    fn next(&mut self) -> Option<io::Result<Output>> {
        loop {
            if self.done {
                return None;
            }
            while let Some(&i) = self.steps.get(self.cursor) {
                match self.read_step(i) {
                    Ok(Some(data)) => return Some(Ok(Output { step: i, data })),
                    Ok(None) => {}
                    Err(e) => {
                        (self.cursor, self.limit) = (self.cursor + 1, None);
                        return Some(Err(e));
                    }
                }
                (self.cursor, self.limit) = (self.cursor + 1, None);
            }
            self.cursor = 0;
            if !self.follow || self.final_pass {
                self.done = true;
                return None;
            }
            if let Some(end) = run::read_status(&self.dir).ok().flatten().filter(|s| !s.state.is_active()) {
                // One more pass after the end so the last lines are not lost.
                self.end = Some(end);
                self.final_pass = true;
                continue;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// [`Follow`] cut into lines ([`Follow::lines`]).
#[derive(Debug)]
pub struct Lines {
    inner: Follow,
    /// Per step, what came after its last newline.
    partial: Vec<(usize, Vec<u8>)>,
    ready: std::collections::VecDeque<Output>,
}

impl Lines {
    /// The [`Follow`] underneath (its [`Follow::ended`] status).
    pub fn follow(&self) -> &Follow {
        &self.inner
    }
}

impl Iterator for Lines {
    type Item = io::Result<Output>;

    fn next(&mut self) -> Option<io::Result<Output>> {
        loop {
            if let Some(line) = self.ready.pop_front() {
                return Some(Ok(line));
            }
            match self.inner.next() {
                Some(Err(e)) => return Some(Err(e)),
                Some(Ok(out)) => {
                    let at = match self.partial.iter().position(|(s, _)| *s == out.step) {
                        Some(at) => at,
                        None => {
                            self.partial.push((out.step, Vec::new()));
                            self.partial.len() - 1
                        }
                    };
                    let buf = &mut self.partial[at].1;
                    buf.extend_from_slice(&out.data);
                    while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                        let rest = buf.split_off(nl + 1);
                        let line = std::mem::replace(buf, rest);
                        self.ready.push_back(Output { step: out.step, data: line });
                    }
                }
                None => {
                    for (step, data) in self.partial.drain(..).filter(|(_, d)| !d.is_empty()) {
                        self.ready.push_back(Output { step, data });
                    }
                    return self.ready.pop_front().map(Ok);
                }
            }
        }
    }
}

/// Where the last `n` lines of `f` start, found by reading backwards from the
/// end in bounded chunks (a final newline does not start an empty line).
fn tail_start(f: &mut std::fs::File, n: usize) -> io::Result<u64> {
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
