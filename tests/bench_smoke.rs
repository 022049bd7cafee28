//! CI smoke run of the benchmark (docs/performance.md) with tiny sizes, so it
//! cannot rot. It checks that every section of the report is produced; it
//! never asserts timings.

use std::process::Command;

#[test]
fn bench_produces_its_report() {
    let dir = tempfile::tempdir().unwrap();
    let json_out = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_runspool-bench"))
        .arg("--runspool")
        .arg(env!("CARGO_BIN_EXE_runspool"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--latency-n", "3", "--burst-n", "6", "--parallel", "2", "--idle-secs", "1"])
        .args(["--runs", "30", "--active", "4", "--calls", "1"])
        .arg("--out")
        .arg(&json_out)
        .output()
        .expect("run runspool-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "runspool-bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    for section in ["### Latency", "### Burst", "### Idle", "### CLI", "### Daemon start-up", "### Targets"] {
        assert!(stdout.contains(section), "missing {section} in the report:\n{stdout}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_out).unwrap()).unwrap();
    for key in ["latency", "burst", "idle", "scale", "adopt", "targets"] {
        assert!(v.get(key).is_some(), "missing `{key}` in the JSON report: {v}");
    }
    // The benchmark cleans up after itself.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bench.json")], "leftovers: {left:?}");
}
