//! Submit a command, print its output as it comes, and wait for its end,
//! with the client core the `runspool` CLI is built on (`runspool::client`).
//!
//! ```text
//! cargo run --example submit_and_wait -- [--root DIR] [CMD ARGS...]
//! ```
//!
//! Without a command it runs `echo hello`. A daemon must run on the root
//! (`runspool daemon`) for the run to start; until one does, the request
//! waits in the spool and so does this example.

use std::io::Write as _;
use std::time::Duration;

use runspool::client::{Client, WaitError};

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
    if args.is_empty() {
        args = vec!["echo".into(), "hello".into()];
    }
    let client = Client::new(root);
    let id = client.submit_argv(&args)?;
    eprintln!("submitted {id} under {}", client.root().display());
    if !client.daemon_running() {
        eprintln!("no daemon runs on this root: start one with `runspool --root {} daemon`", client.root().display());
    }
    // Where it is right after submit: pending, claimed, queued, running or ended, never "not found".
    eprintln!("stage now: {}", client.status(id.as_str())?.name());

    // Its steps' output as it comes; the iterator ends when the run does.
    let mut stdout = std::io::stdout();
    for out in client.follow(id.as_str())? {
        stdout.write_all(&out?.data)?;
    }
    stdout.flush()?;

    match client.wait(id.as_str(), Some(Duration::from_secs(600))) {
        Ok(status) => {
            eprintln!("{id} ended {} (exit {})", status.state, status.exit_code.unwrap_or(1));
            std::process::exit(status.exit_code.unwrap_or(1));
        }
        Err(WaitError::Timeout { stage, .. }) => eprintln!("{id} is still {} after 10 minutes", stage.name()),
        Err(e) => eprintln!("{id}: {e}"),
    }
    std::process::exit(1)
}
