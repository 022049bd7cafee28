//! `runspool pause`, `resume` and `max-running`: queue control through
//! `<root>/runspool/queue.json` (`store::queue`), which the daemon honours
//! at once and reports in daemon.json `queue`.

use anyhow::Context as _;

use crate::store::queue::{self, QueueFile};
use crate::store::Layout;

/// The file as it is, or a fresh one when there is none. An invalid file
/// is replaced only by `resume --reset` (`fresh`), never silently.
fn load(layout: &Layout, fresh: bool) -> anyhow::Result<QueueFile> {
    let p = queue::path(layout);
    match queue::read(&p) {
        Ok(Some(q)) => Ok(q),
        Ok(None) => Ok(QueueFile { version: 1, ..Default::default() }),
        Err(_) if fresh => {
            // A FIFO, directory or symlink is not overwritten by rename: remove it first.
            if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                anyhow::bail!("{} is a directory; remove it (rmdir) and run this again", p.display());
            }
            let _ = std::fs::remove_file(&p);
            Ok(QueueFile { version: 1, ..Default::default() })
        }
        Err(e) => anyhow::bail!("{e}"),
    }
}

/// Read-modify-write of queue.json under `runspool/queue.lock`, so two
/// clients (`pause` and `max-running` at once) never lose each other's change.
fn locked(layout: &Layout) -> anyhow::Result<std::fs::File> {
    let dir = layout.daemon_dir();
    crate::store::safety::check_layout(layout)?;
    super::args::ensure_dir(&dir)?;
    let p = layout.queue_lock();
    crate::store::fsutil::lock(&p, false)
        .with_context(|| format!("cannot lock {}; check that the root is writable by you", p.display()))?
        .ok_or_else(|| anyhow::anyhow!("cannot lock {}", p.display()))
}

fn save(layout: &Layout, mut q: QueueFile) -> anyhow::Result<()> {
    crate::store::safety::check_layout(layout)?;
    q.version = 1;
    q.updated_at = crate::now_ms();
    queue::write(layout, &q).with_context(|| {
        format!("cannot write {}; check that the root is writable by you", queue::path(layout).display())
    })
}

fn daemon_note(layout: &Layout) -> &'static str {
    if crate::store::fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false) {
        "the daemon applies it now"
    } else {
        "no daemon runs on this root: it applies when one starts"
    }
}

pub fn pause(layout: &Layout, reason: Option<String>) -> anyhow::Result<i32> {
    let _lock = locked(layout)?;
    let mut q = load(layout, false)?;
    if !q.paused {
        q.paused_at = Some(crate::now_ms());
    }
    q.paused = true;
    if reason.is_some() {
        q.reason = reason;
    }
    save(layout, q)?;
    println!(
        "queue paused: nothing is claimed from the spool and no queued run starts; running runs go on ({}; `runspool resume` ends it)",
        daemon_note(layout)
    );
    Ok(0)
}

pub fn resume(layout: &Layout, reset: bool) -> anyhow::Result<i32> {
    let _lock = locked(layout)?;
    let mut q = load(layout, reset)?;
    q.paused = false;
    q.paused_at = None;
    q.reason = None;
    if reset {
        q.max_running = None;
    }
    save(layout, q.clone())?;
    match q.max_running {
        Some(n) => println!(
            "queue resumed, max-running {n} (override kept; `runspool max-running --clear` or `resume --reset` drops it) ({})",
            daemon_note(layout)
        ),
        None => println!("queue resumed, max-running from the config ({})", daemon_note(layout)),
    }
    Ok(0)
}

pub fn max_running(layout: &Layout, n: Option<usize>, clear: bool) -> anyhow::Result<i32> {
    let _lock = locked(layout)?;
    let mut q = load(layout, false)?;
    match (n, clear) {
        (Some(0), _) => anyhow::bail!("max-running must be at least 1 (to stop starting runs use `runspool pause`)"),
        (Some(n), false) => q.max_running = Some(n),
        (None, true) => q.max_running = None,
        _ => {
            // Show what applies.
            let effective = super::health::read_report_nofollow(layout).and_then(|r| r.queue).map(|q| q.max_running);
            match (q.max_running, effective) {
                (Some(o), _) => println!("max-running {o} (override in {})", queue::path(layout).display()),
                (None, Some(e)) => println!("max-running {e} (from the daemon's config)"),
                (None, None) => println!("max-running from the config (no override)"),
            }
            return Ok(0);
        }
    }
    save(layout, q)?;
    match n {
        Some(n) => println!("max-running {n}, over the config's max_running ({})", daemon_note(layout)),
        None => println!("max-running override cleared: the config's max_running applies ({})", daemon_note(layout)),
    }
    Ok(0)
}
