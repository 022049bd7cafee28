//! runspool-bench: the performance benchmark of docs/performance.md.
//!
//! It measures, on temporary roots under `--dir` (use a disk path and a tmpfs
//! path for the two variants), side by side in one run:
//! 1. latency, one request at a time: drop→claimed, →runner started, →step
//!    started, →terminal status, for runspool and for a minimal reference
//!    pipeline built into this binary (`__ref-daemon` / `__ref-runner`);
//! 2. bursts of `--burst-n` trivial runs at each `--parallel` (max_running),
//!    for both, with the daemons' peak RSS;
//! 3. idle cost of the runspool daemon from /proc (CPU, wakeups, RSS) with 0
//!    and `--runs` terminal runs, native and poll watching, all at once;
//! 4. `runspool list/status` with `--runs` terminal and `--active` active
//!    runs on disk (time per call, files opened via strace when present);
//! 5. daemon start-up (re-adoption) with `--active` live runs.
//!
//! With `--pueue`, the burst and latency tests also run through pueue
//! (`pueue add`, a private `pueued`), installed with cargo when missing.
//!
//! Timings are printed as a Markdown report (and `--out FILE` as JSON). The
//! machine is shared and noisy: compare the ratios, not the absolute numbers.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use clap::Parser;
use notify::{RecursiveMode, Watcher};
use serde_json::{json, Value};

use runspool::store::fsutil;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "runspool-bench",
    about = "Benchmark runspool against a minimal reference pipeline (see docs/performance.md)"
)]
struct Args {
    /// The runspool binary (default: `runspool` next to this binary)
    #[arg(long, value_name = "PATH")]
    runspool: Option<PathBuf>,
    /// Directory for the temporary roots (a disk path, or a tmpfs such as /dev/shm)
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Label for the report (default: the file system type of --dir)
    #[arg(long)]
    label: Option<String>,
    /// Requests in the latency test (each pipeline)
    #[arg(long, default_value_t = 500)]
    latency_n: usize,
    /// Runs per burst
    #[arg(long, default_value_t = 2000)]
    burst_n: usize,
    /// Bursts per pipeline and max_running, alternating the order; the medians are reported
    #[arg(long, default_value_t = 1)]
    burst_repeat: usize,
    /// max_running values for the bursts
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    parallel: Vec<usize>,
    /// Length of the idle measurement, seconds
    #[arg(long, default_value_t = 60)]
    idle_secs: u64,
    /// Fabricated terminal runs for the idle, scale and start-up tests
    #[arg(long, default_value_t = 100_000)]
    runs: usize,
    /// Fabricated active runs for the scale and start-up tests
    #[arg(long, default_value_t = 1000)]
    active: usize,
    /// CLI calls timed per scale measurement
    #[arg(long, default_value_t = 20)]
    calls: usize,
    /// Phases to run
    #[arg(long, value_delimiter = ',', default_value = "latency,burst,idle,scale,adopt")]
    phases: Vec<String>,
    /// Also write the results as JSON here
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Keep the temporary roots (for inspection)
    #[arg(long)]
    keep: bool,
    /// Also run the burst and latency tests through pueue (`pueue add`), side by
    /// side; installs pueue with `cargo install` when it is not on PATH or in ~/.cargo/bin
    #[arg(long)]
    pueue: bool,
    /// Tasks per pueue burst (pueue runs about 5 trivial tasks/s, hence smaller than --burst-n)
    #[arg(long, default_value_t = 200)]
    pueue_burst_n: usize,
    /// Tasks in the pueue latency test
    #[arg(long, default_value_t = 50)]
    pueue_latency_n: usize,
    /// pueue version `cargo install` asks for when pueue is missing
    #[arg(long, default_value = "4.0.4")]
    pueue_version: String,
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // Internal roles of the reference pipeline, started by the benchmark itself.
    match argv.get(1).map(String::as_str) {
        Some("__ref-daemon") => std::process::exit(ref_daemon(Path::new(&argv[2]), argv[3].parse().unwrap_or(2))),
        Some("__ref-runner") => std::process::exit(ref_runner(Path::new(&argv[2]))),
        _ => {}
    }
    let args = Args::parse();
    match run(args) {
        Ok(()) => {}
        Err(e) => {
            eprintln!("runspool-bench: {e:#}");
            std::process::exit(1);
        }
    }
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

fn mkdirs(p: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(p)
}

fn write_private(p: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(p)?;
    f.write_all(bytes)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[derive(Clone, Copy, Default)]
struct Stats {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    n: usize,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.retain(|x| x.is_finite());
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stats {
        p50: pct(&v, 0.5),
        p90: pct(&v, 0.9),
        p99: pct(&v, 0.99),
        max: v.last().copied().unwrap_or(f64::NAN),
        n: v.len(),
    }
}

fn stats_json(s: &Stats) -> Value {
    json!({"p50_ms": s.p50, "p90_ms": s.p90, "p99_ms": s.p99, "max_ms": s.max, "n": s.n})
}

fn request_body(id: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"version": 1, "runId": id, "cwd": "/", "steps": [{"agent": "bench", "command": ["/bin/true"]}]}),
    )
    .unwrap()
}

/// Publish a request the PROTOCOL way (dot temp, then rename) and return the drop instant.
fn drop_request(spool: &Path, id: &str) -> std::io::Result<Instant> {
    let tmp = spool.join(format!(".{id}.tmp"));
    write_private(&tmp, &request_body(id))?;
    let t0 = Instant::now();
    fs::rename(&tmp, spool.join(format!("{id}.json")))?;
    Ok(t0)
}

/// (own CPU ms, CPU ms of reaped children) from `/proc/<pid>/stat` (utime+stime, cutime+cstime).
fn proc_cpu_ms(pid: u32) -> Option<(f64, f64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name start at field 3 (state).
    let f: Vec<u64> =
        s.rsplit_once(')')?.1.split_whitespace().skip(11).take(4).filter_map(|x| x.parse().ok()).collect();
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    (f.len() == 4).then(|| ((f[0] + f[1]) as f64 * 1000.0 / tick, (f[2] + f[3]) as f64 * 1000.0 / tick))
}

fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// (on-CPU ns, times scheduled in, context switches, threads) summed over the process's threads.
fn proc_sched(pid: u32) -> (u64, u64, u64, usize) {
    let (mut cpu, mut slices, mut ctx, mut n) = (0, 0, 0, 0);
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) else { return (0, 0, 0, 0) };
    for t in rd.flatten() {
        n += 1;
        if let Ok(s) = fs::read_to_string(t.path().join("schedstat")) {
            let f: Vec<u64> = s.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            if f.len() >= 3 {
                cpu += f[0];
                slices += f[2];
            }
        }
        if let Ok(s) = fs::read_to_string(t.path().join("status")) {
            for l in s.lines() {
                if l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches") {
                    ctx += l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                }
            }
        }
    }
    (cpu, slices, ctx, n)
}

fn terminate(child: &mut Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A daemon under test (runspool or the reference), stopped on drop.
struct Daemon {
    child: Child,
}
impl Daemon {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}
impl Drop for Daemon {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    while !f() {
        if Instant::now() > until {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The two pipelines
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Runspool,
    Reference,
}

struct Env {
    runspool: PathBuf,
    me: PathBuf,
    base: PathBuf,
    seq: std::cell::Cell<u32>,
}

impl Env {
    fn fresh_root(&self, name: &str) -> anyhow::Result<PathBuf> {
        let n = self.seq.get();
        self.seq.set(n + 1);
        let root = self.base.join(format!("{n:02}-{name}"));
        mkdirs(&root)?;
        Ok(root)
    }

    fn start_runspool(&self, root: &Path, max_running: usize, strategy: &str) -> anyhow::Result<Daemon> {
        let cfg = root.with_extension("toml");
        fs::write(&cfg, format!("max_running = {max_running}\n[watch]\nstrategy = \"{strategy}\"\n"))?;
        let log = File::create(root.with_extension("daemon.log"))?;
        let child = Command::new(&self.runspool)
            .arg("--root")
            .arg(root)
            .arg("daemon")
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .spawn()?;
        let mut d = Daemon { child };
        let dj = root.join("runspool/daemon.json");
        wait_for("runspool daemon.json", Duration::from_secs(300), || {
            dj.exists() || matches!(d.child.try_wait(), Ok(Some(_)))
        })?;
        if let Ok(Some(st)) = d.child.try_wait() {
            anyhow::bail!("the runspool daemon exited ({st}); see {}", root.with_extension("daemon.log").display());
        }
        Ok(d)
    }

    fn start_reference(&self, root: &Path, max_running: usize) -> anyhow::Result<Daemon> {
        let log = File::create(root.with_extension("daemon.log"))?;
        let child = Command::new(&self.me)
            .arg("__ref-daemon")
            .arg(root)
            .arg(max_running.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let d = Daemon { child };
        let ready = root.join("ready");
        wait_for("the reference daemon", Duration::from_secs(60), || ready.exists())?;
        Ok(d)
    }

    fn start(&self, kind: Kind, root: &Path, max_running: usize) -> anyhow::Result<Daemon> {
        match kind {
            Kind::Runspool => self.start_runspool(root, max_running, "native"),
            Kind::Reference => self.start_reference(root, max_running),
        }
    }
}

/// Where a pipeline records that a run is fully finished (its last write).
fn done_marker(kind: Kind, root: &Path, id: &str) -> PathBuf {
    match kind {
        Kind::Runspool => root.join("async-subagent-results").join(format!("{id}.json")),
        Kind::Reference => root.join("done").join(id),
    }
}

/// Directory holding one entry per terminal run.
fn terminal_dir(kind: Kind, root: &Path) -> PathBuf {
    match kind {
        Kind::Runspool => root.join("async-subagent-runs/.terminal-runs/default"),
        Kind::Reference => root.join("done"),
    }
}

// ---------------------------------------------------------------------------
// The reference pipeline: the minimum the protocol asks for, written directly
// against the OS. inotify event → open+flock+read+parse → mkdir → claim rename
// (fsynced) → atomic queued status → spawn a detached runner, which writes
// `running`, spawns the step, appends the step event, waits, writes the
// terminal status (fsynced) and a done marker.
// ---------------------------------------------------------------------------

enum RefMsg {
    Spool,
    Exited,
}

fn ref_daemon(root: &Path, max_running: usize) -> i32 {
    let spool = root.join("spool");
    let runs = root.join("async-subagent-runs");
    for d in [&spool, &runs, &root.join("done")] {
        if let Err(e) = mkdirs(d) {
            eprintln!("{}: {e}", d.display());
            return 1;
        }
    }
    let (tx, rx) = channel::<RefMsg>();
    let tx2 = tx.clone();
    let mut watcher = match notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
        if let Ok(ev) = r {
            if ev.paths.iter().any(|p| p.file_name().is_some_and(|n| !n.to_string_lossy().starts_with('.'))) {
                let _ = tx2.send(RefMsg::Spool);
            }
        }
    }) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("inotify: {e}");
            return 1;
        }
    };
    if let Err(e) = watcher.watch(&spool, RecursiveMode::NonRecursive) {
        eprintln!("inotify: {e}");
        return 1;
    }
    let me = std::env::current_exe().expect("current exe");
    let _ = fs::write(root.join("ready"), b"");
    let mut queue: VecDeque<PathBuf> = VecDeque::new();
    let mut running = 0usize;
    let mut dirty = true;
    loop {
        if dirty {
            dirty = false;
            ref_scan(&spool, &runs, &mut queue);
        }
        while running < max_running {
            let Some(dir) = queue.pop_front() else { break };
            let mut cmd = Command::new(&me);
            cmd.arg("__ref-runner")
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0);
            match cmd.spawn() {
                Ok(mut child) => {
                    running += 1;
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        let _ = child.wait();
                        let _ = tx.send(RefMsg::Exited);
                    });
                }
                Err(e) => eprintln!("spawn: {e}"),
            }
        }
        let Ok(m) = rx.recv() else { return 0 };
        let mut handle = |m: RefMsg| match m {
            RefMsg::Spool => dirty = true,
            RefMsg::Exited => running -= 1,
        };
        handle(m);
        while let Ok(m) = rx.try_recv() {
            handle(m);
        }
    }
}

fn ref_scan(spool: &Path, runs: &Path, queue: &mut VecDeque<PathBuf>) {
    let Ok(rd) = fs::read_dir(spool) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        if let Some(dir) = ref_claim(spool, runs, &name) {
            queue.push_back(dir);
        }
    }
}

fn ref_claim(spool: &Path, runs: &Path, name: &str) -> Option<PathBuf> {
    let path = spool.join(name);
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .ok()?;
    if !fsutil::flock(&f, true).ok()? {
        return None;
    }
    let mut raw = Vec::new();
    f.read_to_end(&mut raw).ok()?;
    let v: Value = serde_json::from_slice(&raw).ok()?;
    let id = v.get("runId")?.as_str()?.to_string();
    let dir = runs.join(&id);
    fs::DirBuilder::new().mode(0o700).create(&dir).ok()?;
    fs::rename(&path, dir.join("request.json")).ok()?;
    let _ = fsutil::fsync_dir(&dir);
    let _ = fsutil::fsync_dir(spool);
    let status = json!({"runId": id, "state": "queued", "queue": {"claimedAt": runspool::now_ms()}});
    fsutil::write_atomic(&dir.join("status.json"), &serde_json::to_vec_pretty(&status).ok()?, false).ok()?;
    Some(dir)
}

fn ref_runner(dir: &Path) -> i32 {
    let Ok(Some(_lock)) = fsutil::lock(&dir.join("runner.lock"), true) else { return 1 };
    let Ok(raw) = fs::read(dir.join("request.json")) else { return 1 };
    let Ok(req) = serde_json::from_slice::<Value>(&raw) else { return 1 };
    let id = req["runId"].as_str().unwrap_or("?").to_string();
    let argv: Vec<String> = req["steps"][0]["command"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let status = |state: &str, code: Option<i32>| {
        serde_json::to_vec_pretty(&json!({"runId": id, "state": state, "pid": std::process::id(), "exitCode": code}))
            .unwrap()
    };
    if fsutil::write_atomic(&dir.join("status.json"), &status("running", None), false).is_err() {
        return 1;
    }
    let Ok(out) = OpenOptions::new().append(true).create(true).mode(0o600).open(dir.join("output-0.log")) else {
        return 1;
    };
    let err = out.try_clone().ok();
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).stdout(out).process_group(0);
    if let Some(e) = err {
        cmd.stderr(e);
    }
    let code = match cmd.spawn() {
        Ok(mut c) => {
            let ev = json!({"type": "subagent.step.started", "ts": runspool::now_ms(), "runId": id, "stepIndex": 0});
            let _ = fsutil::append_line(&dir.join("events.jsonl"), &serde_json::to_vec(&ev).unwrap());
            c.wait().ok().and_then(|s| s.code()).unwrap_or(1)
        }
        Err(_) => 127,
    };
    let state = if code == 0 { "complete" } else { "failed" };
    if fsutil::write_atomic(&dir.join("status.json"), &status(state, Some(code)), true).is_err() {
        return 1;
    }
    let root = dir.parent().and_then(Path::parent).expect("root");
    let _ = fsutil::touch(&root.join("done").join(&id));
    0
}

// ---------------------------------------------------------------------------
// 1. Latency
// ---------------------------------------------------------------------------

#[derive(Default, Clone, Copy)]
struct Marks {
    claimed: Option<Duration>,
    started: Option<Duration>,
    step: Option<Duration>,
    terminal: Option<Duration>,
}

struct Observer {
    watcher: notify::RecommendedWatcher,
    rx: Receiver<()>,
}

impl Observer {
    fn new(runs: &Path) -> anyhow::Result<Observer> {
        let (tx, rx) = channel();
        let mut watcher = notify::recommended_watcher(move |_r: notify::Result<notify::Event>| {
            let _ = tx.send(());
        })?;
        watcher.watch(runs, RecursiveMode::NonRecursive)?;
        Ok(Observer { watcher, rx })
    }

    /// Watch one run from its drop until its terminal status and done marker.
    /// Each mark is the first time the observer saw the state (inotify wake-ups,
    /// with a 2 ms poll as a safety net).
    fn observe(&mut self, dir: &Path, t0: Instant, done: &Path) -> anyhow::Result<Marks> {
        let mut m = Marks::default();
        let mut watched = false;
        let deadline = t0 + Duration::from_secs(60);
        loop {
            match self.rx.recv_timeout(Duration::from_millis(2)) {
                Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => anyhow::bail!("watcher died"),
            }
            while self.rx.try_recv().is_ok() {}
            let now = t0.elapsed();
            if !watched && dir.exists() {
                self.watcher.watch(dir, RecursiveMode::NonRecursive)?;
                watched = true;
            }
            if watched {
                let state = fs::read(dir.join("status.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .and_then(|v| v.get("state").and_then(Value::as_str).map(String::from));
                match state.as_deref() {
                    Some("queued") => {
                        m.claimed.get_or_insert(now);
                    }
                    Some("running") => {
                        m.claimed.get_or_insert(now);
                        m.started.get_or_insert(now);
                    }
                    Some(s) => {
                        m.claimed.get_or_insert(now);
                        m.started.get_or_insert(now);
                        m.step.get_or_insert(now);
                        m.terminal.get_or_insert(now);
                        if s != "complete" {
                            anyhow::bail!("{} ended {s}", dir.display());
                        }
                    }
                    None => {}
                }
                if m.step.is_none() {
                    if let Ok(ev) = fs::read_to_string(dir.join("events.jsonl")) {
                        if ev.contains("subagent.step.started") {
                            m.claimed.get_or_insert(now);
                            m.started.get_or_insert(now);
                            m.step = Some(now);
                        }
                    }
                }
            }
            if m.terminal.is_some() && done.exists() {
                let _ = self.watcher.unwatch(dir);
                return Ok(m);
            }
            if Instant::now() > deadline {
                anyhow::bail!("{} did not finish within 60 s", dir.display());
            }
        }
    }
}

struct LatencyResult {
    claimed: Stats,
    started: Stats,
    step: Stats,
    terminal: Stats,
}

fn latency(env: &Env, n: usize) -> anyhow::Result<(LatencyResult, LatencyResult)> {
    let roots = [env.fresh_root("latency-runspool")?, env.fresh_root("latency-reference")?];
    let kinds = [Kind::Runspool, Kind::Reference];
    let _d: Vec<Daemon> = kinds.iter().zip(&roots).map(|(k, r)| env.start(*k, r, 2)).collect::<anyhow::Result<_>>()?;
    let mut obs: Vec<Observer> =
        roots.iter().map(|r| Observer::new(&r.join("async-subagent-runs"))).collect::<anyhow::Result<_>>()?;
    let mut marks: [Vec<Marks>; 2] = [vec![], vec![]];
    // Warm-up (page cache, first spawn), not counted; then alternate the two
    // pipelines request by request so drift hits both alike.
    for i in 0..n + 3 {
        for p in 0..2 {
            let id = format!("lat-{i:06}");
            let t0 = drop_request(&roots[p].join("spool"), &id)?;
            let m = obs[p].observe(
                &roots[p].join("async-subagent-runs").join(&id),
                t0,
                &done_marker(kinds[p], &roots[p], &id),
            )?;
            if i >= 3 {
                marks[p].push(m);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let res = |v: &Vec<Marks>| {
        let col = |f: &dyn Fn(&Marks) -> Option<Duration>| {
            stats(v.iter().map(|m| f(m).map(ms).unwrap_or(f64::NAN)).collect())
        };
        LatencyResult {
            claimed: col(&|m| m.claimed),
            started: col(&|m| m.started),
            step: col(&|m| m.step),
            terminal: col(&|m| m.terminal),
        }
    };
    Ok((res(&marks[0]), res(&marks[1])))
}

// ---------------------------------------------------------------------------
// 2. Burst
// ---------------------------------------------------------------------------

struct BurstResult {
    secs: f64,
    per_s: f64,
    peak_rss_kib: u64,
    /// CPU ms per run: the daemon itself, and its reaped children (runners and their steps).
    cpu_daemon_ms: f64,
    cpu_children_ms: f64,
}

/// The round with the median throughput (peak RSS: the highest of all rounds).
fn median_burst(mut v: Vec<BurstResult>) -> BurstResult {
    let peak = v.iter().map(|b| b.peak_rss_kib).max().unwrap_or(0);
    v.sort_by(|a, b| a.per_s.partial_cmp(&b.per_s).unwrap());
    let m = v.swap_remove(v.len() / 2);
    BurstResult { peak_rss_kib: peak, ..m }
}

fn count_entries(dir: &Path) -> usize {
    fs::read_dir(dir)
        .map(|rd| rd.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
        .unwrap_or(0)
}

fn burst(env: &Env, kind: Kind, n: usize, max_running: usize) -> anyhow::Result<BurstResult> {
    let name = match kind {
        Kind::Runspool => format!("burst{max_running}-runspool"),
        Kind::Reference => format!("burst{max_running}-reference"),
    };
    let root = env.fresh_root(&name)?;
    let d = env.start(kind, &root, max_running)?;
    let staging = root.join("staging");
    mkdirs(&staging)?;
    let ids: Vec<String> = (0..n).map(|i| format!("burst-{i:06}")).collect();
    for id in &ids {
        write_private(&staging.join(format!("{id}.json")), &request_body(id))?;
    }
    let spool = root.join("spool");
    let term = terminal_dir(kind, &root);
    let t0 = Instant::now();
    for id in &ids {
        fs::rename(staging.join(format!("{id}.json")), spool.join(format!("{id}.json")))?;
    }
    let deadline = t0 + Duration::from_secs(120 + n as u64 / 5);
    while count_entries(&term) < n {
        if Instant::now() > deadline {
            anyhow::bail!("{name}: only {} of {n} runs ended in time", count_entries(&term));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let secs = t0.elapsed().as_secs_f64();
    let peak_rss_kib = proc_status_kib(d.pid(), "VmHWM:").unwrap_or(0);
    // The last runners exit (and are reaped) just after their terminal marker.
    std::thread::sleep(Duration::from_millis(300));
    let (cpu_d, cpu_c) = proc_cpu_ms(d.pid()).unwrap_or((0.0, 0.0));
    // Spot-check outcomes: every run must have completed.
    for id in [&ids[0], &ids[n / 2], &ids[n - 1]] {
        let s: Value =
            serde_json::from_slice(&fs::read(root.join("async-subagent-runs").join(id).join("status.json"))?)?;
        if s["state"] != "complete" {
            anyhow::bail!("{name}: run {id} ended {}", s["state"]);
        }
    }
    drop(d);
    Ok(BurstResult {
        secs,
        per_s: n as f64 / secs,
        peak_rss_kib,
        cpu_daemon_ms: cpu_d / n as f64,
        cpu_children_ms: cpu_c / n as f64,
    })
}

// ---------------------------------------------------------------------------
// Fabricated runs (idle, scale, start-up)
// ---------------------------------------------------------------------------

/// `n` terminal runs as a runner leaves them (status, terminal marker, result),
/// ended one millisecond apart in the last hour.
fn fabricate_terminal(root: &Path, n: usize) -> anyhow::Result<Vec<String>> {
    let runs = root.join("async-subagent-runs");
    let term = runs.join(".terminal-runs/default");
    let results = root.join("async-subagent-results");
    for d in [root.join("spool"), runs.join(".active-runs"), term.clone(), results.clone()] {
        mkdirs(&d)?;
    }
    let base = runspool::now_ms() - 3_600_000;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("term-{i:07}");
        let ended = base + i as i64;
        let dir = runs.join(&id);
        fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let status = json!({
            "runId": id, "sessionId": "default", "mode": "single", "state": "complete",
            "startedAt": ended - 5, "lastUpdate": ended, "endedAt": ended, "timeoutMs": 1_800_000,
            "exitCode": 0, "pid": 1, "cwd": "/", "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": ended - 6},
            "steps": [{"agent": "bench", "status": "complete", "startedAt": ended - 4, "endedAt": ended,
                       "durationMs": 4, "exitCode": 0, "outputFile": dir.join("output-0.log")}],
        });
        write_private(&dir.join("status.json"), &serde_json::to_vec_pretty(&status)?)?;
        let marker = json!({"version": 1, "runId": id, "sessionId": "default", "endedAt": ended});
        write_private(
            &term.join(runspool::protocol::status::terminal_marker_name(ended, &id)),
            &serde_json::to_vec(&marker)?,
        )?;
        let result = json!({"id": id, "runId": id, "sessionId": "default", "mode": "single", "state": "complete",
            "success": true, "exitCode": 0, "summary": "", "results": [], "durationMs": 5, "timestamp": ended,
            "asyncDir": dir, "cwd": "/"});
        write_private(&results.join(format!("{id}.json")), &serde_json::to_vec(&result)?)?;
        ids.push(id);
    }
    Ok(ids)
}

/// `n` runs in state `running` with active markers; the caller may hold
/// their runner locks to play live runners (liveness is the lock, PROTOCOL §12).
fn fabricate_active(root: &Path, n: usize) -> anyhow::Result<Vec<String>> {
    let runs = root.join("async-subagent-runs");
    mkdirs(&runs.join(".active-runs"))?;
    mkdirs(&root.join("spool"))?;
    let now = runspool::now_ms();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("act-{i:06}");
        let dir = runs.join(&id);
        fs::DirBuilder::new().mode(0o700).create(&dir)?;
        mkdirs(&dir.join("control"))?;
        let status = json!({
            "runId": id, "sessionId": "default", "mode": "single", "state": "running",
            "startedAt": now, "lastUpdate": now, "timeoutMs": 604_800_000u64, "deadlineAt": now + 604_800_000i64,
            "pid": std::process::id(), "cwd": "/", "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": now - 1},
            "steps": [{"agent": "bench", "status": "running", "startedAt": now}],
        });
        write_private(&dir.join("request.json"), &request_body(&id))?;
        write_private(&dir.join("status.json"), &serde_json::to_vec_pretty(&status)?)?;
        write_private(&runs.join(".active-runs").join(&id), b"")?;
        ids.push(id);
    }
    Ok(ids)
}

// ---------------------------------------------------------------------------
// 3. Idle
// ---------------------------------------------------------------------------

struct IdleResult {
    strategy: &'static str,
    runs: usize,
    cpu_ms: f64,
    cpu_pct: f64,
    wakeups_per_s: f64,
    rss_kib: u64,
    threads: usize,
    settle_s: f64,
}

fn idle(env: &Env, secs: u64, runs: usize) -> anyhow::Result<Vec<IdleResult>> {
    let configs: [(&'static str, usize); 4] = [("native", 0), ("native", runs), ("poll", 0), ("poll", runs)];
    let mut roots = Vec::new();
    for (strategy, n) in configs {
        let root = env.fresh_root(&format!("idle-{strategy}-{n}"))?;
        if n > 0 {
            fabricate_terminal(&root, n)?;
        }
        roots.push((strategy, n, root));
    }
    let mut daemons = Vec::new();
    for (strategy, n, root) in roots {
        let t = Instant::now();
        let d = env.start_runspool(&root, 4, strategy)?;
        daemons.push((strategy, n, d, t));
    }
    // Settle: start-up (re-adoption of the fabricated runs) must be over.
    let mut settle = Vec::new();
    for (_, _, d, t) in &daemons {
        let until = Instant::now() + Duration::from_secs(600);
        let mut last = proc_sched(d.pid()).0;
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let now = proc_sched(d.pid()).0;
            if now.saturating_sub(last) < 1_000_000 || Instant::now() > until {
                break;
            }
            last = now;
        }
        settle.push(t.elapsed().as_secs_f64());
    }
    let before: Vec<_> = daemons.iter().map(|(_, _, d, _)| proc_sched(d.pid())).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let wall = t0.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (i, (strategy, n, d, _)) in daemons.iter().enumerate() {
        let after = proc_sched(d.pid());
        let cpu_ns = after.0.saturating_sub(before[i].0);
        out.push(IdleResult {
            strategy,
            runs: *n,
            cpu_ms: cpu_ns as f64 / 1e6,
            cpu_pct: cpu_ns as f64 / 1e9 / wall * 100.0,
            wakeups_per_s: after.1.saturating_sub(before[i].1) as f64 / wall,
            rss_kib: proc_status_kib(d.pid(), "VmRSS:").unwrap_or(0),
            threads: after.3,
            settle_s: settle[i],
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// 4. Scale (CLI) and 5. start-up
// ---------------------------------------------------------------------------

struct CliResult {
    what: String,
    stats: Stats,
    opens: Option<usize>,
}

fn opens_of(bin: &Path, args: &[String]) -> Option<usize> {
    let log = std::env::temp_dir().join(format!("runspool-bench-strace-{}.txt", std::process::id()));
    let st = Command::new("strace")
        .args(["-f", "-qq", "-e", "trace=open,openat,openat2", "-o"])
        .arg(&log)
        .arg(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    let text = fs::read_to_string(&log).ok();
    let _ = fs::remove_file(&log);
    if !st.success() {
        return None;
    }
    // Successful opens only.
    Some(text?.lines().filter(|l| l.contains("open") && !l.contains("= -1")).count())
}

fn time_cli(env: &Env, root: &Path, args: &[&str], calls: usize) -> anyhow::Result<CliResult> {
    time_cli_with(env, root, args, calls, "", &mut || Ok(()))
}

/// `before` runs ahead of each call, outside the timing.
fn time_cli_with(
    env: &Env,
    root: &Path,
    args: &[&str],
    calls: usize,
    note: &str,
    before: &mut dyn FnMut() -> std::io::Result<()>,
) -> anyhow::Result<CliResult> {
    let mut full: Vec<String> = vec!["--root".into(), root.display().to_string()];
    full.extend(args.iter().map(|s| s.to_string()));
    let mut v = Vec::new();
    for i in 0..calls + 1 {
        before()?;
        let t = Instant::now();
        let st = Command::new(&env.runspool)
            .args(&full)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        let d = ms(t.elapsed());
        if !st.success() {
            anyhow::bail!("runspool {} failed ({st})", args.join(" "));
        }
        if i > 0 {
            v.push(d);
        }
    }
    let base = opens_of(&env.runspool, &["--version".to_string()]);
    let opens = opens_of(&env.runspool, &full).zip(base).map(|(a, b)| a.saturating_sub(b));
    Ok(CliResult { what: format!("runspool {}{note}", args.join(" ")), stats: stats(v), opens })
}

fn scale(env: &Env, runs: usize, active: usize, calls: usize) -> anyhow::Result<Vec<CliResult>> {
    let root = env.fresh_root("scale")?;
    let term = fabricate_terminal(&root, runs)?;
    let act = fabricate_active(&root, active)?;
    let mut out = Vec::new();
    // `list --recent` reuses the newest names of a session directory unchanged
    // for 2 s (runspool/recent-cache): measure a quiet index, then one that
    // changed just before each call (a run ended: the full listing).
    let sdir = root.join("async-subagent-runs/.terminal-runs/default");
    std::thread::sleep(Duration::from_millis(3100));
    out.push(time_cli_with(env, &root, &["list", "--recent", "20"], calls, " (quiet index)", &mut || Ok(()))?);
    let touch = sdir.join(".bench-change");
    out.push(time_cli_with(env, &root, &["list", "--recent", "20"], calls, " (index just changed)", &mut || {
        fs::write(&touch, b"")?;
        fs::remove_file(&touch)
    })?);
    out.push(time_cli(env, &root, &["list", "--active"], calls)?);
    if let Some(id) = term.get(runs / 2) {
        out.push(time_cli(env, &root, &["status", id], calls)?);
    }
    if let Some(id) = act.first() {
        out.push(time_cli(env, &root, &["status", id], calls)?);
    }
    // The floor of a full listing, side by side: a process that reads every
    // name of the session directory and sorts none.
    let mut v = Vec::new();
    for i in 0..calls + 1 {
        let t = Instant::now();
        let st = Command::new("ls").arg("-f").arg(&sdir).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
        if !st.success() {
            anyhow::bail!("ls -f {} failed ({st})", sdir.display());
        }
        if i > 0 {
            v.push(ms(t.elapsed()));
        }
    }
    out.push(CliResult {
        what: format!(
            "`ls -f` of the session directory (reads all {runs} names, sorts none: the floor of a full listing)"
        ),
        stats: stats(v),
        opens: None,
    });
    Ok(out)
}

struct AdoptResult {
    terminal: usize,
    active: usize,
    secs: f64,
}

/// Daemon start-up with `active` live runs (their runner locks held by this
/// process) and `terminal` finished runs: from spawn until daemon.json
/// reports every active run as running.
fn adopt(env: &Env, active: usize, terminal: usize) -> anyhow::Result<AdoptResult> {
    let root = env.fresh_root(&format!("adopt-{active}-{terminal}"))?;
    if terminal > 0 {
        fabricate_terminal(&root, terminal)?;
    }
    let ids = fabricate_active(&root, active)?;
    let runs = root.join("async-subagent-runs");
    let locks: Vec<File> = ids
        .iter()
        .map(|id| {
            fsutil::lock(&runs.join(id).join("runner.lock"), true)?.ok_or_else(|| std::io::Error::other("lock busy"))
        })
        .collect::<std::io::Result<_>>()?;
    let dj = root.join("runspool/daemon.json");
    let t0 = Instant::now();
    let d = env.start_runspool(&root, 4, "native")?;
    wait_for("re-adoption", Duration::from_secs(600), || {
        fs::read(&dj)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["runs"]["running"].as_u64() == Some(active as u64))
    })?;
    let secs = t0.elapsed().as_secs_f64();
    drop(d); // stop the daemon before the "runners" die, or it would repair them
    drop(locks);
    Ok(AdoptResult { terminal, active, secs })
}

// ---------------------------------------------------------------------------
// 6. pueue side by side (--pueue)
//
// pueue is a task queue with a daemon (`pueued`) and a client (`pueue add`),
// the nearest existing tool to runspool. A private pueued per test, with its
// own config, data and runtime directories under the bench's temp root, so the
// user's own pueue (if any) is never touched.
// ---------------------------------------------------------------------------

/// The pueue binaries under comparison.
struct PueueTools {
    pueue: PathBuf,
    pueued: PathBuf,
    version: String,
    /// Seconds `cargo install` took when the benchmark installed pueue itself.
    install_secs: Option<f64>,
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

fn pueue_tools(version: &str) -> anyhow::Result<PueueTools> {
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

struct PueueBurst {
    parallel: usize,
    n: usize,
    secs: f64,
    add_secs: f64,
    per_s: f64,
    peak_rss_kib: u64,
}

/// `n` trivial tasks added one after another with `pueue add -- true` (each add
/// returns once the daemon has the task); the clock runs from the first add
/// until `pueue status --json` (polled every 100 ms, or n/5 ms for large n:
/// the answer grows with n) shows all of them done.
fn pueue_burst(env: &Env, tools: &PueueTools, n: usize, parallel: usize, keep: bool) -> anyhow::Result<PueueBurst> {
    let d = Pueued::start(tools, env.fresh_root(&format!("pueue-burst{parallel}"))?, parallel, keep)?;
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
    let peak_rss_kib = proc_status_kib(d.pid(), "VmHWM:").unwrap_or(0);
    Ok(PueueBurst { parallel, n, secs, add_secs, per_s: n as f64 / secs, peak_rss_kib })
}

struct PueueLatency {
    added: Stats,
    started: Stats,
    done: Stats,
}

/// One task at a time: the clock starts just before `pueue add` is spawned
/// (the client is pueue's interface, as the rename is runspool's). Marks:
/// `pueue add` returned; the task's command ran (it truncates a file of its
/// own, seen by inotify with a 2 ms poll as a safety net); `pueue status
/// --json` (polled every 5 ms from then on) shows it done. 3 warm-up tasks
/// are not counted.
fn pueue_latency(env: &Env, tools: &PueueTools, n: usize, keep: bool) -> anyhow::Result<PueueLatency> {
    let dir = env.fresh_root("pueue-latency")?;
    let marks = dir.join("marks");
    mkdirs(&marks)?;
    let (tx, rx) = channel();
    let mut watcher = notify::recommended_watcher(move |_r: notify::Result<notify::Event>| {
        let _ = tx.send(());
    })?;
    watcher.watch(&marks, RecursiveMode::NonRecursive)?;
    let d = Pueued::start(tools, dir.join("pueue"), 2, keep)?;
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
    Ok(PueueLatency { added: stats(added), started: stats(started), done: stats(done) })
}

// ---------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------

fn fs_type(p: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(p)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Median time to create an empty file in a fresh directory under `base`
/// (the shape of a run directory), to explain disk numbers.
fn create_cost_us(base: &Path) -> anyhow::Result<f64> {
    let probe = base.join("create-probe");
    mkdirs(&probe)?;
    let mut per_file = Vec::new();
    for d in 0..20 {
        let dir = probe.join(d.to_string());
        let t = Instant::now();
        fs::create_dir(&dir)?;
        for f in 0..8 {
            fs::File::create(dir.join(f.to_string()))?;
        }
        per_file.push(t.elapsed().as_secs_f64() * 1e6 / 9.0);
    }
    fs::remove_dir_all(&probe)?;
    per_file.sort_by(f64::total_cmp);
    Ok(per_file[per_file.len() / 2])
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "holds"
    } else {
        "MISSED"
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let runspool = args.runspool.clone().unwrap_or_else(|| me.with_file_name("runspool"));
    if !runspool.exists() {
        anyhow::bail!("{} not found; build it (cargo build --release) or pass --runspool", runspool.display());
    }
    // Native watching (runspool's, the reference's, the observer's) needs inotify instances.
    if let Ok(v) = fs::read_to_string("/proc/sys/fs/inotify/max_user_instances") {
        if v.trim().parse::<u64>().is_ok_and(|n| n < 16) {
            anyhow::bail!(
                "fs.inotify.max_user_instances is {}; raise it (sysctl fs.inotify.max_user_instances=128) first",
                v.trim()
            );
        }
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    mkdirs(&parent)?;
    let base = parent.join(format!("runspool-bench-{}", std::process::id()));
    mkdirs(&base)?;
    let label = args.label.clone().unwrap_or_else(|| fs_type(&parent));
    let env = Env { runspool, me, base: base.clone(), seq: std::cell::Cell::new(0) };
    let has = |p: &str| args.phases.iter().any(|x| x == p);
    let mut report = String::new();
    let mut js = json!({"label": label, "dir": parent.display().to_string(), "fs": fs_type(&parent)});
    let mut targets: Vec<(String, String, bool)> = Vec::new();
    let r = (|| -> anyhow::Result<()> {
        report += &format!("## runspool-bench: {label} ({} under {})\n\n", fs_type(&parent), parent.display());
        let create_us = create_cost_us(&base)?;
        report += &format!(
            "File creation here: {create_us:.0} µs per empty file (median of 20 directories of 8 files). \
             On ext4 this varies up to 100× between directories of one filesystem, and runspool \
             creates more files per run than the reference, so read disk ratios with it.\n\n"
        );
        js["create_us"] = json!(create_us);
        let pueue = if args.pueue { Some(pueue_tools(&args.pueue_version)?) } else { None };
        if let Some(t) = &pueue {
            let how = match t.install_secs {
                Some(s) => format!(
                    "installed by the benchmark (`cargo install pueue --version {} --locked`, {s:.0} s)",
                    args.pueue_version
                ),
                None => "already installed".into(),
            };
            report += &format!("pueue side by side: pueue {} ({how}), a private `pueued` per test.\n\n", t.version);
            js["pueue"] = json!({"version": t.version, "install_secs": t.install_secs});
        }
        if has("latency") {
            eprintln!("latency: {} requests per pipeline, one at a time ...", args.latency_n);
            let (rs, rf) = latency(&env, args.latency_n)?;
            report += &format!("### Latency, one request at a time (n = {}, ms)\n\n", rs.claimed.n);
            report += "| drop → | runspool p50 | p90 | p99 | max | reference p50 | p90 | p99 | max | ratio p50 | ratio p99 |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
            let mut jl = serde_json::Map::new();
            for (name, a, b) in [
                ("claimed", rs.claimed, rf.claimed),
                ("runner started", rs.started, rf.started),
                ("step started", rs.step, rf.step),
                ("terminal status", rs.terminal, rf.terminal),
            ] {
                report +=
                    &format!(
                    "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}× | {:.2}× |\n",
                    a.p50, a.p90, a.p99, a.max, b.p50, b.p90, b.p99, b.max, a.p50 / b.p50, a.p99 / b.p99
                );
                jl.insert(name.into(), json!({"runspool": stats_json(&a), "reference": stats_json(&b)}));
            }
            report += "\n";
            js["latency"] = Value::Object(jl);
            let (r50, r99) = (rs.started.p50 / rf.started.p50, rs.started.p99 / rf.started.p99);
            targets.push(("drop→runner started p50 ≤ 1.5× reference".into(), format!("{r50:.2}×"), r50 <= 1.5));
            targets.push(("drop→runner started p99 ≤ 3× reference".into(), format!("{r99:.2}×"), r99 <= 3.0));
            if let Some(t) = &pueue {
                eprintln!("latency: {} tasks through pueue, one at a time ...", args.pueue_latency_n);
                let pl = pueue_latency(&env, t, args.pueue_latency_n, args.keep)?;
                report += &format!(
                    "### pueue side by side: latency, one task at a time (pueue n = {}, runspool n = {}, ms)\n\n",
                    pl.done.n, rs.started.n
                );
                report += "| mark (runspool: drop →; pueue: `pueue add` spawned →) | runspool p50 | p90 | p99 | max | pueue p50 | p90 | p99 | max | runspool / pueue p50 | p99 |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
                let na = Stats { p50: f64::NAN, p90: f64::NAN, p99: f64::NAN, max: f64::NAN, n: 0 };
                let cell = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "–".into() };
                let mut jp = serde_json::Map::new();
                for (name, a, b) in [
                    ("accepted (runspool: claimed; pueue: `pueue add` returned)", rs.claimed, pl.added),
                    ("runner started (pueue: no such stage)", rs.started, na),
                    ("step started (pueue: the task's command ran)", rs.step, pl.started),
                    ("terminal (pueue: `pueue status` shows it done)", rs.terminal, pl.done),
                ] {
                    let (r50, r99) = (a.p50 / b.p50, a.p99 / b.p99);
                    let ratio = |r: f64| if r.is_finite() { format!("{r:.3}×") } else { "–".into() };
                    report += &format!(
                        "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                        cell(a.p50),
                        cell(a.p90),
                        cell(a.p99),
                        cell(a.max),
                        cell(b.p50),
                        cell(b.p90),
                        cell(b.p99),
                        cell(b.max),
                        ratio(r50),
                        ratio(r99)
                    );
                    if b.n > 0 {
                        jp.insert(
                            name.split(" (").next().unwrap_or(name).into(),
                            json!({"runspool": stats_json(&a), "pueue": stats_json(&b),
                            "ratio_runspool_over_pueue_p50": r50, "ratio_runspool_over_pueue_p99": r99}),
                        );
                    }
                }
                report += "\n";
                js["pueue"]["latency"] = Value::Object(jp);
            }
        }
        if has("burst") {
            report += &format!("### Burst of {} runs dropped at once\n\n", args.burst_n);
            report += "| max_running | runspool s | runs/s | daemon peak RSS MiB | CPU ms/run, daemon + runners | reference s | runs/s | peak RSS MiB | CPU ms/run | throughput ratio | ratio per round |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
            let mut jb = Vec::new();
            let mut pueue_rows: Vec<(PueueBurst, f64, f64, Vec<String>)> = Vec::new();
            for &p in &args.parallel {
                let (mut rss, mut rfs, mut pbs) = (Vec::new(), Vec::new(), Vec::new());
                for k in 0..args.burst_repeat.max(1) {
                    eprintln!("burst: {} runs at max_running {p} (round {}) ...", args.burst_n, k + 1);
                    // Alternate which pipeline goes first so drift hits both alike.
                    if k % 2 == 0 {
                        rfs.push(burst(&env, Kind::Reference, args.burst_n, p)?);
                        rss.push(burst(&env, Kind::Runspool, args.burst_n, p)?);
                    } else {
                        rss.push(burst(&env, Kind::Runspool, args.burst_n, p)?);
                        rfs.push(burst(&env, Kind::Reference, args.burst_n, p)?);
                    }
                    // pueue in the same round, so it shares the round's load.
                    if let Some(t) = &pueue {
                        eprintln!(
                            "burst: {} tasks through pueue at parallel {p} (round {}) ...",
                            args.pueue_burst_n,
                            k + 1
                        );
                        pbs.push(pueue_burst(&env, t, args.pueue_burst_n, p, args.keep)?);
                    }
                }
                let pueue_rounds: Vec<String> =
                    rss.iter().zip(&pbs).map(|(a, b)| format!("{:.1}", a.per_s / b.per_s)).collect();
                let rounds: Vec<String> =
                    rss.iter().zip(&rfs).map(|(a, b)| format!("{:.2}", a.per_s / b.per_s)).collect();
                let (rs, rf) = (median_burst(rss), median_burst(rfs));
                let ratio = rs.per_s / rf.per_s;
                report += &format!(
                    "| {p} | {:.2} | {:.1} | {:.1} | {:.2} + {:.2} | {:.2} | {:.1} | {:.1} | {:.2} + {:.2} | {ratio:.2}× | {} |\n",
                    rs.secs,
                    rs.per_s,
                    rs.peak_rss_kib as f64 / 1024.0,
                    rs.cpu_daemon_ms,
                    rs.cpu_children_ms,
                    rf.secs,
                    rf.per_s,
                    rf.peak_rss_kib as f64 / 1024.0,
                    rf.cpu_daemon_ms,
                    rf.cpu_children_ms,
                    rounds.join(", ")
                );
                jb.push(json!({"max_running": p, "n": args.burst_n, "rounds": args.burst_repeat.max(1), "round_ratios": rounds,
                    "runspool": {"secs": rs.secs, "runs_per_s": rs.per_s, "peak_rss_kib": rs.peak_rss_kib,
                        "cpu_ms_per_run": {"daemon": rs.cpu_daemon_ms, "children": rs.cpu_children_ms}},
                    "reference": {"secs": rf.secs, "runs_per_s": rf.per_s, "peak_rss_kib": rf.peak_rss_kib,
                        "cpu_ms_per_run": {"daemon": rf.cpu_daemon_ms, "children": rf.cpu_children_ms}}}));
                targets.push((
                    format!("burst throughput at max_running {p} ≥ 0.7× reference"),
                    format!("{ratio:.2}×"),
                    ratio >= 0.7,
                ));
                if !pbs.is_empty() {
                    // The round with the median throughput, as for the other two.
                    pbs.sort_by(|a, b| a.per_s.partial_cmp(&b.per_s).unwrap());
                    let pb = pbs.swap_remove(pbs.len() / 2);
                    pueue_rows.push((pb, rs.per_s, rf.per_s, pueue_rounds));
                }
            }
            report += "\n";
            js["burst"] = json!(jb);
            if !pueue_rows.is_empty() {
                report += &format!(
                    "### pueue side by side: burst ({} tasks `pueue add -- true` for pueue, {} runs for runspool; runs/s compared)\n\n",
                    args.pueue_burst_n, args.burst_n
                );
                report += "| max_running = pueue parallel | runspool runs/s | reference runs/s | pueue s | of it adding s | pueue tasks/s | pueued peak RSS MiB | runspool / pueue | reference / pueue | runspool / pueue per round |\n|---|---|---|---|---|---|---|---|---|---|\n";
                let mut jpb = Vec::new();
                for (pb, rs_per_s, rf_per_s, pueue_rounds) in &pueue_rows {
                    let (ratio, ref_ratio) = (rs_per_s / pb.per_s, rf_per_s / pb.per_s);
                    report += &format!(
                        "| {} | {rs_per_s:.1} | {rf_per_s:.1} | {:.2} | {:.2} | {:.2} | {:.1} | {ratio:.1}× | {ref_ratio:.1}× | {} |\n",
                        pb.parallel,
                        pb.secs,
                        pb.add_secs,
                        pb.per_s,
                        pb.peak_rss_kib as f64 / 1024.0,
                        pueue_rounds.join(", ")
                    );
                    jpb.push(json!({"parallel": pb.parallel, "n": pb.n, "rounds": pueue_rounds.len(), "round_ratios": pueue_rounds, "secs": pb.secs, "add_secs": pb.add_secs, "tasks_per_s": pb.per_s,
                        "peak_rss_kib": pb.peak_rss_kib, "runspool_runs_per_s": rs_per_s, "reference_runs_per_s": rf_per_s,
                        "ratio_runspool_over_pueue": ratio, "ratio_reference_over_pueue": ref_ratio}));
                    targets.push((
                        format!("burst throughput at max_running {} ≥ 30× pueue", pb.parallel),
                        format!("{ratio:.1}×"),
                        ratio >= 30.0,
                    ));
                }
                report += "\n";
                js["pueue"]["burst"] = json!(jpb);
            }
        }
        if has("idle") {
            eprintln!(
                "idle: 4 daemons for {} s (fabricating {} terminal runs twice first) ...",
                args.idle_secs, args.runs
            );
            let res = idle(&env, args.idle_secs, args.runs)?;
            report += &format!("### Idle daemon over {} s (from /proc)\n\n", args.idle_secs);
            report += "| watch | terminal runs | CPU ms | CPU % | wakeups/s | RSS MiB | threads |\n|---|---|---|---|---|---|---|\n";
            let mut ji = Vec::new();
            for r in &res {
                report += &format!(
                    "| {} | {} | {:.2} | {:.4} | {:.2} | {:.1} | {} |\n",
                    r.strategy,
                    r.runs,
                    r.cpu_ms,
                    r.cpu_pct,
                    r.wakeups_per_s,
                    r.rss_kib as f64 / 1024.0,
                    r.threads
                );
                ji.push(json!({"strategy": r.strategy, "terminal_runs": r.runs, "settle_s": r.settle_s, "cpu_ms": r.cpu_ms,
                    "cpu_pct": r.cpu_pct, "wakeups_per_s": r.wakeups_per_s, "rss_kib": r.rss_kib, "threads": r.threads}));
                if r.strategy == "native" {
                    targets.push((
                        format!("idle native, {} runs: ≤ 1 wakeup/s", r.runs),
                        format!("{:.2}/s", r.wakeups_per_s),
                        r.wakeups_per_s <= 1.0,
                    ));
                    targets.push((
                        format!("idle native, {} runs: CPU ≤ 0.01%", r.runs),
                        format!("{:.4}%", r.cpu_pct),
                        r.cpu_pct <= 0.01,
                    ));
                    let (limit, what) = if r.runs == 0 { (15.0, "≤ 15 MiB") } else { (40.0, "≤ 40 MiB") };
                    let mib = r.rss_kib as f64 / 1024.0;
                    targets.push((
                        format!("idle RSS with {} runs {what}", r.runs),
                        format!("{mib:.1} MiB"),
                        mib <= limit,
                    ));
                }
            }
            report += "\n";
            js["idle"] = json!(ji);
        }
        if has("scale") {
            eprintln!("scale: {} terminal + {} active runs ...", args.runs, args.active);
            let res = scale(&env, args.runs, args.active, args.calls)?;
            report += &format!(
                "### CLI with {} terminal runs and {} active runs stored ({} calls each)\n\n",
                args.runs, args.active, args.calls
            );
            report +=
                "| command | p50 ms | p90 ms | max ms | files opened (beyond `--version`) |\n|---|---|---|---|---|\n";
            let mut jc = Vec::new();
            for (i, r) in res.iter().enumerate() {
                let opens = r.opens.map(|o| o.to_string()).unwrap_or_else(|| "n/a".into());
                let what = if r.what.contains('`') { r.what.clone() } else { format!("`{}`", r.what) };
                report +=
                    &format!("| {what} | {:.1} | {:.1} | {:.1} | {opens} |\n", r.stats.p50, r.stats.p90, r.stats.max);
                jc.push(json!({"command": r.what, "stats": stats_json(&r.stats), "opens": r.opens}));
                let o = r.opens.map(|o| o <= 60).unwrap_or(true);
                let target = match i {
                    0 => Some(("`list --recent 20` ≤ 50 ms, O(20) files (quiet index)", 50.0)),
                    3 => Some(("`status ID` ≤ 20 ms", 20.0)),
                    _ => None,
                };
                if let Some((what, limit_ms)) = target {
                    let opens = r.opens.map(|o| o.to_string()).unwrap_or("?".into());
                    targets.push((
                        what.into(),
                        format!("{:.1} ms, {opens} files", r.stats.p50),
                        r.stats.p50 <= limit_ms && o,
                    ));
                }
            }
            report += "\n";
            js["scale"] = json!(jc);
        }
        if has("adopt") {
            let mut ja = Vec::new();
            report += "### Daemon start-up (re-adoption of live runs)\n\n| active runs | terminal runs | spawn → all re-adopted s |\n|---|---|---|\n";
            for terminal in [0, args.runs] {
                eprintln!("start-up: {} active + {terminal} terminal runs ...", args.active);
                let r = adopt(&env, args.active, terminal)?;
                report += &format!("| {} | {} | {:.3} |\n", r.active, r.terminal, r.secs);
                ja.push(json!({"active": r.active, "terminal": r.terminal, "secs": r.secs}));
                targets.push((
                    format!("re-adoption of {} active runs ({} terminal) ≤ 2 s", r.active, r.terminal),
                    format!("{:.3} s", r.secs),
                    r.secs <= 2.0,
                ));
            }
            report += "\n";
            js["adopt"] = json!(ja);
        }
        Ok(())
    })();
    if !targets.is_empty() {
        report += "### Targets\n\n| target | measured | verdict |\n|---|---|---|\n";
        for (t, m, ok) in &targets {
            report += &format!("| {t} | {m} | {} |\n", verdict(*ok));
        }
        js["targets"] = json!(targets
            .iter()
            .map(|(t, m, ok)| json!({"target": t, "measured": m, "holds": ok}))
            .collect::<Vec<_>>());
    }
    print!("{report}");
    std::io::stdout().flush()?;
    if let Some(out) = &args.out {
        fs::write(out, serde_json::to_vec_pretty(&js)?)?;
    }
    if args.keep || r.is_err() {
        eprintln!("kept {} for inspection", base.display());
    } else {
        let _ = fs::remove_dir_all(&base);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

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
