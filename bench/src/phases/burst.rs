//! Phase 2, bursts: `n` trivial runs dropped at once, per max_running, with
//! pueue in the same rounds when asked.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::fsops::{mkdirs, write_private};
use crate::pipelines::{request_body, terminal_dir, Env, Kind};
use crate::procfs;
use crate::pueue::{self, PueueBurst};

/// One burst through one pipeline.
#[derive(Clone, Copy, Debug)]
pub struct BurstResult {
    pub secs: f64,
    pub per_s: f64,
    pub peak_rss_kib: u64,
    /// CPU ms per run: the daemon itself, and its reaped children (runners and their steps).
    pub cpu_daemon_ms: f64,
    pub cpu_children_ms: f64,
}

/// The round with the median throughput (peak RSS: the highest of all rounds).
fn median_burst(mut v: Vec<BurstResult>) -> BurstResult {
    let peak = v.iter().map(|b| b.peak_rss_kib).max().unwrap_or(0);
    v.sort_by(|a, b| a.per_s.partial_cmp(&b.per_s).unwrap());
    let m = v.swap_remove(v.len() / 2);
    BurstResult { peak_rss_kib: peak, ..m }
}

/// pueue's rounds at one max_running (= pueue's parallel).
#[derive(Clone, Debug)]
pub struct PueueRow {
    /// The round with the median throughput.
    pub median: PueueBurst,
    /// runspool / pueue throughput of each round.
    pub round_ratios: Vec<f64>,
}

/// Every round at one max_running.
#[derive(Clone, Debug)]
pub struct BurstRow {
    pub max_running: usize,
    pub n: usize,
    pub rounds: usize,
    /// runspool / reference throughput of each round.
    pub round_ratios: Vec<f64>,
    /// The rounds with the median throughput.
    pub runspool: BurstResult,
    pub reference: BurstResult,
    pub pueue: Option<PueueRow>,
}

/// Write `n` requests (ids `<prefix>-000000`, ...) to a staging directory
/// under `root`, rename them all into the spool as fast as possible, and
/// wait until every run is terminal, looking every `poll`. Seconds from the
/// first rename to the last terminal marker, and the run ids (`name`
/// labels the error).
pub fn drop_and_drain(
    kind: Kind,
    root: &Path,
    name: &str,
    prefix: &str,
    n: usize,
    poll: Duration,
) -> anyhow::Result<(f64, Vec<String>)> {
    let staging = root.join("staging");
    mkdirs(&staging)?;
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i:06}")).collect();
    for id in &ids {
        write_private(&staging.join(format!("{id}.json")), &request_body(id))?;
    }
    let (spool, term) = (root.join("spool"), terminal_dir(kind, root));
    let t0 = Instant::now();
    for id in &ids {
        fs::rename(staging.join(format!("{id}.json")), spool.join(format!("{id}.json")))?;
    }
    let deadline = t0 + Duration::from_secs(120 + n as u64 / 5);
    while count_entries(&term) < n {
        if Instant::now() > deadline {
            anyhow::bail!("{name}: only {} of {n} runs ended in time", count_entries(&term));
        }
        std::thread::sleep(poll);
    }
    Ok((t0.elapsed().as_secs_f64(), ids))
}

pub fn count_entries(dir: &Path) -> usize {
    fs::read_dir(dir)
        .map(|rd| rd.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
        .unwrap_or(0)
}

/// One burst of `n` runs through `kind` on a fresh root and daemon.
fn burst(env: &Env, kind: Kind, n: usize, max_running: usize) -> anyhow::Result<BurstResult> {
    let name = format!("burst{max_running}-{}", kind.name());
    let root = env.fresh_root(&name)?;
    let d = env.start(kind, &root, max_running)?;
    let (secs, ids) = drop_and_drain(kind, &root, &name, "burst", n, Duration::from_millis(10))?;
    let peak_rss_kib = procfs::status_kib(d.pid(), "VmHWM:").unwrap_or(0);
    // The last runners exit (and are reaped) just after their terminal marker.
    std::thread::sleep(Duration::from_millis(300));
    let (cpu_d, cpu_c) = procfs::cpu_ms(d.pid()).unwrap_or((0.0, 0.0));
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

/// `rounds` bursts of `n` runs per pipeline at `max_running`, alternating
/// which pipeline goes first; pueue (when given) in the same rounds.
pub fn row(
    env: &Env,
    n: usize,
    max_running: usize,
    rounds: usize,
    pueue: Option<&pueue::Setup>,
) -> anyhow::Result<BurstRow> {
    let p = max_running;
    let rounds = rounds.max(1);
    let (mut rss, mut rfs, mut pbs) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..rounds {
        eprintln!("burst: {n} runs at max_running {p} (round {}) ...", k + 1);
        // Alternate which pipeline goes first so drift hits both alike.
        if k % 2 == 0 {
            rfs.push(burst(env, Kind::Reference, n, p)?);
            rss.push(burst(env, Kind::Runspool, n, p)?);
        } else {
            rss.push(burst(env, Kind::Runspool, n, p)?);
            rfs.push(burst(env, Kind::Reference, n, p)?);
        }
        // pueue in the same round, so it shares the round's load.
        if let Some(s) = pueue {
            eprintln!("burst: {} tasks through pueue at parallel {p} (round {}) ...", s.burst_n, k + 1);
            pbs.push(pueue::burst(env, s, p)?);
        }
    }
    let pueue_ratios: Vec<f64> = rss.iter().zip(&pbs).map(|(a, b)| a.per_s / b.per_s).collect();
    let round_ratios: Vec<f64> = rss.iter().zip(&rfs).map(|(a, b)| a.per_s / b.per_s).collect();
    let pueue = (!pbs.is_empty()).then(|| {
        // The round with the median throughput, as for the other two.
        pbs.sort_by(|a, b| a.per_s.partial_cmp(&b.per_s).unwrap());
        PueueRow { median: pbs.swap_remove(pbs.len() / 2), round_ratios: pueue_ratios }
    });
    Ok(BurstRow {
        max_running: p,
        n,
        rounds,
        round_ratios,
        runspool: median_burst(rss),
        reference: median_burst(rfs),
        pueue,
    })
}
