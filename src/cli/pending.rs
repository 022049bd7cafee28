//! `status` and `stop` of a request still in the spool, or of one refused or
//! withdrawn before any run directory existed (see `target`).

use std::path::Path;
use std::time::Duration;

use anyhow::bail;

use super::target::{age, await_claim, daemon_running, error_file, read_error, Pending};
use super::text::visible;
use crate::daemon::spool;
use crate::store::{Layout, RunId};

/// `status` of a request still in the spool.
pub(crate) fn status(layout: &Layout, p: &Pending, json: bool) -> anyhow::Result<i32> {
    let path = layout.spool().join(&p.name);
    let running = daemon_running(layout);
    if json {
        let v = serde_json::json!({
            "runId": p.run_id, "state": "pending", "spoolFile": path.display().to_string(),
            "publishedAt": p.since_ms, "daemonRunning": running,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("run       {}", p.run_id);
    println!("state     pending in spool (for {})", age(p.since_ms));
    println!("request   {}", path.display());
    if running {
        println!("daemon    running; it claims the request in turn");
    } else {
        println!(
            "daemon    not running under {}: start one (`runspool daemon` or `runspool service start`) to run it",
            layout.root.display()
        );
    }
    println!("withdraw  runspool stop {}", p.run_id);
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
    use anyhow::Context as _;
    let path = layout.spool().join(&p.name);
    let message = format!(
        "withdrawn by `runspool stop` before it was claimed{}",
        reason.map(|r| format!(": {r}")).unwrap_or_default()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let outcome = match spool::withdraw(layout, &p.name, &message) {
            Ok(o) => o,
            // Still in the spool: nothing was withdrawn. Gone: settled by
            // someone, maybe us; what is on disk says how (below).
            Err(e) if std::fs::symlink_metadata(&path).is_ok() => {
                return Err(e).with_context(|| format!("cannot withdraw {}", path.display()))
            }
            Err(e) => {
                eprintln!(
                    "runspool: {} left the spool while being withdrawn ({}); looking at where it went",
                    path.display(),
                    visible(&e.to_string())
                );
                spool::Withdrawal::Gone
            }
        };
        match outcome {
            spool::Withdrawal::Withdrawn { entry, unfinished: None, .. } => {
                eprintln!(
                    "runspool: withdrew {} before any daemon claimed it; it never runs (moved to {}, code `withdrawn`)",
                    p.run_id,
                    entry.display()
                );
                return Ok(None);
            }
            spool::Withdrawal::Withdrawn { entry, unfinished: Some(why), .. } => {
                eprintln!(
                    "runspool: withdrew {} before any daemon claimed it; it never runs (moved to {}). \
                     Not finished yet: {why}; the daemon writes its error file (code `withdrawn`) and run \
                     once there is space (at its next start, or its next rescan while it runs)",
                    p.run_id,
                    entry.display(),
                    why = visible(&why)
                );
                return Ok(None);
            }
            spool::Withdrawal::Gone => break,
            spool::Withdrawal::Busy if std::time::Instant::now() > deadline => bail!(
                "{} stayed locked for 30 s (a writer still at work on it?); nothing was withdrawn: try again",
                path.display()
            ),
            spool::Withdrawal::Busy => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    // The daemon settled it first: stop the run it made. Mid-claim (its
    // request is in the run, status.json not yet), the stop goes into the
    // run's inbox at once: `inspect::stop` writes it there.
    if crate::store::run::claimed(&layout.run_dir(&p.run_id)) {
        eprintln!("runspool: the daemon claimed {} first; stopping its run", p.run_id);
        return Ok(Some(p.run_id.clone()));
    }
    if await_claim(layout, p, Some(std::time::Instant::now() + Duration::from_secs(30)))? {
        eprintln!("runspool: the daemon claimed {} first; stopping its run", p.run_id);
        return Ok(Some(p.run_id.clone()));
    }
    let ef = error_file(layout, &p.name);
    if ef.exists() {
        let (code, message) = read_error(&ef);
        let (code, message) = (visible(&code), visible(&message));
        if code == "withdrawn" {
            eprintln!(
                "runspool: {} was withdrawn before any daemon claimed it; it never runs (see {})",
                p.run_id,
                ef.display()
            );
            return Ok(None);
        }
        bail!("{} was refused before it ran ({code}: {message}); nothing to stop (see {})", p.name, ef.display());
    }
    bail!(
        "{} left the spool but run {} did not appear within 30 s; try `runspool stop {}` again",
        path.display(),
        layout.run_dir(&p.run_id).display(),
        p.run_id
    )
}
