//! The client libraries' own test suites, run against this build's daemon
//! (`CARGO_BIN_EXE_runspool`): each starts real daemons on temporary roots
//! and drives them through the client, through files alone.

use std::path::Path;
use std::process::Command;

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
