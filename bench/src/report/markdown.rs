//! The report as Markdown (stdout; docs/performance.md pastes it).

use std::fmt::Write;

use super::{latency_marks, pueue_latency_marks, summary, targets, BurstPhase, IdlePhase, Report, ScalePhase};
use crate::phases::adopt::AdoptResult;
use crate::phases::backlog::BacklogResult;
use crate::phases::bridge::BridgeResult;
use crate::phases::latency::Latency;
use crate::pueue::PueueLatency;

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "holds"
    } else {
        "MISSED"
    }
}

/// The whole report: the header, then one section per phase that ran, then the targets.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## runspool-bench: {} ({} under {})\n", r.label, r.fs, r.dir);
    if let Some(create_us) = r.create_us {
        let _ = writeln!(
            s,
            "File creation here: {create_us:.0} µs per empty file (median of 20 directories of 8 files). \
             On ext4 this varies up to 100× between directories of one filesystem, and runspool \
             creates more files per run than the reference, so read disk ratios with it.\n"
        );
    }
    if let Some(p) = &r.pueue {
        let how = match p.install_secs {
            Some(secs) => format!(
                "installed by the benchmark (`cargo install pueue --version {} --locked`, {secs:.0} s)",
                p.requested_version
            ),
            None => "already installed".into(),
        };
        let _ = writeln!(s, "pueue side by side: pueue {} ({how}), a private `pueued` per test.\n", p.version);
    }
    let summary = summary(r);
    if !summary.is_empty() {
        s += "### Summary: the targets of issue 23\n\n| target | measured | verdict |\n|---|---|---|\n";
        for t in &summary {
            let _ = writeln!(s, "| {} | {} | {} |", t.target, t.measured, verdict(t.holds));
        }
        s += "\n";
    }
    if let Some(l) = &r.latency {
        latency(&mut s, l);
        if let Some(pl) = &r.pueue_latency {
            pueue_latency(&mut s, l, pl);
        }
    }
    if let Some(b) = &r.bridge {
        bridge(&mut s, b);
    }
    if let Some(b) = &r.burst {
        burst(&mut s, b);
        pueue_burst(&mut s, b);
    }
    if let Some(b) = &r.backlog {
        backlog(&mut s, b);
    }
    if let Some(i) = &r.idle {
        idle(&mut s, i);
    }
    if let Some(sc) = &r.scale {
        scale(&mut s, sc);
    }
    if let Some(a) = &r.adopt {
        adopt(&mut s, a);
    }
    let targets = targets(r);
    if !targets.is_empty() {
        s += "### Targets\n\n| target | measured | verdict |\n|---|---|---|\n";
        for t in &targets {
            let _ = writeln!(s, "| {} | {} | {} |", t.target, t.measured, verdict(t.holds));
        }
    }
    s
}

fn latency(s: &mut String, l: &Latency) {
    let _ = writeln!(s, "### Latency, one request at a time (n = {}, ms)\n", l.runspool.claimed.n);
    *s += "| drop → | runspool p50 | p90 | p99 | max | reference p50 | p90 | p99 | max | ratio p50 | ratio p99 |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (name, a, b) in latency_marks(l) {
        let _ = writeln!(
            s,
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}× | {:.2}× |",
            a.p50,
            a.p90,
            a.p99,
            a.max,
            b.p50,
            b.p90,
            b.p99,
            b.max,
            a.p50 / b.p50,
            a.p99 / b.p99
        );
    }
    *s += "\n";
}

fn pueue_latency(s: &mut String, l: &Latency, pl: &PueueLatency) {
    let _ = writeln!(
        s,
        "### pueue side by side: latency, one task at a time (pueue n = {}, runspool n = {}, ms)\n",
        pl.done.n, l.runspool.started.n
    );
    *s += "| mark (runspool: drop →; pueue: `pueue add` spawned →) | runspool p50 | p90 | p99 | max | pueue p50 | p90 | p99 | max | runspool / pueue p50 | p99 |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    let cell = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "–".into() };
    let ratio = |r: f64| if r.is_finite() { format!("{r:.3}×") } else { "–".into() };
    for (name, a, b) in pueue_latency_marks(&l.runspool, pl) {
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(a.p50),
            cell(a.p90),
            cell(a.p99),
            cell(a.max),
            cell(b.p50),
            cell(b.p90),
            cell(b.p99),
            cell(b.max),
            ratio(a.p50 / b.p50),
            ratio(a.p99 / b.p99)
        );
    }
    *s += "\n";
}

fn burst(s: &mut String, b: &BurstPhase) {
    let _ = writeln!(s, "### Burst of {} runs dropped at once\n", b.n);
    *s += "| max_running | runspool s | runs/s | daemon peak RSS MiB | CPU ms/run, daemon + runners | reference s | runs/s | peak RSS MiB | CPU ms/run | throughput ratio | ratio per round |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    for row in &b.rows {
        let (rs, rf) = (&row.runspool, &row.reference);
        let rounds: Vec<String> = row.round_ratios.iter().map(|r| format!("{r:.2}")).collect();
        let _ = writeln!(
            s,
            "| {} | {:.2} | {:.1} | {:.1} | {:.2} + {:.2} | {:.2} | {:.1} | {:.1} | {:.2} + {:.2} | {:.2}× | {} |",
            row.max_running,
            rs.secs,
            rs.per_s,
            mib(rs.peak_rss_kib),
            rs.cpu_daemon_ms,
            rs.cpu_children_ms,
            rf.secs,
            rf.per_s,
            mib(rf.peak_rss_kib),
            rf.cpu_daemon_ms,
            rf.cpu_children_ms,
            row.ratio(),
            rounds.join(", ")
        );
    }
    *s += "\n";
}

fn bridge(s: &mut String, b: &BridgeResult) {
    let _ =
        writeln!(s, "### Bridge start latency: the runner's request file → the provider's `start` (n = {}, ms)\n", b.n);
    *s += "| pipeline | p50 | p90 | p99 | max | timed from a fallback |\n|---|---|---|---|---|---|\n";
    for (name, side) in [("runspool", &b.runspool), ("reference", &b.reference)] {
        let st = &side.start;
        let _ = writeln!(
            s,
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            st.p50, st.p90, st.p99, st.max, side.fallbacks
        );
    }
    let _ = writeln!(s, "\nratio p50: {:.2}×\n", b.runspool.start.p50 / b.reference.start.p50);
}

fn backlog(s: &mut String, b: &BacklogResult) {
    let _ = writeln!(s, "### Backlog of {} runs dropped at once (max_running {})\n", b.n, b.max_running);
    *s += "| pipeline | drained in s | daemon peak RSS MiB | RSS 2 s after the last run MiB |\n|---|---|---|---|\n";
    for (name, side) in [("runspool", &b.runspool), ("reference", &b.reference)] {
        let _ = writeln!(
            s,
            "| {name} | {:.2} | {:.1} | {:.1} |",
            side.secs,
            mib(side.peak_rss_kib),
            mib(side.after_rss_kib)
        );
    }
    let _ = writeln!(s, "| fresh runspool daemon on the drained root | – | – | {:.1} |\n", mib(b.fresh_rss_kib));
}

fn pueue_burst(s: &mut String, b: &BurstPhase) {
    let rows: Vec<_> = b.rows.iter().filter_map(|row| Some((row, row.pueue.as_ref()?))).collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "### pueue side by side: burst ({} tasks `pueue add -- true` for pueue, {} runs for runspool; runs/s compared)\n",
        b.pueue_n, b.n
    );
    *s += "| max_running = pueue parallel | runspool runs/s | reference runs/s | pueue s | of it adding s | pueue tasks/s | pueued peak RSS MiB | runspool / pueue | reference / pueue | runspool / pueue per round |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (row, p) in rows {
        let (rs_per_s, rf_per_s, pb) = (row.runspool.per_s, row.reference.per_s, &p.median);
        let rounds: Vec<String> = p.round_ratios.iter().map(|r| format!("{r:.1}")).collect();
        let _ = writeln!(
            s,
            "| {} | {rs_per_s:.1} | {rf_per_s:.1} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1}× | {:.1}× | {} |",
            pb.parallel,
            pb.secs,
            pb.add_secs,
            pb.per_s,
            mib(pb.peak_rss_kib),
            rs_per_s / pb.per_s,
            rf_per_s / pb.per_s,
            rounds.join(", ")
        );
    }
    *s += "\n";
}

fn idle(s: &mut String, i: &IdlePhase) {
    let _ = writeln!(s, "### Idle daemon over {} s (from /proc)\n", i.secs);
    *s += "| watch | terminal runs | CPU ms | CPU % | wakeups/s | RSS MiB | threads |\n|---|---|---|---|---|---|---|\n";
    for r in &i.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.4} | {:.2} | {:.1} | {} |",
            r.strategy,
            r.runs,
            r.cpu_ms,
            r.cpu_pct,
            r.wakeups_per_s,
            mib(r.rss_kib),
            r.threads
        );
    }
    *s += "\n";
}

fn scale(s: &mut String, sc: &ScalePhase) {
    let _ = writeln!(
        s,
        "### CLI with {} terminal runs and {} active runs stored ({} calls each)\n",
        sc.runs, sc.active, sc.calls
    );
    *s += "| command | p50 ms | p90 ms | max ms | files opened (beyond `--version`) |\n|---|---|---|---|---|\n";
    for r in &sc.rows {
        let opens = r.opens.map(|o| o.to_string()).unwrap_or_else(|| "n/a".into());
        let what = if r.what.contains('`') { r.what.clone() } else { format!("`{}`", r.what) };
        let _ = writeln!(s, "| {what} | {:.1} | {:.1} | {:.1} | {opens} |", r.stats.p50, r.stats.p90, r.stats.max);
    }
    *s += "\n";
}

fn adopt(s: &mut String, rows: &[AdoptResult]) {
    *s += "### Daemon start-up (re-adoption of live runs)\n\n| active runs | terminal runs | spawn → all re-adopted s |\n|---|---|---|\n";
    for r in rows {
        let _ = writeln!(s, "| {} | {} | {:.3} |", r.active, r.terminal, r.secs);
    }
    *s += "\n";
}
