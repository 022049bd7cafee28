//! CI smoke run of the benchmark (docs/performance.md) with tiny sizes, so it
//! cannot rot. It checks that every section of the report is produced; it
//! never asserts timings.
//!
//! The runspool binaries belong to the other workspace member, so cargo gives
//! no `CARGO_BIN_EXE_runspool` here: they are taken from the directory cargo
//! put this package's binary in (the workspace's one target directory). A
//! plain `cargo test` builds them first; when they are missing or older than
//! the product's sources the test fails saying so, never skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The newest modification time of the `.rs` files under `dir` (what cargo
/// rebuilds the product from; a manifest edit need not rebuild it).
fn newest_source(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let (path, md) = (e.path(), e.metadata().ok()?);
        let t = if md.is_dir() {
            newest_source(&path)
        } else if path.extension().is_some_and(|x| x == "rs") {
            md.modified().ok()
        } else {
            None
        };
        newest = newest.max(t);
    }
    newest
}

/// `name` as the workspace built it, checked to exist and to be newer than
/// the product's sources.
fn product_binary(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_runspool-bench")).parent().expect("the target directory");
    let bin = dir.join(name);
    let fix = "build the product first: `cargo build` at the workspace root (a plain `cargo test` does it)";
    let built =
        std::fs::metadata(&bin).and_then(|m| m.modified()).unwrap_or_else(|e| panic!("{}: {e}; {fix}", bin.display()));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").join("src");
    if newest_source(&src).is_some_and(|t| t > built) {
        panic!("{} is older than the sources in {}; {fix}", bin.display(), src.display());
    }
    bin
}

#[test]
fn bench_produces_its_report() {
    let runspool = product_binary("runspool");
    // The daemon under test starts its runs with the runner next to it.
    product_binary("runspool-runner");
    let dir = tempfile::tempdir().unwrap();
    let json_out = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_runspool-bench"))
        .arg("--runspool")
        .arg(&runspool)
        .arg("--dir")
        .arg(dir.path())
        .args(["--latency-n", "3", "--burst-n", "6", "--parallel", "2", "--idle-secs", "1"])
        .args(["--runs", "30", "--active", "4", "--calls", "1", "--backlog-n", "20", "--bridge-n", "2"])
        .arg("--out")
        .arg(&json_out)
        .output()
        .expect("run runspool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "runspool-bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    let sections = [
        "### Summary: the targets of issue 23",
        "### Latency",
        "### Bridge start latency",
        "### Burst",
        "### Backlog of 20 runs",
        "### Idle",
        "### CLI",
        "### Daemon start-up",
        "### Targets",
    ];
    for section in sections {
        assert!(stdout.contains(section), "missing {section} in the report:\n{stdout}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_out).unwrap()).unwrap();
    for key in ["summary", "latency", "bridge", "burst", "backlog", "idle", "scale", "adopt", "targets"] {
        assert!(v.get(key).is_some(), "missing `{key}` in the JSON report: {v}");
    }
    // Every issue-23 target has a row in the summary: burst (one max_running),
    // closed-loop latency, backlog peak and after, bridge, idle (two native daemons).
    assert_eq!(v["summary"].as_array().map(Vec::len), Some(7), "summary: {}", v["summary"]);
    // Both pipelines served every bridge request and every backlog run.
    assert_eq!(v["bridge"]["runspool"]["start"]["n"], 2, "{}", v["bridge"]);
    assert_eq!(v["bridge"]["reference"]["start"]["n"], 2, "{}", v["bridge"]);
    assert!(v["backlog"]["runspool"]["peak_rss_kib"].as_u64().is_some_and(|k| k > 0), "{}", v["backlog"]);
    // The benchmark cleans up after itself.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bench.json")], "leftovers: {left:?}");
}

/// CPU time (user + system) of `pid` so far, in clock ticks.
#[cfg(target_os = "linux")]
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    // Fields after the command name, which ends with the last ')'.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The reference pipeline's daemon must sleep when nothing lands in its
/// spool: a watcher that wakes on its own listings (notify 8 reports opens)
/// spins, and on a two-core machine starves the pipeline being measured.
/// Generous bound: half the CPU time the 3 s could take (a spin took ~75%).
#[cfg(target_os = "linux")]
#[test]
fn the_reference_daemon_sleeps_when_idle() {
    let root = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_runspool-bench"))
        .arg("__ref-daemon")
        .arg(root.path())
        .arg("2")
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("the reference daemon starts");
    let ready = root.path().join("ready");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !ready.exists() {
        assert!(std::time::Instant::now() < deadline, "the reference daemon never wrote {}", ready.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let before = cpu_ticks(child.id());
    std::thread::sleep(std::time::Duration::from_secs(3));
    let used = cpu_ticks(child.id()) - before;
    let _ = child.kill();
    let _ = child.wait();
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    assert!(used < hz * 3 / 2, "the idle reference daemon used {used} ticks of CPU in 3 s ({hz} a second)");
}
