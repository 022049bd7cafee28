//! Power-loss durability (docs/durability.md). The barriers are checked from
//! outside, on the system calls of a real daemon, runner and CLI traced by
//! strace: each durable step is followed by the fsync (file or directory)
//! that orders it before the next one. Skipped, with a message, where strace
//! is missing or cannot trace. The states a power loss can leave behind that
//! recovery must turn into a consistent one (a torn status.json, a torn
//! terminal marker) are built on disk and handed to a real daemon.

use crate::common;

use common::*;
use serde_json::json;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TRACED: &str = "trace=?rename,renameat,renameat2,fsync,fdatasync,?mkdir,mkdirat,openat,?unlink,unlinkat,execve";

/// strace usable here (installed, and allowed to trace)? Else the reason.
fn strace_missing() -> Option<String> {
    match Command::new("strace").args(["-qq", "-o", "/dev/null", "true"]).stderr(Stdio::piped()).output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("strace cannot trace here: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Some(format!("strace is not installed ({e}); scripts/fixtures.sh strace installs it")),
    }
}

/// `cmd` run under strace writing to `trace`: same arguments and environment.
fn under_strace(cmd: &Command, trace: &Path) -> Command {
    let mut s = Command::new("strace");
    s.args(["-f", "-qq", "-s", "4096", "-y", "-e", TRACED, "-o"]).arg(trace).arg(cmd.get_program());
    s.args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => s.env(k, v),
            None => s.env_remove(k),
        };
    }
    s
}

/// One completed system call: its name, its arguments and result as strace
/// printed them, in completion order (a thread's calls are sequential, so
/// that is their issue order).
#[derive(Debug)]
struct Call {
    name: String,
    text: String,
}

impl Call {
    fn ok(&self) -> bool {
        self.text.rsplit(" = ").next().is_some_and(|r| !r.starts_with('-'))
    }
    /// The quoted path arguments.
    fn paths(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut it = self.text.split('"');
        it.next();
        while let Some(q) = it.next() {
            out.push(q.to_string());
            it.next();
        }
        out
    }
    /// The path of the first descriptor argument (`fsync(5</a/b>)`).
    fn fd_path(&self) -> Option<String> {
        let open = self.text.find('<')?;
        let close = self.text[open..].find('>')? + open;
        Some(self.text[open + 1..close].to_string())
    }
    fn is_rename(&self, from: &Path, to: &Path) -> bool {
        self.name.starts_with("rename") && self.ok() && {
            let p = self.paths();
            p.len() == 2 && Path::new(&p[0]) == from && Path::new(&p[1]) == to
        }
    }
    fn renames_to(&self, to: &Path) -> bool {
        self.name.starts_with("rename") && self.ok() && self.paths().get(1).is_some_and(|p| Path::new(p) == to)
    }
    fn fsyncs(&self, p: &Path) -> bool {
        matches!(self.name.as_str(), "fsync" | "fdatasync")
            && self.ok()
            && self.fd_path().is_some_and(|f| Path::new(&f) == p)
    }
}

fn parse_trace(raw: &str) -> Vec<Call> {
    let mut pending: HashMap<&str, String> = HashMap::new();
    let mut out = Vec::new();
    for line in raw.lines() {
        let Some((pid, rest)) = line.trim_start().split_once(char::is_whitespace) else { continue };
        let rest = rest.trim_start();
        let text = if let Some(head) = rest.strip_suffix("<unfinished ...>") {
            pending.insert(pid, head.to_string());
            continue;
        } else if let Some(resumed) = rest.strip_prefix("<... ") {
            let Some((_, tail)) = resumed.split_once("resumed>") else { continue };
            format!("{}{}", pending.remove(pid).unwrap_or_default(), tail)
        } else {
            rest.to_string()
        };
        let Some(name) = text.split('(').next().filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        out.push(Call { name: name.to_string(), text });
    }
    out
}

struct Trace {
    calls: Vec<Call>,
    path: PathBuf,
}

impl Trace {
    fn read(path: &Path) -> Trace {
        Trace { calls: parse_trace(&fs::read_to_string(path).unwrap()), path: path.to_path_buf() }
    }
    /// A copy of the trace that outlives the test's root, for a failure message.
    fn kept(&self) -> String {
        let keep = std::env::temp_dir().join(format!("runspool-durability-{}.strace", unique("trace")));
        match fs::copy(&self.path, &keep) {
            Ok(_) => format!("trace kept at {}", keep.display()),
            Err(e) => format!("the trace could not be kept: {e}"),
        }
    }
    /// Index of the first call after `after` matching `f`.
    fn find(&self, after: Option<usize>, what: &str, f: impl Fn(&Call) -> bool) -> usize {
        let from = after.map_or(0, |i| i + 1);
        self.calls[from..]
            .iter()
            .position(f)
            .map(|i| i + from)
            .unwrap_or_else(|| panic!("no {what} in the trace after call {from} ({})", self.kept()))
    }
    fn before(&self, a: usize, b: usize, what: &str) {
        assert!(
            a < b,
            "{what}: call {a} `{}` must come before call {b} `{}` ({})",
            self.calls[a].text,
            self.calls[b].text,
            self.kept()
        );
    }
}

/// A daemon under strace; its pid from daemon.json.
fn start_traced_daemon(env: &TestEnv, trace: &Path) -> (Child, i64) {
    let cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    let log = fs::OpenOptions::new().create(true).append(true).open(&env.log_path).unwrap();
    let mut child = under_strace(&cmd, trace)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .expect("spawn strace");
    let mut pid = None;
    let ok = poll_until(LONG, || {
        pid = read_json(&env.daemon_json()).and_then(|d| d["pid"].as_i64());
        pid.is_some() || child.try_wait().unwrap().is_some()
    });
    assert!(ok && pid.is_some(), "the traced daemon did not start\n{}", env.log_tail(40));
    (child, pid.unwrap())
}

/// SIGTERM the traced daemon and wait for strace to end with its tracees.
fn stop_traced(mut child: Child, pid: i64) {
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + LONG;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("strace did not end within {LONG:?} of the daemon's SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn claim_rejection_and_terminal_write_are_ordered_by_fsyncs() {
    if let Some(why) = strace_missing() {
        eprintln!("SKIPPED durability barrier test: {why}");
        return;
    }
    let env = TestEnv::new();
    let trace_path = env.base().join("daemon.strace");
    let (child, pid) = start_traced_daemon(&env, &trace_path);
    let id = "dur-ok";
    // The step outlives the loop turn that creates the active marker.
    env.submit(&request(Some(id), &env.work, vec![cmd_step("a", &["sleep", "2"])]));
    let mut bad = request(None, &env.work, vec![cmd_step("a", &["true"])]);
    bad["bogus"] = json!(1);
    env.drop_request("dur-bad", &bad);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    env.wait_rejection("dur-bad");
    wait_until(LONG, "the terminal marker", || fs::read_dir(env.terminal_dir()).is_ok_and(|d| d.count() > 0));
    stop_traced(child, pid);
    let t = Trace::read(&trace_path);

    let (spool, runs, dir) = (env.spool(), env.runs(), env.run_dir(id));
    let status = dir.join("status.json");
    // Claim: mkdir, fsync(runs), commit rename, fsync(run dir) and fsync(spool), status.
    let mkdir = t.find(None, "mkdir of the run directory", |c| {
        c.name.starts_with("mkdir") && c.ok() && c.paths().first().is_some_and(|p| Path::new(p) == dir)
    });
    let commit = t.find(Some(mkdir), "the commit rename", |c| {
        c.is_rename(&spool.join(format!("{id}.json")), &dir.join("request.json"))
    });
    let runs_synced = t.find(Some(mkdir), "fsync of the runs root", |c| c.fsyncs(&runs));
    t.before(runs_synced, commit, "the run directory is durable before the request moves into it");
    let dir_synced = t.find(Some(commit), "fsync of the run directory", |c| c.fsyncs(&dir));
    let spool_synced = t.find(Some(commit), "fsync of the spool", |c| c.fsyncs(&spool));
    let queued = t.find(Some(commit), "the queued status rename", |c| c.renames_to(&status));
    t.before(dir_synced, queued, "request.json is durable before status.json is written");
    t.before(spool_synced, queued, "the spool entry's removal is durable before status.json is written");
    // Active marker: only after the status it reflects is durable (§6.1).
    let marker = t.find(Some(queued), "the active marker's creation", |c| {
        c.name == "openat"
            && c.ok()
            && c.text.contains("O_CREAT")
            && c.paths().first().is_some_and(|p| Path::new(p) == env.active_dir().join(id))
    });
    let status_synced = t.find(Some(queued), "fsync of status.json", |c| c.fsyncs(&status));
    t.before(status_synced, marker, "status.json's data is durable before the active marker");
    let entry_synced = t.find(Some(status_synced), "fsync of the run directory after status.json", |c| c.fsyncs(&dir));
    t.before(entry_synced, marker, "status.json's entry is durable before the active marker");

    // The runner's first `running` write is durable before the step starts:
    // a power loss must never bring a started run back as `queued`.
    let running = t.find(Some(queued), "the running status rename", |c| c.renames_to(&status));
    let running_temp = PathBuf::from(&t.calls[running].paths()[0]);
    assert!(
        (queued..running).any(|i| t.calls[i].fsyncs(&running_temp)),
        "the running status is fsynced before its rename ({})",
        t.kept()
    );
    let step = t.find(Some(running), "the step's exec", |c| {
        c.name == "execve" && c.ok() && c.paths().first().is_some_and(|p| p.ends_with("/sleep") || p == "sleep")
    });
    let running_dir_synced = t.find(Some(running), "fsync of the run directory after `running`", |c| c.fsyncs(&dir));
    t.before(running_dir_synced, step, "the running status is durable before the step starts");

    // Terminal write (runner): status fsynced (temp, then directory), result
    // renamed public and the results directory fsynced, then the terminal marker.
    let public = env.result_path(id);
    let published = t.find(Some(queued), "the public result rename", |c| c.renames_to(&public));
    let terminal =
        (0..published).rev().find(|&i| t.calls[i].renames_to(&status)).expect("a status write before the result");
    let temp = PathBuf::from(&t.calls[terminal].paths()[0]);
    let temp_synced = (0..terminal).rev().find(|&i| t.calls[i].fsyncs(&temp));
    assert!(temp_synced.is_some(), "the terminal status is fsynced before its rename ({})", t.kept());
    let terminal_dir_synced =
        t.find(Some(terminal), "fsync of the run directory after the terminal status", |c| c.fsyncs(&dir));
    t.before(terminal_dir_synced, published, "the terminal status is durable before the result");
    let results_synced = t.find(Some(published), "fsync of the results directory", |c| c.fsyncs(&env.results()));
    let marked = t.find(Some(published), "the terminal marker", |c| {
        c.name.starts_with("rename")
            && c.ok()
            && c.paths().get(1).is_some_and(|p| p.contains("/.terminal-runs/") && p.ends_with(&format!("-{id}.json")))
    });
    t.before(results_synced, marked, "the public result is durable before the terminal marker");

    // Rejection: the move is durable in rejected/ and spool/ before the error file.
    let moved = t.find(None, "the move to rejected/", |c| {
        c.is_rename(&spool.join("dur-bad.json"), &env.rejected().join("dur-bad.json"))
    });
    let error_file =
        t.find(Some(moved), "the error file", |c| c.renames_to(&env.rejected().join("dur-bad.error.json")));
    let rejected_synced = t.find(Some(moved), "fsync of rejected/", |c| c.fsyncs(&env.rejected()));
    let spool_synced = t.find(Some(moved), "fsync of the spool after the move", |c| c.fsyncs(&spool));
    t.before(rejected_synced, error_file, "the move is durable in rejected/ before the error file");
    t.before(spool_synced, error_file, "the move is durable in the spool before the error file");
}

#[test]
fn a_withdrawal_is_durable_before_the_cli_reports_it() {
    if let Some(why) = strace_missing() {
        eprintln!("SKIPPED withdrawal barrier test: {why}");
        return;
    }
    let env = TestEnv::new();
    let id = "dur-withdrawn";
    env.submit(&request(Some(id), &env.work, vec![cmd_step("a", &["true"])]));
    let trace_path = env.base().join("stop.strace");
    let mut cli = Command::new(BIN);
    cli.arg("stop").arg("--root").arg(&env.root).arg(id).env("XDG_CONFIG_HOME", env.base().join("xdg"));
    let out = under_strace(&cli, &trace_path).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "runspool stop: {}", String::from_utf8_lossy(&out.stderr));
    let t = Trace::read(&trace_path);
    let (entry, err) = (env.rejected().join(format!("{id}.json")), env.rejected().join(format!("{id}.error.json")));
    let moved = t.find(None, "the move to rejected/", |c| c.is_rename(&env.spool().join(format!("{id}.json")), &entry));
    let rejected_synced = t.find(Some(moved), "fsync of rejected/", |c| c.fsyncs(&env.rejected()));
    let spool_synced = t.find(Some(moved), "fsync of the spool", |c| c.fsyncs(&env.spool()));
    let error_file = t.find(Some(moved), "the error file", |c| c.renames_to(&err));
    t.before(rejected_synced, error_file, "the move is durable in rejected/ before the error file");
    t.before(spool_synced, error_file, "the move is durable in the spool before the error file");
    // The rejected run of its run id follows the durable move too.
    let run = t.find(Some(moved), "the rejected run's rename", |c| c.renames_to(&env.run_dir(id)));
    t.before(spool_synced, run, "the move is durable before the rejected run appears");
    // The error file's data is durable (its temp fsynced before the rename,
    // or the file after it), then its entry (rejected/ fsynced after it).
    let err_temp = PathBuf::from(&t.calls[error_file].paths()[0]);
    let data_synced = (moved..error_file).any(|i| t.calls[i].fsyncs(&err_temp))
        || t.calls[error_file..].iter().any(|c| c.fsyncs(&err));
    assert!(data_synced, "the error file's data is fsynced ({})", t.kept());
    t.find(Some(error_file), "fsync of rejected/ after the error file", |c| c.fsyncs(&env.rejected()));
    assert_eq!(read_json(&err).unwrap()["code"], "withdrawn");
}

/// A claimed run as a power loss can leave it: request.json renamed in, the
/// queued status's rename on disk but not its data.
fn torn_claim(env: &TestEnv, id: &str, torn: &[u8]) {
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    let body = serde_json::to_vec(&request(Some(id), &env.work, vec![cmd_step("a", &["true"])])).unwrap();
    write_file_mode(&dir.join("request.json"), &body, 0o600);
    write_file_mode(&dir.join("status.json"), torn, 0o600);
}

#[test]
fn a_claim_whose_queued_status_was_torn_by_a_power_loss_runs_once() {
    let mut env = TestEnv::new();
    torn_claim(&env, "torn-empty", b"");
    torn_claim(&env, "torn-zeros", &[0u8; 512]);
    env.start_daemon();
    for id in ["torn-empty", "torn-zeros"] {
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "complete", "{id}: {st}");
        let started = env.event_types(id).iter().filter(|t| *t == "subagent.run.started").count();
        assert_eq!(started, 1, "{id}: runs exactly once");
        assert!(env.result_path(id).exists(), "{id}: its result is published");
    }
}

#[test]
fn a_terminal_marker_torn_by_a_power_loss_is_written_again() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "torn-marker";
    env.submit(&request(Some(id), &env.work, vec![cmd_step("a", &["true"])]));
    env.wait_terminal(id);
    let terminal = env.terminal_dir();
    let find = || -> Option<PathBuf> {
        let sessions = fs::read_dir(&terminal).ok()?;
        sessions
            .flatten()
            .flat_map(|s| fs::read_dir(s.path()).into_iter().flatten().flatten())
            .map(|e| e.path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().ends_with(&format!("-{id}.json"))))
    };
    wait_until(LONG, "the terminal marker", || find().is_some());
    env.kill9();
    let marker = find().unwrap();
    fs::write(&marker, b"").unwrap();
    env.start_daemon();
    wait_until(LONG, "the terminal marker written again", || read_json(&marker).is_some_and(|m| m["runId"] == id));
}
