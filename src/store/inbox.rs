//! A run's control inbox (PROTOCOL §9), read and changed the one way the
//! runner, the daemon (for a queued run) and `runspool stop` all use:
//! `control/` and `control/stop-requests/` are opened by descriptor without
//! following symlinks ([`DirFd`]), and their entries are read and removed
//! relative to those descriptors. A symlinked `control/` or `stop-requests/`
//! is no inbox: it is ignored (and logged once), never followed.
//!
//! Only a regular file is a request. A legacy `stop.json`, `timeout.json` or
//! `interrupt.json` that is a FIFO, a directory, a symlink or a device is no
//! request to anyone: whoever looks first removes it (never opening it,
//! never following it) and logs it once.

use std::io;
use std::path::Path;

use super::dirfd::{warn_once, DirFd, Kind};
use super::layout::{CONTROL_DIR, STOP_REQUESTS_DIR};
use crate::protocol::control::{parse_stop_request, StopRequest, MAX_STOP_REQUEST_BYTES};

/// Largest legacy control file read (its body only adds a reason).
pub const MAX_LEGACY_BYTES: u64 = 64 * 1024;

/// Open `<run_dir>/control` without following it. None when it is missing,
/// or refused (a symlink, not a directory: logged once).
pub fn open(run_dir: &Path) -> Option<DirFd> {
    let run = open_logged(|| DirFd::open(run_dir), run_dir)?;
    open_logged(|| run.open_sub(CONTROL_DIR), &run_dir.join(CONTROL_DIR))
}

/// Open `control/stop-requests` of an opened inbox, the same way.
fn stop_requests(control: &DirFd) -> Option<DirFd> {
    open_logged(|| control.open_sub(STOP_REQUESTS_DIR), &control.path().join(STOP_REQUESTS_DIR))
}

fn open_logged(f: impl FnOnce() -> io::Result<DirFd>, path: &Path) -> Option<DirFd> {
    match f() {
        Ok(d) => Some(d),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            warn_once(path, &e);
            None
        }
    }
}

/// Create `control/` and `control/stop-requests/` (0700) when missing, for a
/// watch. False, logged once, when either is not a real directory: such an
/// inbox must not be watched (a watch would follow the link).
pub fn prepare(run_dir: &Path) -> bool {
    let Some(run) = open_logged(|| DirFd::open(run_dir), run_dir) else { return false };
    let Some(control) = open_logged(|| run.create_sub(CONTROL_DIR), &run_dir.join(CONTROL_DIR)) else {
        return false;
    };
    open_logged(|| control.create_sub(STOP_REQUESTS_DIR), &control.path().join(STOP_REQUESTS_DIR)).is_some()
}

/// The names of the stop requests waiting, in name (= `ts`) order: dot
/// names are temps of writers at work.
fn request_names(dir: &DirFd) -> Vec<String> {
    let mut names: Vec<String> = match dir.names() {
        Ok(n) => n.into_iter().filter(|n| !n.starts_with('.') && n.ends_with(".json")).collect(),
        Err(e) => {
            warn_once(dir.path(), &e);
            vec![]
        }
    };
    names.sort();
    names
}

/// Read one stop request; None when it is not a valid one (not a regular
/// file, too large to be one, not `type: "stop"`).
fn read_request(dir: &DirFd, name: &str) -> Option<StopRequest> {
    let bytes = dir.read(name, MAX_STOP_REQUEST_BYTES + 1).ok()?;
    if bytes.len() as u64 > MAX_STOP_REQUEST_BYTES {
        return None;
    }
    parse_stop_request(&bytes)
}

/// Is a stop request (a `*.json` entry of any kind) waiting in `control/stop-requests/`?
pub fn stop_request_waiting(control: &DirFd) -> bool {
    stop_requests(control).is_some_and(|d| !request_names(&d).is_empty())
}

/// Take the stop requests `wanted` accepts, in `ts` order: each is read,
/// removed, and returned only once its removal succeeded, so a request fires
/// at most once. Entries that are not valid requests are removed and
/// skipped; valid ones `wanted` refuses stay. At most `limit` are taken.
pub fn take_stop_requests(control: &DirFd, wanted: impl Fn(&StopRequest) -> bool, limit: usize) -> Vec<StopRequest> {
    let Some(dir) = stop_requests(control) else { return vec![] };
    let mut out = Vec::new();
    for n in request_names(&dir) {
        if out.len() >= limit {
            break;
        }
        let parsed = read_request(&dir, &n);
        if parsed.as_ref().is_some_and(|r| !wanted(r)) {
            continue;
        }
        match dir.remove(&n) {
            Ok(()) => out.extend(parsed.map(|r| (r.ts.unwrap_or(0), n, r))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {} // taken by the other side
            Err(e) => warn_once(&dir.path().join(&n), &e),
        }
    }
    out.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    out.into_iter().map(|(_, _, r)| r).collect()
}

/// The legacy control file `name` (`stop.json`, `timeout.json`,
/// `interrupt.json`) when it is a request: a regular file, with its body
/// (empty when it cannot be read). Anything else in its place is removed
/// and logged once; a missing file is None.
pub fn legacy(control: &DirFd, name: &str) -> Option<Vec<u8>> {
    match control.kind(name) {
        Ok(Kind::File) => Some(control.read(name, MAX_LEGACY_BYTES).unwrap_or_default()),
        Ok(kind) => {
            let path = control.path().join(name);
            let e = io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is {}, not a control request (a regular file); removed it unopened",
                    path.display(),
                    kind.describe()
                ),
            );
            match control.remove(name) {
                Ok(()) => warn_once(&path, &e),
                Err(re) if re.kind() == io::ErrorKind::NotFound => {}
                Err(re) => warn_once(&path, &io::Error::new(re.kind(), format!("{e}: removing it failed: {re}"))),
            }
            None
        }
        Err(_) => None,
    }
}

/// Remove a consumed legacy control file.
pub fn remove_legacy(control: &DirFd, name: &str) {
    match control.unlink(name) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => warn_once(&control.path().join(name), &e),
    }
}

/// Write `bytes` as `control/<name>` (`sub` None) or
/// `control/stop-requests/<name>`, creating the directories (0700) when
/// missing, never through a symlink. For `runspool stop`.
pub fn write(run_dir: &Path, sub: Option<&str>, name: &str, bytes: &[u8]) -> io::Result<std::path::PathBuf> {
    let control = DirFd::open(run_dir)?.create_sub(CONTROL_DIR)?;
    let dir = match sub {
        Some(s) => control.create_sub(s)?,
        None => control,
    };
    dir.write_atomic(name, bytes)?;
    Ok(dir.path().join(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_are_taken_in_ts_order_and_invalid_ones_removed() {
        let d = tempfile::tempdir().unwrap();
        let sr = d.path().join("control/stop-requests");
        std::fs::create_dir_all(&sr).unwrap();
        std::fs::write(sr.join("2-b.json"), json!({"type": "stop", "ts": 2, "targetIndex": 0}).to_string()).unwrap();
        std::fs::write(sr.join("1-a.json"), json!({"type": "stop", "ts": 1}).to_string()).unwrap();
        std::fs::write(sr.join("0-bad.json"), b"nope").unwrap();
        std::fs::write(sr.join(".tmp.json"), b"writer at work").unwrap();
        let c = open(d.path()).unwrap();
        assert!(stop_request_waiting(&c));
        let run_level = take_stop_requests(&c, |r| r.target_index.is_none(), 1);
        assert_eq!(run_level.len(), 1);
        assert_eq!(run_level[0].ts, Some(1));
        let mut left: Vec<_> = std::fs::read_dir(&sr).unwrap().flatten().map(|e| e.file_name()).collect();
        left.sort();
        assert_eq!(left, [".tmp.json", "2-b.json"], "the invalid one is gone, the targeted one stays");
        assert_eq!(take_stop_requests(&c, |_| true, usize::MAX)[0].target_index, Some(0));
        assert!(!stop_request_waiting(&c));
    }

    #[test]
    fn only_a_regular_legacy_file_is_a_request() {
        let d = tempfile::tempdir().unwrap();
        let control = d.path().join("control");
        std::fs::create_dir_all(control.join("timeout.json")).unwrap();
        let target = d.path().join("target");
        std::fs::write(&target, b"{}").unwrap();
        std::os::unix::fs::symlink(&target, control.join("interrupt.json")).unwrap();
        std::fs::write(control.join("stop.json"), b"").unwrap();
        let c = open(d.path()).unwrap();
        assert_eq!(legacy(&c, "stop.json"), Some(vec![]));
        assert_eq!(legacy(&c, "timeout.json"), None);
        assert_eq!(legacy(&c, "interrupt.json"), None);
        assert!(
            !control.join("timeout.json").exists()
                && std::fs::symlink_metadata(control.join("interrupt.json")).is_err()
        );
        assert!(target.exists());
        remove_legacy(&c, "stop.json");
        assert!(!control.join("stop.json").exists());
    }

    #[test]
    fn writing_never_goes_through_a_symlink() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let run = d.path().join("run");
        std::fs::create_dir_all(run.join("control")).unwrap();
        std::os::unix::fs::symlink(&outside, run.join("control/stop-requests")).unwrap();
        let e = write(&run, Some(STOP_REQUESTS_DIR), "1-a.json", b"{}").unwrap_err();
        assert!(e.to_string().contains("stop-requests"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        let p = write(&run, None, "interrupt.json", b"{}").unwrap();
        assert_eq!(std::fs::read(p).unwrap(), b"{}");
        assert!(open(&run).is_some_and(|c| !stop_request_waiting(&c)));
    }
}
