//! The reference pipeline: the minimum the protocol asks for, written directly
//! against the OS. inotify event → open+flock+read+parse → mkdir → claim rename
//! (fsynced) → atomic queued status → spawn a detached runner, which writes
//! `running`, spawns the step, appends the step event, waits, writes the
//! terminal status (fsynced) and a done marker.
//!
//! Both roles run in this binary (`__ref-daemon ROOT MAX_RUNNING`,
//! `__ref-runner RUN_DIR`), started by the benchmark itself.

use std::collections::VecDeque;
use std::fs::{self, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;

use notify::{RecursiveMode, Watcher};
use serde_json::{json, Value};

use crate::fsops::{self, mkdirs, now_ms};

enum Msg {
    Spool,
    Exited,
}

/// The reference daemon: claims what lands in `ROOT/spool` and keeps up to
/// `max_running` runners going. Returns the process exit code.
pub fn daemon(root: &Path, max_running: usize) -> i32 {
    let spool = root.join("spool");
    let runs = root.join("async-subagent-runs");
    for d in [&spool, &runs, &root.join("done")] {
        if let Err(e) = mkdirs(d) {
            eprintln!("{}: {e}", d.display());
            return 1;
        }
    }
    let (tx, rx) = channel::<Msg>();
    let tx2 = tx.clone();
    let mut watcher = match notify::recommended_watcher(move |r: notify::Result<notify::Event>| {
        if !crate::fsops::is_change(&r) {
            return;
        }
        if let Ok(ev) = r {
            if ev.paths.iter().any(|p| p.file_name().is_some_and(|n| !n.to_string_lossy().starts_with('.'))) {
                let _ = tx2.send(Msg::Spool);
            }
        }
    }) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("inotify: {e}");
            return 1;
        }
    };
    if let Err(e) = watcher.watch(&spool, RecursiveMode::NonRecursive) {
        eprintln!("inotify: {e}");
        return 1;
    }
    let me = std::env::current_exe().expect("current exe");
    let _ = fs::write(root.join("ready"), b"");
    let mut queue: VecDeque<PathBuf> = VecDeque::new();
    let mut running = 0usize;
    let mut dirty = true;
    loop {
        if dirty {
            dirty = false;
            scan(&spool, &runs, &mut queue);
        }
        while running < max_running {
            let Some(dir) = queue.pop_front() else { break };
            let mut cmd = Command::new(&me);
            cmd.arg("__ref-runner")
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0);
            match cmd.spawn() {
                Ok(mut child) => {
                    running += 1;
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        let _ = child.wait();
                        let _ = tx.send(Msg::Exited);
                    });
                }
                Err(e) => eprintln!("spawn: {e}"),
            }
        }
        let Ok(m) = rx.recv() else { return 0 };
        let mut handle = |m: Msg| match m {
            Msg::Spool => dirty = true,
            Msg::Exited => running -= 1,
        };
        handle(m);
        while let Ok(m) = rx.try_recv() {
            handle(m);
        }
    }
}

fn scan(spool: &Path, runs: &Path, queue: &mut VecDeque<PathBuf>) {
    let Ok(rd) = fs::read_dir(spool) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        if let Some(dir) = claim(spool, runs, &name) {
            queue.push_back(dir);
        }
    }
}

fn claim(spool: &Path, runs: &Path, name: &str) -> Option<PathBuf> {
    let path = spool.join(name);
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .ok()?;
    if !fsops::flock(&f, true).ok()? {
        return None;
    }
    let mut raw = Vec::new();
    f.read_to_end(&mut raw).ok()?;
    let v: Value = serde_json::from_slice(&raw).ok()?;
    let id = v.get("runId")?.as_str()?.to_string();
    let dir = runs.join(&id);
    fs::DirBuilder::new().mode(0o700).create(&dir).ok()?;
    fs::rename(&path, dir.join("request.json")).ok()?;
    let _ = fsops::fsync_dir(&dir);
    let _ = fsops::fsync_dir(spool);
    let status = json!({"runId": id, "state": "queued", "queue": {"claimedAt": now_ms()}});
    fsops::write_atomic(&dir.join("status.json"), &serde_json::to_vec_pretty(&status).ok()?, false).ok()?;
    Some(dir)
}

/// The reference runner of one claimed run. Returns the process exit code.
pub fn runner(dir: &Path) -> i32 {
    let Ok(Some(_lock)) = fsops::lock(&dir.join("runner.lock"), true) else { return 1 };
    let Ok(raw) = fs::read(dir.join("request.json")) else { return 1 };
    let Ok(req) = serde_json::from_slice::<Value>(&raw) else { return 1 };
    let id = req["runId"].as_str().unwrap_or("?").to_string();
    let argv: Vec<String> = req["steps"][0]["command"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let status = |state: &str, code: Option<i32>| {
        serde_json::to_vec_pretty(&json!({"runId": id, "state": state, "pid": std::process::id(), "exitCode": code}))
            .unwrap()
    };
    if fsops::write_atomic(&dir.join("status.json"), &status("running", None), false).is_err() {
        return 1;
    }
    let Ok(out) = OpenOptions::new().append(true).create(true).mode(0o600).open(dir.join("output-0.log")) else {
        return 1;
    };
    let err = out.try_clone().ok();
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null()).stdout(out).process_group(0);
    if let Some(e) = err {
        cmd.stderr(e);
    }
    let code = match cmd.spawn() {
        Ok(mut c) => {
            let ev = json!({"type": "subagent.step.started", "ts": now_ms(), "runId": id, "stepIndex": 0});
            let _ = fsops::append_line(&dir.join("events.jsonl"), &serde_json::to_vec(&ev).unwrap());
            c.wait().ok().and_then(|s| s.code()).unwrap_or(1)
        }
        Err(_) => 127,
    };
    let state = if code == 0 { "complete" } else { "failed" };
    if fsops::write_atomic(&dir.join("status.json"), &status(state, Some(code)), true).is_err() {
        return 1;
    }
    let root = dir.parent().and_then(Path::parent).expect("root");
    let _ = fsops::touch(&root.join("done").join(&id));
    0
}
