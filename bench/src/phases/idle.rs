//! Phase 3, idle: four runspool daemons (native and poll watching, with 0
//! and `runs` terminal runs) measured from /proc over the same window.

use std::time::{Duration, Instant};

use crate::fabricate;
use crate::pipelines::{Daemon, Env};
use crate::procfs;

/// One idle daemon over the window.
#[derive(Clone, Copy, Debug)]
pub struct IdleResult {
    pub strategy: &'static str,
    pub runs: usize,
    pub cpu_ms: f64,
    pub cpu_pct: f64,
    pub wakeups_per_s: f64,
    pub rss_kib: u64,
    pub threads: usize,
    /// Seconds from spawn until start-up work was over.
    pub settle_s: f64,
}

/// Seconds from `started` until `d` spends under 1 ms of CPU per 500 ms
/// (start-up, the re-adoption of fabricated runs, is over), at most 600 s.
pub fn settle(d: &Daemon, started: Instant) -> f64 {
    let until = Instant::now() + Duration::from_secs(600);
    let mut last = procfs::sched(d.pid()).cpu_ns;
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = procfs::sched(d.pid()).cpu_ns;
        if now.saturating_sub(last) < 1_000_000 || Instant::now() > until {
            break;
        }
        last = now;
    }
    started.elapsed().as_secs_f64()
}

/// All four daemons at once, idle for `secs` after each has settled.
pub fn measure(env: &Env, secs: u64, runs: usize) -> anyhow::Result<Vec<IdleResult>> {
    let configs: [(&'static str, usize); 4] = [("native", 0), ("native", runs), ("poll", 0), ("poll", runs)];
    let mut roots = Vec::new();
    for (strategy, n) in configs {
        let root = env.fresh_root(&format!("idle-{strategy}-{n}"))?;
        if n > 0 {
            fabricate::terminal(&root, n)?;
        }
        roots.push((strategy, n, root));
    }
    let mut daemons = Vec::new();
    for (strategy, n, root) in roots {
        let t = Instant::now();
        let d = env.start_runspool(&root, 4, strategy)?;
        daemons.push((strategy, n, d, t));
    }
    let settled: Vec<f64> = daemons.iter().map(|(_, _, d, t)| settle(d, *t)).collect();
    let before: Vec<_> = daemons.iter().map(|(_, _, d, _)| procfs::sched(d.pid())).collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let wall = t0.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (i, (strategy, n, d, _)) in daemons.iter().enumerate() {
        let after = procfs::sched(d.pid());
        let cpu_ns = after.cpu_ns.saturating_sub(before[i].cpu_ns);
        out.push(IdleResult {
            strategy,
            runs: *n,
            cpu_ms: cpu_ns as f64 / 1e6,
            cpu_pct: cpu_ns as f64 / 1e9 / wall * 100.0,
            wakeups_per_s: after.slices.saturating_sub(before[i].slices) as f64 / wall,
            rss_kib: procfs::status_kib(d.pid(), "VmRSS:").unwrap_or(0),
            threads: after.threads,
            settle_s: settled[i],
        });
    }
    Ok(out)
}
