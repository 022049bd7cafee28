//! Print every run's events as they are written, one stream across runs,
//! for a while (`runspool events --follow` does the same, for ever).
//!
//! ```text
//! cargo run --example follow_events -- [--root DIR] [SECONDS]
//! ```
//!
//! Each event is printed once, whatever runs start, end or are removed
//! meanwhile; those already written before it started are not news.

use std::time::{Duration, Instant};

use runspool::client::Client;

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let root = match args.first().map(String::as_str) {
        Some("--root") if args.len() >= 2 => {
            let root = args.remove(1);
            args.remove(0);
            Some(root.into())
        }
        _ => None,
    };
    let secs: u64 = args.first().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let client = Client::new(root);
    eprintln!("events under {} for {secs} s", client.root().display());
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut seen = 0;
    // `None`: from now on; `Some(ms)` would start at that time, from every run's first event.
    for event in client.events(None, true).until(deadline) {
        let event = event?;
        println!("{:>13} {} {}", event.ts().unwrap_or(0), event.run_id, event.kind().unwrap_or("?"));
        seen += 1;
    }
    eprintln!("{seen} events");
    Ok(())
}
