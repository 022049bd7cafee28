//! Storage-capacity and watch-fallback proofs with real faults (PROTOCOL
//! §10–§12): a full tmpfs (bytes and inodes), a btrfs quota, a runner whose
//! file limit drops under it, inotify limits of zero in a user namespace, a
//! FUSE (bindfs) root, and an overflowing event queue. Tests that need root
//! (mounts) say so and skip otherwise.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn need_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("skipped: {test} needs root (mounts); CI runs it as root");
        return false;
    }
    true
}

fn fixtures(tools: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures.sh");
    let st = Command::new("bash").arg(script).args(tools).status().expect("run scripts/fixtures.sh");
    assert!(st.success(), "scripts/fixtures.sh {tools:?} failed");
}

fn sh(cmd: &str) -> std::process::Output {
    Command::new("sh").arg("-c").arg(cmd).output().unwrap()
}

/// A mount over a directory, lazily unmounted on drop (runners may still hold files).
struct Mount {
    at: PathBuf,
    extra: Vec<String>, // commands to run after unmounting
}
impl Drop for Mount {
    fn drop(&mut self) {
        if std::env::var_os("RUNSPOOL_TEST_KEEP").is_some() {
            eprintln!("keeping the mount at {}", self.at.display());
            return;
        }
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        for c in &self.extra {
            let _ = sh(c);
        }
    }
}

fn mount_tmpfs(at: &Path, opts: &str) -> Mount {
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("{opts},mode=0700"), "tmpfs"])
        .arg(at)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs on {}", at.display());
    Mount { at: at.to_path_buf(), extra: vec![] }
}

/// Fill the filesystem under `dir` to the brim; returns the filler files,
/// big chunks first so that freeing them one by one gives space back gradually.
fn fill(dir: &Path, chunk: usize) -> Vec<PathBuf> {
    fs::create_dir_all(dir).unwrap();
    let mut files = Vec::new();
    let mut size = chunk;
    let mut i = 0;
    while size >= 512 {
        loop {
            let p = dir.join(format!("fill-{i:06}"));
            i += 1;
            match fs::write(&p, vec![0xAB; size]) {
                Ok(()) => files.push(p),
                Err(e) => {
                    let _ = fs::remove_file(&p); // a partial file is no use
                    let code = e.raw_os_error();
                    assert!(
                        matches!(code, Some(libc::ENOSPC) | Some(libc::EDQUOT)),
                        "filling {} failed with {e}, not a capacity error",
                        dir.display()
                    );
                    break;
                }
            }
        }
        size /= 4;
    }
    // Inodes too, when they run out first the loop above stops early anyway.
    files
}

/// Fill every free inode with empty files.
fn fill_inodes(dir: &Path) -> Vec<PathBuf> {
    fs::create_dir_all(dir).unwrap();
    let mut files = Vec::new();
    for i in 0.. {
        let p = dir.join(format!("i{i:07}"));
        match fs::File::create(&p) {
            Ok(_) => files.push(p),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "creating inodes failed with {e}");
                break;
            }
        }
    }
    files
}

#[derive(Clone)]
enum Want {
    Run(&'static str, i64),
    Reject(&'static str),
}

/// Stage `n` requests (valid single/chain runs and some invalid ones) as files
/// in `stage` on the same filesystem, so publishing them is only a rename.
fn stage_requests(env: &TestEnv, stage: &Path, prefix: &str, n: usize) -> Vec<(String, Want)> {
    fs::create_dir_all(stage).unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let name = format!("{prefix}-{i:04}");
        let (req, want) = match i % 5 {
            0 => (request(Some(&name), &env.work, vec![sh_step("a", "exit 0")]), Want::Run("complete", 0)),
            1 => (request(Some(&name), &env.work, vec![sh_step("a", "exit 3")]), Want::Run("failed", 3)),
            2 => (
                request(Some(&name), &env.work, vec![sh_step("a", "true"), sh_step("b", "exit 0")]),
                Want::Run("complete", 0),
            ),
            3 => {
                let mut r = request(None, &env.work, vec![sh_step("a", "true")]);
                r["bogusField"] = json!(1);
                (r, Want::Reject(RejectionCode::InvalidField.as_str()))
            }
            _ => (
                request(
                    Some(&name),
                    &env.work,
                    vec![parallel(vec![sh_step("p", "true"), sh_step("q", "exit 0")], None)],
                ),
                Want::Run("complete", 0),
            ),
        };
        let p = stage.join(format!("{name}.json"));
        fs::write(&p, serde_json::to_vec(&req).unwrap()).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
        out.push((name, want));
    }
    out
}

/// Sample daemon.json's storage state in the background.
fn watch_storage(env: &TestEnv) -> (Arc<Mutex<Vec<String>>>, Arc<std::sync::atomic::AtomicBool>) {
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, stop2, path) = (seen.clone(), stop.clone(), env.daemon_json());
    std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(d) = read_json(&path) {
                let st = d["storage"]["state"].as_str().unwrap_or("?").to_string();
                let mut v = s2.lock().unwrap();
                if v.last() != Some(&st) {
                    v.push(st);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    (seen, stop)
}

fn temp_files(root: &Path) -> Vec<PathBuf> {
    walk_all(root)
        .into_iter()
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with('.') && n.ends_with(".tmp")
        })
        .collect()
}

/// Every request ends as exactly one terminal run (or one rejection), no
/// status.json is empty or truncated, no temp file is left, indexes agree.
fn check_outcomes(env: &TestEnv, wanted: &[(String, Want)]) {
    // Runners retry deferred index writes every second: give them time to land.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let problems = outcome_problems(env, wanted);
        if problems.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            panic!("{} problems:\n  {}\n{}", problems.len(), problems.join("\n  "), env.log_tail(60));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn outcome_problems(env: &TestEnv, wanted: &[(String, Want)]) -> Vec<String> {
    let rejected = list_names(&env.rejected());
    let mut problems = Vec::new();
    for (name, want) in wanted {
        match want {
            Want::Run(state, code) => {
                let st = env.status(name);
                match st {
                    Some(s) if s["state"] == *state && s["exitCode"] == *code => {}
                    other => problems.push(format!(
                        "{name}: want {state}/{code}, got {:?}",
                        other.map(|s| (s["state"].clone(), s["exitCode"].clone()))
                    )),
                }
                if rejected.iter().any(|r| r.starts_with(name.as_str())) {
                    problems.push(format!("{name} is also in rejected/"));
                }
            }
            Want::Reject(code) => {
                let entries: Vec<&String> =
                    rejected.iter().filter(|r| r.starts_with(name.as_str()) && !r.ends_with(".error.json")).collect();
                if entries.len() != 1 {
                    problems.push(format!("{name}: {} rejected entries", entries.len()));
                }
                match read_json(&env.rejected().join(format!("{name}.error.json"))) {
                    Some(e) if e["code"] == *code => {}
                    other => problems.push(format!("{name}: error file {other:?}")),
                }
            }
        }
    }
    for id in env.run_ids() {
        let p = env.run_dir(&id).join("status.json");
        let bytes = fs::read(&p).unwrap_or_default();
        if serde_json::from_slice::<Value>(&bytes).is_err() {
            problems.push(format!("{}: empty or truncated ({} bytes)", p.display(), bytes.len()));
        }
    }
    for t in temp_files(&env.root) {
        problems.push(format!("temp file left: {}", t.display()));
    }
    problems.extend(consistency_errors(env));
    problems
}

fn settle(env: &TestEnv, wanted: &[(String, Want)], timeout: Duration) {
    let ok = poll_until(timeout, || {
        env.pending_spool().is_empty()
            && env.active_markers().is_empty()
            && wanted.iter().all(|(n, w)| match w {
                Want::Run(..) => env.state(n).is_some_and(|s| is_terminal_state(&s)) && env.result_path(n).exists(),
                Want::Reject(_) => env.rejected().join(format!("{n}.error.json")).exists(),
            })
    });
    if !ok {
        let missing: Vec<_> = wanted
            .iter()
            .filter(|(n, _)| env.state(n).is_none_or(|s| !is_terminal_state(&s)))
            .take(10)
            .map(|(n, _)| (n.clone(), env.state(n)))
            .collect();
        panic!(
            "did not settle: spool {:?} active {:?} missing {:?}\n{}",
            env.pending_spool().iter().take(10).collect::<Vec<_>>(),
            env.active_markers().iter().take(10).collect::<Vec<_>>(),
            missing,
            env.log_tail(300)
        );
    }
}

/// The common full-disk scenario: requests published while the filesystem
/// is full; space comes back a chunk at a time; nothing is lost.
fn full_disk_scenario(
    env: &mut TestEnv,
    filler_dir: &Path,
    fill_fn: &dyn Fn(&Path) -> Vec<PathBuf>,
    n: usize,
    publish_first: bool,
) {
    env.start_daemon();
    let (seen, stop) = watch_storage(env);
    let stage = env.root.join("stage");
    let wanted = stage_requests(env, &stage, "full", n);
    let publish = || {
        for (name, _) in &wanted {
            fs::rename(stage.join(format!("{name}.json")), env.spool().join(format!("{name}.json"))).unwrap();
        }
    };
    // On btrfs even a rename needs space past the quota: publish, then fill
    // at once while the daemon is at work. On tmpfs a rename is free: fill first.
    if publish_first {
        publish();
    }
    let filler = fill_fn(filler_dir);
    assert!(!filler.is_empty(), "could not fill the filesystem");
    eprintln!("filled with {} files; {n} requests published", filler.len());
    if !publish_first {
        publish();
    }
    // Let the daemon meet the full disk for a while.
    std::thread::sleep(Duration::from_secs(4));
    let total = filler.len();
    let mut rest = filler;
    rest.reverse(); // smallest first: space comes back slowly at first
    while !rest.is_empty() {
        // About forty steps back to an empty filesystem, however many files filled it.
        let k = rest.len().min((total / 40).max(4));
        for p in rest.drain(..k) {
            fs::remove_file(p).unwrap();
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    settle(env, &wanted, Duration::from_secs(240));
    // daemon.json ends ok.
    wait_until(Duration::from_secs(30), "daemon.json storage ok", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "ok")
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = seen.lock().unwrap().clone();
    eprintln!("daemon.json storage states seen: {seen:?}");
    assert!(
        seen.iter().any(|s| s == "degraded"),
        "daemon.json never reported degraded: {seen:?}\n{}",
        env.log_tail(60)
    );
    let _ = fs::remove_dir_all(&stage);
    check_outcomes(env, &wanted);
    assert!(env.term().success());
}

const FULL_CONFIG: &str = "max_running = 8\n[storage]\nmin_free_bytes = 0\n[watch]\nrescan_interval_s = 2\n";

#[test]
fn enospc_bytes_on_a_full_tmpfs() {
    if !need_root("enospc_bytes_on_a_full_tmpfs") {
        return;
    }
    let mut env = TestEnv::with_config(FULL_CONFIG);
    // Big enough for all 200 runs once the filler is gone.
    let _m = mount_tmpfs(&env.root, "size=24m");
    env.ensure_layout();
    let filler = env.root.join("filler");
    full_disk_scenario(&mut env, &filler, &|d| fill(d, 256 * 1024), 200, false);
}

#[test]
fn enospc_inodes_on_a_full_tmpfs() {
    if !need_root("enospc_inodes_on_a_full_tmpfs") {
        return;
    }
    let mut env = TestEnv::with_config(FULL_CONFIG);
    let _m = mount_tmpfs(&env.root, "size=64m,nr_inodes=8000");
    env.ensure_layout();
    let filler = env.root.join("filler");
    full_disk_scenario(&mut env, &filler, &fill_inodes, 200, false);
}

#[test]
fn edquot_on_a_btrfs_qgroup() {
    if !need_root("edquot_on_a_btrfs_qgroup") {
        return;
    }
    fixtures(&["btrfs"]);
    let mut env = TestEnv::with_config(FULL_CONFIG);
    let img = env.base().join("btrfs.img");
    let mnt = env.base().join("btrfs");
    fs::create_dir_all(&mnt).unwrap();
    assert!(sh(&format!("truncate -s 300M {0} && mkfs.btrfs -q {0}", img.display())).status.success());
    let out = sh(&format!("mount -o loop {} {}", img.display(), mnt.display()));
    if !out.status.success() {
        eprintln!("skipped: cannot mount a btrfs loop image here ({})", String::from_utf8_lossy(&out.stderr));
        return;
    }
    let _m = Mount { at: mnt.clone(), extra: vec![format!("rm -f {}", img.display())] };
    // The runspool root is a subvolume with a 2 MiB quota: writes past it get EDQUOT.
    let sub = mnt.join("root");
    let cmds = format!(
        "btrfs quota enable {m} && btrfs subvolume create {s} >/dev/null && btrfs qgroup limit 2M {s} && chmod 700 {s} && sync",
        m = mnt.display(),
        s = sub.display()
    );
    let out = sh(&cmds);
    assert!(out.status.success(), "btrfs quota setup: {}", String::from_utf8_lossy(&out.stderr));
    eprintln!("using a btrfs qgroup limit for real EDQUOT");
    env.root = sub.clone();
    env.ensure_layout();
    let filler = sub.join("filler");
    full_disk_scenario(&mut env, &filler, &|d| fill(d, 64 * 1024), 100, true);
}

#[test]
fn min_free_bytes_pauses_claiming_and_resumes() {
    if !need_root("min_free_bytes_pauses_claiming_and_resumes") {
        return;
    }
    // A 16 MiB tmpfs with a 6 MiB floor: after filling to 1 MiB free, nothing is claimed.
    let mut env = TestEnv::with_config("[storage]\nmin_free_bytes = 6291456\n[watch]\nrescan_interval_s = 2\n");
    let _m = mount_tmpfs(&env.root, "size=16m");
    env.ensure_layout();
    env.start_daemon();
    let ballast = env.root.join("ballast");
    fs::write(&ballast, vec![0u8; 14 * 1024 * 1024]).unwrap();
    wait_until(Duration::from_secs(30), "daemon.json degraded", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "degraded")
    });
    let d = read_json(&env.daemon_json()).unwrap();
    assert!(d["storage"]["reason"].as_str().unwrap().contains("min_free_bytes"), "{d}");
    let (id, _) = env.submit(&request(Some("floor-1"), &env.work, vec![sh_step("a", "exit 0")]));
    std::thread::sleep(Duration::from_secs(3));
    assert!(env.spool().join(format!("{id}.json")).exists(), "claimed below the free-space floor");
    assert!(env.status(&id).is_none());
    fs::remove_file(&ballast).unwrap();
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "complete");
    wait_until(Duration::from_secs(30), "daemon.json ok", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["storage"]["state"] == "ok")
    });
    assert!(env.log_tail(400).contains("claiming paused"), "no warning logged");
    assert!(env.term().success());
}

fn runner_pid(env: &TestEnv, id: &str) -> i64 {
    env.status(id).and_then(|s| s["runner"]["pid"].as_i64()).expect("runner pid in status")
}

#[test]
fn runner_terminal_write_waits_out_a_full_disk_for_minutes() {
    if !need_root("runner_terminal_write_waits_out_a_full_disk_for_minutes") {
        return;
    }
    let mut env = TestEnv::with_config(FULL_CONFIG);
    let _m = mount_tmpfs(&env.root, "size=3m");
    env.ensure_layout();
    env.start_daemon();
    let flag = env.work.join("go");
    let script = format!("while [ ! -e {} ]; do sleep 0.1; done; exit 7", flag.display());
    let (id, _) = env.submit(&request(Some("late-1"), &env.work, vec![sh_step("a", &script)]));
    env.wait_state(&id, "running");
    let pid = runner_pid(&env, &id);
    let filler = fill(&env.root.join("filler"), 64 * 1024);
    fs::write(&flag, b"").unwrap(); // the flag lives outside the full filesystem
                                    // The step ends now, and the terminal write meets a full disk. Hold it for over a minute.
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(65) {
        assert!(process_alive(pid), "the runner exited with its terminal write still pending");
        let st = env.state(&id).unwrap_or_default();
        assert_eq!(st, "running", "status changed while the disk was full");
        std::thread::sleep(Duration::from_secs(1));
    }
    for p in filler {
        fs::remove_file(p).unwrap();
    }
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed");
    assert_eq!(st["exitCode"], 7);
    assert_eq!(st["steps"][0]["exitCode"], 7);
    wait_until(Duration::from_secs(30), "runner exit", || !process_alive(pid));
    assert!(env.result(&id).is_some(), "no result after recovery");
    assert!(temp_files(&env.root).is_empty(), "temp files left: {:?}", temp_files(&env.root));
    env.check_consistency();
    assert!(env.term().success());
}

#[test]
fn runner_under_a_file_descriptor_limit_still_records_its_end() {
    fixtures(&["prlimit"]);
    let mut env = TestEnv::new();
    env.start_daemon();
    let flag = env.work.join("go");
    let script = format!("while [ ! -e {} ]; do sleep 0.1; done; exit 5", flag.display());
    let (id, _) = env.submit(&request(Some("emfile-1"), &env.work, vec![sh_step("a", &script)]));
    env.wait_state(&id, "running");
    let pid = runner_pid(&env, &id);
    // Drop the runner's open-file limit below what it has open: every new open fails with EMFILE.
    // Only the soft limit: raising a hard limit again needs CAP_SYS_RESOURCE.
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let soft: String = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap()
        .to_string();
    let out = sh(&format!("prlimit --pid {pid} --nofile=3:"));
    assert!(out.status.success(), "prlimit: {}", String::from_utf8_lossy(&out.stderr));
    fs::write(&flag, b"").unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert!(process_alive(pid), "the runner gave up under EMFILE");
    assert_eq!(env.state(&id).as_deref(), Some("running"), "a terminal write got through under EMFILE?");
    let out = sh(&format!("prlimit --pid {pid} --nofile={soft}:"));
    assert!(out.status.success(), "prlimit: {}", String::from_utf8_lossy(&out.stderr));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed");
    assert_eq!(st["exitCode"], 5);
    wait_until(Duration::from_secs(30), "runner exit", || !process_alive(pid));
    env.check_consistency();
}

fn unshare_available() -> bool {
    sh("unshare -U -r true").status.success()
}

#[test]
fn zero_inotify_limits_fall_back_to_polling() {
    if !unshare_available() {
        eprintln!("skipped: user namespaces (unshare -U -r) are not available here");
        return;
    }
    let mut env = TestEnv::new();
    // /proc/sys/user/max_inotify_instances is per user namespace: zero inside,
    // untouched outside (fs.inotify.max_user_instances would be the host's own).
    let mut cmd = Command::new("unshare");
    cmd.args(["-U", "-r", "sh", "-c", "echo 0 > /proc/sys/user/max_inotify_instances && exec \"$0\" \"$@\""]);
    cmd.arg(BIN).arg("daemon").arg("--root").arg(&env.root).arg("--config").arg(&env.config_path);
    cmd.env("XDG_CONFIG_HOME", env.base().join("xdg")).env("RUNSPOOL_LOG", "debug");
    env.start_daemon_command(cmd);
    let d = read_json(&env.daemon_json()).unwrap();
    assert_eq!(d["watch"]["strategy"], "poll", "{d}");
    assert_eq!(d["watch"]["backend"], "poll", "{d}");
    let reason = d["watch"]["reason"].as_str().unwrap();
    assert!(reason.contains("inotify") && reason.contains("max_user_instances"), "reason: {reason}");
    let (id, _) = env.submit(&request(Some("poll-1"), &env.work, vec![sh_step("a", "exit 0")]));
    assert_eq!(env.wait_terminal(&id)["state"], "complete");
    let (id, _) = env.submit(&request(Some("poll-2"), &env.work, vec![sh_step("a", "sleep 30")]));
    env.wait_state(&id, "running");
    // The runner could not watch its inbox either: stop still works through its periodic check.
    env.write_control(&id, "stop");
    assert_eq!(env.wait_terminal(&id)["state"], "stopped");
    assert!(env.term().success());
}

#[test]
fn native_strategy_that_cannot_start_is_a_startup_error() {
    if !unshare_available() {
        eprintln!("skipped: user namespaces (unshare -U -r) are not available here");
        return;
    }
    let env = TestEnv::with_config("[watch]\nstrategy = \"native\"\n");
    let mut cmd = Command::new("unshare");
    cmd.args(["-U", "-r", "sh", "-c", "echo 0 > /proc/sys/user/max_inotify_instances && exec \"$0\" \"$@\""]);
    cmd.arg(BIN).arg("daemon").arg("--root").arg(&env.root).arg("--config").arg(&env.config_path);
    let (st, out) = env.run_command_expect_exit(cmd, Duration::from_secs(30));
    assert!(!st.success());
    assert!(out.contains("sysctl fs.inotify.max_user_instances"), "no sysctl hint: {out}");
}

#[test]
fn fuse_root_is_polled_and_backing_writes_are_claimed() {
    if !need_root("fuse_root_is_polled_and_backing_writes_are_claimed") {
        return;
    }
    fixtures(&["bindfs"]);
    if !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: /dev/fuse is missing");
        return;
    }
    let mut env = TestEnv::new();
    let backing = env.base().join("backing");
    mkdir_0700(&backing);
    let mnt = env.base().join("fuse");
    mkdir_0700(&mnt);
    let out = sh(&format!("bindfs --no-allow-other {} {}", backing.display(), mnt.display()));
    assert!(out.status.success(), "bindfs: {}", String::from_utf8_lossy(&out.stderr));
    let _m = Mount { at: mnt.clone(), extra: vec![] };
    fs::set_permissions(&mnt, fs::Permissions::from_mode(0o700)).unwrap();
    env.root = mnt.join("root");
    mkdir_0700(&env.root);
    env.ensure_layout();
    env.start_daemon();
    let d = read_json(&env.daemon_json()).unwrap();
    assert_eq!(d["watch"]["strategy"], "poll", "{d}");
    assert!(d["watch"]["reason"].as_str().unwrap().contains("fuse"), "{d}");
    // Write through the backing directory: the FUSE mount sees no inotify event for it.
    let back_spool = backing.join("root/spool");
    for i in 0..5 {
        let id = format!("fuse-{i}");
        let req = request(Some(&id), &env.work, vec![sh_step("a", "exit 0")]);
        let tmp = back_spool.join(format!(".{id}.tmp"));
        fs::write(&tmp, serde_json::to_vec(&req).unwrap()).unwrap();
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600)).unwrap();
        fs::rename(&tmp, back_spool.join(format!("{id}.json"))).unwrap();
    }
    for i in 0..5 {
        assert_eq!(env.wait_terminal(&format!("fuse-{i}"))["state"], "complete");
    }
    assert!(env.term().success());
}

#[test]
fn event_queue_overflow_loses_no_request() {
    // A burst far larger than the inotify queue (max_queued_events, 16384 by
    // default) while the daemon is busy: overflow forces a rescan.
    let mut env = TestEnv::with_config("max_running = 4\n[watch]\nrescan_interval_s = 600\n");
    let _m = if is_root() {
        let m = mount_tmpfs(&env.root, "size=512m");
        env.ensure_layout();
        Some(m)
    } else {
        None
    };
    let queue = fs::read_to_string("/proc/sys/fs/inotify/max_queued_events").unwrap_or_default();
    env.start_daemon();
    let n = 20_000usize.max(queue.trim().parse::<usize>().unwrap_or(16384) + 2000);
    eprintln!("dropping {n} requests (max_queued_events = {})", queue.trim());
    let stage = env.root.join("stage");
    fs::create_dir_all(&stage).unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        // Mostly rejections (cheap), a valid run every 1000.
        let name = format!("burst-{i:05}");
        // Invalid ones carry no run id, so no rejected run directory is made for each.
        let valid = i % 1000 == 0;
        let mut req = request(valid.then_some(name.as_str()), &env.work, vec![sh_step("a", "exit 0")]);
        if !valid {
            req["typo"] = json!(true);
        } else {
            ids.push(name.clone());
        }
        let p = stage.join(format!("{name}.json"));
        fs::write(&p, serde_json::to_vec(&req).unwrap()).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
    }
    for i in 0..n {
        let name = format!("burst-{i:05}.json");
        fs::rename(stage.join(&name), env.spool().join(&name)).unwrap();
    }
    wait_until(Duration::from_secs(600), "all burst requests handled", || env.pending_spool().is_empty());
    for id in &ids {
        assert_eq!(env.wait_terminal(id)["state"], "complete");
    }
    let errors = list_names(&env.rejected()).iter().filter(|n| n.ends_with(".error.json")).count();
    assert_eq!(errors, n - ids.len(), "every invalid request has exactly one error file");
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    eprintln!("overflow rescans logged: {}", log.matches("overflowed").count());
    assert!(env.term().success());
}

/// The chaos test of issue 3: 1,000 requests while the daemon is SIGKILLed
/// every 0.5–2 s and restarted, and the disk fills and empties twice.
/// Nothing lost, nothing duplicated, every index consistent at the end.
#[test]
fn chaos_with_kills_and_a_disk_that_fills_twice() {
    if !need_root("chaos_with_kills_and_a_disk_that_fills_twice") {
        return;
    }
    let mut env = TestEnv::with_config(FULL_CONFIG);
    let _m = mount_tmpfs(&env.root, "size=48m");
    env.ensure_layout();
    env.start_daemon();
    let stage = env.root.join("stage");
    let wanted = stage_requests(&env, &stage, "chaos", 1000);
    let mut rng = Rng::new(0x5eed_cafe);
    let filler_dir = env.root.join("filler");
    let mut published = 0;
    let mut fills = 0;
    let mut filler: Vec<PathBuf> = Vec::new();
    let mut kills = 0;
    let start = Instant::now();
    while published < wanted.len() || fills < 2 || !filler.is_empty() {
        // Publish a batch.
        let batch = (rng.range(20, 120) as usize).min(wanted.len() - published);
        for (name, _) in &wanted[published..published + batch] {
            fs::rename(stage.join(format!("{name}.json")), env.spool().join(format!("{name}.json"))).unwrap();
        }
        published += batch;
        // Fill the disk at the 30% and 70% marks; free it on the next round.
        if !filler.is_empty() {
            for p in filler.drain(..) {
                fs::remove_file(p).unwrap();
            }
        } else if fills < 2 && published * 10 >= wanted.len() * (3 + 4 * fills) {
            filler = fill(&filler_dir, 256 * 1024);
            fills += 1;
            eprintln!("chaos: disk full (#{fills}) after {published} requests");
        }
        std::thread::sleep(Duration::from_millis(rng.range(500, 2000)));
        env.kill9();
        kills += 1;
        env.start_daemon();
        assert!(start.elapsed() < Duration::from_secs(300), "chaos loop took too long");
    }
    eprintln!("chaos: {kills} kills, {fills} fills, {published} requests");
    assert!(kills >= 10);
    settle(&env, &wanted, Duration::from_secs(300));
    let _ = fs::remove_dir_all(&stage);
    let _ = fs::remove_dir_all(&filler_dir);
    check_outcomes(&env, &wanted);
    assert!(env.term().success());
}

/// `runspool stop` of a pending request on a full disk with room for its
/// intent marker only (one page): the move succeeds, its error file and run
/// cannot be written. Killed there, or giving up after its minute, the
/// withdrawal is reported for what it is (withdrawn, not finished: never a
/// failure), and once space returns the daemon finishes it as `withdrawn`
/// (never `duplicate-run-id`) and the request never runs.
#[test]
fn a_withdrawal_cut_short_by_a_full_disk_is_finished_as_withdrawn() {
    if !need_root("a_withdrawal_cut_short_by_a_full_disk_is_finished_as_withdrawn") {
        return;
    }
    let mut env = TestEnv::with_config(FULL_CONFIG);
    let _m = mount_tmpfs(&env.root, "size=4m");
    env.ensure_layout();
    let ran = env.work.join("ran");
    for id in ["wd-killed", "wd-gave-up"] {
        env.submit(&request(Some(id), &env.work, vec![sh_step("s", &format!("touch '{}'", ran.display()))]));
    }
    let mut filler = fill(&env.root.join("filler"), 256 * 1024);
    let stop = |id: &str| {
        let mut c = Command::new(BIN);
        c.args(["stop", id, "--reason", &format!("{id} no longer needed"), "--root"]).arg(&env.root);
        c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    // A withdrawal that waits for room to record its intent gets one small
    // file's worth (the last filler files are the smallest): its error file
    // still finds the disk full.
    let mut moved_with_room_for_its_intent = |id: &str| {
        let moved = env.rejected().join(format!("{id}.json"));
        let t0 = Instant::now();
        while !moved.exists() && t0.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !moved.exists() {
            fs::remove_file(filler.pop().unwrap()).unwrap();
        }
        wait_until(LONG, &format!("the withdrawal to move {id}"), || moved.exists());
    };
    let mut child = stop("wd-killed");
    moved_with_room_for_its_intent("wd-killed");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!env.rejected().join("wd-killed.error.json").exists(), "the disk was meant to be full for the error file");
    child.kill().unwrap();
    child.wait().unwrap();

    let child = stop("wd-gave-up");
    moved_with_room_for_its_intent("wd-gave-up");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "moved out of the spool, it is withdrawn: {}", describe(&o));
    let said = stderr_str(&o);
    assert!(said.contains("withdrew wd-gave-up") && said.contains("Not finished yet"), "{said}");
    assert!(env.pending_spool().is_empty(), "{:?}", env.pending_spool());

    for p in filler {
        fs::remove_file(p).unwrap();
    }
    env.start_daemon();
    for id in ["wd-killed", "wd-gave-up"] {
        let ef = env.rejected().join(format!("{id}.error.json"));
        wait_until(LONG, &format!("{}\n{}", ef.display(), env.log_tail(30)), || ef.exists());
        let err = read_json(&ef).unwrap();
        assert_eq!(err["code"], RejectionCode::Withdrawn.as_str(), "{err}");
        assert!(err["message"].as_str().unwrap().contains(&format!("{id} no longer needed")), "{err}");
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "rejected", "{st}");
        assert!(st["error"].as_str().unwrap().starts_with("withdrawn: "), "{st}");
        assert!(!env.run_dir(id).join("request.json").exists(), "{id} was never claimed");
    }
    wait_until(LONG, "the intent markers to go", || {
        !list_names(&env.rejected()).iter().any(|n| n.starts_with(".withdrawing-"))
    });
    assert!(!ran.exists(), "a withdrawn request never runs");
    env.check_consistency();
    assert!(env.term().success());
}
