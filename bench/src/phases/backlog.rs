//! Memory under a backlog: `n` requests dropped into the spool at once, at
//! `max_running`; the daemon's peak RSS (`VmHWM`) while it drains them and its
//! RSS (`VmRSS`) once every run is terminal and 2 s have passed. Side by side:
//! the reference daemon on the same backlog, and a fresh runspool daemon
//! started on the drained root (what the same finished runs cost a daemon
//! that never held the backlog).

use std::time::{Duration, Instant};

use crate::phases::burst::drop_and_drain;
use crate::phases::idle::settle;
use crate::pipelines::{Daemon, Env, Kind};
use crate::procfs;

/// One pipeline through the backlog.
#[derive(Clone, Copy, Debug)]
pub struct BacklogSide {
    /// Drop of the first request → the last run terminal.
    pub secs: f64,
    pub peak_rss_kib: u64,
    /// `VmRSS` 2 s after the last run ended.
    pub after_rss_kib: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct BacklogResult {
    pub n: usize,
    pub max_running: usize,
    pub runspool: BacklogSide,
    pub reference: BacklogSide,
    /// `VmRSS` of a fresh runspool daemon on the drained root, once its start-up is over.
    pub fresh_rss_kib: u64,
}

/// Drop `n` requests at once into `kind`'s daemon `d` on `root` and wait until all are terminal.
fn drain(kind: Kind, root: &std::path::Path, d: &Daemon, n: usize) -> anyhow::Result<BacklogSide> {
    let name = format!("backlog-{}", kind.name());
    let (secs, _) = drop_and_drain(kind, root, &name, "backlog", n, Duration::from_millis(20))?;
    let peak_rss_kib = procfs::status_kib(d.pid(), "VmHWM:").unwrap_or(0);
    std::thread::sleep(Duration::from_secs(2));
    let after_rss_kib = procfs::status_kib(d.pid(), "VmRSS:").unwrap_or(0);
    Ok(BacklogSide { secs, peak_rss_kib, after_rss_kib })
}

/// The backlog through both pipelines, then a fresh runspool daemon on runspool's drained root.
pub fn measure(env: &Env, n: usize, max_running: usize) -> anyhow::Result<BacklogResult> {
    let n = n.max(1);
    let root = env.fresh_root("backlog-runspool")?;
    let d = env.start(Kind::Runspool, &root, max_running)?;
    let runspool = drain(Kind::Runspool, &root, &d, n)?;
    drop(d);
    let t = Instant::now();
    let fresh = env.start(Kind::Runspool, &root, max_running)?;
    settle(&fresh, t);
    let fresh_rss_kib = procfs::status_kib(fresh.pid(), "VmRSS:").unwrap_or(0);
    drop(fresh);
    let rroot = env.fresh_root("backlog-reference")?;
    let r = env.start(Kind::Reference, &rroot, max_running)?;
    let reference = drain(Kind::Reference, &rroot, &r, n)?;
    drop(r);
    Ok(BacklogResult { n, max_running, runspool, reference, fresh_rss_kib })
}
