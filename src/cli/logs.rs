//! `logs`: a run's step output, whole, its last lines, followed to the end,
//! or as JSON.

use std::io::{Read, Write};

use serde_json::json;

use super::text::{age, visible};
use crate::client::{Client, Follow, Stage, Target, WaitError};
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, Layout};

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
    let client = Client::from_layout(layout.clone());
    let target = client.resolve(run)?;
    if follow {
        return follow_target(layout, &target, step, lines);
    }
    let id = match target {
        Target::Run(id) => id,
        Target::Pending(p) => {
            eprintln!(
                "runspool: {} is pending in the spool (for {}); no output yet (`runspool logs -f {}` waits for it)",
                p.run_id,
                age(p.since_ms),
                p.run_id
            );
            return Ok(0);
        }
        Target::Rejected { name, error_file } => {
            let (code, message) = crate::client::read_error(&error_file);
            let (what, exit) = if code == "withdrawn" { ("withdrawn", 1) } else { ("refused", 2) };
            let (code, message) = (visible(&code), visible(&message));
            eprintln!(
                "runspool: {name} was {what} before it ran ({code}: {message}); it has no output (see {})",
                error_file.display()
            );
            return Ok(exit);
        }
    };
    match client.stage(&Target::Run(id.clone()))? {
        Stage::Claimed(_) => {
            eprintln!(
                "runspool: {id} was just claimed and is not queued yet; no output yet (`runspool logs -f {id}` waits for it)"
            );
            return Ok(0);
        }
        // Refused (or withdrawn) before it ran: say why on stderr, exit 2 (1), as `logs -f` does.
        Stage::Ended(s) if s.state == State::Rejected => return follow_target(layout, &Target::Run(id), step, lines),
        _ => {}
    }
    let mut out = client.output(&id)?;
    if let Some(i) = step {
        out = out.only_step(i)?;
    }
    if json_out {
        return logs_json(&layout.run_dir(&id), out.status(), out.steps());
    }
    if let Some(n) = lines {
        out = out.tail(n)?;
    }
    print(&mut out, false)?;
    Ok(0)
}

/// `logs -f` (and `submit --follow`) of any target: a request still in the
/// spool is followed through its claim. Exit code: the run's
/// (`run_exit_code`), 2 when it was refused before it ran, 1 when it was
/// withdrawn (stopped before its claim).
pub(crate) fn follow_target(
    layout: &Layout,
    target: &Target,
    step: Option<usize>,
    lines: Option<usize>,
) -> anyhow::Result<i32> {
    let mut f = match Client::from_layout(layout.clone()).follow_target(target) {
        Ok(f) => f,
        // Refused before it ran (exit 2) or withdrawn, that is stopped
        // before its claim (exit 1, as a stopped run), with a `rejected`
        // status or only an error file.
        Err(e @ (WaitError::Rejected { .. } | WaitError::Withdrawn { .. })) => {
            let (WaitError::Rejected { refusal, .. } | WaitError::Withdrawn { refusal, .. }) = &e else {
                unreachable!()
            };
            let (code, message) = (visible(&refusal.code), visible(&refusal.message));
            let (what, exit) = if matches!(e, WaitError::Withdrawn { .. }) { ("withdrawn", 1) } else { ("refused", 2) };
            eprintln!(
                "runspool: {} was {what} before it ran ({code}): {message} (see {})",
                refusal.name,
                refusal.error_file.display()
            );
            return Ok(exit);
        }
        Err(WaitError::Other(e)) => return Err(e),
        Err(e) => return Err(e.into()),
    };
    if let Some(i) = step {
        f = f.only_step(i)?;
    }
    if let Some(n) = lines {
        f = f.tail(n)?;
    }
    print(&mut f, true)?;
    let end = f.ended().cloned().unwrap_or_else(|| f.status().clone());
    Ok(say_end(f.run_id(), &end))
}

/// The run `id` ended as `end`: say so on stderr when it did not complete
/// (stdout stays the steps' own); its exit code.
fn say_end(id: &str, end: &Status) -> i32 {
    let code = run_exit_code(end);
    if code != 0 {
        let why = end.error.as_deref().map(|e| format!(": {}", visible(e))).unwrap_or_default();
        eprintln!("runspool: {id} {} (exit {code}){why}", visible(end.state.as_str()));
    }
    code
}

/// Print what `f` yields on stdout; several steps read once each get a
/// `==> step i (agent) <==` header, a follow is flushed as it comes.
fn print(f: &mut Follow, follow: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    let headers = !follow && f.steps().len() > 1;
    let mut last = None;
    while let Some(o) = f.next() {
        let o = o?;
        if headers && last != Some(o.step) {
            writeln!(out, "==> step {} ({}) <==", o.step, visible(&f.status().steps[o.step].agent))?;
            last = Some(o.step);
        }
        out.write_all(&o.data)?;
        if follow {
            out.flush()?;
        }
    }
    out.flush()?;
    Ok(())
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
