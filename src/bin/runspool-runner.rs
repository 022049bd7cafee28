//! `runspool-runner <runDir>`: what the daemon starts for every run; the same
//! code as `runspool runner <runDir>` (src/runner). Perf: without the CLI,
//! this binary has a third of `runspool`'s relocations, so each run's start
//! costs about 30 page faults fewer (docs/performance.md). The daemon falls
//! back to `runspool runner` when this file is not next to its own binary.

fn main() {
    let mut args = std::env::args_os().skip(1);
    match (args.next(), args.next()) {
        (Some(dir), None) if !dir.to_string_lossy().starts_with('-') => {
            runspool::logging::init_runner();
            std::process::exit(runspool::runner::main(std::path::Path::new(&dir)))
        }
        _ => {
            eprintln!(
                "usage: runspool-runner <runDir>\n\nThe runspool daemon starts this for each run it claimed; see `runspool runner --help`."
            );
            std::process::exit(2)
        }
    }
}
