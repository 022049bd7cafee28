//! `runspool events`: every run's events as one stream of JSON lines
//! (`client::Events`).

use std::io::Write as _;

use anyhow::bail;

use super::text::visible;
use crate::client::Client;
use crate::store::Layout;

/// `--since`: ms since the epoch (digits only), or a duration ago (`30s`, `5m`, `2d`).
fn since_ms(arg: &str) -> anyhow::Result<i64> {
    let arg = arg.trim();
    if !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_digit()) {
        return arg.parse().map_err(|_| anyhow::anyhow!("--since {arg} is too large for a time in ms"));
    }
    match super::args::parse_duration(arg) {
        Ok(d) => Ok(crate::now_ms() - d.as_millis() as i64),
        Err(e) => bail!("--since {e}; or give a time in ms since the epoch (digits only)"),
    }
}

/// Print each event line once, as it is in its run's events.jsonl; with
/// `follow`, keep printing until stdout closes or the command is interrupted.
pub fn events(layout: &Layout, since: Option<&str>, follow: bool) -> anyhow::Result<i32> {
    let since = since.map(since_ms).transpose()?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut events = Client::from_layout(layout.clone()).events(since, follow);
    while let Some(e) = events.next() {
        match e {
            Ok(e) => writeln!(out, "{}", e.line)?,
            // The runs root could not be listed: say so, and go on looking when following.
            Err(e) if follow => eprintln!("runspool: {}", visible(&e.to_string())),
            Err(e) => bail!("cannot read the runs under {}: {e}", layout.runs().display()),
        }
        // Nothing more ready: what was read goes out before the next wait.
        if follow && events.buffered() == 0 {
            out.flush()?;
        }
    }
    out.flush()?;
    Ok(0)
}
