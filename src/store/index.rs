//! The active and terminal run indexes (PROTOCOL §6) and their self-healing
//! readers. Indexes are only written after the status they reflect is durable.

use std::io;
use std::path::{Path, PathBuf};

use super::fsutil::{self, mkdir_private, remove_if_exists};
use super::layout::Layout;
use super::run::read_status;
use crate::protocol::seg::seg;
use crate::protocol::status::{terminal_marker_name, Status, TerminalMarker};

fn alias_dir(l: &Layout, tool_call_id: &str) -> PathBuf {
    l.active().join("tool-calls").join(seg(tool_call_id))
}

pub fn mark_active(l: &Layout, s: &Status) -> io::Result<()> {
    fsutil::touch(&l.active().join(&s.run_id))?;
    if let Some(tc) = &s.tool_call_id {
        // The alias is optional: its failure never blocks the run.
        let dir = alias_dir(l, tc);
        let r = mkdir_private(&l.active().join("tool-calls"))
            .and_then(|_| mkdir_private(&dir))
            .and_then(|_| fsutil::touch(&dir.join(&s.run_id)));
        if let Err(e) = r {
            tracing::warn!(run_id = %s.run_id, error = %e, "could not create the tool-call alias");
        }
    }
    Ok(())
}

pub fn unmark_active(l: &Layout, run_id: &str, tool_call_id: Option<&str>) -> io::Result<()> {
    if let Some(tc) = tool_call_id {
        let dir = alias_dir(l, tc);
        remove_if_exists(&dir.join(run_id))?;
        let _ = std::fs::remove_dir(&dir); // only succeeds when empty
    }
    remove_if_exists(&l.active().join(run_id))
}

pub fn terminal_marker_path(l: &Layout, s: &Status) -> PathBuf {
    l.terminal()
        .join(seg(&s.session_id))
        .join(terminal_marker_name(s.ended_at.unwrap_or(s.last_update), &s.run_id))
}

pub fn mark_terminal(l: &Layout, s: &Status) -> io::Result<()> {
    let path = terminal_marker_path(l, s);
    mkdir_private(path.parent().expect("marker has a parent"))?;
    let m = TerminalMarker {
        version: 1,
        run_id: s.run_id.clone(),
        session_id: s.session_id.clone(),
        ended_at: s.ended_at.unwrap_or(s.last_update).max(0),
    };
    fsutil::write_atomic(&path, &serde_json::to_vec(&m).map_err(io::Error::other)?, false)
}

/// Active runs from the index. Stale markers (run directory or status
/// missing, or status terminal) are removed.
pub fn list_active(l: &Layout) -> io::Result<Vec<Status>> {
    let mut out = Vec::new();
    let dir = match std::fs::read_dir(l.active()) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(id) = name.to_str() else { continue };
        if id.starts_with('.') || !e.file_type().map(|t| t.is_file()).unwrap_or(false) {
            continue;
        }
        match read_status(&l.run_dir(id)) {
            Ok(Some(s)) if s.state.is_active() => out.push(s),
            Ok(Some(s)) => {
                let _ = unmark_active(l, id, s.tool_call_id.as_deref());
            }
            Ok(None) => {
                // A half-claimed run (request.json, no status yet) is not stale: the daemon finishes it.
                if !l.run_dir(id).join("request.json").exists() {
                    let _ = remove_if_exists(&e.path());
                }
            }
            Err(_) => {}
        }
    }
    out.sort_by_key(|s| (s.queue.claimed_at, s.run_id.clone()));
    Ok(out)
}

/// The newest `limit` terminal runs, from the markers alone: only the status
/// files of the runs returned are opened. Markers that are unparsable, of
/// another version, disagree with the status, or repeat a run are removed.
pub fn list_recent(l: &Layout, session: Option<&str>, limit: usize) -> io::Result<Vec<Status>> {
    let sessions: Vec<PathBuf> = match session {
        Some(s) => vec![l.terminal().join(seg(s))],
        None => match std::fs::read_dir(l.terminal()) {
            Ok(d) => d.flatten().filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false)).map(|e| e.path()).collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => vec![],
            Err(e) => return Err(e),
        },
    };
    // Perf: keep only (name, session index) per marker and join paths for the few we open;
    // a PathBuf per entry doubled the cost of listing 100,000 markers.
    let mut names: Vec<(String, usize)> = Vec::new();
    for (si, dir) in sessions.iter().enumerate() {
        let Ok(rd) = std::fs::read_dir(dir) else { continue };
        for e in rd.flatten() {
            if let Some(n) = e.file_name().to_str() {
                if !n.starts_with('.') && n.ends_with(".json") {
                    names.push((n.to_string(), si));
                }
            }
        }
    }
    // Names start with the zero-padded end time: descending name order is newest first.
    names.sort_unstable_by(|a, b| b.0.cmp(&a.0));
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (name, si) in names {
        if out.len() >= limit {
            break;
        }
        let path = sessions[si].join(&name);
        match validate_marker(l, &path) {
            Some(s) if seen.insert(s.run_id.clone()) => out.push(s),
            _ => {
                let _ = remove_if_exists(&path);
            }
        }
    }
    Ok(out)
}

fn validate_marker(l: &Layout, path: &Path) -> Option<Status> {
    let bytes = fsutil::read_nofollow(path, 64 * 1024).ok()?;
    let m: TerminalMarker = serde_json::from_slice(&bytes).ok()?;
    if m.version != 1 || !crate::protocol::is_id(&m.run_id, 128) {
        return None;
    }
    let s = read_status(&l.run_dir(&m.run_id)).ok()??;
    let ok = !s.state.is_active()
        && s.session_id == m.session_id
        && s.ended_at.map(|e| e.max(0)) == Some(m.ended_at)
        && terminal_marker_path(l, &s) == path;
    ok.then_some(s)
}
