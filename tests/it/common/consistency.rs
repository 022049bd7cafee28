//! The whole-root consistency check (spool, temp files, runs, active and
//! terminal markers, results): every TestEnv's drop ends its test with it, and
//! a test may run it earlier, once everything has settled.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::time::Duration;

use serde_json::{json, Value};

use super::{is_active_state, is_terminal_state, list_names, poll_until, seg, walk_all, TestEnv};

impl TestEnv {
    /// Assert the whole root is consistent (call it once everything has settled).
    /// The invariants are eventual (the result and the indexes follow the terminal
    /// status), so this waits up to 30 s for them to hold, then reports what does not.
    pub fn check_consistency(&self) {
        let errors = self.settled_consistency_errors();
        if !errors.is_empty() {
            panic!(
                "consistency check failed ({} problems):\n  {}\n{}",
                errors.len(),
                errors.join("\n  "),
                self.log_tail(40)
            );
        }
    }
}

impl TestEnv {
    /// `consistency_errors` once they are gone or after 30 s, whichever comes first.
    pub fn settled_consistency_errors(&self) -> Vec<String> {
        let mut errors = vec![];
        poll_until(Duration::from_secs(30), || {
            errors = consistency_errors(self);
            errors.is_empty()
        });
        errors
    }
}

pub fn terminal_marker_name(ended_at: i64, run_id: &str) -> String {
    format!("{:016}-{}.json", ended_at.max(0), seg(run_id))
}

/// Every inconsistency of the root, as text (empty when consistent).
pub fn consistency_errors(env: &TestEnv) -> Vec<String> {
    let mut errs = vec![];
    // 1. spool: nothing pending
    let pending = env.pending_spool();
    if !pending.is_empty() {
        errs.push(format!("spool still holds {:?}", pending));
    }
    // PROTOCOL §14: a run is runspool's when it is a directory (never a symlink)
    // where its claim left request.json or whose status says runspool launched
    // it. Every other entry (a pi host's run, a symlink planted in the runs
    // root) is left as it is, so neither it nor its markers are checked.
    let foreign: HashSet<String> = env
        .run_ids()
        .into_iter()
        .filter(|id| {
            let dir = env.run_dir(id);
            !fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
                || !is_regular(&dir.join("request.json"))
                    && regular_json(&dir.join("status.json")).is_none_or(|st| st["launchedBy"] != "runspool")
        })
        .collect();
    let in_foreign_run = |p: &std::path::Path| foreign.iter().any(|id| p.starts_with(env.run_dir(id)));
    // 2. temp files anywhere
    for p in walk_all(&env.root) {
        let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if n.starts_with('.') && n.ends_with(".tmp") && !in_foreign_run(&p) {
            errs.push(format!("leftover temp file {}", p.display()));
        }
    }
    // 3. runs
    let mut statuses: BTreeMap<String, Value> = BTreeMap::new();
    for id in env.run_ids() {
        let dir = env.run_dir(&id);
        if foreign.contains(&id) {
            continue;
        }
        if !dir.is_dir() {
            errs.push(format!("{} in runs root is not a directory", id));
            continue;
        }
        let st = match regular_json(&dir.join("status.json")) {
            Some(s) => s,
            None => {
                errs.push(format!("run {} has no (parsable) status.json", id));
                continue;
            }
        };
        let state = st["state"].as_str().unwrap_or("").to_string();
        if state != "rejected" && !is_regular(&dir.join("request.json")) {
            errs.push(format!("run {} ({}) has no request.json", id, state));
        }
        if st["runId"].as_str() != Some(id.as_str()) {
            errs.push(format!("run dir {} has status runId {:?}", id, st["runId"]));
        }
        if !is_active_state(&state) && !is_terminal_state(&state) {
            errs.push(format!("run {} has unknown state {:?}", id, state));
        }
        statuses.insert(id, st);
    }
    // 4. active markers
    let markers: HashSet<String> = env.active_markers().into_iter().collect();
    for m in markers.iter().filter(|m| !foreign.contains(*m)) {
        match statuses.get(m) {
            None => errs.push(format!("active marker {} has no run with a status", m)),
            Some(st) => {
                let s = st["state"].as_str().unwrap_or("");
                if !is_active_state(s) {
                    errs.push(format!("active marker for run {} in terminal state {}", m, s));
                }
            }
        }
        let mp = env.active_dir().join(m);
        if !mp.is_file() {
            errs.push(format!("active marker {} is not a regular file", m));
        }
    }
    // tool-call aliases must point at active runs only
    let tc = env.active_dir().join("tool-calls");
    for sub in list_names(&tc) {
        let d = tc.join(&sub);
        let names = list_names(&d);
        if names.is_empty() {
            errs.push(format!("empty tool-call alias dir {}", d.display()));
        }
        for n in names.into_iter().filter(|n| !foreign.contains(n)) {
            let active = statuses.get(&n).and_then(|s| s["state"].as_str()).map(is_active_state).unwrap_or(false);
            if !active {
                errs.push(format!("tool-call alias {}/{} for a run that is not active", sub, n));
            }
        }
    }
    for (id, st) in &statuses {
        let s = st["state"].as_str().unwrap_or("");
        if is_active_state(s) && !markers.contains(id) {
            errs.push(format!("active run {} ({}) has no active marker", id, s));
        }
    }
    // 5. terminal markers
    let mut by_run: HashMap<String, Vec<(String, String, Value)>> = HashMap::new();
    for (sdir, f, c) in env.terminal_markers() {
        let rid = c["runId"].as_str().unwrap_or("").to_string();
        if rid.is_empty() {
            errs.push(format!("unparsable terminal marker {}/{}", sdir, f));
            continue;
        }
        if foreign.contains(&rid) {
            continue;
        }
        by_run.entry(rid).or_default().push((sdir, f, c));
    }
    for (id, ms) in &by_run {
        match statuses.get(id) {
            None => errs.push(format!(
                "terminal marker(s) {:?} for missing run {}",
                ms.iter().map(|m| &m.1).collect::<Vec<_>>(),
                id
            )),
            Some(st) => {
                if !is_terminal_state(st["state"].as_str().unwrap_or("")) {
                    errs.push(format!("terminal marker for active run {}", id));
                }
            }
        }
    }
    for (id, st) in &statuses {
        let s = st["state"].as_str().unwrap_or("");
        if !is_terminal_state(s) {
            continue;
        }
        let session = st["sessionId"].as_str().unwrap_or("default");
        let ended = st["endedAt"].as_i64();
        let ms = by_run.get(id).cloned().unwrap_or_default();
        if ms.len() != 1 {
            errs.push(format!(
                "terminal run {} ({}) has {} terminal markers: {:?}",
                id,
                s,
                ms.len(),
                ms.iter().map(|m| format!("{}/{}", m.0, m.1)).collect::<Vec<_>>()
            ));
        } else {
            let (sdir, f, c) = &ms[0];
            match ended {
                None => errs.push(format!("terminal run {} has no integer endedAt", id)),
                Some(e) => {
                    let want_name = terminal_marker_name(e, id);
                    if sdir != &seg(session) || f != &want_name {
                        errs.push(format!(
                            "terminal marker of {} is {}/{}, want {}/{}",
                            id,
                            sdir,
                            f,
                            seg(session),
                            want_name
                        ));
                    }
                    let want = json!({"version": 1, "runId": id, "sessionId": session, "endedAt": e});
                    for k in ["version", "runId", "sessionId", "endedAt"] {
                        if c[k] != want[k] {
                            errs.push(format!("terminal marker of {}: {} = {}, want {}", id, k, c[k], want[k]));
                        }
                    }
                }
            }
        }
        match regular_json(&env.result_path(id)) {
            None => errs.push(format!("terminal run {} ({}) has no result file", id, s)),
            Some(r) => {
                if r["runId"].as_str() != Some(id.as_str()) {
                    errs.push(format!("result of {} names runId {:?}", id, r["runId"]));
                }
                if r["state"].as_str() != Some(s) {
                    errs.push(format!("result of {} says state {:?}, status says {}", id, r["state"], s));
                }
                if r["exitCode"] != st["exitCode"] {
                    errs.push(format!("result of {} exitCode {} != status {}", id, r["exitCode"], st["exitCode"]));
                }
            }
        }
    }
    errs
}

/// The JSON of `p` when it is a regular file (not through a symlink) of at most
/// 16 MiB: a hostile root's FIFO or device in a file's place must not block or
/// flood the check that ends every test.
fn regular_json(p: &std::path::Path) -> Option<Value> {
    let m = fs::symlink_metadata(p).ok()?;
    if !m.file_type().is_file() || m.len() > 16 << 20 {
        return None;
    }
    serde_json::from_slice(&fs::read(p).ok()?).ok()
}

/// A regular file, not followed through a symlink.
fn is_regular(p: &std::path::Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_file())
}
