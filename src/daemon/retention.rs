//! Retention (PROTOCOL §12): terminal runs other than `paused` older than the
//! limit are removed with their results; the run directory is first renamed
//! to `.deleting-run-<uuid>` so a half-removed run never looks like a run.

use std::path::Path;

use crate::protocol::seg::{seg, seg250};
use crate::protocol::status::State;
use crate::store::{index, run, Layout};

pub fn sweep(l: &Layout, retention_days: u64) -> usize {
    remove_leftovers(&l.runs());
    if retention_days == 0 {
        return 0;
    }
    let cutoff = crate::now_ms() - (retention_days as i64) * 86_400_000;
    let mut removed = 0;
    let Ok(sessions) = std::fs::read_dir(l.terminal()) else { return 0 };
    for sdir in sessions.flatten() {
        let Ok(markers) = std::fs::read_dir(sdir.path()) else { continue };
        for m in markers.flatten() {
            let name = m.file_name().to_string_lossy().into_owned();
            // The name starts with the zero-padded end time: no need to open young markers.
            let Some(ended) = name.get(..16).and_then(|s| s.parse::<i64>().ok()) else { continue };
            if ended >= cutoff {
                continue;
            }
            // Markers are written by clients and pi hosts: never block on a FIFO here.
            let Ok(bytes) = crate::store::fsutil::read_nofollow(&m.path(), 64 * 1024) else { continue };
            let Ok(marker) = serde_json::from_slice::<crate::protocol::status::TerminalMarker>(&bytes) else {
                continue;
            };
            let dir = l.run_dir(&marker.run_id);
            match run::read_status(&dir) {
                Ok(Some(s)) if s.state == State::Paused || s.state.is_active() => continue,
                Ok(Some(s)) if s.ended_at.unwrap_or(0) >= cutoff => continue,
                Ok(_) => {}
                Err(_) => continue,
            }
            let _ = std::fs::remove_file(l.results().join(format!("{}.json", marker.run_id)));
            let _ = std::fs::remove_file(
                l.results()
                    .join("result-index/sessions")
                    .join(seg(&marker.session_id))
                    .join(format!("{}.json", seg250(&marker.run_id))),
            );
            if dir.exists() {
                let tomb = l.runs().join(format!(".deleting-run-{}", uuid::Uuid::new_v4()));
                if std::fs::rename(&dir, &tomb).is_ok() {
                    let _ = std::fs::remove_dir_all(&tomb);
                }
            }
            let _ = index::unmark_active(l, &marker.run_id, None);
            let _ = std::fs::remove_file(m.path());
            tracing::info!(run_id = %marker.run_id, "retention removed an old run");
            removed += 1;
        }
        let _ = std::fs::remove_dir(sdir.path()); // only when empty
    }
    removed
}

/// Finish removals cut short by a crash.
fn remove_leftovers(runs: &Path) {
    let Ok(rd) = std::fs::read_dir(runs) else { return };
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().starts_with(".deleting-run-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
