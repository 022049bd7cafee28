//! Phase 1, latency: one request at a time through both pipelines.

use std::fs;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use notify::{RecursiveMode, Watcher};
use serde_json::Value;

use crate::pipelines::{done_marker, drop_request, Daemon, Env, Kind};
use crate::stats::{ms, Stats};

/// When the observer first saw each stage of one run, from its drop.
#[derive(Default, Clone, Copy)]
struct Marks {
    claimed: Option<Duration>,
    started: Option<Duration>,
    step: Option<Duration>,
    terminal: Option<Duration>,
}

impl Marks {
    /// Record what `status.json`'s state (and the events file) show at `now`:
    /// a later stage implies the earlier ones.
    fn saw(&mut self, dir: &Path, now: Duration) -> anyhow::Result<()> {
        let state = fs::read(dir.join("status.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v.get("state").and_then(Value::as_str).map(String::from));
        match state.as_deref() {
            Some("queued") => {
                self.claimed.get_or_insert(now);
            }
            Some("running") => {
                self.claimed.get_or_insert(now);
                self.started.get_or_insert(now);
            }
            Some(s) => {
                self.claimed.get_or_insert(now);
                self.started.get_or_insert(now);
                self.step.get_or_insert(now);
                self.terminal.get_or_insert(now);
                if s != "complete" {
                    anyhow::bail!("{} ended {s}", dir.display());
                }
            }
            None => {}
        }
        if self.step.is_none() {
            if let Ok(ev) = fs::read_to_string(dir.join("events.jsonl")) {
                if ev.contains("subagent.step.started") {
                    self.claimed.get_or_insert(now);
                    self.started.get_or_insert(now);
                    self.step = Some(now);
                }
            }
        }
        Ok(())
    }
}

struct Observer {
    watcher: notify::RecommendedWatcher,
    rx: Receiver<()>,
}

impl Observer {
    fn new(runs: &Path) -> anyhow::Result<Observer> {
        let (tx, rx) = channel();
        let mut watcher = notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
            if crate::fsops::is_change(&r) {
                let _ = tx.send(());
            }
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
                m.saw(dir, now)?;
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

/// Drop → each stage, for one pipeline.
#[derive(Clone, Copy, Debug)]
pub struct LatencyResult {
    pub claimed: Stats,
    pub started: Stats,
    pub step: Stats,
    pub terminal: Stats,
}

impl LatencyResult {
    fn of(marks: &[Marks]) -> LatencyResult {
        let col = |f: &dyn Fn(&Marks) -> Option<Duration>| {
            Stats::of(marks.iter().map(|m| f(m).map(ms).unwrap_or(f64::NAN)).collect())
        };
        LatencyResult {
            claimed: col(&|m| m.claimed),
            started: col(&|m| m.started),
            step: col(&|m| m.step),
            terminal: col(&|m| m.terminal),
        }
    }
}

/// The latency phase's result: both pipelines side by side.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub runspool: LatencyResult,
    pub reference: LatencyResult,
}

/// `n` requests per pipeline, one at a time.
pub fn measure(env: &Env, n: usize) -> anyhow::Result<Latency> {
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
    Ok(Latency { runspool: LatencyResult::of(&marks[0]), reference: LatencyResult::of(&marks[1]) })
}
