//! The report's shape: the Markdown sections and the JSON keys, field order
//! included, that docs/performance.md and its readers rely on.

use serde_json::Value;

use super::*;
use crate::phases::backlog::{BacklogResult, BacklogSide};
use crate::phases::bridge::{BridgeResult, BridgeSide};
use crate::phases::burst::{BurstResult, PueueRow};
use crate::pueue::PueueBurst;

fn stats(p50: f64) -> Stats {
    Stats { p50, p90: p50 * 1.5, p99: p50 * 2.0, max: p50 * 3.0, n: 10 }
}

fn burst(per_s: f64) -> BurstResult {
    BurstResult { secs: 1.0, per_s, peak_rss_kib: 4096, cpu_daemon_ms: 1.0, cpu_children_ms: 2.0 }
}

/// A report with every phase and pueue.
fn full() -> Report {
    let lat = |x| LatencyResult {
        claimed: stats(x),
        started: stats(2.0 * x),
        step: stats(3.0 * x),
        terminal: stats(4.0 * x),
    };
    let pb = PueueBurst { parallel: 2, n: 20, secs: 4.0, add_secs: 1.0, per_s: 5.0, peak_rss_kib: 8192 };
    Report {
        label: "tmpfs".into(),
        dir: "/dev/shm/rsb".into(),
        fs: "tmpfs".into(),
        create_us: Some(12.0),
        pueue: Some(PueueInfo { version: "4.0.4".into(), install_secs: None, requested_version: "4.0.4".into() }),
        latency: Some(Latency { runspool: lat(1.0), reference: lat(0.8) }),
        pueue_latency: Some(PueueLatency { added: stats(5.0), started: stats(9.0), done: stats(20.0) }),
        burst: Some(BurstPhase {
            n: 100,
            pueue_n: 20,
            rows: vec![BurstRow {
                max_running: 2,
                n: 100,
                rounds: 1,
                round_ratios: vec![0.9],
                runspool: burst(900.0),
                reference: burst(1000.0),
                pueue: Some(PueueRow { median: pb, round_ratios: vec![180.0] }),
            }],
        }),
        idle: Some(IdlePhase {
            secs: 1,
            rows: vec![IdleResult {
                strategy: "native",
                runs: 0,
                cpu_ms: 0.0,
                cpu_pct: 0.0,
                wakeups_per_s: 0.0,
                rss_kib: 9000,
                threads: 3,
                settle_s: 0.5,
            }],
        }),
        scale: Some(ScalePhase {
            runs: 30,
            active: 4,
            calls: 1,
            rows: vec![CliResult { what: "runspool list --active".into(), stats: stats(4.0), opens: None }],
        }),
        adopt: Some(vec![AdoptResult { terminal: 0, active: 4, secs: 0.03 }]),
        backlog: Some(BacklogResult {
            n: 200,
            max_running: 8,
            runspool: BacklogSide { secs: 2.0, peak_rss_kib: 30 * 1024, after_rss_kib: 8 * 1024 },
            reference: BacklogSide { secs: 1.0, peak_rss_kib: 4096, after_rss_kib: 4096 },
            fresh_rss_kib: 7 * 1024,
        }),
        bridge: Some(BridgeResult {
            n: 5,
            runspool: BridgeSide { start: stats(40.0), fallbacks: 1 },
            reference: BridgeSide { start: stats(2.0), fallbacks: 0 },
        }),
    }
}

fn keys(v: &Value) -> Vec<&str> {
    v.as_object().expect("an object").keys().map(String::as_str).collect()
}

#[test]
fn markdown_has_every_section_in_order() {
    let md = markdown::render(&full());
    let sections = [
        "## runspool-bench: tmpfs (tmpfs under /dev/shm/rsb)\n\nFile creation here: 12 µs",
        "pueue side by side: pueue 4.0.4 (already installed), a private `pueued` per test.\n\n",
        "### Summary: the targets of issue 23\n\n| target | measured | verdict |\n|---|---|---|\n",
        "| burst throughput at max_running 2 ≥ 0.8× reference | 0.90× (900 vs 1000 runs/s) | holds |\n",
        "| closed loop: drop→terminal status p50 ≤ 1.3× reference | 1.25× (4.00 vs 3.20 ms) | holds |\n",
        "| backlog of 200 (max_running 8): daemon peak RSS ≤ 20 MiB | 30.0 MiB (reference 4.0 MiB) | MISSED |\n",
        "| backlog of 200: daemon RSS once drained ≤ 10 MiB | 8.0 MiB (fresh daemon on the drained root 7.0 MiB, reference 4.0 MiB) | holds |\n",
        "| bridge: runner's request → provider start p50 ≤ 50 ms | 40.0 ms (20.0× reference, 2.0 ms) | holds |\n",
        "| idle native, 0 runs: ≤ 1 wakeup/s | 0.00/s | holds |\n\n",
        "### Latency, one request at a time (n = 10, ms)\n\n",
        "### pueue side by side: latency, one task at a time (pueue n = 10, runspool n = 10, ms)\n\n",
        "### Bridge start latency: the runner's request file → the provider's `start` (n = 5, ms)\n\n",
        "| runspool | 40.00 | 60.00 | 80.00 | 120.00 | 1 |\n",
        "### Burst of 100 runs dropped at once\n\n",
        "| 2 | 1.00 | 900.0 | 4.0 | 1.00 + 2.00 | 1.00 | 1000.0 | 4.0 | 1.00 + 2.00 | 0.90× | 0.90 |\n\n",
        "### pueue side by side: burst (20 tasks `pueue add -- true` for pueue, 100 runs for runspool; runs/s compared)",
        "### Backlog of 200 runs dropped at once (max_running 8)\n\n",
        "| runspool | 2.00 | 30.0 | 8.0 |\n",
        "| fresh runspool daemon on the drained root | – | – | 7.0 |\n\n",
        "### Idle daemon over 1 s (from /proc)\n\n",
        "### CLI with 30 terminal runs and 4 active runs stored (1 calls each)\n\n",
        "| `runspool list --active` | 4.0 | 6.0 | 12.0 | n/a |\n\n",
        "### Daemon start-up (re-adoption of live runs)\n\n",
        "### Targets\n\n",
        "| burst throughput at max_running 2 ≥ 30× pueue | 180.0× | holds |\n",
    ];
    let mut at = 0;
    for s in sections {
        let i = md[at..].find(s).unwrap_or_else(|| panic!("missing, or out of order: {s:?}\n{md}"));
        at += i + s.len();
    }
    assert!(
        md.contains("| runner started (pueue: no such stage) | 2.00 | 3.00 | 4.00 | 6.00 | – | – | – | – | – | – |")
    );
}

#[test]
fn json_keys_and_their_order() {
    let v: Value = serde_json::from_slice(&json::render(&full()).unwrap()).unwrap();
    let top = [
        "label",
        "dir",
        "fs",
        "create_us",
        "summary",
        "pueue",
        "latency",
        "bridge",
        "burst",
        "backlog",
        "idle",
        "scale",
        "adopt",
        "targets",
    ];
    assert_eq!(keys(&v), top);
    assert_eq!(keys(&v["summary"][0]), ["target", "measured", "holds"]);
    assert_eq!(v["summary"].as_array().unwrap().len(), 6);
    assert_eq!(keys(&v["bridge"]), ["n", "runspool", "reference", "ratio_p50"]);
    assert_eq!(keys(&v["bridge"]["runspool"]), ["start", "fallbacks"]);
    assert_eq!(keys(&v["bridge"]["runspool"]["start"]), ["p50_ms", "p90_ms", "p99_ms", "max_ms", "n"]);
    assert_eq!(keys(&v["backlog"]), ["n", "max_running", "runspool", "reference", "fresh_daemon_rss_kib"]);
    assert_eq!(keys(&v["backlog"]["runspool"]), ["secs", "peak_rss_kib", "after_rss_kib"]);
    assert_eq!(keys(&v["pueue"]), ["version", "install_secs", "latency", "burst"]);
    assert!(v["pueue"]["install_secs"].is_null());
    // pueue has no runner stage: no key for it.
    assert_eq!(keys(&v["pueue"]["latency"]), ["accepted", "step started", "terminal"]);
    let pl = &v["pueue"]["latency"]["accepted"];
    assert_eq!(keys(pl), ["runspool", "pueue", "ratio_runspool_over_pueue_p50", "ratio_runspool_over_pueue_p99"]);
    assert_eq!(keys(&pl["pueue"]), ["p50_ms", "p90_ms", "p99_ms", "max_ms", "n"]);
    let pb = &v["pueue"]["burst"][0];
    assert_eq!(
        keys(pb),
        [
            "parallel",
            "n",
            "rounds",
            "round_ratios",
            "secs",
            "add_secs",
            "tasks_per_s",
            "peak_rss_kib",
            "runspool_runs_per_s",
            "reference_runs_per_s",
            "ratio_runspool_over_pueue",
            "ratio_reference_over_pueue"
        ]
    );
    assert_eq!(pb["round_ratios"], serde_json::json!(["180.0"]));
    assert_eq!(keys(&v["latency"]), ["claimed", "runner started", "step started", "terminal status"]);
    assert_eq!(keys(&v["latency"]["claimed"]), ["runspool", "reference"]);
    let b = &v["burst"][0];
    assert_eq!(keys(b), ["max_running", "n", "rounds", "round_ratios", "runspool", "reference"]);
    assert_eq!(keys(&b["runspool"]), ["secs", "runs_per_s", "peak_rss_kib", "cpu_ms_per_run"]);
    assert_eq!(keys(&b["runspool"]["cpu_ms_per_run"]), ["daemon", "children"]);
    assert_eq!(b["round_ratios"], serde_json::json!(["0.90"]));
    let idle = ["strategy", "terminal_runs", "settle_s", "cpu_ms", "cpu_pct", "wakeups_per_s", "rss_kib", "threads"];
    assert_eq!(keys(&v["idle"][0]), idle);
    assert_eq!(keys(&v["scale"][0]), ["command", "stats", "opens"]);
    assert!(v["scale"][0]["opens"].is_null());
    assert_eq!(keys(&v["adopt"][0]), ["active", "terminal", "secs"]);
    assert_eq!(keys(&v["targets"][0]), ["target", "measured", "holds"]);
}

#[test]
fn only_what_ran_is_reported() {
    let r = Report { label: "x".into(), dir: "/d".into(), fs: "ext4".into(), ..Report::default() };
    let v: Value = serde_json::from_slice(&json::render(&r).unwrap()).unwrap();
    assert_eq!(keys(&v), ["label", "dir", "fs"]);
    assert_eq!(markdown::render(&r), "## runspool-bench: x (ext4 under /d)\n\n");
}
