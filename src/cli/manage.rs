//! `restart`, `rm`, `clean` and run-id completion: managing runspool's own
//! finished runs through the same files any client could use (PROTOCOL.md).
//! A run another host launched (no runspool request.json, §14) is never
//! restarted or removed, nor is an active run.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::client::{pending_names, resolve, Target};
use crate::protocol::ids::RequestedRunId;
use crate::protocol::request::MAX_REQUEST_BYTES;
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, index, run, Layout, RunId};

/// The run directory `arg` names; a pending or rejected request is refused with `what` to do.
fn resolve_run(layout: &Layout, arg: &str, verb: &str) -> anyhow::Result<RunId> {
    match resolve(layout, arg)? {
        Target::Run(id) => Ok(id),
        Target::Pending(p) => bail!(
            "`{arg}` is a request still in the spool ({}); there is no run to {verb} yet \
             (withdraw it with `runspool stop {}`)",
            layout.spool().join(&p.name).display(),
            p.run_id
        ),
        Target::Rejected { error_file, .. } => bail!(
            "`{arg}` was refused before any run existed (see {}); there is no run to {verb}",
            error_file.display()
        ),
    }
}

/// `runspool restart <run>`: publish the run's request again under a new run
/// id, with `restartOf` naming the old run and without the old `toolCallId`
/// and `completionOwnerId` (no host waits for the new run). Prints the new run id.
pub fn restart(layout: &Layout, arg: &str, json_out: bool) -> anyhow::Result<i32> {
    let id = resolve_run(layout, arg, "restart")?;
    let dir = layout.run_dir(&id);
    if run::ownership(&dir, None) != run::Ownership::Claimed {
        bail!(
            "{} has no request.json of runspool's: only runs runspool launched can be restarted \
             (this one was launched by another host, or refused before it ran)",
            dir.display()
        );
    }
    let s = run::read_status(&dir)?.with_context(|| format!("{} has no status.json yet", dir.display()))?;
    if s.state.is_active() {
        bail!("run {id} is still {}; stop it first (`runspool stop {id}`) or wait for it to end", s.state.as_str());
    }
    let path = RunPaths::request(&dir);
    let bytes =
        fsutil::read_nofollow(&path, MAX_REQUEST_BYTES).with_context(|| format!("cannot read {}", path.display()))?;
    let mut v: Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{} is not valid JSON", path.display()))?;
    let obj = v.as_object_mut().with_context(|| format!("{} must hold a JSON object", path.display()))?;
    let new_id = uuid::Uuid::new_v4().to_string();
    obj.insert("runId".into(), json!(new_id));
    obj.insert("restartOf".into(), json!(id));
    // The new run answers no host's tool call: a pi window must not be told it ended.
    obj.remove("toolCallId");
    obj.remove("completionOwnerId");
    let name = super::submit::publish(layout, &serde_json::to_vec_pretty(&v)?, &new_id)?;
    if json_out {
        println!("{}", json!({"runId": new_id, "restartOf": id, "request": layout.spool().join(name)}));
    } else {
        println!("{new_id}");
    }
    Ok(0)
}

/// Why runspool may not remove the run `id` (in `dir`, with status `s`
/// read by `run::read_status`, which refuses a status that is not the
/// directory's own), or None when it may.
/// A finished run's runner that still holds its lock is waited for up to `wait`.
fn refusal(id: &RunId, dir: &Path, s: &Status, wait: std::time::Duration) -> Option<String> {
    if !run::ownership(dir, Some(s)).is_ours() {
        return Some(format!("{} was launched by another host; runspool never removes it", dir.display()));
    }
    if s.state.is_active() {
        return Some(format!("run {id} is still {}; stop it first (`runspool stop {id}`)", s.state.as_str()));
    }
    // A runner finishing its last writes (the active marker's removal, its
    // exit) still holds its lock for a moment after the terminal status and
    // the result appear, so `runspool wait ID && runspool rm ID` waits for it.
    let lock = RunPaths::runner_lock(dir);
    let deadline = std::time::Instant::now() + wait;
    while fsutil::lock_held(&lock).unwrap_or(false) {
        if std::time::Instant::now() >= deadline {
            return Some(format!(
                "run {id} is {} but its runner still holds {} after {}s; check that process (`runspool status {id}` names it) and try again",
                s.state.as_str(),
                lock.display(),
                wait.as_secs()
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    None
}

/// How long `rm` waits for the runner of a finished run to exit (`clean`
/// does not wait: it leaves such a run for the next time).
const RUNNER_FINISHING: std::time::Duration = std::time::Duration::from_secs(5);

/// Remove one checked run the way retention does (results, index entries,
/// marker, then the directory via a tombstone).
fn remove(layout: &Layout, id: &RunId, s: &Status) -> anyhow::Result<()> {
    let marker = index::terminal_marker_path(layout, s);
    crate::store::results::remove_run(layout, id, s, &marker);
    let dir = layout.run_dir(id);
    if std::fs::symlink_metadata(&dir).is_ok() {
        bail!("cannot remove {}: check its permissions and run `runspool rm {id}` again", dir.display());
    }
    Ok(())
}

/// `runspool rm <run>...`: remove finished runs of runspool's. Every run is
/// checked first; nothing is removed when one is refused.
pub fn rm(layout: &Layout, args: &[String], json_out: bool) -> anyhow::Result<i32> {
    let mut checked = Vec::new();
    for arg in args {
        let id = resolve_run(layout, arg, "remove")?;
        let dir = layout.run_dir(&id);
        let s = run::read_status(&dir)
            .with_context(|| format!("nothing was removed: {} is not a run runspool can remove", dir.display()))?
            .with_context(|| format!("{} has no status.json yet; nothing was removed", dir.display()))?;
        if let Some(why) = refusal(&id, &dir, &s, RUNNER_FINISHING) {
            bail!("{why}; nothing was removed");
        }
        if !checked.iter().any(|(c, _): &(RunId, Status)| *c == id) {
            checked.push((id, s));
        }
    }
    let mut removed = Vec::new();
    for (id, s) in &checked {
        remove(layout, id, s)?;
        removed.push(id.clone());
        if !json_out {
            println!("removed {id}");
        }
    }
    if json_out {
        println!("{}", json!({"removed": removed}));
    }
    Ok(0)
}

/// `runspool clean`: remove every finished run of runspool's (older than
/// `older_than`, in `state` when given). A `paused` run is kept unless
/// `--state paused` asks for it.
pub fn clean(
    layout: &Layout,
    older_than: Option<Duration>,
    state: Option<&str>,
    dry_run: bool,
    json_out: bool,
) -> anyhow::Result<i32> {
    let want = state.map(State::from);
    if let Some(w) = want.as_ref().filter(|w| w.is_active()) {
        bail!("--state {w} names an active state; `clean` removes only finished runs (e.g. complete, failed, stopped)");
    }
    let cutoff = older_than.map(|d| crate::now_ms() - d.as_millis() as i64);
    let mut ids: Vec<String> = match std::fs::read_dir(layout.runs()) {
        Ok(rd) => rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", layout.runs().display())),
    };
    ids.sort();
    let mut removed = Vec::new();
    for name in ids {
        let Some(id) = RunId::parse(&name) else { continue };
        let dir = layout.run_dir(&id);
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let Ok(Some(s)) = run::read_status(&dir) else { continue };
        let state_ok = match &want {
            Some(w) => s.state == *w,
            None => s.state != State::Paused,
        };
        let old_enough = cutoff.is_none_or(|c| s.ended_at.is_some_and(|e| e < c));
        if !state_ok || !old_enough || refusal(&id, &dir, &s, std::time::Duration::ZERO).is_some() {
            continue;
        }
        if !dry_run {
            remove(layout, &id, &s)?;
        }
        if !json_out {
            println!("{} {id}", if dry_run { "would remove" } else { "removed" });
        }
        removed.push(id);
    }
    if json_out {
        println!("{}", json!({"removed": removed, "dryRun": dry_run}));
    } else if removed.is_empty() {
        println!("no finished runs of runspool's to remove under {}", layout.runs().display());
    }
    Ok(0)
}

/// `runspool __complete-runs`: the ids of runs and the names of pending
/// requests (never read: a TAB must not read the spool's bodies), one a
/// line, for the completion scripts.
pub fn complete_runs(layout: &Layout) -> i32 {
    let mut ids: Vec<String> = std::fs::read_dir(layout.runs())
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| RequestedRunId::is_valid(n))
                .collect()
        })
        .unwrap_or_default();
    ids.extend(pending_names(layout));
    ids.sort();
    ids.dedup();
    for id in ids {
        println!("{id}");
    }
    0
}
