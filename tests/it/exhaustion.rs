//! Resource exhaustion: 20,000 spool entries published at once (valid and
//! hostile mixed) are each claimed exactly once or rejected with their code,
//! the daemon's peak RSS stays bounded (reported from /proc), and entries that
//! keep failing (a writer that never lets go of its flock, a file that is
//! forever being rewritten) never block the ones behind them.
//!
//! Not here: 1,000 external-job requests in one run serviced 100 per sweep.
//! That belongs with the external-job bridge and its own tests.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::json;
use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOTAL: usize = 20_000;
const VALID_EVERY: usize = 10; // one valid request in ten
/// Generous: the daemon holds names, not contents; it needs far less than this.
const RSS_LIMIT_KIB: u64 = 256 * 1024;

fn write_fast(p: &std::path::Path, bytes: &[u8], mode: u32) {
    let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(p).unwrap();
    f.write_all(bytes).unwrap();
    fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
}

#[test]
fn twenty_thousand_entries_bounded_memory_and_no_blocking() {
    let mut env = TestEnv::with_config("max_running = 2\nretention_days = 0\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let pid = env.daemon_pid().unwrap();
    let (_, rss_idle) = proc_rss_kib(pid).unwrap();
    let work = env.work.clone();

    // Entries that keep failing, published first so they head every scan.
    let locked_path = env.spool().join("stuck-locked.json");
    let locked = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&locked_path).unwrap();
    assert_eq!(unsafe { libc::flock(locked.as_raw_fd(), libc::LOCK_EX) }, 0);
    (&locked).write_all(b"{\"version\": 1, ").unwrap();
    let fresh_path = env.spool().join("stuck-fresh.json");
    let stop = Arc::new(AtomicBool::new(false));
    let rewriter = {
        let (p, stop) = (fresh_path.clone(), stop.clone());
        write_fast(&p, b"{\"version\"", 0o600);
        std::thread::spawn(move || {
            // An in-place writer that never finishes: the mtime stays fresh.
            let mut f = OpenOptions::new().write(true).open(&p).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                f.rewind().unwrap();
                f.write_all(format!("{{\"version\": 1, \"n\": {n}").as_bytes()).unwrap();
                n += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(50));

    // Stage everything under dot names (never read), then publish at once.
    let kinds: [(&str, &str); 6] = [
        ("garbage-old", RejectionCode::InvalidJson.as_str()),
        ("garbage-fresh", RejectionCode::InvalidJson.as_str()),
        ("version", RejectionCode::UnsupportedVersion.as_str()),
        ("traversal", RejectionCode::InvalidField.as_str()),
        ("perm", RejectionCode::BadPermissions.as_str()),
        ("cwd", RejectionCode::CwdMissing.as_str()),
    ];
    let mut expected: BTreeMap<String, &str> = BTreeMap::new();
    let mut valid: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut staged = Vec::with_capacity(TOTAL);
    for i in 0..TOTAL {
        let tmp = env.spool().join(format!(".x-{i}"));
        if i % VALID_EVERY == 0 {
            let id = format!("v{i:05}");
            let bytes = serde_json::to_vec(&request(Some(&id), &work, vec![cmd_step("a", &["true"])])).unwrap();
            write_fast(&tmp, &bytes, 0o600);
            valid.insert(id.clone(), bytes);
            staged.push((tmp, env.spool().join(format!("{id}.json"))));
            continue;
        }
        let (kind, code) = kinds[i % kinds.len()];
        let name = format!("{kind}-{i:05}");
        let base = request(None, &work, vec![cmd_step("a", &["true"])]);
        let mut mode = 0o600;
        let bytes = match kind {
            "garbage-old" | "garbage-fresh" => format!("{{\"version\": 1, \"cwd\": \"{i}").into_bytes(),
            "version" => serde_json::to_vec(&json!({"version": 2, "cwd": "/", "steps": []})).unwrap(),
            "traversal" => {
                let mut r = base.clone();
                r["runId"] = json!(format!("../escape-{i}"));
                serde_json::to_vec(&r).unwrap()
            }
            "perm" => {
                mode = 0o622;
                serde_json::to_vec(&base).unwrap()
            }
            _ => {
                let mut r = base.clone();
                r["cwd"] = json!(format!("{}/missing-{i}", work.display()));
                serde_json::to_vec(&r).unwrap()
            }
        };
        write_fast(&tmp, &bytes, mode);
        if kind == "garbage-old" {
            set_mtime_ago(&tmp, 60);
        }
        expected.insert(name.clone(), code);
        staged.push((tmp, env.spool().join(format!("{name}.json"))));
    }
    let t0 = Instant::now();
    for (from, to) in &staged {
        fs::rename(from, to).unwrap();
    }
    report(&format!("exhaustion: published {TOTAL} entries ({} valid) at once", valid.len()));

    // Wait until everything but the two stuck entries has left the spool.
    let stuck = ["stuck-fresh.json".to_string(), "stuck-locked.json".to_string()];
    let mut peak_seen = 0u64;
    let deadline = Instant::now() + Duration::from_secs(1200);
    loop {
        if let Some((hwm, _)) = proc_rss_kib(pid) {
            peak_seen = peak_seen.max(hwm);
        }
        let left: Vec<String> = env.pending_spool().into_iter().filter(|n| !stuck.contains(n)).collect();
        if left.is_empty() {
            break;
        }
        assert!(env.daemon_exited().is_none(), "the daemon died\n{}", env.log_tail(60));
        assert!(
            Instant::now() < deadline,
            "{} entries still in the spool after 20 minutes, e.g. {:?}\n{}",
            left.len(),
            &left[..left.len().min(5)],
            env.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (hwm, rss) = proc_rss_kib(pid).expect("the daemon is alive");
    let peak = hwm.max(peak_seen);
    report(&format!(
        "exhaustion: daemon peak RSS while claiming {TOTAL} entries: {:.1} MiB (VmHWM; {:.1} MiB idle before, {:.1} MiB now), {:?} after publishing",
        peak as f64 / 1024.0,
        rss_idle as f64 / 1024.0,
        rss as f64 / 1024.0,
        t0.elapsed()
    ));
    assert!(peak < RSS_LIMIT_KIB, "daemon peak RSS {peak} KiB exceeds {RSS_LIMIT_KIB} KiB");

    // The stuck entries are still waiting: neither rejected early nor lost.
    assert!(locked_path.exists() && fresh_path.exists(), "stuck entries stay in the spool while their writers work");
    assert!(
        !env.rejected().join("stuck-locked.error.json").exists()
            && !env.rejected().join("stuck-fresh.error.json").exists()
    );

    // Every hostile entry is rejected exactly once, with its code.
    let mut wrong = vec![];
    for (name, code) in &expected {
        match read_json(&env.rejected().join(format!("{name}.error.json"))) {
            None => wrong.push(format!("{name}: no error file")),
            Some(v) if v["code"] != *code => wrong.push(format!("{name}: {} != {code}", v["code"])),
            Some(_) => {}
        }
        if !env.rejected().join(format!("{name}.json")).exists() {
            wrong.push(format!("{name}: rejected entry missing"));
        }
    }
    let rejected_files = list_names(&env.rejected());
    let extra: Vec<&String> = rejected_files
        .iter()
        .filter(|n| {
            let stem = n.strip_suffix(".error.json").or_else(|| n.strip_suffix(".json")).unwrap_or(n);
            !expected.contains_key(stem)
        })
        .collect();
    if !extra.is_empty() {
        wrong.push(format!(
            "{} unexpected names in rejected/ (a duplicate or a valid request rejected?), e.g. {:?}",
            extra.len(),
            &extra[..extra.len().min(5)]
        ));
    }
    // Every valid entry is exactly one run that owns its bytes.
    for (id, bytes) in &valid {
        let dir = env.run_dir(id);
        match fs::read(dir.join("request.json")) {
            Ok(b) if &b == bytes => {}
            Ok(_) => wrong.push(format!("{id}: request.json differs from what was published")),
            Err(e) => wrong.push(format!("{id}: not claimed ({e})")),
        }
    }
    let runs: Vec<String> = env.run_ids();
    let unknown: Vec<&String> = runs.iter().filter(|r| !valid.contains_key(*r)).collect();
    if !unknown.is_empty() {
        wrong.push(format!(
            "{} run directories for no valid request, e.g. {:?}",
            unknown.len(),
            &unknown[..unknown.len().min(5)]
        ));
    }
    assert!(!env.root.join("escape-1").exists() && !env.root.join("escape-3").exists());
    assert!(wrong.is_empty(), "{} problems:\n  {}", wrong.len(), wrong[..wrong.len().min(30)].join("\n  "));

    // Let go of the stuck entries: the finished one is claimed and runs, the
    // abandoned one is rejected as invalid JSON once it is old enough.
    stop.store(true, Ordering::SeqCst);
    rewriter.join().unwrap();
    // Highest priority, so it does not wait behind the thousands of queued runs.
    let mut req = request(Some("stuck-locked"), &work, vec![cmd_step("a", &["true"])]);
    req["priority"] = json!(1000);
    let tail = serde_json::to_vec(&req).unwrap();
    locked.set_len(0).unwrap();
    (&locked).rewind().unwrap();
    (&locked).write_all(&tail).unwrap();
    drop(locked);
    let e = env.wait_rejection("stuck-fresh");
    assert_eq!(e["code"], RejectionCode::InvalidJson.as_str(), "{e}");
    let st = env.wait_terminal_for("stuck-locked", Duration::from_secs(1200));
    assert_eq!(st["state"], "complete", "{st}");
    assert!(env.daemon_exited().is_none());
}
