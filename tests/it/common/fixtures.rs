//! Building inputs: request and step builders, gates, file writers, requests
//! dropped into the spool, control files, and runs fabricated on disk.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{now_ms, seg, terminal_marker_name, unique, TestEnv};

pub fn cmd_step(agent: &str, argv: &[&str]) -> Value {
    json!({ "agent": agent, "command": argv })
}

/// A shell loop that waits until `gate` exists (see `open_gate`).
pub fn gate_wait(gate: &Path) -> String {
    format!("while [ ! -e '{}' ]; do sleep 0.05; done", gate.display())
}

pub fn open_gate(gate: &Path) {
    fs::write(gate, b"go").unwrap();
}

pub fn sh_step(agent: &str, script: &str) -> Value {
    json!({ "agent": agent, "command": ["sh", "-c", script] })
}

pub fn parallel(steps: Vec<Value>, concurrency: Option<u32>) -> Value {
    match concurrency {
        Some(c) => json!({ "parallel": steps, "concurrency": c }),
        None => json!({ "parallel": steps }),
    }
}

/// A version-1 request with the given steps; `cwd` is the test's work directory.
pub fn request(run_id: Option<&str>, cwd: &Path, steps: Vec<Value>) -> Value {
    let mut v = json!({ "version": 1, "cwd": cwd.to_str().unwrap(), "steps": steps });
    if let Some(id) = run_id {
        v["runId"] = json!(id);
    }
    v
}

pub fn write_file_mode(p: &Path, bytes: &[u8], mode: u32) {
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(p).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

pub fn mkdir_0700(p: &Path) {
    fs::create_dir_all(p).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(0o700)).unwrap();
}

/// Set a path's mtime (without following symlinks) `secs_ago` seconds into the past.
pub fn set_mtime_ago(p: &Path, secs_ago: i64) {
    let t = now_ms() / 1000 - secs_ago;
    let ts = [
        libc::timespec { tv_sec: t as libc::time_t, tv_nsec: 0 },
        libc::timespec { tv_sec: t as libc::time_t, tv_nsec: 0 },
    ];
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) };
    assert_eq!(r, 0, "utimensat {}: {}", p.display(), std::io::Error::last_os_error());
}

impl TestEnv {
    /// Publish `bytes` as `spool/<name>.json` atomically (dot temp + rename), mode 0600.
    pub fn drop_bytes(&self, name: &str, bytes: &[u8]) -> PathBuf {
        self.drop_bytes_mode(name, bytes, 0o600)
    }

    pub fn drop_bytes_mode(&self, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        let tmp = self.spool().join(format!(".tmp-{}", unique("req")));
        write_file_mode(&tmp, bytes, mode);
        let dst = self.spool().join(format!("{}.json", name));
        fs::rename(&tmp, &dst).unwrap();
        dst
    }

    /// Publish a request value; returns the exact bytes written.
    pub fn drop_request(&self, name: &str, req: &Value) -> Vec<u8> {
        let bytes = serde_json::to_vec_pretty(req).unwrap();
        self.drop_bytes(name, &bytes);
        bytes
    }

    /// Publish a request under the name of its runId and return (runId, bytes).
    pub fn submit(&self, req: &Value) -> (String, Vec<u8>) {
        let id = req["runId"].as_str().expect("submit() needs a runId").to_string();
        let bytes = self.drop_request(&id, req);
        (id, bytes)
    }

    /// Write a control file (stop.json / timeout.json / interrupt.json) atomically.
    pub fn write_control(&self, id: &str, kind: &str) {
        let dir = self.run_dir(id).join("control");
        if !dir.exists() {
            let _ = fs::create_dir(&dir);
            let _ = fs::set_permissions(&dir, fs::Permissions::from_mode(0o700));
        }
        let body = json!({ "type": kind, "ts": now_ms(), "source": "test" });
        let tmp = dir.join(format!(".{}.json.{}.tmp", kind, std::process::id()));
        write_file_mode(&tmp, body.to_string().as_bytes(), 0o600);
        fs::rename(&tmp, dir.join(format!("{}.json", kind))).unwrap();
    }

    /// Fabricate a terminal run on disk (status.json, request.json, terminal marker, result).
    pub fn fabricate_terminal_run(&self, id: &str, session: &str, ended_at: i64, state: &str) {
        let dir = self.run_dir(id);
        mkdir_0700(&dir);
        let req = request(Some(id), &self.work, vec![cmd_step("a", &["true"])]);
        write_file_mode(&dir.join("request.json"), serde_json::to_vec(&req).unwrap().as_slice(), 0o600);
        let exit = if state == "complete" { 0 } else { 1 };
        let st = json!({
            "runId": id, "sessionId": session, "mode": "single", "state": state,
            "startedAt": ended_at - 500, "lastUpdate": ended_at, "endedAt": ended_at,
            "timeoutMs": 1800000, "timedOut": false, "stopped": false, "exitCode": exit,
            "pid": 999999, "cwd": self.work.to_str().unwrap(), "currentStep": 0, "chainStepCount": 1,
            "queue": {"priority": 0, "claimedAt": ended_at - 600},
            "steps": [{"agent": "a", "status": if exit == 0 {"complete"} else {"failed"},
                       "startedAt": ended_at - 400, "endedAt": ended_at, "durationMs": 400, "exitCode": exit}]
        });
        write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
        let sdir = self.terminal_dir().join(seg(session));
        if !sdir.exists() {
            mkdir_0700(&sdir);
        }
        let marker = json!({"version": 1, "runId": id, "sessionId": session, "endedAt": ended_at});
        write_file_mode(&sdir.join(terminal_marker_name(ended_at, id)), marker.to_string().as_bytes(), 0o600);
    }

    /// Fabricate the public result file of a fabricated run (from its status).
    pub fn fabricate_result(&self, id: &str) {
        let st = self.status(id).expect("fabricate_result needs a status");
        let r = json!({
            "id": id, "runId": id, "sessionId": st["sessionId"], "mode": st["mode"], "state": st["state"],
            "success": st["state"] == "complete", "exitCode": st["exitCode"], "summary": "", "results": [],
            "durationMs": 0, "timestamp": st["endedAt"], "asyncDir": self.run_dir(id).to_str().unwrap(), "cwd": st["cwd"]
        });
        write_file_mode(&self.result_path(id), r.to_string().as_bytes(), 0o600);
    }
}
