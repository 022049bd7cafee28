//! The bridge test's two internal roles (docs/performance.md, "Bridge start
//! latency"):
//!
//! - `__provider LOGDIR OP`: a command provider (docs/external-jobs.md) whose
//!   `start` notes the instant it began, as `LOGDIR/<run id>.start`, and
//!   answers `completed` at once; `status`, `reattach` and `result` answer
//!   `completed`, `cancel` answers `stopped`.
//! - `__ref-bridge DIR LOGDIR`: the reference of the daemon's side of the
//!   bridge, the least that serves a request on the file event announcing it:
//!   inotify on `DIR/external-job-requests/`, then read the request and spawn
//!   the provider's `start` with the request on stdin.

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{SystemTime, UNIX_EPOCH};

use notify::{RecursiveMode, Watcher};
use serde_json::{json, Value};

/// Nanoseconds since the epoch (the clock the bench's file-event observer uses too).
pub fn epoch_ns(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// A run id as a file name of the log directory: letters, digits, `-`, `_`,
/// `.` (not leading); anything else becomes `_`.
pub fn log_name(id: &str) -> String {
    let s: String = id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    format!("{}.start", s.trim_start_matches('.'))
}

/// The provider role. Returns the process exit code.
pub fn provider(logdir: &Path, op: &str) -> i32 {
    let began = epoch_ns(SystemTime::now());
    let mut input = String::new();
    let _ = std::io::stdin().read_to_string(&mut input);
    let v: Value = serde_json::from_str(&input).unwrap_or(Value::Null);
    let run = std::env::var("RUNSPOOL_RUN_ID").unwrap_or_default();
    let job = v.get("providerJobId").and_then(Value::as_str).map(String::from).unwrap_or(format!("bench-{run}"));
    let answer = match op {
        "start" => {
            let note = json!({
                "startNs": began.to_string(),
                "requestId": std::env::var("RUNSPOOL_BRIDGE_REQUEST_ID").unwrap_or_default(),
                "runDir": std::env::var("RUNSPOOL_RUN_DIR").unwrap_or_default(),
            });
            let target = logdir.join(log_name(&run));
            let tmp = logdir.join(format!(".{}.{}.tmp", log_name(&run), std::process::id()));
            if fs::write(&tmp, note.to_string()).and_then(|_| fs::rename(&tmp, &target)).is_err() {
                println!(
                    r#"{{"code":"bench-log","message":"cannot write {}; check the directory"}}"#,
                    target.display()
                );
                return 2;
            }
            json!({"providerJobId": job, "state": "completed"})
        }
        "status" | "reattach" => json!({"providerJobId": job, "state": "completed"}),
        "result" => json!({"providerJobId": job, "state": "completed", "output": "ok"}),
        "cancel" => json!({"providerJobId": job, "state": "stopped"}),
        _ => {
            println!(r#"{{"code":"unknown-operation","message":"the bench provider has no operation {op}"}}"#);
            return 2;
        }
    };
    println!("{answer}");
    0
}

/// The reference bridge role. Returns the process exit code.
pub fn ref_bridge(dir: &Path, logdir: &Path) -> i32 {
    let reqdir = dir.join("external-job-requests");
    if let Err(e) = crate::fsops::mkdirs(&reqdir) {
        eprintln!("{}: {e}", reqdir.display());
        return 1;
    }
    let (tx, rx) = channel::<()>();
    let mut watcher = match notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
        if crate::fsops::is_change(&r) {
            let _ = tx.send(());
        }
    }) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("inotify: {e}");
            return 1;
        }
    };
    if let Err(e) = watcher.watch(&reqdir, RecursiveMode::NonRecursive) {
        eprintln!("inotify: {e}");
        return 1;
    }
    let me = std::env::current_exe().expect("current exe");
    let _ = fs::write(dir.join("ready"), b"");
    let mut seen = HashSet::new();
    loop {
        let Ok(rd) = fs::read_dir(&reqdir) else { return 1 };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json").filter(|_| !name.starts_with('.')) else { continue };
            if !seen.insert(name.clone()) {
                continue;
            }
            let Ok(body) = fs::read(e.path()) else { continue };
            let child = Command::new(&me)
                .arg("__provider")
                .arg(logdir)
                .arg("start")
                .env("RUNSPOOL_RUN_ID", id)
                .env("RUNSPOOL_BRIDGE_REQUEST_ID", id)
                .env("RUNSPOOL_RUN_DIR", dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            match child {
                Ok(mut c) => {
                    std::thread::spawn(move || {
                        if let Some(mut i) = c.stdin.take() {
                            let _ = i.write_all(&body);
                        }
                        let _ = c.wait();
                    });
                }
                Err(e) => eprintln!("spawn: {e}"),
            }
        }
        if rx.recv().is_err() {
            return 0;
        }
        while rx.try_recv().is_ok() {}
    }
}
