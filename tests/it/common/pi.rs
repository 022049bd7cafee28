//! pi-subagents 0.67.0, installed pinned from the npm registry once per
//! target directory (under a file lock: the tests of this binary run in
//! parallel), and the driver that calls its own code (tests/pi/driver.mjs).
//! Used by tests/it/pi_compat.rs and tests/it/steward.rs.

use super::{describe, read_json, report};
use std::fs::{self, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub const PI_VERSION: &str = "0.67.0";
pub const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pi/driver.mjs");

pub fn tool_present(name: &str) -> bool {
    Command::new(name).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

fn install_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("pi-subagents-{PI_VERSION}"))
}

fn installed_version(dir: &Path) -> Option<String> {
    let pkg = read_json(&dir.join("node_modules/pi-subagents/package.json"))?;
    dir.join("node_modules/jiti/package.json").is_file().then(|| pkg["version"].as_str().unwrap_or("").to_string())
}

/// The directory pi-subagents at PI_VERSION is installed in (installing and
/// warming it the first time); None when node or npm is missing. An npm
/// failure with node present fails the test.
pub fn install() -> Option<PathBuf> {
    if !tool_present("node") || !tool_present("npm") {
        report("skipped: node is not installed");
        return None;
    }
    let dir = install_dir();
    fs::create_dir_all(&dir).unwrap();
    let lock = OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(".install.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0, "flock {}", dir.display());
    if installed_version(&dir).as_deref() != Some(PI_VERSION) || !dir.join(".warmed").exists() {
        // A package.json of its own keeps npm from adopting a parent directory
        // as the project.
        fs::write(dir.join("package.json"), "{\"name\":\"runspool-pi-compat\",\"private\":true}\n").unwrap();
        let out = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--ignore-scripts", &format!("pi-subagents@{PI_VERSION}")])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run npm");
        assert!(out.status.success(), "npm install pi-subagents@{PI_VERSION} failed:\n{}", describe(&out));
        assert_eq!(installed_version(&dir).as_deref(), Some(PI_VERSION), "npm installed another version");
        // Fill jiti's transform cache once, here, rather than from parallel tests.
        let warm = Command::new("node")
            .arg(DRIVER)
            .arg("warm")
            .arg("{}")
            .env("PI_SUBAGENTS_INSTALL_DIR", &dir)
            .stdin(Stdio::null())
            .output()
            .expect("spawn node");
        assert!(warm.status.success(), "the driver cannot load pi-subagents:\n{}", describe(&warm));
        fs::write(dir.join(".warmed"), PI_VERSION).unwrap();
    }
    drop(lock);
    Some(dir)
}
