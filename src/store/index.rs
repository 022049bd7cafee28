//! The active and terminal run indexes (PROTOCOL §6) and their self-healing
//! readers. Indexes are only written after the status they reflect is durable.

use std::io;
use std::path::{Path, PathBuf};

use super::fsutil::{self, mkdir_private, remove_if_exists};
use super::layout::{Layout, RunId};
use super::run::{ownership, read_status, Ownership};
use crate::protocol::seg::seg;
use crate::protocol::status::{terminal_marker_name, Status, TerminalMarker};

fn alias_dir(l: &Layout, tool_call_id: &str) -> PathBuf {
    l.tool_call_aliases().join(seg(tool_call_id))
}

pub fn mark_active(l: &Layout, id: &RunId, s: &Status) -> io::Result<()> {
    fsutil::touch(&l.active_marker(id))?;
    if let Some(tc) = &s.tool_call_id {
        // The alias is optional: its failure never blocks the run.
        let dir = alias_dir(l, tc);
        let r = mkdir_private(&l.tool_call_aliases())
            .and_then(|_| mkdir_private(&dir))
            .and_then(|_| fsutil::touch(&dir.join(id.as_str())));
        if let Err(e) = r {
            tracing::warn!(run_id = %id, error = %e, "could not create the tool-call alias");
        }
    }
    Ok(())
}

/// `mark_active` for a run whose runner may already be at work, under the
/// run's `.status.lock`: the marker is created only while the status is still
/// active, so it can never appear after a fast runner has ended the run and
/// removed it. False when the run had already ended.
pub fn mark_active_if_active(l: &Layout, run_id: &RunId) -> io::Result<bool> {
    if l.active_marker(run_id).exists() {
        return Ok(true); // already indexed (a restart re-adopting its runs)
    }
    let dir = l.run_dir(run_id);
    // Barrier (§6.1: an index only follows a durable status): the queued
    // status is written without fsync to keep the claim fast, so it is made
    // durable here, file and directory, before its marker. Off the
    // drop-to-runner path: this runs once the runner is started. Made before
    // the lock is taken: every later status is the runner's, written durably
    // under that lock, so whichever status is read below is durable. Perf:
    // the runner's `running` write waits for this lock, which it no longer
    // does through two fsyncs (journal commits on a disk).
    match fsutil::open_read(&super::layout::RunPaths::status(&dir)) {
        Ok(f) => f.sync_all()?,
        // No status (a run removed since): nothing to index, as read below.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    }
    fsutil::fsync_dir(&dir)?;
    let _lock = fsutil::lock(&super::layout::RunPaths::status_lock(&dir), false)?;
    match read_status(&dir)? {
        Some(s) if s.state.is_active() => mark_active(l, run_id, &s).map(|()| true),
        _ => Ok(false),
    }
}

/// Remove the run's active marker and its tool-call alias. The alias is
/// optional (§6.1): whatever stands in its way (`tool-calls` not a directory,
/// ENOTDIR, a permission problem) never keeps the marker itself in place.
pub fn unmark_active(l: &Layout, run_id: &RunId, tool_call_id: Option<&str>) -> io::Result<()> {
    if let Some(tc) = tool_call_id {
        let dir = alias_dir(l, tc);
        if let Err(e) = remove_if_exists(&dir.join(run_id.as_str())) {
            tracing::debug!(run_id = %run_id, error = %e, path = %dir.display(), "could not remove the tool-call alias");
        }
        let _ = std::fs::remove_dir(&dir); // only succeeds when empty
    }
    remove_if_exists(&l.active_marker(run_id))
}

pub fn terminal_marker_path(l: &Layout, s: &Status) -> PathBuf {
    l.terminal().join(seg(&s.session_id)).join(terminal_marker_name(s.ended_at.unwrap_or(s.last_update), &s.run_id))
}

pub fn mark_terminal(l: &Layout, s: &Status) -> io::Result<()> {
    let path = terminal_marker_path(l, s);
    let m = TerminalMarker {
        version: 1,
        run_id: s.run_id.clone(),
        session_id: s.session_id.clone(),
        ended_at: s.ended_at.unwrap_or(s.last_update).max(0),
    };
    let bytes = serde_json::to_vec(&m).map_err(io::Error::other)?;
    // The session's directory is made when the write finds it missing (not
    // before every write: perf), and only it: `.terminal-runs/` itself is the root's.
    match fsutil::write_atomic(&path, &bytes, false) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            mkdir_private(path.parent().expect("marker has a parent"))?;
            fsutil::write_atomic(&path, &bytes, false)
        }
        r => r,
    }
}

/// A run found through an index, with whose it is (PROTOCOL §14) and its
/// status, or why the status could not be read (reported, never a reason to
/// delete anything).
#[derive(Debug)]
pub struct Listed {
    pub run_id: RunId,
    pub ownership: Ownership,
    pub status: Result<Status, String>,
}

impl Listed {
    /// The status when it parsed; `None` for an unreadable one.
    pub fn ok(&self) -> Option<&Status> {
        self.status.as_ref().ok()
    }
}

/// Active runs from the index, runspool's and other hosts'. Stale markers
/// are removed: those of runspool's own runs whose status is terminal, and
/// those of run directories that no longer exist (pi-subagents' reader
/// removes those too). Markers of other hosts' runs, of directories without a
/// status yet (a claim or another host's launch in progress) and of
/// unreadable statuses are left alone.
pub fn list_active(l: &Layout) -> io::Result<Vec<Listed>> {
    let mut out = Vec::new();
    each_active(l, &|_| true, &mut |x| out.push(x))?;
    out.sort_by_cached_key(|x| (x.ok().map(|s| s.queue.claimed_at).unwrap_or(0), x.run_id.clone()));
    Ok(out)
}

/// `list_active` one run at a time, unsorted, without the list: only the
/// markers `want` picks have their status read; `f` gets each active run.
/// The daemon's rescan over a backlog of 20,000 queued runs it knows holds
/// no status of theirs (it used to hold all 20,000 at once).
pub fn each_active(l: &Layout, want: &dyn Fn(&RunId) -> bool, f: &mut dyn FnMut(Listed)) -> io::Result<()> {
    let dir = match std::fs::read_dir(l.active()) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in dir.flatten() {
        let name = e.file_name();
        // Names outside the run-id grammar cannot name a run directory.
        let Some(id) = name.to_str().and_then(RunId::parse) else { continue };
        if !want(&id) || !e.file_type().map(|t| t.is_file()).unwrap_or(false) {
            continue;
        }
        let run_dir = l.run_dir(&id);
        match read_status(&run_dir) {
            Ok(Some(s)) if s.state.is_active() => {
                let ownership = ownership(&run_dir, Some(&s));
                f(Listed { run_id: id, ownership, status: Ok(s) });
            }
            Ok(Some(s)) => {
                if ownership(&run_dir, Some(&s)).is_ours() {
                    let _ = unmark_active(l, &id, s.tool_call_id.as_deref());
                }
            }
            // No status: a half-claimed run (the daemon finishes it), a run
            // being created by another host, or a directory that is gone.
            Ok(None) => {
                if std::fs::symlink_metadata(&run_dir).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
                    let _ = remove_if_exists(&e.path());
                }
            }
            Err(err) => {
                let ownership = ownership(&run_dir, None);
                f(Listed { run_id: id, ownership, status: Err(err.to_string()) });
            }
        }
    }
    Ok(())
}

/// The newest `limit` terminal runs, from the markers alone: only the status
/// files of the runs returned are opened. Markers that are unparsable or name
/// a run directory that is gone are removed (pi-subagents' reader does the
/// same), and so are markers of runspool's own runs that disagree with their
/// status or repeat a run. Markers of other hosts' runs are never removed
/// (§14), whatever runspool thinks of them.
pub fn list_recent(l: &Layout, session: Option<&str>, limit: usize) -> io::Result<Vec<Listed>> {
    let sessions: Vec<PathBuf> = match session {
        Some(s) => vec![l.terminal().join(seg(s))],
        None => match std::fs::read_dir(l.terminal()) {
            Ok(d) => {
                d.flatten().filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false)).map(|e| e.path()).collect()
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => vec![],
            Err(e) => return Err(e),
        },
    };
    // Candidates beyond `limit`, so a few bad markers do not force a full listing.
    let want = limit.saturating_add(64);
    let mut complete = true;
    let mut names: Vec<(String, usize)> = Vec::new();
    for (si, dir) in sessions.iter().enumerate() {
        let (top, all) = newest_names(l, dir, want);
        complete &= all;
        names.extend(top.into_iter().map(|n| (n, si)));
    }
    let (out, used) = newest_valid(l, &sessions, names, limit);
    if out.len() < limit && used && !complete {
        // So many bad markers that the candidates ran out: list everything (rare).
        let mut all: Vec<(String, usize)> = Vec::new();
        for (si, dir) in sessions.iter().enumerate() {
            all.extend(read_marker_names(dir).into_iter().map(|n| (n, si)));
        }
        return Ok(newest_valid(l, &sessions, all, limit).0);
    }
    Ok(out)
}

/// Up to `limit` valid runs from (marker name, session index) candidates,
/// newest first; bad or repeated markers are removed. The flag: every
/// candidate was looked at.
fn newest_valid(
    l: &Layout,
    sessions: &[PathBuf],
    mut names: Vec<(String, usize)>,
    limit: usize,
) -> (Vec<Listed>, bool) {
    // Names start with the zero-padded end time: descending name order is newest first.
    names.sort_unstable_by(|a, b| b.0.cmp(&a.0));
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut used = 0;
    for (name, si) in &names {
        if out.len() >= limit {
            break;
        }
        used += 1;
        let path = sessions[*si].join(name);
        match validate_marker(l, &path) {
            Marker::Valid(x) if seen.insert(x.run_id.clone()) => out.push(*x),
            Marker::Valid(x) if x.ownership.is_ours() => {
                let _ = remove_if_exists(&path); // a second marker of one of our runs
            }
            Marker::Stale => {
                let _ = remove_if_exists(&path);
            }
            Marker::Valid(_) | Marker::Skip => {}
        }
    }
    (out, used == names.len())
}

/// Perf: keep one `String` per marker (a `PathBuf` each doubled the cost of
/// listing 100,000 markers).
fn read_marker_names(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else { return vec![] };
    rd.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| is_marker_name(n)).collect()
}

/// A terminal marker's file name (dot names are temps and caches).
fn is_marker_name(n: &str) -> bool {
    !n.starts_with('.') && n.ends_with(".json")
}

/// The `keep` greatest marker names of `dir`, newest first, and how many
/// markers it holds. Perf: one pass with a bounded heap, so listing 100,000
/// markers keeps 1,000 names in memory instead of all of them (the rest of
/// the time is the kernel's readdir; see docs/performance.md).
fn newest_marker_names(dir: &Path, keep: usize) -> (Vec<String>, usize) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let Ok(rd) = std::fs::read_dir(dir) else { return (vec![], 0) };
    let mut heap: BinaryHeap<Reverse<String>> = BinaryHeap::with_capacity(keep + 1);
    let mut total = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str().filter(|n| is_marker_name(n)) else { continue };
        total += 1;
        if heap.len() < keep {
            heap.push(Reverse(n.to_string()));
        } else if heap.peek().is_some_and(|Reverse(min)| n > min.as_str()) {
            heap.pop();
            heap.push(Reverse(n.to_string()));
        }
    }
    // Ascending order of Reverse is descending order of names: newest first.
    (heap.into_sorted_vec().into_iter().map(|Reverse(n)| n).collect(), total)
}

/// Names kept in a session's recent cache.
const CACHE_NAMES: usize = 1000;
/// A directory changed within this long may still change within the same
/// timestamp tick (coarse kernel clocks): its listing is not cached.
const CACHE_QUIET_SECS: i64 = 2;

#[derive(serde::Serialize, serde::Deserialize)]
struct RecentCache {
    version: u32,
    ino: u64,
    ctime_sec: i64,
    ctime_nsec: i64,
    total: usize,
    /// Newest first.
    names: Vec<String>,
}

/// The newest `want` marker names of one session directory, newest first, and
/// whether that is all of them.
///
/// Perf: listing 100,000 markers costs ~40 ms of getdents alone on ext4. A
/// directory's ctime changes whenever an entry is added or removed, so the
/// newest names of a directory whose (inode, ctime) still match a cache
/// written after it had been quiet for `CACHE_QUIET_SECS` are still the
/// newest names. The ctime is used, not the mtime: it moves on the same
/// changes and also when someone resets the mtime. The cache lives in `runspool/recent-cache/`, is only a
/// hint (any mismatch means a full listing) and is rewritten by whoever
/// lists the directory next.
fn newest_names(l: &Layout, dir: &Path, want: usize) -> (Vec<String>, bool) {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(dir) else { return (vec![], true) };
    let cache_path = dir.file_name().map(|n| l.recent_cache().join(n));
    if let Some(cp) = &cache_path {
        if let Ok(bytes) = fsutil::read_nofollow(cp, 1 << 20) {
            if let Ok(c) = serde_json::from_slice::<RecentCache>(&bytes) {
                let fresh =
                    c.version == 1 && c.ino == md.ino() && c.ctime_sec == md.ctime() && c.ctime_nsec == md.ctime_nsec();
                if fresh && (want <= c.names.len() || c.total == c.names.len()) {
                    let all = c.total <= want;
                    let mut names = c.names;
                    names.truncate(want);
                    return (names, all);
                }
            }
        }
    }
    let (mut names, total) = newest_marker_names(dir, want.max(CACHE_NAMES));
    let quiet = crate::now_ms() / 1000 - md.ctime() > CACHE_QUIET_SECS;
    if let (Some(cp), true) = (&cache_path, quiet) {
        let c = RecentCache {
            version: 1,
            ino: md.ino(),
            ctime_sec: md.ctime(),
            ctime_nsec: md.ctime_nsec(),
            total,
            names: names.clone(),
        };
        if let Ok(bytes) = serde_json::to_vec(&c) {
            let _ = fsutil::mkdir_private_all(&l.recent_cache()).and_then(|_| fsutil::write_atomic(cp, &bytes, false));
        }
    }
    let all = total <= want;
    names.truncate(want);
    (names, all)
}

/// What a terminal marker says.
enum Marker {
    /// A terminal run (runspool's, validated against its status; another
    /// host's, as its status says).
    Valid(Box<Listed>),
    /// Unparsable, naming no run directory, or one of runspool's runs whose
    /// status contradicts it: removed.
    Stale,
    /// Nothing to show, and not ours to remove.
    Skip,
}

fn validate_marker(l: &Layout, path: &Path) -> Marker {
    let Ok(bytes) = fsutil::read_nofollow(path, 64 * 1024) else { return Marker::Skip };
    let Ok(m) = serde_json::from_slice::<TerminalMarker>(&bytes) else { return Marker::Stale };
    // A marker is a hint, never a path: only a name of the run-id grammar is
    // looked up, and the status found there must be that run's own.
    let Some(id) = RunId::parse(&m.run_id) else { return Marker::Stale };
    let dir = l.run_dir(&id);
    let s = match read_status(&dir) {
        Ok(Some(s)) => s,
        Ok(None) if std::fs::symlink_metadata(&dir).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) => {
            return Marker::Stale;
        }
        Ok(None) => return Marker::Skip,
        Err(e) => {
            let ownership = ownership(&dir, None);
            return Marker::Valid(Box::new(Listed { run_id: id, ownership, status: Err(e.to_string()) }));
        }
    };
    let ownership = ownership(&dir, Some(&s));
    if s.state.is_active() {
        return if ownership.is_ours() { Marker::Stale } else { Marker::Skip };
    }
    if ownership.is_ours() {
        let ok = m.version == 1
            && s.session_id == m.session_id
            && s.ended_at.map(|e| e.max(0)) == Some(m.ended_at)
            && terminal_marker_path(l, &s) == path;
        if !ok {
            return Marker::Stale;
        }
    }
    Marker::Valid(Box::new(Listed { run_id: id, ownership, status: Ok(s) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_marker_names_keeps_the_greatest_in_order() {
        let d = tempfile::tempdir().unwrap();
        for i in [7, 3, 42, 19, 0, 25, 11, 38, 4, 30] {
            std::fs::write(d.path().join(format!("{i:016}-run-{i}.json")), b"").unwrap();
        }
        std::fs::write(d.path().join(".0000000000000099-tmp.json"), b"").unwrap();
        std::fs::write(d.path().join("0000000000000098-notes.txt"), b"").unwrap();
        let (names, total) = newest_marker_names(d.path(), 4);
        assert_eq!(total, 10, "dot names and other files are not markers");
        let want: Vec<String> = [42, 38, 30, 25].iter().map(|i| format!("{i:016}-run-{i}.json")).collect();
        assert_eq!(names, want);
        let (all, total) = newest_marker_names(d.path(), 100);
        assert_eq!((all.len(), total), (10, 10));
        assert!(all.windows(2).all(|w| w[0] > w[1]), "newest first: {all:?}");
    }
}
