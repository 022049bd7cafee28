//! The report: every phase's typed results, gathered as the phases finish,
//! and the targets derived from them. `markdown` and `json` render it, once,
//! at the end (also after a failed phase: what finished is reported).

pub mod json;
pub mod markdown;

use crate::phases::adopt::AdoptResult;
use crate::phases::backlog::BacklogResult;
use crate::phases::bridge::BridgeResult;
use crate::phases::burst::BurstRow;
use crate::phases::idle::IdleResult;
use crate::phases::latency::{Latency, LatencyResult};
use crate::phases::scale::CliResult;
use crate::pueue::PueueLatency;
use crate::stats::Stats;

/// Everything measured in one run of the benchmark.
#[derive(Debug, Default)]
pub struct Report {
    pub label: String,
    /// The directory the temporary roots were made under (`--dir`).
    pub dir: String,
    /// Its file system type.
    pub fs: String,
    /// Median µs to create an empty file there.
    pub create_us: Option<f64>,
    pub pueue: Option<PueueInfo>,
    pub latency: Option<Latency>,
    pub pueue_latency: Option<PueueLatency>,
    pub burst: Option<BurstPhase>,
    pub idle: Option<IdlePhase>,
    pub scale: Option<ScalePhase>,
    /// Start-up rows, added as each is measured.
    pub adopt: Option<Vec<AdoptResult>>,
    pub backlog: Option<BacklogResult>,
    pub bridge: Option<BridgeResult>,
}

/// The pueue under comparison (`--pueue`).
#[derive(Clone, Debug)]
pub struct PueueInfo {
    pub version: String,
    /// Seconds `cargo install` took, when the benchmark installed it.
    pub install_secs: Option<f64>,
    /// The version `cargo install` asked for (`--pueue-version`).
    pub requested_version: String,
}

#[derive(Clone, Debug)]
pub struct BurstPhase {
    /// Runs per burst.
    pub n: usize,
    /// Tasks per pueue burst.
    pub pueue_n: usize,
    /// One row per max_running, added as each is measured.
    pub rows: Vec<BurstRow>,
}

#[derive(Clone, Debug)]
pub struct IdlePhase {
    pub secs: u64,
    pub rows: Vec<IdleResult>,
}

#[derive(Clone, Debug)]
pub struct ScalePhase {
    pub runs: usize,
    pub active: usize,
    pub calls: usize,
    /// In the order of `phases::scale::measure`.
    pub rows: Vec<CliResult>,
}

/// One target of docs/performance.md and whether it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    pub target: String,
    pub measured: String,
    pub holds: bool,
}

fn target(target: impl Into<String>, measured: String, holds: bool) -> Target {
    Target { target: target.into(), measured, holds }
}

/// The latency marks in report order: name, runspool, reference.
pub fn latency_marks(l: &Latency) -> [(&'static str, Stats, Stats); 4] {
    let (a, b) = (&l.runspool, &l.reference);
    [
        ("claimed", a.claimed, b.claimed),
        ("runner started", a.started, b.started),
        ("step started", a.step, b.step),
        ("terminal status", a.terminal, b.terminal),
    ]
}

/// runspool's latency marks against pueue's nearest ones (pueue has no
/// runner stage); the JSON key is the name up to " (".
pub fn pueue_latency_marks(rs: &LatencyResult, pl: &PueueLatency) -> [(&'static str, Stats, Stats); 4] {
    [
        ("accepted (runspool: claimed; pueue: `pueue add` returned)", rs.claimed, pl.added),
        ("runner started (pueue: no such stage)", rs.started, Stats::NONE),
        ("step started (pueue: the task's command ran)", rs.step, pl.started),
        ("terminal (pueue: `pueue status` shows it done)", rs.terminal, pl.done),
    ]
}

impl BurstRow {
    /// runspool / reference throughput of the median rounds.
    pub fn ratio(&self) -> f64 {
        self.runspool.per_s / self.reference.per_s
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Issue 23's targets, each with its measured value (and the reference's
/// beside it), in the order of the report's summary table.
pub fn summary(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    if let Some(b) = &r.burst {
        for row in &b.rows {
            let (p, ratio) = (row.max_running, row.ratio());
            t.push(target(
                format!("burst throughput at max_running {p} ≥ 0.8× reference"),
                format!("{ratio:.2}× ({:.0} vs {:.0} runs/s)", row.runspool.per_s, row.reference.per_s),
                ratio >= 0.8,
            ));
        }
    }
    if let Some(l) = &r.latency {
        let (a, b) = (l.runspool.terminal.p50, l.reference.terminal.p50);
        let ratio = a / b;
        t.push(target(
            "closed loop: drop→terminal status p50 ≤ 1.3× reference",
            format!("{ratio:.2}× ({a:.2} vs {b:.2} ms)"),
            ratio <= 1.3,
        ));
    }
    if let Some(b) = &r.backlog {
        let (rs, rf) = (&b.runspool, &b.reference);
        let peak = mib(rs.peak_rss_kib);
        t.push(target(
            format!("backlog of {} (max_running {}): daemon peak RSS ≤ 20 MiB", b.n, b.max_running),
            format!("{peak:.1} MiB (reference {:.1} MiB)", mib(rf.peak_rss_kib)),
            peak <= 20.0,
        ));
        let after = mib(rs.after_rss_kib);
        t.push(target(
            format!("backlog of {}: daemon RSS once drained ≤ 10 MiB", b.n),
            format!(
                "{after:.1} MiB (fresh daemon on the drained root {:.1} MiB, reference {:.1} MiB)",
                mib(b.fresh_rss_kib),
                mib(rf.after_rss_kib)
            ),
            after <= 10.0,
        ));
    }
    if let Some(b) = &r.bridge {
        let (a, f) = (b.runspool.start.p50, b.reference.start.p50);
        t.push(target(
            "bridge: runner's request → provider start p50 ≤ 50 ms",
            format!("{a:.1} ms ({:.1}× reference, {f:.1} ms)", a / f),
            a <= 50.0,
        ));
    }
    if let Some(idle) = &r.idle {
        for row in idle.rows.iter().filter(|r| r.strategy == "native") {
            t.push(target(
                format!("idle native, {} runs: ≤ 1 wakeup/s", row.runs),
                format!("{:.2}/s", row.wakeups_per_s),
                row.wakeups_per_s <= 1.0,
            ));
        }
    }
    t
}

/// The targets in report order.
pub fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    if let Some(l) = &r.latency {
        let (rs, rf) = (&l.runspool, &l.reference);
        let (r50, r99) = (rs.started.p50 / rf.started.p50, rs.started.p99 / rf.started.p99);
        t.push(target("drop→runner started p50 ≤ 1.5× reference", format!("{r50:.2}×"), r50 <= 1.5));
        t.push(target("drop→runner started p99 ≤ 3× reference", format!("{r99:.2}×"), r99 <= 3.0));
    }
    if let Some(b) = &r.burst {
        for row in &b.rows {
            let (p, ratio) = (row.max_running, row.ratio());
            t.push(target(
                format!("burst throughput at max_running {p} ≥ 0.7× reference"),
                format!("{ratio:.2}×"),
                ratio >= 0.7,
            ));
        }
        for (row, pb) in b.rows.iter().filter_map(|row| Some((row, row.pueue.as_ref()?))) {
            let ratio = row.runspool.per_s / pb.median.per_s;
            t.push(target(
                format!("burst throughput at max_running {} ≥ 30× pueue", pb.median.parallel),
                format!("{ratio:.1}×"),
                ratio >= 30.0,
            ));
        }
    }
    if let Some(idle) = &r.idle {
        idle_targets(&idle.rows, &mut t);
    }
    if let Some(s) = &r.scale {
        scale_targets(&s.rows, &mut t);
    }
    for a in r.adopt.iter().flatten() {
        t.push(target(
            format!("re-adoption of {} active runs ({} terminal) ≤ 2 s", a.active, a.terminal),
            format!("{:.3} s", a.secs),
            a.secs <= 2.0,
        ));
    }
    t
}

fn idle_targets(rows: &[IdleResult], t: &mut Vec<Target>) {
    for r in rows.iter().filter(|r| r.strategy == "native") {
        t.push(target(
            format!("idle native, {} runs: ≤ 1 wakeup/s", r.runs),
            format!("{:.2}/s", r.wakeups_per_s),
            r.wakeups_per_s <= 1.0,
        ));
        t.push(target(
            format!("idle native, {} runs: CPU ≤ 0.01%", r.runs),
            format!("{:.4}%", r.cpu_pct),
            r.cpu_pct <= 0.01,
        ));
        let (limit, what) = if r.runs == 0 { (15.0, "≤ 15 MiB") } else { (40.0, "≤ 40 MiB") };
        let mib = r.rss_kib as f64 / 1024.0;
        t.push(target(format!("idle RSS with {} runs {what}", r.runs), format!("{mib:.1} MiB"), mib <= limit));
    }
}

/// Row 0 is `list --recent 20` on a quiet index, row 3 `status` of a
/// terminal run (of the next stored kind when there are none, as before).
fn scale_targets(rows: &[CliResult], t: &mut Vec<Target>) {
    for (i, r) in rows.iter().enumerate() {
        let limit = match i {
            0 => Some(("`list --recent 20` ≤ 50 ms, O(20) files (quiet index)", 50.0)),
            3 => Some(("`status ID` ≤ 20 ms", 20.0)),
            _ => None,
        };
        if let Some((what, limit_ms)) = limit {
            let few_files = r.opens.map(|o| o <= 60).unwrap_or(true);
            let opens = r.opens.map(|o| o.to_string()).unwrap_or("?".into());
            t.push(target(what, format!("{:.1} ms, {opens} files", r.stats.p50), r.stats.p50 <= limit_ms && few_files));
        }
    }
}

#[cfg(test)]
mod tests;
