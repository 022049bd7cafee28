//! The client libraries in `clients/`, each run by its own test suite
//! against real daemons started from this build's `runspool` binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn tool_present(name: &str) -> bool {
    Command::new(name).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn describe(o: &Output) -> String {
    format!(
        "exit {:?}\n---- stdout ----\n{}\n---- stderr ----\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The version of `node_modules/<name>` under `dir`, if installed.
fn installed(dir: &Path, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("node_modules").join(name).join("package.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["version"].as_str().map(str::to_string)
}

/// The TypeScript client (`clients/typescript`): `node --test` of its suite
/// (submit/status/follow/wait/stop under a burst on both watch strategies,
/// rejections, timeouts, events exactly once, hostile files, dist/ up to
/// date with src/, the packed tarball installed and used as a user would,
/// from ESM and through jiti). Its devDependencies (typescript, @types/node,
/// jiti, pinned in package-lock.json) are installed with `npm ci` when
/// missing or of another version. Without node or npm it prints a SKIPPED
/// line and passes.
#[test]
fn typescript_client_suite() {
    if !tool_present("node") || !tool_present("npm") {
        eprintln!("SKIPPED typescript_client_suite: node and npm are needed (apt-get install nodejs npm)");
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/typescript");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("package.json")).expect("read package.json")).unwrap();
    let dev = manifest["devDependencies"].as_object().expect("devDependencies in clients/typescript/package.json");
    let stale = dev.iter().any(|(name, want)| installed(&dir, name).as_deref() != want.as_str());
    if stale {
        let out = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run npm ci");
        assert!(out.status.success(), "npm ci in {} failed:\n{}", dir.display(), describe(&out));
    }
    // The suite compiles src/ itself (into a temporary directory, compared with the committed dist/).
    let mut files: Vec<String> = std::fs::read_dir(dir.join("test"))
        .expect("read clients/typescript/test")
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".test.mjs"))
        .map(|n| format!("test/{n}"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no test/*.test.mjs in {}", dir.display());
    let out = Command::new("node")
        .arg("--test")
        .args(&files)
        .current_dir(&dir)
        .env("RUNSPOOL_BIN", env!("CARGO_BIN_EXE_runspool"))
        .env_remove("RUNSPOOL_ROOT")
        .env_remove("PI_SUBAGENTS_TEMP_ROOT")
        .stdin(Stdio::null())
        .output()
        .expect("run node --test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The runner's summary, so a passing run shows what it counted.
    for line in stdout.lines().filter(|l| l.starts_with("# ") && !l.starts_with("# Subtest")) {
        eprintln!("typescript client: {line}");
    }
    assert!(out.status.success(), "the TypeScript client's suite failed:\n{}", describe(&out));
}

/// Version of pytest the Python suite runs under (scripts/pyenv.sh installs it).
const PYTEST: &str = "pytest==8.3.4";

#[test]
fn python_client_suite() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let setup = Command::new("bash")
        .arg(repo.join("scripts/pyenv.sh"))
        .arg(PYTEST)
        .arg(repo.join("clients/python"))
        .current_dir(repo)
        .output()
        .expect("cannot run bash scripts/pyenv.sh");
    let stderr = String::from_utf8_lossy(&setup.stderr);
    if setup.status.code() == Some(3) {
        println!("SKIPPED python_client_suite: {}", stderr.trim());
        return;
    }
    assert!(
        setup.status.success(),
        "scripts/pyenv.sh could not set up target/py-venv with {PYTEST} and clients/python \
         (is PyPI reachable? remove target/py-venv to start afresh):\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&setup.stdout);
    let python = stdout.lines().last().expect("scripts/pyenv.sh printed no python path").trim().to_string();
    let run = Command::new(&python)
        .args(["-m", "pytest", "clients/python/tests", "-q", "-p", "no:cacheprovider"])
        .env("RUNSPOOL_BIN", env!("CARGO_BIN_EXE_runspool"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("RUNSPOOL_ROOT")
        .env_remove("PI_SUBAGENTS_TEMP_ROOT")
        .current_dir(repo)
        .output()
        .expect("cannot run pytest from target/py-venv");
    assert!(
        run.status.success(),
        "pytest clients/python/tests failed (rerun: RUNSPOOL_BIN=target/debug/runspool {python} -m pytest \
         clients/python/tests):\n{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    println!("{}", String::from_utf8_lossy(&run.stdout).lines().last().unwrap_or_default());
}
