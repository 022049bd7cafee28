//! `runspool-runner <runDir>`: what the daemon starts for every run; the same
//! code as `runspool runner <runDir>` (src/runner). Perf: without the CLI,
//! this binary has a third of `runspool`'s relocations, so each run's start
//! costs about 30 page faults fewer (docs/performance.md). The daemon falls
//! back to `runspool runner` when this file is not next to its own binary.
//!
//! `runspool-runner --fork-server ROOM` (Linux): the daemon's fork server,
//! which forks a runner per run instead of the daemon exec'ing this file
//! (`runspool::platform::forkserver`).

fn main() {
    let mut args = std::env::args_os().skip(1);
    match (args.next(), args.next(), args.next()) {
        (Some(dir), None, None) if !dir.to_string_lossy().starts_with('-') => std::process::exit(run(dir.as_ref())),
        #[cfg(target_os = "linux")]
        (Some(flag), Some(_room), None) if flag == runspool::platform::forkserver::FLAG => {
            std::process::exit(runspool::platform::forkserver::serve(run))
        }
        _ => {
            eprintln!(
                "usage: runspool-runner <runDir>\n\nThe runspool daemon starts this for each run it claimed; see `runspool runner --help`."
            );
            std::process::exit(2)
        }
    }
}

fn run(dir: &std::path::Path) -> i32 {
    runspool::logging::init_runner();
    runspool::runner::main(dir)
}
