//! pueue side by side (`--pueue`).
//!
//! pueue is a task queue with a daemon (`pueued`) and a client (`pueue add`),
//! the nearest existing tool to runspool. A private pueued per test, with its
//! own config, data and runtime directories under the bench's temp root, so the
//! user's own pueue (if any) is never touched.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use notify::{RecursiveMode, Watcher};
use serde_json::Value;

use crate::fsops::{mkdirs, write_private};
use crate::pipelines::{terminate, Env};
use crate::procfs;
use crate::stats::{ms, Stats};

/// What the pueue side of a run needs: the tools and the sizes.
pub struct Setup {
    pub tools: PueueTools,
    /// Tasks per burst.
    pub burst_n: usize,
    /// Tasks in the latency test.
    pub latency_n: usize,
    /// Keep the temporary directories.
    pub keep: bool,
}

/// The pueue binaries under comparison.
pub struct PueueTools {
    pueue: PathBuf,
    pueued: PathBuf,
    pub version: String,
    /// Seconds `cargo install` took when the benchmark installed pueue itself.
    pub install_secs: Option<f64>,
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `name` on PATH, else in cargo's bin directory (where `cargo install` puts it).
fn find_tool(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(h) = std::env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(h).join("bin"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(h).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| is_executable(p))
}

/// pueue and pueued as found, or installed with `cargo install` at `version`.
pub fn tools(version: &str) -> anyhow::Result<PueueTools> {
    let found = || Some((find_tool("pueue")?, find_tool("pueued")?));
    let mut install_secs = None;
    let (pueue, pueued) = match found() {
        Some(p) => p,
        None => {
            eprintln!("pueue: not on PATH or in ~/.cargo/bin; installing it with `cargo install pueue --version {version} --locked` (a few minutes) ...");
            let t = Instant::now();
            // cargo's own output goes to stderr too: stdout carries the report.
            use std::os::fd::AsFd;
            let st = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
                .args(["install", "pueue", "--version", version, "--locked"])
                .stdin(Stdio::null())
                .stdout(Stdio::from(std::io::stderr().as_fd().try_clone_to_owned()?))
                .status()?;
            let secs = t.elapsed().as_secs_f64();
            if !st.success() {
                anyhow::bail!("`cargo install pueue --version {version} --locked` failed after {secs:.0} s ({st}); try another --pueue-version");
            }
            eprintln!("pueue: installed in {secs:.0} s");
            install_secs = Some(secs);
            found().ok_or_else(|| {
                anyhow::anyhow!("pueue installed, but neither PATH nor ~/.cargo/bin has pueue and pueued")
            })?
        }
    };
    let out = Command::new(&pueue).arg("--version").stdin(Stdio::null()).output()?;
    let version = String::from_utf8_lossy(&out.stdout).split_whitespace().last().unwrap_or("unknown").to_string();
    eprintln!("pueue: using pueue {version} ({})", pueue.display());
    Ok(PueueTools { pueue, pueued, version, install_secs })
}

/// Wait for a child up to `timeout`; None if it is still running then.
fn wait_until(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + timeout;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A private pueued; shut down and its directory removed on drop (even on error).
struct Pueued {
    pueue: PathBuf,
    cfg: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
    keep: bool,
}

impl Pueued {
    fn start(tools: &PueueTools, dir: PathBuf, parallel: usize, keep: bool) -> anyhow::Result<Pueued> {
        let (data, runtime) = (dir.join("data"), dir.join("runtime"));
        mkdirs(&data)?;
        mkdirs(&runtime)?;
        let cfg = dir.join("pueue.yml");
        // JSON strings are valid YAML scalars: safe quoting of the paths.
        let q = |p: &Path| serde_json::to_string(&p.display().to_string()).unwrap();
        let yml = format!(
            "shared:\n  pueue_directory: {}\n  runtime_directory: {}\n  alias_file: {}\n  use_unix_socket: true\n  unix_socket_path: {}\ndaemon:\n  default_parallel_tasks: {parallel}\n",
            q(&data),
            q(&runtime),
            q(&dir.join("aliases.yml")),
            q(&runtime.join("pueue.socket")),
        );
        write_private(&cfg, yml.as_bytes())?;
        let log = File::create(dir.join("pueued.log"))?;
        // The same small environment as the client's (see `cmd`): an inherited
        // RUST_BACKTRACE=1, say, makes pueued capture and symbolise a backtrace
        // for each error it builds (+40 MiB of RSS, and CPU), which a user's
        // pueued would not do.
        let mut daemon = Command::new(&tools.pueued);
        daemon.env_clear();
        for k in ["PATH", "HOME"] {
            if let Some(v) = std::env::var_os(k) {
                daemon.env(k, v);
            }
        }
        let child = daemon
            .arg("-c")
            .arg(&cfg)
            .env("PUEUE_CONFIG_PATH", &cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut d = Pueued { pueue: tools.pueue.clone(), cfg, dir, child: Some(child), keep };
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            if d.cmd().arg("status").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success()) {
                break;
            }
            if let Some(Ok(Some(st))) = d.child.as_mut().map(|c| c.try_wait()) {
                anyhow::bail!("pueued exited ({st}); see {}", d.dir.join("pueued.log").display());
            }
            if Instant::now() > until {
                anyhow::bail!("pueued did not answer within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        d.run(&["parallel", &parallel.to_string()])?;
        Ok(d)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// The client, talking to this daemon only. pueue stores the client's
    /// whole environment with every task (and in every `status --json`, and in
    /// its state file on every change): a small one, like a runspool request
    /// that carries none, keeps that from weighing on the comparison.
    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.pueue);
        c.arg("-c").arg(&self.cfg).env_clear().env("PUEUE_CONFIG_PATH", &self.cfg).stdin(Stdio::null());
        for k in ["PATH", "HOME"] {
            if let Some(v) = std::env::var_os(k) {
                c.env(k, v);
            }
        }
        c
    }

    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.cmd().args(args).output()?;
        if !out.status.success() {
            anyhow::bail!(
                "pueue {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn status(&self) -> anyhow::Result<Value> {
        Ok(serde_json::from_str(&self.run(&["status", "--json"])?)?)
    }
}

impl Drop for Pueued {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Ask it to stop; if it does not within 5 s, SIGTERM then SIGKILL (this pid only).
            if let Ok(mut sd) = self.cmd().arg("shutdown").stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
                if wait_until(&mut sd, Duration::from_secs(5)).is_none() {
                    let _ = sd.kill();
                    let _ = sd.wait();
                }
            }
            if wait_until(&mut child, Duration::from_secs(5)).is_none() {
                terminate(&mut child);
            }
        }
        if !self.keep {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A task's state in `pueue status --json` and, when done, its result:
/// pueue 4 writes `{"Done": {"result": "Success", ...}}` (or `{"Running": {...}}`),
/// pueue 3 wrote `{"Done": "Success"}` or a bare `"Running"`; a failed result is
/// `{"Failed": 1}`, shown as its key.
fn pueue_task_state(task: &Value) -> (String, Option<String>) {
    let name = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.keys().next().cloned(),
        _ => None,
    };
    match &task["status"] {
        Value::String(s) => (s.clone(), None),
        Value::Object(m) => match m.iter().next() {
            Some((k, Value::Object(inner))) => (k.clone(), inner.get("result").and_then(name)),
            Some((k, v)) => (k.clone(), name(v)),
            None => (String::new(), None),
        },
        _ => (String::new(), None),
    }
}

/// (done, failed) among the tasks of a `pueue status --json` answer.
fn pueue_done_count(status: &Value) -> (usize, usize) {
    let (mut done, mut failed) = (0, 0);
    for t in status["tasks"].as_object().into_iter().flat_map(|m| m.values()) {
        let (state, result) = pueue_task_state(t);
        if state == "Done" {
            done += 1;
            if result.as_deref() != Some("Success") {
                failed += 1;
            }
        }
    }
    (done, failed)
}

/// One pueue burst.
#[derive(Clone, Copy, Debug)]
pub struct PueueBurst {
    pub parallel: usize,
    pub n: usize,
    pub secs: f64,
    /// Of `secs`, the time the `pueue add` calls took.
    pub add_secs: f64,
    pub per_s: f64,
    pub peak_rss_kib: u64,
}

/// `n` trivial tasks added one after another with `pueue add -- true` (each add
/// returns once the daemon has the task); the clock runs from the first add
/// until `pueue status --json` (polled every 100 ms, or n/5 ms for large n:
/// the answer grows with n) shows all of them done.
pub fn burst(env: &Env, setup: &Setup, parallel: usize) -> anyhow::Result<PueueBurst> {
    let n = setup.burst_n;
    let d = Pueued::start(&setup.tools, env.fresh_root(&format!("pueue-burst{parallel}"))?, parallel, setup.keep)?;
    let t0 = Instant::now();
    for _ in 0..n {
        d.run(&["add", "--", "true"])?;
    }
    let add_secs = t0.elapsed().as_secs_f64();
    // pueue's reference speed is ~5 tasks/s: allow 1 s per task, plus 2 minutes.
    let deadline = t0 + Duration::from_secs(120 + n as u64);
    let secs = loop {
        let (done, failed) = pueue_done_count(&d.status()?);
        let at = t0.elapsed().as_secs_f64();
        if failed > 0 {
            anyhow::bail!("pueue burst: {failed} of the `true` tasks failed");
        }
        if done >= n {
            break at;
        }
        if Instant::now() > deadline {
            anyhow::bail!("pueue burst at parallel {parallel}: only {done} of {n} tasks done in time");
        }
        std::thread::sleep(Duration::from_millis((n as u64 / 5).max(100)));
    };
    let peak_rss_kib = procfs::status_kib(d.pid(), "VmHWM:").unwrap_or(0);
    Ok(PueueBurst { parallel, n, secs, add_secs, per_s: n as f64 / secs, peak_rss_kib })
}

/// pueue's latency marks, from spawning `pueue add`.
#[derive(Clone, Copy, Debug)]
pub struct PueueLatency {
    /// `pueue add` returned.
    pub added: Stats,
    /// The task's command ran.
    pub started: Stats,
    /// `pueue status` shows it done.
    pub done: Stats,
}

/// One task at a time: the clock starts just before `pueue add` is spawned
/// (the client is pueue's interface, as the rename is runspool's). Marks:
/// `pueue add` returned; the task's command ran (it truncates a file of its
/// own, seen by inotify with a 2 ms poll as a safety net); `pueue status
/// --json` (polled every 5 ms from then on) shows it done. 3 warm-up tasks
/// are not counted.
pub fn latency(env: &Env, setup: &Setup) -> anyhow::Result<PueueLatency> {
    let (n, keep) = (setup.latency_n, setup.keep);
    let dir = env.fresh_root("pueue-latency")?;
    let marks = dir.join("marks");
    mkdirs(&marks)?;
    let (tx, rx) = channel();
    let mut watcher = notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
        if crate::fsops::is_change(&r) {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&marks, RecursiveMode::NonRecursive)?;
    let d = Pueued::start(&setup.tools, dir.join("pueue"), 2, keep)?;
    let (mut added, mut started, mut done) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n + 3 {
        let mark = marks.join(format!("t{i:06}"));
        let path = mark.display().to_string();
        if path.contains('\'') {
            anyhow::bail!("{path}: a quote in the temp path");
        }
        // pueue runs the command with `sh -c`; `:` is a builtin, so no extra exec.
        let command = format!(": > '{path}'");
        let t0 = Instant::now();
        let id = d.run(&["add", "--print-task-id", "--", &command])?.trim().to_string();
        let t_added = t0.elapsed();
        let deadline = t0 + Duration::from_secs(60);
        let t_started = loop {
            let _ = rx.recv_timeout(Duration::from_millis(2));
            while rx.try_recv().is_ok() {}
            if mark.exists() {
                break t0.elapsed();
            }
            if Instant::now() > deadline {
                anyhow::bail!("pueue task {id} did not start within 60 s");
            }
        };
        let t_done = loop {
            let st = d.status()?;
            let at = t0.elapsed();
            let (state, result) = pueue_task_state(&st["tasks"][id.as_str()]);
            if state == "Done" {
                if result.as_deref() != Some("Success") {
                    anyhow::bail!("pueue task {id} ended {result:?}");
                }
                break at;
            }
            if Instant::now() > deadline {
                anyhow::bail!("pueue task {id} not done within 60 s (state {state:?})");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if i >= 3 {
            added.push(ms(t_added));
            started.push(ms(t_started));
            done.push(ms(t_done));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(d);
    drop(watcher);
    if !keep {
        let _ = fs::remove_dir_all(&dir);
    }
    Ok(PueueLatency { added: Stats::of(added), started: Stats::of(started), done: Stats::of(done) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pueue_states_of_both_json_shapes() {
        let v4 = json!({"tasks": {
            "0": {"status": {"Done": {"enqueued_at": "x", "start": "y", "end": "z", "result": "Success"}}},
            "1": {"status": {"Done": {"result": {"Failed": 1}}}},
            "2": {"status": {"Running": {"enqueued_at": "x", "start": "y"}}},
            "3": {"status": {"Queued": {"enqueued_at": "x"}}}}});
        assert_eq!(pueue_task_state(&v4["tasks"]["0"]), ("Done".into(), Some("Success".into())));
        assert_eq!(pueue_task_state(&v4["tasks"]["1"]), ("Done".into(), Some("Failed".into())));
        assert_eq!(pueue_task_state(&v4["tasks"]["2"]).0, "Running");
        assert_eq!(pueue_done_count(&v4), (2, 1));
        let v3 = json!({"tasks": {"0": {"status": {"Done": "Success"}}, "1": {"status": "Running"}}});
        assert_eq!(pueue_task_state(&v3["tasks"]["0"]), ("Done".into(), Some("Success".into())));
        assert_eq!(pueue_task_state(&v3["tasks"]["1"]), ("Running".into(), None));
        assert_eq!(pueue_done_count(&v3), (1, 0));
    }
}
