//! The command line.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "runspool-bench",
    about = "Benchmark runspool against a minimal reference pipeline (see docs/performance.md)"
)]
pub struct Args {
    /// The runspool binary (default: `runspool` next to this binary)
    #[arg(long, value_name = "PATH")]
    pub runspool: Option<PathBuf>,
    /// Directory for the temporary roots (a disk path, or a tmpfs such as /dev/shm)
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Label for the report (default: the file system type of --dir)
    #[arg(long)]
    pub label: Option<String>,
    /// Requests in the latency test (each pipeline)
    #[arg(long, default_value_t = 500)]
    pub latency_n: usize,
    /// Runs per burst
    #[arg(long, default_value_t = 2000)]
    pub burst_n: usize,
    /// Bursts per pipeline and max_running, alternating the order; the medians are reported
    #[arg(long, default_value_t = 1)]
    pub burst_repeat: usize,
    /// max_running values for the bursts
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    pub parallel: Vec<usize>,
    /// Length of the idle measurement, seconds
    #[arg(long, default_value_t = 60)]
    pub idle_secs: u64,
    /// Fabricated terminal runs for the idle, scale and start-up tests
    #[arg(long, default_value_t = 100_000)]
    pub runs: usize,
    /// Fabricated active runs for the scale and start-up tests
    #[arg(long, default_value_t = 1000)]
    pub active: usize,
    /// CLI calls timed per scale measurement
    #[arg(long, default_value_t = 20)]
    pub calls: usize,
    /// Requests dropped at once in the backlog test (memory under a backlog)
    #[arg(long, default_value_t = 20_000)]
    pub backlog_n: usize,
    /// max_running of the backlog test
    #[arg(long, default_value_t = 8)]
    pub backlog_parallel: usize,
    /// Runs with one external-job step (command provider) in the bridge test, each pipeline
    #[arg(long, default_value_t = 20)]
    pub bridge_n: usize,
    /// Phases to run
    #[arg(long, value_delimiter = ',', default_value = "latency,bridge,burst,backlog,idle,scale,adopt")]
    pub phases: Vec<String>,
    /// Also write the results as JSON here
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Keep the temporary roots (for inspection)
    #[arg(long)]
    pub keep: bool,
    /// Also run the burst and latency tests through pueue (`pueue add`), side by
    /// side; installs pueue with `cargo install` when it is not on PATH or in ~/.cargo/bin
    #[arg(long)]
    pub pueue: bool,
    /// Tasks per pueue burst (pueue runs about 5 trivial tasks/s, hence smaller than --burst-n)
    #[arg(long, default_value_t = 200)]
    pub pueue_burst_n: usize,
    /// Tasks in the pueue latency test
    #[arg(long, default_value_t = 50)]
    pub pueue_latency_n: usize,
    /// pueue version `cargo install` asks for when pueue is missing
    #[arg(long, default_value = "4.0.4")]
    pub pueue_version: String,
}

impl Args {
    /// Whether `--phases` asks for `phase`.
    pub fn has(&self, phase: &str) -> bool {
        self.phases.iter().any(|x| x == phase)
    }
}
