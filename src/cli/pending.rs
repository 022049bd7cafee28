//! `status` and `stop` of a request still in the spool, or of one refused or
//! withdrawn before any run directory existed (see `target`).

use std::path::Path;

use super::text::{age, visible};
use crate::client::{daemon_running, read_error, Client, Pending, WithdrawOutcome, Withdrawn};
use crate::store::{Layout, RunId};

/// `status` of a request still in the spool.
pub(crate) fn status(layout: &Layout, p: &Pending, json: bool) -> anyhow::Result<i32> {
    let path = layout.spool().join(&p.name);
    let running = daemon_running(layout);
    if json {
        let v = serde_json::json!({
            "runId": p.run_id, "state": "pending", "spoolFile": path.display().to_string(),
            "publishedAt": p.since_ms, "daemonRunning": running,
            "queuePaused": crate::store::queue::read(&crate::store::queue::path(layout)).ok().flatten().is_some_and(|q| q.paused),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("run       {}", p.run_id);
    println!("state     pending in spool (for {})", age(p.since_ms));
    println!("request   {}", path.display());
    // A paused queue claims nothing from the spool (runspool/queue.json).
    let paused = crate::store::queue::read(&crate::store::queue::path(layout)).ok().flatten().filter(|q| q.paused);
    if let Some(q) = &paused {
        let why = q.reason.as_deref().map(|r| format!(" ({})", visible(r))).unwrap_or_default();
        let since = q.paused_at.map(|t| format!(" for {}", age(t))).unwrap_or_default();
        println!(
            "queue     paused{since}{why}: nothing is claimed from the spool until `runspool resume`{}",
            if running { "" } else { " (and a daemon runs)" }
        );
    }
    if running && paused.is_none() {
        println!("daemon    running; it claims the request in turn");
    } else if running {
        println!("daemon    running; it claims the request once the queue is resumed");
    } else {
        println!(
            "daemon    not running under {}: start one (`runspool daemon` or `runspool service start`) to run it",
            layout.root.display()
        );
    }
    println!("withdraw  runspool stop {}", p.run_id);
    Ok(0)
}

/// `status` of a run claimed a moment ago, whose status.json the daemon
/// writes next (at its next start, when it stopped in between).
pub(crate) fn claimed_status(layout: &Layout, id: &RunId, json: bool) -> anyhow::Result<i32> {
    let dir = layout.run_dir(id);
    let running = daemon_running(layout);
    if json {
        let v = serde_json::json!({
            "runId": id, "state": "claimed", "runDir": dir.display().to_string(), "daemonRunning": running,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("run       {id}");
    println!("state     claimed, about to be queued (its status.json is written next)");
    println!("dir       {}", dir.display());
    if !running {
        println!(
            "daemon    not running under {}: the next one to start queues it (`runspool daemon` or `runspool service start`)",
            layout.root.display()
        );
    }
    println!("stop      runspool stop {id}");
    Ok(0)
}

/// `status` of a request refused or withdrawn before it had a run directory.
pub(crate) fn rejected_status(name: &str, error_file: &Path) -> anyhow::Result<i32> {
    let (code, message) = read_error(error_file);
    let (code, message) = (visible(&code), visible(&message));
    println!("request   {name}");
    println!("state     {} before it ran ({code})", if code == "withdrawn" { "withdrawn" } else { "rejected" });
    println!("error     {message}");
    println!("details   {}", error_file.display());
    Ok(0)
}

/// `stop` of a request still in the spool: withdraw it, or, when the daemon
/// claimed it first, hand back its run id so the run is stopped as usual.
/// None: withdrawn, nothing more to do.
pub(crate) fn stop(layout: &Layout, p: &Pending, reason: Option<&str>) -> anyhow::Result<Option<RunId>> {
    match Client::from_layout(layout.clone()).withdraw(p, reason)? {
        WithdrawOutcome::ClaimedFirst(id) => {
            eprintln!("runspool: the daemon claimed {id} first; stopping its run");
            Ok(Some(id))
        }
        WithdrawOutcome::Withdrawn(w) => {
            say_withdrawn(&w);
            Ok(None)
        }
    }
}

/// Say how the request `w` was withdrawn.
pub(crate) fn say_withdrawn(w: &Withdrawn) {
    match (&w.entry, &w.unfinished) {
        (Some(entry), None) => eprintln!(
            "runspool: withdrew {} before any daemon claimed it; it never runs (moved to {}, code `withdrawn`)",
            w.run_id,
            entry.display()
        ),
        (Some(entry), Some(why)) => eprintln!(
            "runspool: withdrew {} before any daemon claimed it; it never runs (moved to {}). \
             Not finished yet: {why}; the daemon writes its error file (code `withdrawn`) and run \
             once there is space (at its next start, or its next rescan while it runs)",
            w.run_id,
            entry.display(),
            why = visible(why)
        ),
        (None, _) => eprintln!(
            "runspool: {} was withdrawn before any daemon claimed it; it never runs (see {})",
            w.run_id,
            w.error_file.display()
        ),
    }
}
