//! The bounded process runner both providers use: the child in its own
//! process group (`platform::child`), stdin written, stdout capped, stderr
//! tailed, the whole group killed at the deadline.

use std::io::{Read, Write};
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use crate::platform::child::{Child, Ladder};
use crate::platform::exec;

/// What a bounded process run produced.
pub struct Output {
    pub status: Option<ExitStatus>,
    pub stdout: Vec<u8>,
    /// True when stdout exceeded the cap (the rest was drained and dropped).
    pub stdout_truncated: bool,
    /// The last 4 KiB of stderr, lossily decoded.
    pub stderr_tail: String,
    pub timed_out: bool,
    pub pgid: u32,
}

/// Run `argv` in its own process group with `stdin`, capturing at most
/// `max_stdout` bytes of stdout and the tail of stderr. At the deadline the
/// whole process group is killed (SIGKILL) and `timed_out` is set. The child
/// never outlives the daemon: it gets SIGKILL when the calling thread exits
/// (PR_SET_PDEATHSIG), and this function does not return before it is
/// reaped, so only the daemon's death can end that thread first.
/// (One function on purpose: spawn, the copy threads, the deadline loop and
/// the reap share the child and must not be split across early returns.)
pub fn run_bounded(
    argv: &[String],
    stdin: &[u8],
    envs: &[(&str, String)],
    deadline: Instant,
    max_stdout: usize,
) -> std::io::Result<Output> {
    let mut cmd = exec::command(&argv[0], exec::Detach { own_group: true, die_with_thread: true });
    cmd.args(&argv[1..]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = Child::spawn(&mut cmd, Some(deadline), Ladder::KILL)?;
    let pgid = child.id();
    let mut sin = child.take_stdin().expect("piped");
    let input = stdin.to_vec();
    // A provider that never reads stdin must not block us: write from a thread.
    std::thread::spawn(move || {
        let _ = sin.write_all(&input);
    });
    let (otx, orx) = channel();
    let mut sout = child.take_stdout().expect("piped");
    std::thread::spawn(move || {
        let mut keep = Vec::new();
        let mut truncated = false;
        let mut buf = [0u8; 8192];
        loop {
            match sout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let room = (max_stdout + 1).saturating_sub(keep.len());
                    keep.extend_from_slice(&buf[..n.min(room)]);
                    if keep.len() > max_stdout {
                        truncated = true;
                        keep.truncate(max_stdout);
                    }
                }
            }
        }
        let _ = otx.send((keep, truncated));
    });
    let (etx, erx) = channel();
    let mut serr = child.take_stderr().expect("piped");
    std::thread::spawn(move || {
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match serr.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    tail.extend_from_slice(&buf[..n]);
                    if tail.len() > 8192 {
                        tail.drain(..tail.len() - 4096);
                    }
                }
            }
        }
        let start = tail.len().saturating_sub(4096);
        let _ = etx.send(String::from_utf8_lossy(&tail[start..]).into_owned());
    });
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        // At the deadline the group gets SIGKILL (`Ladder::KILL`): the leader ends at once.
        child.tick(Instant::now());
        if child.timed_out() {
            break child.wait().ok();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let timed_out = child.timed_out();
    if timed_out {
        // Whatever the group forked between the signal and the reap.
        child.kill();
    }
    // A background grandchild may hold the pipes open: wait for them only
    // until the deadline (plus a moment), then go on without the rest.
    let grace = deadline.max(Instant::now()) + Duration::from_millis(200);
    let (stdout, stdout_truncated) =
        orx.recv_timeout(grace.saturating_duration_since(Instant::now())).unwrap_or_default();
    let stderr_tail = erx
        .recv_timeout(grace.saturating_duration_since(Instant::now()) + Duration::from_millis(50))
        .unwrap_or_default();
    Ok(Output { status, stdout, stdout_truncated, stderr_tail, timed_out, pgid })
}

/// The last `max` characters of `s`, trimmed, for error messages.
pub fn tail_text(s: &str, max: usize) -> String {
    let t = s.trim();
    let n = t.chars().count();
    if n <= max {
        t.to_string()
    } else {
        format!("...{}", t.chars().skip(n - max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_run_captures_and_kills() {
        let far = Instant::now() + Duration::from_secs(30);
        let argv: Vec<String> = ["sh", "-c", "cat; echo err >&2; exit 3"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"hello", &[], far, 1024).unwrap();
        assert_eq!(o.stdout, b"hello");
        assert_eq!(o.status.unwrap().code(), Some(3));
        assert_eq!(o.stderr_tail.trim(), "err");
        assert!(!o.timed_out);
        let argv: Vec<String> = ["sh", "-c", "sleep 30 & sleep 30"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"", &[], Instant::now() + Duration::from_millis(300), 1024).unwrap();
        assert!(o.timed_out);
        let argv: Vec<String> = ["sh", "-c", "head -c 5000 /dev/zero"].iter().map(|s| s.to_string()).collect();
        let o = run_bounded(&argv, b"", &[], far, 100).unwrap();
        assert!(o.stdout_truncated && o.stdout.len() == 100);
    }
}
