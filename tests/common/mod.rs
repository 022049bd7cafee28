//! Shared harness for the runspool integration tests.
//!
//! Every test gets its own temporary root (mode 0700) and, when it needs one,
//! its own daemon. The harness never trusts timing: it waits on conditions with
//! generous deadlines. On drop it SIGKILLs the daemon and every process that
//! belongs to the root (runners and step processes), so no test leaks processes.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

pub const BIN: &str = env!("CARGO_BIN_EXE_runspool");

/// Generous default deadline for anything that involves the daemon or a runner.
pub const LONG: Duration = Duration::from_secs(90);

pub const DEFAULT_CONFIG: &str = "max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n";

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    format!("{}-{}-{}-{}", prefix, std::process::id(), n, now_ms() % 1_000_000)
}

/// Poll `f` every 50 ms until it returns true; panic naming `what` after `timeout`.
pub fn wait_until<F: FnMut() -> bool>(timeout: Duration, what: &str, mut f: F) {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {:?} waiting for: {}", timeout, what);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Like `wait_until` but returns whether the condition became true.
pub fn poll_until<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// seg(): index segment encoding (PROTOCOL 6.3). An independent implementation,
// cross-checked against the PROTOCOL examples in `seg_examples_hold`.
// ---------------------------------------------------------------------------

pub fn encode_uri_component(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{:02X}", b));
        }
    }
    out
}

fn is_portable(e: &str) -> bool {
    if e.is_empty() || e == "." || e == ".." || e.ends_with('.') {
        return false;
    }
    let lower = e.to_ascii_lowercase();
    let reserved_base = |rest: &str| rest.is_empty() || rest.starts_with('.');
    for name in ["con", "prn", "aux", "nul"] {
        if let Some(rest) = lower.strip_prefix(name) {
            if reserved_base(rest) {
                return false;
            }
        }
    }
    for name in ["com", "lpt"] {
        if let Some(rest) = lower.strip_prefix(name) {
            let b = rest.as_bytes();
            if !b.is_empty() && (b'1'..=b'9').contains(&b[0]) && reserved_base(&rest[1..]) {
                return false;
            }
        }
    }
    if lower.contains("%5c") {
        return false;
    }
    if let Some(pos) = e.rfind('.') {
        let ext = &e.as_bytes()[pos + 1..];
        if !ext.is_empty()
            && ext.len() <= 8
            && ext[0].is_ascii_alphabetic()
            && ext.iter().all(|c| c.is_ascii_alphanumeric())
        {
            return false;
        }
    }
    true
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{:02x}", b)).collect()
}

pub fn seg_max(v: &str, max: usize) -> String {
    let e = encode_uri_component(v);
    if e.len() <= max && is_portable(&e) {
        e
    } else {
        format!("~sha256-{}", sha256_hex(v.as_bytes()))
    }
}

/// seg() with max 255, from the library (PROTOCOL 6.3).
pub fn seg(v: &str) -> String {
    runspool::protocol::seg::seg(v)
}

/// seg() with max 250 (result-file names), from the library.
pub fn seg250(v: &str) -> String {
    runspool::protocol::seg::seg250(v)
}

/// The PROTOCOL examples hold, and the library agrees with this file's own
/// transcription of 6.3 on a spread of inputs.
pub fn seg_examples_hold() {
    let samples = [
        "call/a+b=",
        "",
        ".",
        "..",
        "CON",
        "con.x",
        "COM1",
        "com0",
        "lpt9.txt",
        "nul.txt",
        "trailing.",
        "s.jsonl",
        "a.b",
        "a.123",
        "a.b12345678",
        "a.abcdefgh",
        "back\\slash",
        "héllo wörld",
        "default",
        "run-0001",
        "~sha",
        "!~*'()",
        "emoji 😀",
        "prn.",
        "aux",
        "auxiliary",
        "x.JSON",
    ];
    for v in samples.iter().map(|s| s.to_string()).chain([
        "x".repeat(250),
        "x".repeat(251),
        "x".repeat(255),
        "x".repeat(256),
        "é".repeat(84),
        "é".repeat(85),
    ]) {
        assert_eq!(seg(&v), seg_max(&v, 255), "seg({v:?})");
        assert_eq!(seg250(&v), seg_max(&v, 250), "seg250({v:?})");
    }
    assert_eq!(seg("call/a+b="), "call%2Fa%2Bb%3D");
    let x255 = "x".repeat(255);
    assert_eq!(seg(&x255), x255);
    for hashed in ["", ".", "CON", "nul.txt", "trailing.", "s.jsonl", &"x".repeat(256)] {
        assert_eq!(seg(hashed), format!("~sha256-{}", sha256_hex(hashed.as_bytes())), "{hashed:?}");
    }
}

// ---------------------------------------------------------------------------
// Request builders
// ---------------------------------------------------------------------------

pub fn cmd_step(agent: &str, argv: &[&str]) -> Value {
    json!({ "agent": agent, "command": argv })
}

/// A shell loop that waits until `gate` exists (see `open_gate`).
pub fn gate_wait(gate: &Path) -> String {
    format!("while [ ! -e '{}' ]; do sleep 0.05; done", gate.display())
}

pub fn open_gate(gate: &Path) {
    fs::write(gate, b"go").unwrap();
}

pub fn sh_step(agent: &str, script: &str) -> Value {
    json!({ "agent": agent, "command": ["sh", "-c", script] })
}

pub fn parallel(steps: Vec<Value>, concurrency: Option<u32>) -> Value {
    match concurrency {
        Some(c) => json!({ "parallel": steps, "concurrency": c }),
        None => json!({ "parallel": steps }),
    }
}

/// A version-1 request with the given steps; `cwd` is the test's work directory.
pub fn request(run_id: Option<&str>, cwd: &Path, steps: Vec<Value>) -> Value {
    let mut v = json!({ "version": 1, "cwd": cwd.to_str().unwrap(), "steps": steps });
    if let Some(id) = run_id {
        v["runId"] = json!(id);
    }
    v
}

pub fn is_active_state(s: &str) -> bool {
    s == "queued" || s == "running"
}

pub fn is_terminal_state(s: &str) -> bool {
    matches!(s, "complete" | "failed" | "paused" | "stopped" | "rejected")
}

// ---------------------------------------------------------------------------
// Process helpers
// ---------------------------------------------------------------------------

/// True when `pid` exists and is not a zombie.
pub fn process_alive(pid: i64) -> bool {
    if pid <= 0 {
        return false;
    }
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return e.raw_os_error() != Some(libc::ESRCH);
    }
    match fs::read_to_string(format!("/proc/{}/stat", pid)) {
        Ok(s) => {
            // state is the field after the ")" closing the comm
            match s.rfind(')') {
                Some(p) => !s[p + 1..].trim_start().starts_with('Z'),
                None => true,
            }
        }
        Err(_) => false,
    }
}

/// True when any live (non-zombie) process has process group `pgid`.
pub fn process_group_alive(pgid: i64) -> bool {
    if pgid <= 0 {
        return false;
    }
    let Ok(rd) = fs::read_dir("/proc") else { return false };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
        if let Ok(s) = fs::read_to_string(format!("/proc/{}/stat", pid)) {
            if let Some(p) = s.rfind(')') {
                let fields: Vec<&str> = s[p + 1..].split_whitespace().collect();
                // fields[0]=state, [1]=ppid, [2]=pgrp
                if fields.len() > 2 && fields[0] != "Z" && fields[2].parse::<i64>().ok() == Some(pgid) {
                    return true;
                }
            }
        }
    }
    false
}

fn proc_mentions(pid: i64, needle: &[u8]) -> bool {
    let contains = |hay: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    if let Ok(c) = fs::read(format!("/proc/{}/cmdline", pid)) {
        if contains(&c) {
            return true;
        }
    }
    if let Ok(c) = fs::read(format!("/proc/{}/environ", pid)) {
        if contains(&c) {
            return true;
        }
    }
    false
}

/// Kill every process that belongs to `root`: pids named by status.json files
/// (runner pid, step pids, verified through /proc), and any process whose
/// command line or environment mentions the root path.
pub fn kill_root_processes(root: &Path, extra_needle: &Path) {
    let me = std::process::id() as i64;
    let needle = root.as_os_str().as_bytes().to_vec();
    let needle2 = extra_needle.as_os_str().as_bytes().to_vec();
    for _pass in 0..4 {
        let mut targets: HashSet<i64> = HashSet::new();
        // status.json pids
        let runs = root.join("async-subagent-runs");
        if let Ok(rd) = fs::read_dir(&runs) {
            for e in rd.flatten() {
                if let Some(st) = read_json(&e.path().join("status.json")) {
                    let mut pids = vec![];
                    pids.push(st["pid"].as_i64().unwrap_or(0));
                    pids.push(st["runner"]["pid"].as_i64().unwrap_or(0));
                    if let Some(steps) = st["steps"].as_array() {
                        for s in steps {
                            pids.push(s["pid"].as_i64().unwrap_or(0));
                        }
                    }
                    for p in pids {
                        if p > 1 && p != me && (proc_mentions(p, &needle) || proc_mentions(p, &needle2)) {
                            targets.insert(p);
                        }
                    }
                }
            }
        }
        // /proc scan
        if let Ok(rd) = fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i64>().ok()) else { continue };
                if pid <= 1 || pid == me {
                    continue;
                }
                if proc_mentions(pid, &needle) || proc_mentions(pid, &needle2) {
                    targets.insert(pid);
                }
            }
        }
        if targets.is_empty() {
            return;
        }
        for p in &targets {
            unsafe {
                // its process group / session (runners are session leaders, steps group leaders)
                let pg = libc::getpgid(*p as libc::pid_t);
                if pg == *p as libc::pid_t {
                    libc::killpg(pg, libc::SIGKILL);
                }
                libc::kill(*p as libc::pid_t, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------------------------------------------------------------------------
// File helpers
// ---------------------------------------------------------------------------

pub fn read_json(p: &Path) -> Option<Value> {
    let b = fs::read(p).ok()?;
    serde_json::from_slice(&b).ok()
}

pub fn write_file_mode(p: &Path, bytes: &[u8], mode: u32) {
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(p).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

pub fn mkdir_0700(p: &Path) {
    fs::create_dir_all(p).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(0o700)).unwrap();
}

/// Set a path's mtime (without following symlinks) `secs_ago` seconds into the past.
pub fn set_mtime_ago(p: &Path, secs_ago: i64) {
    let t = now_ms() / 1000 - secs_ago;
    let ts = [
        libc::timespec { tv_sec: t as libc::time_t, tv_nsec: 0 },
        libc::timespec { tv_sec: t as libc::time_t, tv_nsec: 0 },
    ];
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
    assert_eq!(r, 0, "utimensat {}: {}", p.display(), std::io::Error::last_os_error());
}

pub fn list_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = match fs::read_dir(dir) {
        Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => vec![],
    };
    v.sort();
    v
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.clone());
            if let Ok(ft) = e.file_type() {
                if ft.is_dir() {
                    walk(&p, out);
                }
            }
        }
    }
}

pub fn walk_all(dir: &Path) -> Vec<PathBuf> {
    let mut v = vec![];
    walk(dir, &mut v);
    v
}

// ---------------------------------------------------------------------------
// The test environment: temp root + optional daemon
// ---------------------------------------------------------------------------

pub struct TestEnv {
    pub tmp: tempfile::TempDir,
    /// The runspool root (`<tmp>/root`, mode 0700).
    pub root: PathBuf,
    /// A scratch directory outside the root, usable as a request cwd.
    pub work: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    pub child: Option<Child>,
    pub extra_args: Vec<String>,
    /// Extra environment of the daemon (and so of its runners).
    pub extra_env: Vec<(String, String)>,
}

impl TestEnv {
    /// A fresh root with the standard layout created (no daemon).
    pub fn new() -> TestEnv {
        Self::with_config(DEFAULT_CONFIG)
    }

    pub fn with_config(config: &str) -> TestEnv {
        let tmp = tempfile::Builder::new().prefix("rsit-").tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
        let base = fs::canonicalize(tmp.path()).unwrap();
        let root = base.join("root");
        mkdir_0700(&root);
        let work = base.join("work");
        mkdir_0700(&work);
        let config_path = base.join("config.toml");
        fs::write(&config_path, config).unwrap();
        let log_path = base.join("daemon.log");
        let env =
            TestEnv { tmp, root, work, config_path, log_path, child: None, extra_args: vec![], extra_env: vec![] };
        env.ensure_layout();
        env
    }

    /// Create the directories a client needs to drop requests (daemon may not run yet).
    pub fn ensure_layout(&self) {
        for d in [
            self.root.clone(),
            self.spool(),
            self.rejected(),
            self.runs(),
            self.runs().join(".active-runs"),
            self.runs().join(".terminal-runs"),
            self.results(),
        ] {
            mkdir_0700(&d);
        }
    }

    pub fn base(&self) -> PathBuf {
        self.root.parent().unwrap().to_path_buf()
    }
    pub fn spool(&self) -> PathBuf {
        self.root.join("spool")
    }
    pub fn rejected(&self) -> PathBuf {
        self.root.join("spool").join("rejected")
    }
    pub fn runs(&self) -> PathBuf {
        self.root.join("async-subagent-runs")
    }
    pub fn run_dir(&self, id: &str) -> PathBuf {
        self.runs().join(id)
    }
    pub fn active_dir(&self) -> PathBuf {
        self.runs().join(".active-runs")
    }
    pub fn terminal_dir(&self) -> PathBuf {
        self.runs().join(".terminal-runs")
    }
    pub fn results(&self) -> PathBuf {
        self.root.join("async-subagent-results")
    }
    pub fn result_path(&self, id: &str) -> PathBuf {
        self.results().join(format!("{}.json", id))
    }
    pub fn daemon_json(&self) -> PathBuf {
        self.root.join("runspool").join("daemon.json")
    }

    // ---------------------------------------------------------------- daemon

    pub fn write_config(&self, config: &str) {
        fs::write(&self.config_path, config).unwrap();
    }

    fn spawn_daemon(&self) -> Child {
        let log = OpenOptions::new().create(true).append(true).open(&self.log_path).unwrap();
        let log2 = log.try_clone().unwrap();
        let mut cmd = self.daemon_command_for(Path::new(BIN), &self.root);
        cmd.args(&self.extra_args)
            .envs(self.extra_env.iter().cloned())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        cmd.spawn().expect("spawn runspool daemon")
    }

    /// Start the daemon and wait until it reports itself in daemon.json.
    pub fn start_daemon(&mut self) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon ----\n");
        let child = self.spawn_daemon();
        let pid = child.id() as i64;
        self.child = Some(child);
        self.wait_ready(pid);
    }

    /// Start the daemon without waiting for it to become ready.
    pub fn start_daemon_nowait(&mut self) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon (nowait) ----\n");
        self.child = Some(self.spawn_daemon());
    }

    fn append_log(&self, s: &str) {
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(&self.log_path) {
            let _ = f.write_all(s.as_bytes());
        }
    }

    fn wait_ready(&mut self, pid: i64) {
        let start = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    panic!("daemon exited during startup with {:?}\n{}", st, self.log_tail(80));
                }
            }
            if let Some(d) = read_json(&self.daemon_json()) {
                if d["pid"].as_i64() == Some(pid) {
                    return;
                }
            }
            // Fallback: the layout exists and the daemon keeps running.
            if start.elapsed() > Duration::from_secs(15) && self.spool().is_dir() {
                eprintln!("harness: daemon.json does not name pid {pid} after 15 s; continuing");
                return;
            }
            if start.elapsed() > Duration::from_secs(60) {
                panic!("daemon not ready after 60 s\n{}", self.log_tail(80));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn daemon_pid(&self) -> Option<i64> {
        self.child.as_ref().map(|c| c.id() as i64)
    }

    /// SIGKILL the daemon (runners stay alive).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = c.wait();
            self.append_log("---- harness: daemon SIGKILLed ----\n");
        }
    }

    /// SIGTERM the daemon and wait for it to exit; returns its exit status.
    pub fn term(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("no daemon running");
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                self.append_log("---- harness: daemon exited after SIGTERM ----\n");
                return st;
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!("daemon did not exit within 60 s of SIGTERM\n{}", self.log_tail(60));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGKILL then start again.
    pub fn restart(&mut self) {
        self.kill9();
        self.start_daemon();
    }

    /// Has the daemon exited on its own? (Returns the status and forgets the child.)
    pub fn daemon_exited(&mut self) -> Option<ExitStatus> {
        let st = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if st.is_some() {
            self.child = None;
        }
        st
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let s = fs::read_to_string(&self.log_path).unwrap_or_default();
        let v: Vec<&str> = s.lines().collect();
        let from = v.len().saturating_sub(lines);
        format!("---- daemon log ({}) tail ----\n{}\n---- end ----", self.log_path.display(), v[from..].join("\n"))
    }

    /// State, error and runner stderr of up to `max` runs: what a failing test
    /// needs to tell "the run ended early" from "the index is wrong".
    pub fn runs_summary(&self, max: usize) -> String {
        let mut out = String::from("---- runs ----\n");
        for id in self.run_ids().into_iter().take(max) {
            let dir = self.run_dir(&id);
            let st = read_json(&dir.join("status.json")).unwrap_or(Value::Null);
            let stderr = fs::read_to_string(dir.join("runner.stderr.log")).unwrap_or_default();
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            out.push_str(&format!(
                "{id}: state={} exit={} error={} active_marker={}\n",
                st["state"],
                st["exitCode"],
                st["error"],
                self.runs().join(".active-runs").join(&id).exists()
            ));
            for l in tail.into_iter().rev() {
                out.push_str(&format!("    runner: {l}\n"));
            }
        }
        out.push_str("---- end ----");
        out
    }

    /// Run `runspool daemon` in the foreground expecting it to exit by itself;
    /// returns (status, stderr+stdout). Panics if it is still running after `timeout`.
    pub fn run_daemon_expect_exit(&self, root: &Path, timeout: Duration) -> (ExitStatus, String) {
        let out_path = self.base().join(format!("{}.out", unique("daemon-refusal")));
        let out = File::create(&out_path).unwrap();
        let mut c = Command::new(BIN)
            .arg("daemon")
            .arg("--root")
            .arg(root)
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("RUNSPOOL_ROOT")
            .env("XDG_CONFIG_HOME", self.base().join("xdg"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return (st, fs::read_to_string(&out_path).unwrap_or_default());
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!(
                    "daemon on {} was still running after {:?}; output:\n{}",
                    root.display(),
                    timeout,
                    fs::read_to_string(&out_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    // ---------------------------------------------------------------- CLI

    fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        let mut it = args.iter();
        if let Some(first) = it.next() {
            cmd.arg(first);
        }
        cmd.arg("--root").arg(&self.root);
        cmd.args(it);
        cmd.env("RUNSPOOL_ROOT", &self.root).env("XDG_CONFIG_HOME", self.base().join("xdg")).stdin(Stdio::null());
        cmd
    }

    /// Run a CLI subcommand (`--root` is inserted after the subcommand name).
    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_timeout(args, Duration::from_secs(120))
    }

    pub fn cli_timeout(&self, args: &[&str], timeout: Duration) -> Output {
        let mut cmd = self.cli_command(args);
        let out_p = self.base().join(format!("{}.stdout", unique("cli")));
        let err_p = self.base().join(format!("{}.stderr", unique("cli")));
        cmd.stdout(Stdio::from(File::create(&out_p).unwrap()));
        cmd.stderr(Stdio::from(File::create(&err_p).unwrap()));
        let mut c = cmd.spawn().expect("spawn runspool cli");
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!("`runspool {}` did not finish within {:?}", args.join(" "), timeout);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = fs::read(&out_p).unwrap_or_default();
        let stderr = fs::read(&err_p).unwrap_or_default();
        let _ = fs::remove_file(&out_p);
        let _ = fs::remove_file(&err_p);
        Output { status, stdout, stderr }
    }

    // ---------------------------------------------------------------- requests

    /// Publish `bytes` as `spool/<name>.json` atomically (dot temp + rename), mode 0600.
    pub fn drop_bytes(&self, name: &str, bytes: &[u8]) -> PathBuf {
        self.drop_bytes_mode(name, bytes, 0o600)
    }

    pub fn drop_bytes_mode(&self, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        let tmp = self.spool().join(format!(".tmp-{}", unique("req")));
        write_file_mode(&tmp, bytes, mode);
        let dst = self.spool().join(format!("{}.json", name));
        fs::rename(&tmp, &dst).unwrap();
        dst
    }

    /// Publish a request value; returns the exact bytes written.
    pub fn drop_request(&self, name: &str, req: &Value) -> Vec<u8> {
        let bytes = serde_json::to_vec_pretty(req).unwrap();
        self.drop_bytes(name, &bytes);
        bytes
    }

    /// Publish a request under the name of its runId and return (runId, bytes).
    pub fn submit(&self, req: &Value) -> (String, Vec<u8>) {
        let id = req["runId"].as_str().expect("submit() needs a runId").to_string();
        let bytes = self.drop_request(&id, req);
        (id, bytes)
    }

    // ---------------------------------------------------------------- readers

    pub fn status(&self, id: &str) -> Option<Value> {
        read_json(&self.run_dir(id).join("status.json"))
    }

    pub fn state(&self, id: &str) -> Option<String> {
        self.status(id).and_then(|s| s["state"].as_str().map(|x| x.to_string()))
    }

    pub fn result(&self, id: &str) -> Option<Value> {
        read_json(&self.result_path(id))
    }

    pub fn events(&self, id: &str) -> Vec<Value> {
        let s = fs::read_to_string(self.run_dir(id).join("events.jsonl")).unwrap_or_default();
        s.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("events.jsonl line parses"))
            .collect()
    }

    pub fn event_types(&self, id: &str) -> Vec<String> {
        self.events(id).iter().map(|e| e["type"].as_str().unwrap_or("").to_string()).collect()
    }

    pub fn output_log(&self, id: &str, step: usize) -> String {
        fs::read_to_string(self.run_dir(id).join(format!("output-{}.log", step))).unwrap_or_default()
    }

    /// Wait until the run's status is terminal; returns it.
    pub fn wait_terminal(&self, id: &str) -> Value {
        self.wait_terminal_for(id, LONG)
    }

    pub fn wait_terminal_for(&self, id: &str, timeout: Duration) -> Value {
        let mut last = None;
        let ok = poll_until(timeout, || {
            last = self.status(id);
            // The result file lands just after the terminal status (PROTOCOL §7):
            // a run is settled for a client once both are there.
            last.as_ref().and_then(|s| s["state"].as_str()).map(is_terminal_state).unwrap_or(false)
                && self.result_path(id).exists()
        });
        if !ok {
            panic!(
                "run {} not terminal after {:?}; last status: {}\n{}\nrunner stderr:\n{}",
                id,
                timeout,
                last.map(|v| v.to_string()).unwrap_or_else(|| "<none>".into()),
                self.log_tail(60),
                fs::read_to_string(self.run_dir(id).join("runner.stderr.log")).unwrap_or_default()
            );
        }
        last.unwrap()
    }

    /// Wait until the run's state equals `state`.
    pub fn wait_state(&self, id: &str, state: &str) -> Value {
        let mut last = None;
        let ok = poll_until(LONG, || {
            last = self.status(id);
            last.as_ref().and_then(|s| s["state"].as_str()) == Some(state)
        });
        if !ok {
            panic!(
                "run {} never reached state {}; last status: {}\n{}",
                id,
                state,
                last.map(|v| v.to_string()).unwrap_or_else(|| "<none>".into()),
                self.log_tail(60)
            );
        }
        last.unwrap()
    }

    /// Wait until a file exists (a step signals readiness through one).
    pub fn wait_file(&self, p: &Path) {
        wait_until(LONG, &format!("file {} to exist\n{}", p.display(), self.log_tail(40)), || p.exists());
    }

    pub fn active_markers(&self) -> Vec<String> {
        list_names(&self.active_dir()).into_iter().filter(|n| n != "tool-calls" && !n.starts_with('.')).collect()
    }

    /// All terminal markers: (session segment, file name, parsed content or Null).
    pub fn terminal_markers(&self) -> Vec<(String, String, Value)> {
        let mut v = vec![];
        for s in list_names(&self.terminal_dir()) {
            let d = self.terminal_dir().join(&s);
            if !d.is_dir() {
                continue;
            }
            for f in list_names(&d) {
                if f.starts_with('.') {
                    continue;
                }
                let c = read_json(&d.join(&f)).unwrap_or(Value::Null);
                v.push((s.clone(), f, c));
            }
        }
        v
    }

    /// Names of all run directories (dot names excluded).
    pub fn run_ids(&self) -> Vec<String> {
        list_names(&self.runs()).into_iter().filter(|n| !n.starts_with('.')).collect()
    }

    /// Names of entries in spool/ that are still waiting (not dot names, not rejected/).
    pub fn pending_spool(&self) -> Vec<String> {
        list_names(&self.spool()).into_iter().filter(|n| n.ends_with(".json") && !n.starts_with('.')).collect()
    }

    /// The `<name>.error.json` of a rejected entry, once it exists.
    pub fn wait_rejection(&self, name: &str) -> Value {
        let p = self.rejected().join(format!("{}.error.json", name));
        let mut v = None;
        let ok = poll_until(LONG, || {
            v = read_json(&p);
            v.is_some()
        });
        if !ok {
            panic!(
                "no rejection for {} after {:?}; spool: {:?}; rejected: {:?}\n{}",
                name,
                LONG,
                self.pending_spool(),
                list_names(&self.rejected()),
                self.log_tail(60)
            );
        }
        v.unwrap()
    }

    /// Write a control file (stop.json / timeout.json / interrupt.json) atomically.
    pub fn write_control(&self, id: &str, kind: &str) {
        let dir = self.run_dir(id).join("control");
        if !dir.exists() {
            let _ = fs::create_dir(&dir);
            let _ = fs::set_permissions(&dir, fs::Permissions::from_mode(0o700));
        }
        let body = json!({ "type": kind, "ts": now_ms(), "source": "test" });
        let tmp = dir.join(format!(".{}.json.{}.tmp", kind, std::process::id()));
        write_file_mode(&tmp, body.to_string().as_bytes(), 0o600);
        fs::rename(&tmp, dir.join(format!("{}.json", kind))).unwrap();
    }

    // ---------------------------------------------------------------- fabrication

    /// Fabricate a terminal run on disk (status.json, request.json, terminal marker, result).
    pub fn fabricate_terminal_run(&self, id: &str, session: &str, ended_at: i64, state: &str) {
        let dir = self.run_dir(id);
        mkdir_0700(&dir);
        let req = request(Some(id), &self.work, vec![cmd_step("a", &["true"])]);
        write_file_mode(&dir.join("request.json"), serde_json::to_vec(&req).unwrap().as_slice(), 0o600);
        let exit = if state == "complete" { 0 } else { 1 };
        let st = json!({
            "runId": id, "sessionId": session, "mode": "single", "state": state,
            "startedAt": ended_at - 500, "lastUpdate": ended_at, "endedAt": ended_at,
            "timeoutMs": 1800000, "timedOut": false, "stopped": false, "exitCode": exit,
            "pid": 999999, "cwd": self.work.to_str().unwrap(), "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": ended_at - 600},
            "steps": [{"agent": "a", "status": if exit == 0 {"complete"} else {"failed"},
                       "startedAt": ended_at - 400, "endedAt": ended_at, "durationMs": 400, "exitCode": exit}]
        });
        write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
        let sdir = self.terminal_dir().join(seg(session));
        if !sdir.exists() {
            mkdir_0700(&sdir);
        }
        let marker = json!({"version": 1, "runId": id, "sessionId": session, "endedAt": ended_at});
        write_file_mode(&sdir.join(terminal_marker_name(ended_at, id)), marker.to_string().as_bytes(), 0o600);
    }

    /// Fabricate the public result file of a fabricated run (from its status).
    pub fn fabricate_result(&self, id: &str) {
        let st = self.status(id).expect("fabricate_result needs a status");
        let r = json!({
            "id": id, "runId": id, "sessionId": st["sessionId"], "mode": st["mode"], "state": st["state"],
            "success": st["state"] == "complete", "exitCode": st["exitCode"], "summary": "", "results": [],
            "durationMs": 0, "timestamp": st["endedAt"], "asyncDir": self.run_dir(id).to_str().unwrap(), "cwd": st["cwd"]
        });
        write_file_mode(&self.result_path(id), r.to_string().as_bytes(), 0o600);
    }

    // ---------------------------------------------------------------- consistency

    /// Assert the whole root is consistent (call it once everything has settled).
    /// The invariants are eventual (the result and the indexes follow the terminal
    /// status), so this waits up to 30 s for them to hold, then reports what does not.
    pub fn check_consistency(&self) {
        let mut errors = vec![];
        poll_until(Duration::from_secs(30), || {
            errors = consistency_errors(self);
            errors.is_empty()
        });
        if !errors.is_empty() {
            panic!(
                "consistency check failed ({} problems):\n  {}\n{}",
                errors.len(),
                errors.join("\n  "),
                self.log_tail(40)
            );
        }
    }
}

pub fn terminal_marker_name(ended_at: i64, run_id: &str) -> String {
    format!("{:016}-{}.json", ended_at.max(0), seg(run_id))
}

/// Every inconsistency of the root, as text (empty when consistent).
pub fn consistency_errors(env: &TestEnv) -> Vec<String> {
    let mut errs = vec![];
    // 1. spool: nothing pending
    let pending = env.pending_spool();
    if !pending.is_empty() {
        errs.push(format!("spool still holds {:?}", pending));
    }
    // 2. temp files anywhere
    for p in walk_all(&env.root) {
        let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if n.starts_with('.') && n.ends_with(".tmp") {
            errs.push(format!("leftover temp file {}", p.display()));
        }
    }
    // 3. runs
    let mut statuses: BTreeMap<String, Value> = BTreeMap::new();
    for id in env.run_ids() {
        let dir = env.run_dir(&id);
        if !dir.is_dir() {
            errs.push(format!("{} in runs root is not a directory", id));
            continue;
        }
        let st = match read_json(&dir.join("status.json")) {
            Some(s) => s,
            None => {
                errs.push(format!("run {} has no (parsable) status.json", id));
                continue;
            }
        };
        let state = st["state"].as_str().unwrap_or("").to_string();
        if state != "rejected" && !dir.join("request.json").is_file() {
            errs.push(format!("run {} ({}) has no request.json", id, state));
        }
        if st["runId"].as_str() != Some(id.as_str()) {
            errs.push(format!("run dir {} has status runId {:?}", id, st["runId"]));
        }
        if !is_active_state(&state) && !is_terminal_state(&state) {
            errs.push(format!("run {} has unknown state {:?}", id, state));
        }
        statuses.insert(id, st);
    }
    // 4. active markers
    let markers: HashSet<String> = env.active_markers().into_iter().collect();
    for m in &markers {
        match statuses.get(m) {
            None => errs.push(format!("active marker {} has no run with a status", m)),
            Some(st) => {
                let s = st["state"].as_str().unwrap_or("");
                if !is_active_state(s) {
                    errs.push(format!("active marker for run {} in terminal state {}", m, s));
                }
            }
        }
        let mp = env.active_dir().join(m);
        if !mp.is_file() {
            errs.push(format!("active marker {} is not a regular file", m));
        }
    }
    // tool-call aliases must point at active runs only
    let tc = env.active_dir().join("tool-calls");
    for sub in list_names(&tc) {
        let d = tc.join(&sub);
        let names = list_names(&d);
        if names.is_empty() {
            errs.push(format!("empty tool-call alias dir {}", d.display()));
        }
        for n in names {
            let active = statuses.get(&n).and_then(|s| s["state"].as_str()).map(is_active_state).unwrap_or(false);
            if !active {
                errs.push(format!("tool-call alias {}/{} for a run that is not active", sub, n));
            }
        }
    }
    for (id, st) in &statuses {
        let s = st["state"].as_str().unwrap_or("");
        if is_active_state(s) && !markers.contains(id) {
            errs.push(format!("active run {} ({}) has no active marker", id, s));
        }
    }
    // 5. terminal markers
    let mut by_run: HashMap<String, Vec<(String, String, Value)>> = HashMap::new();
    for (sdir, f, c) in env.terminal_markers() {
        let rid = c["runId"].as_str().unwrap_or("").to_string();
        if rid.is_empty() {
            errs.push(format!("unparsable terminal marker {}/{}", sdir, f));
            continue;
        }
        by_run.entry(rid).or_default().push((sdir, f, c));
    }
    for (id, ms) in &by_run {
        match statuses.get(id) {
            None => errs.push(format!(
                "terminal marker(s) {:?} for missing run {}",
                ms.iter().map(|m| &m.1).collect::<Vec<_>>(),
                id
            )),
            Some(st) => {
                if !is_terminal_state(st["state"].as_str().unwrap_or("")) {
                    errs.push(format!("terminal marker for active run {}", id));
                }
            }
        }
    }
    for (id, st) in &statuses {
        let s = st["state"].as_str().unwrap_or("");
        if !is_terminal_state(s) {
            continue;
        }
        let session = st["sessionId"].as_str().unwrap_or("default");
        let ended = st["endedAt"].as_i64();
        let ms = by_run.get(id).cloned().unwrap_or_default();
        if ms.len() != 1 {
            errs.push(format!(
                "terminal run {} ({}) has {} terminal markers: {:?}",
                id,
                s,
                ms.len(),
                ms.iter().map(|m| format!("{}/{}", m.0, m.1)).collect::<Vec<_>>()
            ));
        } else {
            let (sdir, f, c) = &ms[0];
            match ended {
                None => errs.push(format!("terminal run {} has no integer endedAt", id)),
                Some(e) => {
                    let want_name = terminal_marker_name(e, id);
                    if sdir != &seg(session) || f != &want_name {
                        errs.push(format!(
                            "terminal marker of {} is {}/{}, want {}/{}",
                            id,
                            sdir,
                            f,
                            seg(session),
                            want_name
                        ));
                    }
                    let want = json!({"version": 1, "runId": id, "sessionId": session, "endedAt": e});
                    for k in ["version", "runId", "sessionId", "endedAt"] {
                        if c[k] != want[k] {
                            errs.push(format!("terminal marker of {}: {} = {}, want {}", id, k, c[k], want[k]));
                        }
                    }
                }
            }
        }
        match read_json(&env.result_path(id)) {
            None => errs.push(format!("terminal run {} ({}) has no result file", id, s)),
            Some(r) => {
                if r["runId"].as_str() != Some(id.as_str()) {
                    errs.push(format!("result of {} names runId {:?}", id, r["runId"]));
                }
                if r["state"].as_str() != Some(s) {
                    errs.push(format!("result of {} says state {:?}, status says {}", id, r["state"], s));
                }
                if r["exitCode"] != st["exitCode"] {
                    errs.push(format!("result of {} exitCode {} != status {}", id, r["exitCode"], st["exitCode"]));
                }
            }
        }
    }
    errs
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = c.wait();
        }
        kill_root_processes(&self.root, &self.base());
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail(150));
            eprintln!("{}", self.runs_summary(20));
            if std::env::var("RUNSPOOL_TEST_KEEP").is_ok() {
                let p = self.tmp.path().to_path_buf();
                eprintln!("keeping test dir {}", p.display());
                std::mem::forget(std::mem::replace(&mut self.tmp, tempfile::tempdir().unwrap()));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Small utilities for tests
// ---------------------------------------------------------------------------

pub fn stdout_str(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr_str(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn describe(o: &Output) -> String {
    format!("status {:?}\nstdout:\n{}\nstderr:\n{}", o.status, stdout_str(o), stderr_str(o))
}

pub fn file_bytes(p: &Path) -> Vec<u8> {
    let mut v = vec![];
    File::open(p).unwrap_or_else(|e| panic!("open {}: {}", p.display(), e)).read_to_end(&mut v).unwrap();
    v
}

pub fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Deterministic xorshift64* PRNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

// ---------------------------------------------------------------------------
// Custom daemon launches (security tests): extra environment, umask, another uid.
// ---------------------------------------------------------------------------

impl TestEnv {
    /// The daemon command line the harness uses for `root`, as `bin`; callers
    /// add environment, credentials or a umask before spawning it.
    pub fn daemon_command_for(&self, bin: &Path, root: &Path) -> Command {
        let mut cmd = Command::new(bin);
        cmd.arg("daemon")
            .arg("--root")
            .arg(root)
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("RUNSPOOL_ROOT")
            .env_remove("PI_SUBAGENTS_TEMP_ROOT")
            .env("XDG_CONFIG_HOME", self.base().join("xdg"))
            .env("RUNSPOOL_LOG", std::env::var("RUNSPOOL_TEST_LOG").unwrap_or_else(|_| "debug".into()))
            .stdin(Stdio::null());
        cmd
    }

    /// Start the daemon from a command built by `daemon_command_for` (its output
    /// goes to the harness log) and wait until it reports itself ready.
    pub fn start_daemon_command(&mut self, mut cmd: Command) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon (custom command) ----\n");
        let log = OpenOptions::new().create(true).append(true).open(&self.log_path).unwrap();
        cmd.stdout(Stdio::from(log.try_clone().unwrap())).stderr(Stdio::from(log));
        let child = spawn_retrying_busy(&mut cmd);
        let pid = child.id() as i64;
        self.child = Some(child);
        self.wait_ready(pid);
    }

    /// Run a daemon command expected to exit by itself; (status, output).
    pub fn run_command_expect_exit(&self, mut cmd: Command, timeout: Duration) -> (ExitStatus, String) {
        let out_path = self.base().join(format!("{}.out", unique("daemon-refusal")));
        let out = File::create(&out_path).unwrap();
        let _ = fs::set_permissions(&out_path, fs::Permissions::from_mode(0o666));
        cmd.stdout(Stdio::from(out.try_clone().unwrap())).stderr(Stdio::from(out));
        let mut c = spawn_retrying_busy(&mut cmd);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return (st, fs::read_to_string(&out_path).unwrap_or_default());
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!(
                    "daemon was still running after {:?}; output:\n{}",
                    timeout,
                    fs::read_to_string(&out_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

/// Spawn, retrying ETXTBSY: a binary copied moments ago may still be open for
/// writing in a child that another test thread forked and has not exec'd yet.
pub fn spawn_retrying_busy(cmd: &mut Command) -> Child {
    let mut tries = 0;
    loop {
        match cmd.spawn() {
            Ok(c) => return c,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("spawn {:?}: {}", cmd.get_program(), e),
        }
    }
}

/// Peak and current resident set size of a process in KiB (VmHWM, VmRSS).
pub fn proc_rss_kib(pid: i64) -> Option<(u64, u64)> {
    let s = fs::read_to_string(format!("/proc/{}/status", pid)).ok()?;
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

// ---------------------------------------------------------------------------
// External-job tests: a daemon with extra environment (PATH with wrappers,
// SLURM_CONF), started again after the harness or a wrapper killed it.
// ---------------------------------------------------------------------------

impl TestEnv {
    /// Start the daemon with extra environment variables and wait until it is ready.
    pub fn start_daemon_env(&mut self, vars: &[(&str, String)]) {
        let mut cmd = self.daemon_command_for(Path::new(BIN), &self.root);
        cmd.args(&self.extra_args);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        self.start_daemon_command(cmd);
    }

    /// Wait until the daemon started by the harness has exited (killed by someone else).
    pub fn wait_daemon_exit(&mut self) -> ExitStatus {
        let mut st = None;
        let ok = poll_until(LONG, || {
            st = self.daemon_exited();
            st.is_some()
        });
        assert!(ok, "the daemon did not exit\n{}", self.log_tail(60));
        self.append_log("---- harness: daemon exited ----\n");
        st.unwrap()
    }
}

/// Print a line that shows in `cargo test` output even when the test passes
/// (the test harness captures `println!`/`eprintln!`, not the stderr handle).
pub fn report(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}
