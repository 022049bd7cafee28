//! The report as JSON (`--out FILE`): the same results as the Markdown, raw.
//! The structs below are the file's schema, field order included.

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde::Serialize as DeriveSerialize;

use super::{latency_marks, pueue_latency_marks, summary, targets, Report, Target};
use crate::stats::Stats;

/// Name → value pairs as a JSON object, in this order.
struct Ordered<T>(Vec<(&'static str, T)>);

impl<T: Serialize> Serialize for Ordered<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Non-finite numbers (no samples) are written as `null`, as serde_json does.
#[derive(DeriveSerialize)]
struct StatsJson {
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    n: usize,
}

impl From<&Stats> for StatsJson {
    fn from(s: &Stats) -> Self {
        StatsJson { p50_ms: s.p50, p90_ms: s.p90, p99_ms: s.p99, max_ms: s.max, n: s.n }
    }
}

#[derive(DeriveSerialize)]
struct Top<'a> {
    label: &'a str,
    dir: &'a str,
    fs: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    create_us: Option<f64>,
    /// Issue 23's targets (the Markdown's summary table).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    summary: Vec<TargetJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pueue: Option<PueueJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency: Option<Ordered<LatencyPair>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bridge: Option<BridgeJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<Vec<BurstJson>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backlog: Option<BacklogJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    idle: Option<Vec<IdleJson>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scale: Option<Vec<CliJson>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    adopt: Option<Vec<AdoptJson>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    targets: Vec<TargetJson>,
}

#[derive(DeriveSerialize)]
struct BridgeSideJson {
    start: StatsJson,
    fallbacks: usize,
}

#[derive(DeriveSerialize)]
struct BridgeJson {
    n: usize,
    runspool: BridgeSideJson,
    reference: BridgeSideJson,
    ratio_p50: f64,
}

#[derive(DeriveSerialize)]
struct BacklogSideJson {
    secs: f64,
    peak_rss_kib: u64,
    after_rss_kib: u64,
}

#[derive(DeriveSerialize)]
struct BacklogJson {
    n: usize,
    max_running: usize,
    runspool: BacklogSideJson,
    reference: BacklogSideJson,
    fresh_daemon_rss_kib: u64,
}

#[derive(DeriveSerialize)]
struct PueueJson {
    version: String,
    install_secs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency: Option<Ordered<PueuePair>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<Vec<PueueBurstJson>>,
}

#[derive(DeriveSerialize)]
struct LatencyPair {
    runspool: StatsJson,
    reference: StatsJson,
}

#[derive(DeriveSerialize)]
struct PueuePair {
    runspool: StatsJson,
    pueue: StatsJson,
    ratio_runspool_over_pueue_p50: f64,
    ratio_runspool_over_pueue_p99: f64,
}

#[derive(DeriveSerialize)]
struct CpuPerRun {
    daemon: f64,
    children: f64,
}

#[derive(DeriveSerialize)]
struct BurstSide {
    secs: f64,
    runs_per_s: f64,
    peak_rss_kib: u64,
    cpu_ms_per_run: CpuPerRun,
}

#[derive(DeriveSerialize)]
struct BurstJson {
    max_running: usize,
    n: usize,
    rounds: usize,
    round_ratios: Vec<String>,
    runspool: BurstSide,
    reference: BurstSide,
}

#[derive(DeriveSerialize)]
struct PueueBurstJson {
    parallel: usize,
    n: usize,
    rounds: usize,
    round_ratios: Vec<String>,
    secs: f64,
    add_secs: f64,
    tasks_per_s: f64,
    peak_rss_kib: u64,
    runspool_runs_per_s: f64,
    reference_runs_per_s: f64,
    ratio_runspool_over_pueue: f64,
    ratio_reference_over_pueue: f64,
}

#[derive(DeriveSerialize)]
struct IdleJson {
    strategy: &'static str,
    terminal_runs: usize,
    settle_s: f64,
    cpu_ms: f64,
    cpu_pct: f64,
    wakeups_per_s: f64,
    rss_kib: u64,
    threads: usize,
}

#[derive(DeriveSerialize)]
struct CliJson {
    command: String,
    stats: StatsJson,
    opens: Option<usize>,
}

#[derive(DeriveSerialize)]
struct AdoptJson {
    active: usize,
    terminal: usize,
    secs: f64,
}

#[derive(DeriveSerialize)]
struct TargetJson {
    target: String,
    measured: String,
    holds: bool,
}

impl From<Target> for TargetJson {
    fn from(t: Target) -> Self {
        TargetJson { target: t.target, measured: t.measured, holds: t.holds }
    }
}

fn burst_side(b: &crate::phases::burst::BurstResult) -> BurstSide {
    BurstSide {
        secs: b.secs,
        runs_per_s: b.per_s,
        peak_rss_kib: b.peak_rss_kib,
        cpu_ms_per_run: CpuPerRun { daemon: b.cpu_daemon_ms, children: b.cpu_children_ms },
    }
}

fn pueue(r: &Report) -> Option<PueueJson> {
    let p = r.pueue.as_ref()?;
    // Stages pueue has no samples for (its missing runner stage) are left out.
    let latency = r.latency.as_ref().zip(r.pueue_latency.as_ref()).map(|(l, pl)| {
        Ordered(
            pueue_latency_marks(&l.runspool, pl)
                .into_iter()
                .filter(|(_, _, b)| b.n > 0)
                .map(|(name, a, b)| {
                    let key = name.split(" (").next().unwrap_or(name);
                    let pair = PueuePair {
                        runspool: (&a).into(),
                        pueue: (&b).into(),
                        ratio_runspool_over_pueue_p50: a.p50 / b.p50,
                        ratio_runspool_over_pueue_p99: a.p99 / b.p99,
                    };
                    (key, pair)
                })
                .collect(),
        )
    });
    let burst_rows: Vec<PueueBurstJson> = r
        .burst
        .iter()
        .flat_map(|b| &b.rows)
        .filter_map(|row| {
            let p = row.pueue.as_ref()?;
            let (rs, rf, pb) = (row.runspool.per_s, row.reference.per_s, &p.median);
            Some(PueueBurstJson {
                parallel: pb.parallel,
                n: pb.n,
                rounds: p.round_ratios.len(),
                round_ratios: p.round_ratios.iter().map(|r| format!("{r:.1}")).collect(),
                secs: pb.secs,
                add_secs: pb.add_secs,
                tasks_per_s: pb.per_s,
                peak_rss_kib: pb.peak_rss_kib,
                runspool_runs_per_s: rs,
                reference_runs_per_s: rf,
                ratio_runspool_over_pueue: rs / pb.per_s,
                ratio_reference_over_pueue: rf / pb.per_s,
            })
        })
        .collect();
    let burst = (!burst_rows.is_empty()).then_some(burst_rows);
    Some(PueueJson { version: p.version.clone(), install_secs: p.install_secs, latency, burst })
}

/// The report as pretty-printed JSON.
pub fn render(r: &Report) -> serde_json::Result<Vec<u8>> {
    let latency = r.latency.as_ref().map(|l| {
        Ordered(
            latency_marks(l)
                .into_iter()
                .map(|(name, a, b)| (name, LatencyPair { runspool: (&a).into(), reference: (&b).into() }))
                .collect(),
        )
    });
    let burst = r.burst.as_ref().map(|b| {
        b.rows
            .iter()
            .map(|row| BurstJson {
                max_running: row.max_running,
                n: row.n,
                rounds: row.rounds,
                round_ratios: row.round_ratios.iter().map(|r| format!("{r:.2}")).collect(),
                runspool: burst_side(&row.runspool),
                reference: burst_side(&row.reference),
            })
            .collect()
    });
    let bridge = r.bridge.as_ref().map(|b| {
        let side =
            |x: &crate::phases::bridge::BridgeSide| BridgeSideJson { start: (&x.start).into(), fallbacks: x.fallbacks };
        BridgeJson {
            n: b.n,
            runspool: side(&b.runspool),
            reference: side(&b.reference),
            ratio_p50: b.runspool.start.p50 / b.reference.start.p50,
        }
    });
    let backlog = r.backlog.as_ref().map(|b| {
        let side = |x: &crate::phases::backlog::BacklogSide| BacklogSideJson {
            secs: x.secs,
            peak_rss_kib: x.peak_rss_kib,
            after_rss_kib: x.after_rss_kib,
        };
        BacklogJson {
            n: b.n,
            max_running: b.max_running,
            runspool: side(&b.runspool),
            reference: side(&b.reference),
            fresh_daemon_rss_kib: b.fresh_rss_kib,
        }
    });
    let idle = r.idle.as_ref().map(|i| {
        i.rows
            .iter()
            .map(|r| IdleJson {
                strategy: r.strategy,
                terminal_runs: r.runs,
                settle_s: r.settle_s,
                cpu_ms: r.cpu_ms,
                cpu_pct: r.cpu_pct,
                wakeups_per_s: r.wakeups_per_s,
                rss_kib: r.rss_kib,
                threads: r.threads,
            })
            .collect()
    });
    let scale = r.scale.as_ref().map(|s| {
        s.rows.iter().map(|c| CliJson { command: c.what.clone(), stats: (&c.stats).into(), opens: c.opens }).collect()
    });
    let adopt = r
        .adopt
        .as_ref()
        .map(|rows| rows.iter().map(|a| AdoptJson { active: a.active, terminal: a.terminal, secs: a.secs }).collect());
    let top = Top {
        label: &r.label,
        dir: &r.dir,
        fs: &r.fs,
        create_us: r.create_us,
        summary: summary(r).into_iter().map(TargetJson::from).collect(),
        pueue: pueue(r),
        latency,
        bridge,
        burst,
        backlog,
        idle,
        scale,
        adopt,
        targets: targets(r).into_iter().map(TargetJson::from).collect(),
    };
    serde_json::to_vec_pretty(&top)
}
