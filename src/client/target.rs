//! What a run argument names. A request is a run from the moment it is in
//! the spool: a client names a run by its id (or a unique prefix), and that
//! id may still belong to a request waiting in `spool/` (by the run id it
//! will get, or by its file name), or to one refused or withdrawn before any
//! run directory existed.
//!
//! The bottom of the client's readers: [`super::Client::resolve`] and every
//! command of the CLI that takes a run argument use it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use serde_json::Value;

use crate::protocol::ids::RequestedRunId;
use crate::protocol::request::MAX_REQUEST_BYTES;
use crate::store::layout::RunPaths;
use crate::store::spool::{self, classify_name, Name};
use crate::store::{fsutil, Layout, RunId};

/// What a run argument names ([`super::Client::resolve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A run directory: claimed (maybe without its status.json yet),
    /// rejected with a run, or another host's run.
    Run(RunId),
    /// A request still in the spool.
    Pending(Pending),
    /// Refused or withdrawn before any run directory existed.
    Rejected {
        /// Its file name in the spool when it was published.
        name: String,
        /// Its error file in `spool/rejected/` (PROTOCOL §2.3).
        error_file: PathBuf,
    },
}

impl Target {
    /// The run id the target has or gets: None for a rejection whose spool
    /// name is not in the run-id grammar.
    pub fn run_id(&self) -> Option<RunId> {
        match self {
            Target::Run(id) => Some(id.clone()),
            Target::Pending(p) => Some(p.run_id.clone()),
            Target::Rejected { name, .. } => RunId::parse(name.trim_end_matches(".json")),
        }
    }
}

/// A request waiting in the spool to be claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The run id it gets when claimed: the body's `runId`, else the one the
    /// daemon derives from the entry (`spool::claim_id`).
    pub run_id: RunId,
    /// Its file name in the spool.
    pub name: String,
    /// When it was published (the entry's mtime), ms.
    pub since_ms: i64,
}

/// A run directory of that id (claimed, half-claimed or another host's).
fn run_exists(layout: &Layout, id: &RunId) -> bool {
    let dir = layout.run_dir(id);
    std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
        && (RunPaths::status(&dir).exists() || RunPaths::request(&dir).exists())
}

/// The spool entry `name`, if it is one the daemon could claim.
fn entry(layout: &Layout, name: &str) -> Option<Pending> {
    if classify_name(name) != Name::Candidate {
        return None;
    }
    let path = layout.spool().join(name);
    let md = std::fs::symlink_metadata(&path).ok()?;
    if !md.is_file() || md.len() > MAX_REQUEST_BYTES {
        return None;
    }
    // Without a valid runId the daemon derives one from the entry (an invalid
    // one gets the request rejected, and no run of that name is created).
    let run_id = body_run_id(&path).and_then(|id| RunId::parse(&id)).unwrap_or_else(|| spool::claim_id(&md, name));
    Some(Pending { run_id, name: name.to_string(), since_ms: md.mtime() * 1000 + md.mtime_nsec() / 1_000_000 })
}

/// How much of a request `body_run_id` reads first: `runId` is near the top
/// of what `submit` writes, and a request is up to 1 MiB (its steps).
const RUN_ID_PREFIX: u64 = 64 * 1024;

/// The valid top-level `runId` of the request at `path`, found by a
/// streaming parse that stops at that key: from its first 64 KiB when they
/// hold it, else from the whole file (at most `MAX_REQUEST_BYTES`). None: no
/// valid `runId`, or not a JSON object. The spool is anyone's to write:
/// never a link followed or a FIFO waited on (`read_nofollow`).
fn body_run_id(path: &Path) -> Option<String> {
    let head = fsutil::read_nofollow(path, RUN_ID_PREFIX).ok()?;
    let found = match top_level_run_id(&head) {
        Err(e) if e.is_eof() && head.len() as u64 == RUN_ID_PREFIX => {
            top_level_run_id(&fsutil::read_nofollow(path, MAX_REQUEST_BYTES).ok()?)
        }
        r => r,
    };
    found.ok().flatten().filter(|s| RequestedRunId::is_valid(s))
}

/// The top-level `runId` string of the JSON object at the start of `bytes`
/// (Ok(None): the object has none, or it is not a string). Stops reading
/// at the key: what follows is not looked at.
fn top_level_run_id(bytes: &[u8]) -> Result<Option<String>, serde_json::Error> {
    use serde::de::{Deserializer as _, Error as _, IgnoredAny, MapAccess, Visitor};
    struct Find<'a>(&'a mut Option<Option<String>>);
    impl<'de> Visitor<'de> for Find<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
            while let Some(k) = m.next_key::<String>()? {
                if k == "runId" {
                    let v: Value = m.next_value()?;
                    *self.0 = Some(v.as_str().map(str::to_string));
                    // Found: stop here rather than read the rest.
                    return Err(A::Error::custom("runId found"));
                }
                m.next_value::<IgnoredAny>()?;
            }
            *self.0 = Some(None);
            Ok(())
        }
    }
    let mut found = None;
    let r = serde_json::Deserializer::from_slice(bytes).deserialize_map(Find(&mut found));
    match (found, r) {
        (Some(f), _) => Ok(f),
        (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(None),
    }
}

/// Every claimable entry in the spool, each body read as the iterator gets
/// to it: a search that stops at its match reads no further.
pub(crate) fn entries(layout: &Layout) -> impl Iterator<Item = Pending> + '_ {
    std::fs::read_dir(layout.spool())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(move |n| entry(layout, &n))
}

/// Ids this short are shown whole: cutting them saves little and hides a chosen name.
pub const SHORT_ID_KEEP: usize = 12;

/// The body of the pending request `p` (bounded, never through a link),
/// when it is still in the spool and a JSON object.
pub fn pending_request(layout: &Layout, p: &Pending) -> Option<Value> {
    let b = fsutil::read_nofollow(&layout.spool().join(&p.name), MAX_REQUEST_BYTES).ok()?;
    serde_json::from_slice::<Value>(&b).ok().filter(Value::is_object)
}

/// The shortest prefix of each of `ids`, at least 8 characters, that no
/// other id of `all` (every run and pending request of the root) starts
/// with, so `resolve` finds it again. An id of at most `SHORT_ID_KEEP`
/// characters (a name someone chose, like `build-42`), or one no prefix sets
/// apart, stays whole.
pub fn short_ids<'a>(all: impl IntoIterator<Item = &'a str>, ids: &[&'a str]) -> Vec<String> {
    let mut sorted: Vec<&str> = all.into_iter().chain(ids.iter().copied()).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let common = |a: &str, b: &str| a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    ids.iter()
        .map(|id| {
            let i = sorted.binary_search(id).unwrap_or(0);
            let before = i.checked_sub(1).map(|j| common(sorted[j], id)).unwrap_or(0);
            let after = sorted.get(i + 1).map(|n| common(n, id)).unwrap_or(0);
            let len = before.max(after).saturating_add(1).max(8);
            if len >= id.chars().count() || id.chars().count() <= SHORT_ID_KEEP {
                id.to_string()
            } else {
                id.chars().take(len).collect()
            }
        })
        .collect()
}

/// The names the requests waiting in the spool answer to, for completion:
/// their spool file names without `.json` (`submit` names a request by its
/// run id), from the listing and each entry's lstat, never their bodies.
pub fn pending_names(layout: &Layout) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(layout.spool()) else { return vec![] };
    rd.flatten()
        .filter(|e| e.metadata().is_ok_and(|m| m.is_file() && m.len() <= MAX_REQUEST_BYTES))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| classify_name(n) == Name::Candidate)
        .filter_map(|n| n.strip_suffix(".json").map(str::to_string))
        .collect()
}

/// An exact match of `arg`: a run id, a pending request's run id or file
/// name, or a settled rejection's name. When the spool's bodies were all
/// read without a match, the entries they make are left in `listed` for a
/// prefix search to reuse.
fn exact(layout: &Layout, arg: &str, listed: &mut Option<Vec<Pending>>) -> Option<Target> {
    let id = RunId::parse(arg);
    if let Some(id) = id.as_ref().filter(|id| run_exists(layout, id)) {
        return Some(Target::Run(id.clone()));
    }
    let stem = arg.strip_suffix(".json").unwrap_or(arg);
    if let Some(p) = entry(layout, &format!("{stem}.json")) {
        return Some(Target::Pending(p));
    }
    // Only a valid id can be a pending request's run id: then the bodies, to the first match.
    if RequestedRunId::is_valid(arg) {
        let mut seen = Vec::new();
        for p in entries(layout) {
            if p.run_id.as_str() == arg {
                return Some(Target::Pending(p));
            }
            seen.push(p);
        }
        *listed = Some(seen);
    }
    // Claimed between the two looks: the claim's rename moved it into its run.
    if let Some(id) = id.filter(|id| run_exists(layout, id)) {
        return Some(Target::Run(id));
    }
    let error_file = layout.rejected_error_file(stem);
    if std::fs::symlink_metadata(&error_file).is_ok_and(|m| m.is_file()) {
        return Some(Target::Rejected { name: format!("{stem}.json"), error_file });
    }
    // The file name `<runId>.json` of a request claimed since it was
    // published (`runspool submit` names requests so): its run, when that
    // run's request names itself `stem`.
    if let Some(id) = RunId::parse(stem).filter(|id| stem != arg && claimed_from(layout, id)) {
        return Some(Target::Run(id));
    }
    None
}

/// Does run `id` hold a request of runspool's whose `runId` is `id`?
fn claimed_from(layout: &Layout, id: &RunId) -> bool {
    if !RequestedRunId::is_valid(id) {
        return false;
    }
    let request = RunPaths::request(&layout.run_dir(id));
    let body =
        fsutil::read_nofollow(&request, MAX_REQUEST_BYTES).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    body.as_ref().and_then(|b| b.get("runId")).and_then(Value::as_str) == Some(id.as_str())
}

/// Resolve a run argument: a full run id (of any length), a pending request's
/// run id or spool file name, or a unique prefix of 8 or more characters of
/// either kind of run id.
pub fn resolve(layout: &Layout, arg: &str) -> anyhow::Result<Target> {
    // A rejection moves the entry out of the spool a moment before its error
    // file and run appear: look again before saying there is nothing.
    let mut listed = None;
    for attempt in 0..3 {
        if let Some(t) = exact(layout, arg, &mut listed) {
            return Ok(t);
        }
        let stem = arg.strip_suffix(".json").unwrap_or(arg);
        let moving = [arg.to_string(), format!("{stem}.json")]
            .iter()
            .any(|n| std::fs::symlink_metadata(layout.rejected().join(n)).is_ok());
        if attempt == 2 || !moving {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if arg.len() < 8 {
        bail!(
            "no run or pending request `{arg}` under {}; give the full run id or a prefix of 8 or more characters \
             (see `runspool list`)",
            layout.root.display()
        );
    }
    let mut found: Vec<Target> = Vec::new();
    if let Ok(rd) = std::fs::read_dir(layout.runs()) {
        for e in rd.flatten() {
            if let Some(id) = e.file_name().to_str().filter(|n| n.starts_with(arg)).and_then(RunId::parse) {
                found.push(Target::Run(id));
            }
        }
    }
    // No run id starts with what no run id could start with: no body read then.
    let pending =
        if RequestedRunId::is_valid(arg) { listed.unwrap_or_else(|| entries(layout).collect()) } else { vec![] };
    for p in pending {
        if p.run_id.starts_with(arg) && !found.iter().any(|t| matches!(t, Target::Run(id) if *id == p.run_id)) {
            found.push(Target::Pending(p));
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => bail!("no run or pending request matches `{arg}` under {}; see `runspool list`", layout.root.display()),
        n => {
            let ids: Vec<&str> = found
                .iter()
                .map(|t| match t {
                    Target::Run(id) => id.as_str(),
                    Target::Pending(p) => p.run_id.as_str(),
                    Target::Rejected { name, .. } => name.as_str(),
                })
                .collect();
            bail!("`{arg}` matches {n} runs ({}); give more characters", ids.join(", "))
        }
    }
}

/// Wait until the pending request `p` leaves the spool, or `give_up` passes.
/// Ok(true): its run directory exists (claimed, or rejected with a run);
/// Ok(false): it left without a run (rejected or withdrawn without a run id,
/// see its error file) or time ran out while it still waits.
pub fn await_claim(layout: &Layout, p: &Pending, give_up: Option<std::time::Instant>) -> anyhow::Result<bool> {
    let path = layout.spool().join(&p.name);
    let mut gone_since: Option<std::time::Instant> = None;
    loop {
        if RunPaths::status(&layout.run_dir(&p.run_id)).exists() {
            return Ok(true);
        }
        let in_spool = std::fs::symlink_metadata(&path).is_ok();
        let half_claimed = RunPaths::request(&layout.run_dir(&p.run_id)).exists();
        if !in_spool && !half_claimed {
            let stem = p.name.trim_end_matches(".json");
            if layout.rejected_error_file(stem).exists() {
                return Ok(false);
            }
            let since = *gone_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > Duration::from_secs(10) {
                bail!(
                    "request {} left the spool but neither run {} nor a rejection in {} appeared; \
                     another client may have removed it",
                    path.display(),
                    layout.run_dir(&p.run_id).display(),
                    layout.rejected().display()
                );
            }
        } else {
            gone_since = None;
        }
        if give_up.is_some_and(|g| std::time::Instant::now() >= g) {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Is a daemon holding the root's lock?
pub fn daemon_running(layout: &Layout) -> bool {
    fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false)
}

/// Where the error file of a rejection or withdrawal of the entry `name` is.
pub fn error_file(layout: &Layout, name: &str) -> PathBuf {
    layout.rejected_error_file(name.trim_end_matches(".json"))
}

/// Read an error file from rejected/: (code, message); `?` and a pointer
/// to the file for what it does not hold.
pub fn read_error(p: &Path) -> (String, String) {
    let v: Value =
        fsutil::read_nofollow(p, 1 << 20).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    (v["code"].as_str().unwrap_or("?").to_string(), v["message"].as_str().unwrap_or("see the error file").to_string())
}

#[cfg(test)]
mod tests {
    use super::{short_ids, top_level_run_id};

    #[test]
    fn short_ids_are_the_shortest_unique_prefix_of_8_or_more() {
        let all = [
            "7d0e4c2a-31b5-4f6e-9a0c-5e2b8f1d9c47",
            "7d0e4c2a-9999-4f6e-9a0c-5e2b8f1d9c47",
            "b13c152b-fadb-494c-966a-e72ef0c1f934",
            "b13c152b",
            "build-42",
            "nightly-build-of-the-week",
            "nightly-build-of-the-month",
        ];
        let got = short_ids(all, &all);
        assert_eq!(
            got,
            [
                "7d0e4c2a-3",
                "7d0e4c2a-9",
                "b13c152b-",
                "b13c152b",
                "build-42",
                "nightly-build-of-the-w",
                "nightly-build-of-the-m"
            ]
        );
        assert_eq!(short_ids([], &["a8f3e1c2-0000-4000-8000-000000000000"]), ["a8f3e1c2"]);
    }

    #[test]
    fn run_id_is_the_top_level_key_only_and_stops_the_read() {
        let id = |b: &str| top_level_run_id(b.as_bytes()).ok().flatten();
        assert_eq!(id(r#"{"a":{"runId":"inner"},"runId":"outer"}"#).as_deref(), Some("outer"));
        assert_eq!(id(r#"{"run\u0049d":"escaped"}"#).as_deref(), Some("escaped"));
        // Found before the end: what follows (cut off, or not JSON) is not read.
        assert_eq!(id(r#"{"runId":"early","steps":[{"x":"#).as_deref(), Some("early"));
        assert_eq!(id(r#"{"steps":[],"version":1}"#), None);
        assert_eq!(id(r#"{"runId":7}"#), None);
        assert!(top_level_run_id(br#"{"steps":["cut"#).is_err_and(|e| e.is_eof()));
        assert!(top_level_run_id(b"[1]").is_err());
    }
}
