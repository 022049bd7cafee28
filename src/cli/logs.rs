//! `logs`: a run's step output, whole, its last lines, followed to the end,
//! or as JSON.

use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::ControlFlow;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::json;

use super::target::{age, await_claim, error_file, load, read_error, resolve, Target};
use super::text::visible;
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, run, Layout, RunId};

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
    let id = match run_of(layout, run, follow)? {
        ControlFlow::Continue(id) => id,
        ControlFlow::Break(code) => return Ok(code),
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
                    writeln!(out, "==> step {i} ({}) <==", visible(&s.steps[i].agent))?;
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
                let why = end.error.as_deref().map(|e| format!(": {}", visible(e))).unwrap_or_default();
                eprintln!("runspool: {id} {} (exit {code}){why}", visible(end.state.as_str()));
            }
            return Ok(code);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The run `logs` reads: Continue(its id), or Break(the exit code) when
/// there is no output to read (a request pending without `follow`, or
/// refused before it ran).
fn run_of(layout: &Layout, run: &str, follow: bool) -> anyhow::Result<ControlFlow<i32, RunId>> {
    Ok(match resolve(layout, run)? {
        Target::Run(id) => ControlFlow::Continue(id),
        Target::Pending(p) if follow => {
            if !await_claim(layout, &p, None)? {
                let ef = error_file(layout, &p.name);
                let (code, message) = read_error(&ef);
                let (code, message) = (visible(&code), visible(&message));
                eprintln!("runspool: {} was refused before it ran ({code}): {message} (see {})", p.name, ef.display());
                return Ok(ControlFlow::Break(2));
            }
            ControlFlow::Continue(p.run_id)
        }
        Target::Pending(p) => {
            eprintln!(
                "runspool: {} is pending in the spool (for {}); no output yet (`runspool logs -f {}` waits for it)",
                p.run_id,
                age(p.since_ms),
                p.run_id
            );
            return Ok(ControlFlow::Break(0));
        }
        Target::Rejected { name, error_file } => {
            let (code, message) = read_error(&error_file);
            let (code, message) = (visible(&code), visible(&message));
            if follow {
                // As when the refusal comes while following: exit 2, whichever came first.
                eprintln!(
                    "runspool: {name} was refused before it ran ({code}): {message} (see {})",
                    error_file.display()
                );
                return Ok(ControlFlow::Break(2));
            }
            bail!(
                "{name} was refused before it ran ({code}: {message}); it has no output (see {})",
                error_file.display()
            )
        }
    })
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
