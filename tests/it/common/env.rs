//! The test environment: a temporary root (mode 0700) with the standard layout,
//! a work directory outside it, the config and log paths, and the optional
//! daemon child. Its drop ends every scenario: the whole-root consistency
//! check first (while the daemon still runs, so what is eventual can settle),
//! then SIGKILL for the daemon and every process of the root.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Child;
use std::sync::OnceLock;

use super::{kill_root_processes, mkdir_0700, DEFAULT_CONFIG};

pub struct TestEnv {
    pub tmp: tempfile::TempDir,
    /// The runspool root (`<tmp>/root`, mode 0700).
    pub root: PathBuf,
    /// A scratch directory outside the root, usable as a request cwd.
    pub work: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    pub child: Option<Child>,
    pub extra_args: Vec<String>,
    /// Extra environment of the daemon (and so of its runners).
    pub extra_env: Vec<(String, String)>,
    /// Why this test leaves its root inconsistent on purpose; unset, the drop
    /// fails the test unless the root passes `check_consistency`.
    inconsistent_on_purpose: OnceLock<String>,
}

impl TestEnv {
    /// A fresh root with the standard layout created (no daemon).
    pub fn new() -> TestEnv {
        Self::with_config(DEFAULT_CONFIG)
    }

    pub fn with_config(config: &str) -> TestEnv {
        let tmp = tempfile::Builder::new().prefix("rsit-").tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
        let base = fs::canonicalize(tmp.path()).unwrap();
        let root = base.join("root");
        mkdir_0700(&root);
        let work = base.join("work");
        mkdir_0700(&work);
        let config_path = base.join("config.toml");
        fs::write(&config_path, config).unwrap();
        let log_path = base.join("daemon.log");
        let env = TestEnv {
            tmp,
            root,
            work,
            config_path,
            log_path,
            child: None,
            extra_args: vec![],
            extra_env: vec![],
            inconsistent_on_purpose: OnceLock::new(),
        };
        env.ensure_layout();
        env
    }

    /// Create the directories a client needs to drop requests (daemon may not run yet).
    pub fn ensure_layout(&self) {
        for d in [
            self.root.clone(),
            self.spool(),
            self.rejected(),
            self.runs(),
            self.runs().join(".active-runs"),
            self.runs().join(".terminal-runs"),
            self.results(),
        ] {
            mkdir_0700(&d);
        }
    }

    pub fn base(&self) -> PathBuf {
        self.root.parent().unwrap().to_path_buf()
    }
    pub fn spool(&self) -> PathBuf {
        self.root.join("spool")
    }
    pub fn rejected(&self) -> PathBuf {
        self.root.join("spool").join("rejected")
    }
    pub fn runs(&self) -> PathBuf {
        self.root.join("async-subagent-runs")
    }
    pub fn run_dir(&self, id: &str) -> PathBuf {
        self.runs().join(id)
    }
    pub fn active_dir(&self) -> PathBuf {
        self.runs().join(".active-runs")
    }
    pub fn terminal_dir(&self) -> PathBuf {
        self.runs().join(".terminal-runs")
    }
    pub fn results(&self) -> PathBuf {
        self.root.join("async-subagent-results")
    }
    pub fn result_path(&self, id: &str) -> PathBuf {
        self.results().join(format!("{}.json", id))
    }
    pub fn daemon_json(&self) -> PathBuf {
        self.root.join("runspool").join("daemon.json")
    }
}

impl TestEnv {
    /// Opt out of the consistency check that ends every test, saying why: the
    /// test leaves the root inconsistent on purpose (a crash it does not
    /// recover from, a hostile or fabricated root, a spool the daemon must
    /// not claim from). The first reason given is kept.
    pub fn leaves_root_inconsistent(&self, why: &str) {
        let _ = self.inconsistent_on_purpose.set(why.to_string());
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A test that already fails is not failed again; one that opted out is not checked.
        let inconsistent = match self.inconsistent_on_purpose.get() {
            None if !std::thread::panicking() => self.settled_consistency_errors(),
            _ => vec![],
        };
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = c.wait();
        }
        kill_root_processes(&self.root, &self.base());
        if std::thread::panicking() || !inconsistent.is_empty() {
            eprintln!("{}", self.log_tail(150));
            eprintln!("{}", self.runs_summary(20));
            if std::env::var("RUNSPOOL_TEST_KEEP").is_ok() {
                let p = self.tmp.path().to_path_buf();
                eprintln!("keeping test dir {}", p.display());
                std::mem::forget(std::mem::replace(&mut self.tmp, tempfile::tempdir().unwrap()));
            }
        }
        if !inconsistent.is_empty() {
            panic!(
                "the root is inconsistent at the end of the test ({} problems; a test that means it calls \
                 env.leaves_root_inconsistent(why)):\n  {}",
                inconsistent.len(),
                inconsistent.join("\n  ")
            );
        }
    }
}
