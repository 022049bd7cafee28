//! What a service owner watches: one log line per run end, with the run's
//! id, state, exit code and duration as fields (docs/logging.md), and the
//! Prometheus text file of `metrics_file` for node_exporter's textfile
//! collector (docs/operations.md).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::protocol::daemon::{QueueInfo, RunCounts};
use crate::store::{Layout, RunId};

/// The metrics file is rewritten at most this often.
const WRITE_EVERY: Duration = Duration::from_secs(1);
/// ... and at least this often, so its mtime says the daemon lives.
const WRITE_AT_LEAST: Duration = Duration::from_secs(60);
/// Run ends remembered to log each once, however often it is seen. A run's
/// end is met again only while its publication is unfinished (a lingering
/// active marker, a start-up check racing its end), within moments of its
/// first; 4,096 covers that with room, at 0.1 MiB. Perf: at 65,536 the set
/// and its order took 0.56 MiB after a 20,000-run backlog (more than half of
/// what a drained daemon kept on its heap) and 1.7 MiB once full.
const REMEMBERED_ENDS: usize = 4_096;
/// The upper bounds of the claim latency histogram, in seconds.
const LATENCY_BUCKETS: [f64; 11] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 600.0];
/// Node_exporter reads the file as another user: it is world-readable.
const FILE_MODE: u32 = 0o644;

/// What the metrics file says about the daemon besides run ends and claims.
pub struct View<'a> {
    pub runs: &'a RunCounts,
    pub queue: &'a QueueInfo,
    /// Queued runs per lane and reason (the scheduler's counts).
    pub by_lane_reason: &'a BTreeMap<String, BTreeMap<&'static str, usize>>,
    /// `[lanes.NAME]` of the configuration.
    pub lanes: &'a BTreeMap<String, crate::config::Lane>,
    pub degraded: bool,
    pub watch_strategy: &'a str,
    pub watch_backend: &'a str,
}

pub struct Metrics {
    path: Option<PathBuf>,
    /// The daemon's start, ms since the epoch.
    started_at: i64,
    ended: BTreeMap<String, u64>,
    timed_out: u64,
    /// Runs logged, by a hash of their id (`id_key`): eight bytes each, not
    /// the id twice, for the last `REMEMBERED_ENDS` runs.
    logged: HashSet<u64>,
    logged_order: VecDeque<u64>,
    latency_counts: [u64; LATENCY_BUCKETS.len()],
    latency_sum_ms: u64,
    latency_count: u64,
    /// The text as last written (None: write at the next chance).
    written: Option<String>,
    last_write: Option<Instant>,
    /// A change waits for WRITE_EVERY to pass.
    due: Option<Instant>,
    /// The last write error, logged once until it changes.
    error: Option<String>,
}

/// A run id's key in `Metrics::logged`: a 64-bit hash (a collision, about
/// one in 2^41 for 4,096 ids, costs one run's end line, nothing else).
fn id_key(id: &RunId) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    id.as_str().hash(&mut h);
    h.finish()
}

impl Metrics {
    pub fn new(path: Option<PathBuf>, started_at: i64) -> Metrics {
        let ended = ["complete", "failed", "stopped"].into_iter().map(|s| (s.to_string(), 0)).collect();
        Metrics {
            path,
            started_at,
            ended,
            timed_out: 0,
            logged: HashSet::new(),
            logged_order: VecDeque::new(),
            latency_counts: [0; LATENCY_BUCKETS.len()],
            latency_sum_ms: 0,
            latency_count: 0,
            written: None,
            last_write: None,
            due: None,
            error: None,
        }
    }

    /// A SIGHUP changed `metrics_file`: the new file is written at once.
    pub fn set_path(&mut self, path: Option<PathBuf>) {
        if path != self.path {
            self.path = path;
            self.written = None;
            self.last_write = None;
            self.error = None;
        }
    }

    /// Run `id` ended (its runner settled, or it ended while queued): log
    /// one line with its outcome, and count it. A run is logged once per
    /// daemon, however often a rescan meets its end again. `unseen`: found
    /// ended at start-up, after the previous daemon's last sign of life.
    pub fn ended(&mut self, layout: &Layout, id: &RunId, unseen: bool) {
        let key = id_key(id);
        if self.logged.contains(&key) {
            return;
        }
        let s = match crate::store::run::read_status(&layout.run_dir(id)) {
            Ok(Some(s)) if !s.state.is_active() => s,
            Ok(_) => return,
            Err(e) => {
                tracing::debug!(run_id = %id, error = %e, "run ended, but its status cannot be read");
                return;
            }
        };
        if self.logged_order.len() >= REMEMBERED_ENDS {
            if let Some(old) = self.logged_order.pop_front() {
                self.logged.remove(&old);
            }
        }
        self.logged.insert(key);
        self.logged_order.push_back(key);
        let state = s.state.as_str();
        let duration_ms = s.ended_at.map(|e| (e - s.started_at).max(0));
        let mut how = state.to_string();
        if let Some(c) = s.exit_code {
            let _ = write!(how, " (exit code {c})");
        }
        if s.timed_out {
            how.push_str(", timed out");
        }
        if let Some(d) = duration_ms {
            let _ = write!(how, " after {}.{:03} s", d / 1000, d % 1000);
        }
        if unseen {
            how.push_str(" (found at daemon start; the previous daemon may not have seen it end)");
        }
        tracing::info!(
            run_id = %id,
            state,
            exit_code = s.exit_code,
            duration_ms,
            timed_out = s.timed_out,
            lane = s.lane(),
            "run ended: {id} {how}"
        );
        *self.ended.entry(state.to_string()).or_insert(0) += 1;
        if s.timed_out {
            self.timed_out += 1;
        }
    }

    /// Claims made, as milliseconds from publication to claim.
    pub fn claimed(&mut self, latencies_ms: &[u64]) {
        for &l in latencies_ms {
            for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
                if l as f64 <= *b * 1000.0 {
                    self.latency_counts[i] += 1;
                }
            }
            self.latency_sum_ms += l;
            self.latency_count += 1;
        }
    }

    /// Rewrite the file when what it says changed, at most once a second
    /// (and at least once a minute).
    pub fn turn(&mut self, view: &View) {
        let Some(path) = self.path.clone() else { return };
        let now = Instant::now();
        if let Some(t) = self.last_write.map(|t| t + WRITE_EVERY).filter(|t| now < *t) {
            self.due = Some(t);
            return;
        }
        self.due = None;
        let text = self.render(view, true);
        let stale = self.last_write.is_none_or(|t| now >= t + WRITE_AT_LEAST);
        if self.written.as_deref() == Some(text.as_str()) && !stale {
            return;
        }
        self.write(&path, text);
    }

    /// The daemon stops: `runspool_up 0`, so a stopped daemon is not taken
    /// for a live one with nothing to do.
    pub fn shutdown(&mut self, view: &View) {
        if let Some(path) = self.path.clone() {
            let text = self.render(view, false);
            self.write(&path, text);
        }
    }

    pub fn next_wake(&self) -> Option<Instant> {
        self.path.as_ref()?;
        [self.due, self.last_write.map(|t| t + WRITE_AT_LEAST)].into_iter().flatten().min()
    }

    fn write(&mut self, path: &std::path::Path, text: String) {
        self.last_write = Some(Instant::now());
        match crate::store::fsutil::write_atomic_mode(path, text.as_bytes(), false, FILE_MODE) {
            Ok(()) => {
                if self.error.take().is_some() {
                    tracing::info!(path = %path.display(), "metrics file written again");
                }
                self.written = Some(text);
            }
            Err(e) => {
                let msg = e.to_string();
                if self.error.as_deref() != Some(msg.as_str()) {
                    tracing::warn!(
                        path = %path.display(), error = %msg,
                        "cannot write the metrics file; check that its directory exists and is writable by you, or change metrics_file"
                    );
                    self.error = Some(msg);
                }
            }
        }
    }

    /// The Prometheus text exposition format (version 0.0.4).
    fn render(&self, v: &View, up: bool) -> String {
        let mut t = Text::default();
        t.family("runspool_up", "gauge", "1 while the runspool daemon runs; 0 once it stopped.");
        t.sample("runspool_up", &[], u64::from(up) as f64);
        t.family(
            "runspool_daemon_start_time_seconds",
            "gauge",
            "When the running daemon started, in seconds since the Unix epoch.",
        );
        t.sample("runspool_daemon_start_time_seconds", &[], self.started_at as f64 / 1000.0);
        t.family("runspool_build_info", "gauge", "The daemon's runspool version.");
        t.sample("runspool_build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1.0);
        t.family("runspool_runs", "gauge", "Active runs by state (daemon.json runs).");
        t.sample("runspool_runs", &[("state", "queued")], v.runs.queued as f64);
        t.sample("runspool_runs", &[("state", "running")], v.runs.running as f64);
        t.family(
            "runspool_runs_ended_total",
            "counter",
            "Runs that ended since the daemon started, by terminal state.",
        );
        for (state, n) in &self.ended {
            t.sample("runspool_runs_ended_total", &[("state", state)], *n as f64);
        }
        t.family(
            "runspool_runs_timed_out_total",
            "counter",
            "Runs that ended with a time limit (the run's or a step's) reached since the daemon started, also counted by state.",
        );
        t.sample("runspool_runs_timed_out_total", &[], self.timed_out as f64);
        t.family(
            "runspool_queue_depth",
            "gauge",
            "Queued runs by lane and by why they wait (daemon.json queue.byLane and queue.byReason).",
        );
        for (lane, reasons) in v.by_lane_reason {
            for (reason, n) in reasons {
                t.sample("runspool_queue_depth", &[("lane", lane), ("reason", reason)], *n as f64);
            }
        }
        t.family(
            "runspool_lane_running",
            "gauge",
            "Runs with a live runner by lane (daemon.json queue.runningByLane).",
        );
        for (lane, n) in &v.queue.running_by_lane {
            t.sample("runspool_lane_running", &[("lane", lane)], *n as f64);
        }
        t.family("runspool_lane_max_running", "gauge", "The configured limit of each lane ([lanes.NAME] max_running).");
        for (lane, l) in v.lanes {
            t.sample("runspool_lane_max_running", &[("lane", lane)], l.max_running as f64);
        }
        t.family(
            "runspool_max_running",
            "gauge",
            "Runs with a live runner at once, at most (the queue file's override included).",
        );
        t.sample("runspool_max_running", &[], v.queue.max_running as f64);
        t.family("runspool_queue_paused", "gauge", "1 while the queue is paused (runspool pause).");
        t.sample("runspool_queue_paused", &[], u64::from(v.queue.paused) as f64);
        t.family(
            "runspool_claim_latency_seconds",
            "histogram",
            "Time from a request's publication in the spool (its file's mtime) to its claim, since the daemon started.",
        );
        for (b, n) in LATENCY_BUCKETS.iter().zip(self.latency_counts) {
            t.sample("runspool_claim_latency_seconds_bucket", &[("le", &fmt_value(*b))], n as f64);
        }
        t.sample("runspool_claim_latency_seconds_bucket", &[("le", "+Inf")], self.latency_count as f64);
        t.sample("runspool_claim_latency_seconds_sum", &[], self.latency_sum_ms as f64 / 1000.0);
        t.sample("runspool_claim_latency_seconds_count", &[], self.latency_count as f64);
        t.family(
            "runspool_storage_degraded",
            "gauge",
            "1 while storage is degraded and claiming stops (daemon.json storage.state).",
        );
        t.sample("runspool_storage_degraded", &[], u64::from(v.degraded) as f64);
        t.family("runspool_watch_info", "gauge", "How the daemon watches the spool (daemon.json watch).");
        t.sample("runspool_watch_info", &[("strategy", v.watch_strategy), ("backend", v.watch_backend)], 1.0);
        t.0
    }
}

#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape_label(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {}", fmt_value(value));
    }
}

/// A label value as the text format wants it: `\`, `"` and newline escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A sample value: integers without a fraction, `+Inf`/`-Inf`/`NaN` spelled out.
fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(
        runs: &'a RunCounts,
        queue: &'a QueueInfo,
        by: &'a BTreeMap<String, BTreeMap<&'static str, usize>>,
        lanes: &'a BTreeMap<String, crate::config::Lane>,
    ) -> View<'a> {
        View {
            runs,
            queue,
            by_lane_reason: by,
            lanes,
            degraded: false,
            watch_strategy: "native",
            watch_backend: "inotify",
        }
    }

    #[test]
    fn samples_follow_the_text_format() {
        let mut m = Metrics::new(None, 1_767_348_000_123);
        m.claimed(&[3, 200, 700_000]);
        let runs = RunCounts { queued: 2, running: 1 };
        let queue = QueueInfo {
            paused: false,
            since: None,
            reason: None,
            max_running: 4,
            max_running_override: None,
            error: None,
            by_lane: BTreeMap::new(),
            by_reason: BTreeMap::new(),
            running_by_lane: BTreeMap::from([("gpu".to_string(), 1)]),
        };
        let by = BTreeMap::from([("gpu".to_string(), BTreeMap::from([("lane", 2)]))]);
        let lanes = BTreeMap::from([("gpu".to_string(), crate::config::Lane { max_running: 1 })]);
        let text = m.render(&view(&runs, &queue, &by, &lanes), true);
        for line in [
            "runspool_up 1",
            "runspool_daemon_start_time_seconds 1767348000.123",
            "runspool_runs{state=\"queued\"} 2",
            "runspool_runs_ended_total{state=\"complete\"} 0",
            "runspool_queue_depth{lane=\"gpu\",reason=\"lane\"} 2",
            "runspool_lane_running{lane=\"gpu\"} 1",
            "runspool_lane_max_running{lane=\"gpu\"} 1",
            "runspool_claim_latency_seconds_bucket{le=\"0.01\"} 1",
            "runspool_claim_latency_seconds_bucket{le=\"0.25\"} 2",
            "runspool_claim_latency_seconds_bucket{le=\"600\"} 2",
            "runspool_claim_latency_seconds_bucket{le=\"+Inf\"} 3",
            "runspool_claim_latency_seconds_count 3",
            "runspool_claim_latency_seconds_sum 700.203",
            "# TYPE runspool_claim_latency_seconds histogram",
            "runspool_watch_info{strategy=\"native\",backend=\"inotify\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in:\n{text}");
        }
        assert!(m.render(&view(&runs, &queue, &by, &lanes), false).contains("\nrunspool_up 0\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        assert_eq!(fmt_value(f64::INFINITY), "+Inf");
        assert_eq!(fmt_value(0.5), "0.5");
        assert_eq!(fmt_value(3.0), "3");
    }
}
