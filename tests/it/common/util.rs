//! Constants and small utilities every test binary may use: the binary under
//! test, the default deadline and config, unique names, a seeded PRNG, and a
//! line printer that survives `cargo test`'s output capture.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const BIN: &str = env!("CARGO_BIN_EXE_runspool");

/// `runspool-runner`, built next to `BIN`.
pub fn runner_bin() -> std::path::PathBuf {
    std::path::Path::new(BIN).with_file_name("runspool-runner")
}

/// Install a copy of the program `from` as `to`, mode 0755: copied beside
/// it, then renamed over it, so `to` is a new inode as a package upgrade
/// makes it (a running program is never written in place).
pub fn install_program(from: &std::path::Path, to: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = to.with_extension("new");
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), tmp.display()));
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

/// Generous default deadline for anything that involves the daemon or a runner.
pub const LONG: Duration = Duration::from_secs(90);

pub const DEFAULT_CONFIG: &str = "max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n";

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    format!("{}-{}-{}-{}", prefix, std::process::id(), n, now_ms() % 1_000_000)
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Deterministic xorshift64* PRNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// Print a line that shows in `cargo test` output even when the test passes
/// (the test harness captures `println!`/`eprintln!`, not the stderr handle).
pub fn report(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The python of the project's private venv (`scripts/pyenv.sh`, under the
/// target directory) with the pinned `package` installed; None, reported as
/// SKIPPED with `what` was not checked, when python3, its venv module or pip
/// is unavailable. An installation that fails otherwise fails the test.
pub fn python_with(package: &str, what: &str) -> Option<std::path::PathBuf> {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().join("py-venv");
    let out = Command::new("sh")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pyenv.sh"))
        .arg("--venv")
        .arg(&venv)
        .arg(package)
        .stdin(Stdio::null())
        .output()
        .expect("run sh scripts/pyenv.sh");
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
        Some(3) => {
            super::report(&format!(
                "SKIPPED: no usable python3 with venv and pip ({}); {what} was not checked",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            None
        }
        _ => panic!("scripts/pyenv.sh {package} failed:\n{}", super::describe(&out)),
    }
}
