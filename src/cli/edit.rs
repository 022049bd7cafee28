//! `runspool edit <run>`: change the request of a held run (PROTOCOL §15)
//! in `$EDITOR` before it starts. The edited request passes the claim's
//! validation, replaces `request.json` under `.status.lock` while the run is
//! still held, and the queued status is rebuilt from it; the runner reads
//! and validates `request.json` again when the run starts.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use serde_json::Value;

use super::text::visible;
use crate::client::{read_error, resolve, Target};
use crate::protocol::request::{self, Context, Rejection, RejectionCode, MAX_REQUEST_BYTES};
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, run, Layout, RunId};

/// The claim's checks as far as the CLI can know them: any provider (the
/// daemon's config decides, as for `submit`), the `cwd`s must exist, and a
/// request without `timeoutMs` keeps the run time limit the claim gave it.
struct EditContext {
    default_timeout_ms: u64,
}

impl Context for EditContext {
    fn provider_configured(&self, _: &str) -> bool {
        true
    }
    fn default_timeout_ms(&self) -> u64 {
        self.default_timeout_ms
    }
}

/// The status fields a queued status takes from its request's scheduling,
/// dropped from the old status before the rebuilt one's are put in.
const SCHEDULING_FIELDS: [&str; 8] =
    ["lane", "after", "afterPolicy", "notBefore", "held", "waiting", "waitingFor", "restartOf"];

pub fn edit(layout: &Layout, arg: &str) -> anyhow::Result<i32> {
    let id = match resolve(layout, arg)? {
        Target::Run(id) => id,
        Target::Pending(p) => bail!(
            "{} is still a request in the spool, not a held run; to change it, withdraw it with \
             `runspool stop {}` and submit it again (with --hold to edit it before it starts)",
            p.name,
            p.run_id
        ),
        Target::Rejected { name, error_file } => {
            let (code, _) = read_error(&error_file);
            bail!(
                "{name} was refused before it ran ({}); nothing to edit (see {})",
                visible(&code),
                error_file.display()
            )
        }
    };
    let dir = layout.run_dir(&id);
    let status = check_held(&dir, &id)?;
    let req_path = RunPaths::request(&dir);
    let original = fsutil::read_nofollow(&req_path, MAX_REQUEST_BYTES + 1)
        .with_context(|| format!("cannot read {}", req_path.display()))?;
    let draft = draft_path(&id);
    write_draft(&draft, &original)?;
    run_editor(&draft)?;
    let edited = fsutil::read_nofollow(&draft, MAX_REQUEST_BYTES + 1)
        .with_context(|| format!("cannot read the edited request {}", draft.display()))?;
    if edited == original {
        let _ = std::fs::remove_file(&draft);
        eprintln!("runspool: the request of run {id} is unchanged");
        return Ok(0);
    }
    let kept = |what: String| -> anyhow::Error {
        anyhow::anyhow!(
            "{what}\nthe run's request ({}) is unchanged; the edited text is in {} (run `runspool edit {id}` again)",
            req_path.display(),
            draft.display()
        )
    };
    let req = match check(&original, &edited, &status) {
        Ok(r) => r,
        Err(r) => return Err(kept(format!("the edited request would be rejected ({}): {}", r.code, r.message))),
    };
    // Under the status lock, as the daemon writes a hold or release: a
    // release that won the race is seen here, and one that comes after
    // finds the new request and status.
    let lock_path = RunPaths::status_lock(&dir);
    let _lock = fsutil::lock(&lock_path, false).with_context(|| format!("cannot lock {}", lock_path.display()))?;
    let current = match check_held(&dir, &id) {
        Ok(s) => s,
        Err(e) => return Err(kept(format!("{e:#}"))),
    };
    if fsutil::read_nofollow(&req_path, MAX_REQUEST_BYTES + 1).ok().as_deref() != Some(&original[..]) {
        return Err(kept(format!(
            "{} changed while it was being edited (another `runspool edit`?)",
            req_path.display()
        )));
    }
    let new_status = rebuild(&req, &id, &dir, &current);
    fsutil::write_atomic(&req_path, &edited, true).with_context(|| format!("cannot write {}", req_path.display()))?;
    let bytes = serde_json::to_vec_pretty(&new_status)?;
    let status_path = RunPaths::status(&dir);
    if let Err(e) = fsutil::write_atomic(&status_path, &bytes, true) {
        // Put the request back so the two never disagree.
        let _ = fsutil::write_atomic(&req_path, &original, true);
        return Err(kept(format!("cannot write {}: {e}", status_path.display())));
    }
    let _ = std::fs::remove_file(&draft);
    eprintln!("runspool: edited the request of run {id}; it stays held until `runspool release {id}`");
    Ok(0)
}

/// The run's status, when it is runspool's, queued and held.
fn check_held(dir: &Path, id: &RunId) -> anyhow::Result<Status> {
    let s = run::read_status(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .with_context(|| format!("run {id} has no status.json yet; try again in a moment"))?;
    if !run::ownership(dir, Some(&s)).is_ours() {
        bail!("run {id} was launched by another host (pi-subagents), not by runspool; runspool never writes into it");
    }
    if s.state != State::Queued {
        bail!("run {id} is {}, not queued and held; only a held run can be edited", visible(s.state.as_str()));
    }
    if !s.held() {
        bail!(
            "run {id} is queued but not held, so it may start at any moment; hold it first (`runspool hold {id}`), \
             then edit it"
        );
    }
    Ok(s)
}

/// The claim's validation of the edited bytes, and the same `runId`.
fn check(original: &[u8], edited: &[u8], status: &Status) -> Result<request::Request, Rejection> {
    if edited.len() as u64 > MAX_REQUEST_BYTES {
        return Err(Rejection::new(RejectionCode::TooLarge, format!("it is over {MAX_REQUEST_BYTES} bytes")));
    }
    let old: Option<Value> = serde_json::from_slice(original).ok();
    let old_id = old.as_ref().and_then(|v| v.get("runId")).cloned();
    let had_timeout = old.as_ref().is_some_and(|v| v.get("timeoutMs").is_some());
    let ctx =
        EditContext { default_timeout_ms: if had_timeout { request::DEFAULT_TIMEOUT_MS } else { status.timeout_ms } };
    let value = request::parse(edited)?;
    let req = request::validate(edited, &value, &ctx)?;
    let new_id = value.get("runId").cloned();
    if new_id != old_id {
        let shown = |v: &Option<Value>| v.as_ref().map_or("absent".to_string(), |v| v.to_string());
        return Err(Rejection::new(
            RejectionCode::InvalidField,
            format!(
                "field `runId` is {} but was {}; a run's request names its own run: put back \"runId\"",
                shown(&new_id),
                shown(&old_id)
            ),
        ));
    }
    Ok(req)
}

/// The queued status the claim would write for `req`, keeping the claim's
/// time, the hold and every other field the daemon added.
fn rebuild(req: &request::Request, id: &RunId, dir: &Path, old: &Status) -> Status {
    let mut s = Status::queued(req, id, dir, old.started_at);
    s.queue.claimed_at = old.queue.claimed_at;
    s.last_update = crate::now_ms().max(old.last_update.saturating_add(1));
    for (k, v) in &old.extra {
        if !SCHEDULING_FIELDS.contains(&k.as_str()) && !s.extra.contains_key(k) {
            s.extra.insert(k.clone(), v.clone());
        }
    }
    s.set_held(true);
    let after = s.after();
    s.set_waiting(Some("held"), &after);
    s
}

fn draft_path(id: &RunId) -> PathBuf {
    std::env::temp_dir().join(format!("runspool-edit-{id}-{}.json", uuid::Uuid::new_v4().simple()))
}

fn write_draft(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// `$EDITOR`, else `$VISUAL`, else `vi`, run by the shell (so it may carry
/// arguments, as `code --wait`) on `path`.
fn run_editor(path: &Path) -> anyhow::Result<()> {
    let editor = ["EDITOR", "VISUAL"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .find(|e| !e.trim().is_empty())
        .unwrap_or_else(|| "vi".to_string());
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(path)
        .status()
        .with_context(|| format!("cannot start the editor `{editor}` (set $EDITOR)"))?;
    if !st.success() {
        bail!(
            "the editor `{editor}` exited with {st}; the run's request is unchanged (the edited text is in {})",
            path.display()
        );
    }
    Ok(())
}
