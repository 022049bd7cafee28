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
//! 5. daemon start-up (re-adoption) with `--active` live runs;
//! 6. memory under a backlog of `--backlog-n` requests dropped at once, for
//!    both daemons, and a fresh runspool daemon on the drained root;
//! 7. bridge start latency: the runner's external-job request file → a command
//!    provider's `start` (`__provider`), against `__ref-bridge`.
//!
//! The report opens with a summary table of issue 23's targets.
//!
//! With `--pueue`, the burst and latency tests also run through pueue
//! (`pueue add`, a private `pueued`), installed with cargo when missing.
//!
//! Timings are printed as a Markdown report (and `--out FILE` as JSON). The
//! machine is shared and noisy: compare the ratios, not the absolute numbers.
//!
//! Each phase (`phases/`) returns typed results into a [`report::Report`],
//! which `report::markdown` and `report::json` render once at the end.

mod args;
mod fabricate;
mod fsops;
mod phases;
mod pipelines;
mod procfs;
mod provider;
mod pueue;
mod reference;
mod report;
mod stats;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;

use args::Args;
use fsops::mkdirs;
use pipelines::Env;
use report::{BurstPhase, IdlePhase, PueueInfo, Report, ScalePhase};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // Internal roles of the reference pipeline, started by the benchmark itself.
    match argv.get(1).map(String::as_str) {
        Some("__ref-daemon") => {
            std::process::exit(reference::daemon(Path::new(&argv[2]), argv[3].parse().unwrap_or(2)))
        }
        Some("__ref-runner") => std::process::exit(reference::runner(Path::new(&argv[2]))),
        Some("__provider") if argv.len() >= 4 => std::process::exit(provider::provider(Path::new(&argv[2]), &argv[3])),
        Some("__ref-bridge") if argv.len() >= 4 => {
            std::process::exit(provider::ref_bridge(Path::new(&argv[2]), Path::new(&argv[3])))
        }
        _ => {}
    }
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("runspool-bench: {e:#}");
        std::process::exit(1);
    }
}

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

/// The runspool binary under test: `--runspool`, else next to this binary.
fn runspool_binary(args: &Args, me: &Path) -> anyhow::Result<PathBuf> {
    let runspool = args.runspool.clone().unwrap_or_else(|| me.with_file_name("runspool"));
    if !runspool.exists() {
        anyhow::bail!("{} not found; build it (cargo build --release) or pass --runspool", runspool.display());
    }
    Ok(runspool)
}

fn run(args: Args) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let runspool = runspool_binary(&args, &me)?;
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
    let fs = fs_type(&parent);
    let env = Env { runspool, me, base: base.clone(), seq: std::cell::Cell::new(0) };
    let mut report = Report {
        label: args.label.clone().unwrap_or_else(|| fs.clone()),
        dir: parent.display().to_string(),
        fs,
        ..Report::default()
    };
    let r = measure(&args, &env, &mut report);
    print!("{}", report::markdown::render(&report));
    std::io::stdout().flush()?;
    if let Some(out) = &args.out {
        fs::write(out, report::json::render(&report)?)?;
    }
    if args.keep || r.is_err() {
        eprintln!("kept {} for inspection", base.display());
    } else {
        let _ = fs::remove_dir_all(&base);
    }
    r
}

/// Every phase `--phases` asks for, in a fixed order, each result stored in
/// `report` as soon as it is measured (so a failed phase keeps the others).
fn measure(args: &Args, env: &Env, report: &mut Report) -> anyhow::Result<()> {
    report.create_us = Some(create_cost_us(&env.base)?);
    let pueue = match args.pueue {
        true => Some(pueue::Setup {
            tools: pueue::tools(&args.pueue_version)?,
            burst_n: args.pueue_burst_n,
            latency_n: args.pueue_latency_n,
            keep: args.keep,
        }),
        false => None,
    };
    report.pueue = pueue.as_ref().map(|p| PueueInfo {
        version: p.tools.version.clone(),
        install_secs: p.tools.install_secs,
        requested_version: args.pueue_version.clone(),
    });
    if args.has("latency") {
        eprintln!("latency: {} requests per pipeline, one at a time ...", args.latency_n);
        report.latency = Some(phases::latency::measure(env, args.latency_n)?);
        if let Some(p) = &pueue {
            eprintln!("latency: {} tasks through pueue, one at a time ...", args.pueue_latency_n);
            report.pueue_latency = Some(pueue::latency(env, p)?);
        }
    }
    if args.has("bridge") {
        eprintln!("bridge: {} external-job runs per pipeline, one at a time ...", args.bridge_n);
        report.bridge = Some(phases::bridge::measure(env, args.bridge_n)?);
    }
    if args.has("burst") {
        let phase = report.burst.insert(BurstPhase { n: args.burst_n, pueue_n: args.pueue_burst_n, rows: vec![] });
        for &p in &args.parallel {
            phase.rows.push(phases::burst::row(env, args.burst_n, p, args.burst_repeat, pueue.as_ref())?);
        }
    }
    if args.has("backlog") {
        eprintln!("backlog: {} runs at max_running {} per pipeline ...", args.backlog_n, args.backlog_parallel);
        report.backlog = Some(phases::backlog::measure(env, args.backlog_n, args.backlog_parallel)?);
    }
    if args.has("idle") {
        eprintln!("idle: 4 daemons for {} s (fabricating {} terminal runs twice first) ...", args.idle_secs, args.runs);
        let rows = phases::idle::measure(env, args.idle_secs, args.runs)?;
        report.idle = Some(IdlePhase { secs: args.idle_secs, rows });
    }
    if args.has("scale") {
        eprintln!("scale: {} terminal + {} active runs ...", args.runs, args.active);
        let rows = phases::scale::measure(env, args.runs, args.active, args.calls)?;
        report.scale = Some(ScalePhase { runs: args.runs, active: args.active, calls: args.calls, rows });
    }
    if args.has("adopt") {
        let rows = report.adopt.insert(Vec::new());
        for terminal in [0, args.runs] {
            eprintln!("start-up: {} active + {terminal} terminal runs ...", args.active);
            rows.push(phases::adopt::measure(env, args.active, terminal)?);
        }
    }
    Ok(())
}
