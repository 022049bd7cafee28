//! The daemon's lifecycle under the harness: the command line, start (ready
//! once daemon.json names its pid), SIGKILL, SIGTERM, restart, its log, and
//! daemons expected to refuse and exit by themselves.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{poll_until, read_json, spawn_retrying_busy, unique, TestEnv, BIN, LONG};

impl TestEnv {
    pub fn write_config(&self, config: &str) {
        fs::write(&self.config_path, config).unwrap();
    }

    fn spawn_daemon(&self) -> Child {
        let log = OpenOptions::new().create(true).append(true).open(&self.log_path).unwrap();
        let log2 = log.try_clone().unwrap();
        let mut cmd = self.daemon_command_for(Path::new(BIN), &self.root);
        cmd.args(&self.extra_args)
            .envs(self.extra_env.iter().cloned())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        cmd.spawn().expect("spawn runspool daemon")
    }

    /// Start the daemon and wait until it reports itself in daemon.json.
    pub fn start_daemon(&mut self) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon ----\n");
        let child = self.spawn_daemon();
        let pid = child.id() as i64;
        self.child = Some(child);
        self.wait_ready(pid);
    }

    /// Start the daemon without waiting for it to become ready.
    pub fn start_daemon_nowait(&mut self) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon (nowait) ----\n");
        self.child = Some(self.spawn_daemon());
    }

    fn append_log(&self, s: &str) {
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(&self.log_path) {
            let _ = f.write_all(s.as_bytes());
        }
    }

    fn wait_ready(&mut self, pid: i64) {
        let start = Instant::now();
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    panic!("daemon exited during startup with {:?}\n{}", st, self.log_tail(80));
                }
            }
            if let Some(d) = read_json(&self.daemon_json()) {
                if d["pid"].as_i64() == Some(pid) {
                    return;
                }
            }
            // Fallback: the layout exists and the daemon keeps running.
            if start.elapsed() > Duration::from_secs(15) && self.spool().is_dir() {
                eprintln!("harness: daemon.json does not name pid {pid} after 15 s; continuing");
                return;
            }
            if start.elapsed() > Duration::from_secs(60) {
                panic!("daemon not ready after 60 s\n{}", self.log_tail(80));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn daemon_pid(&self) -> Option<i64> {
        self.child.as_ref().map(|c| c.id() as i64)
    }

    /// SIGKILL the daemon (runners stay alive).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = c.wait();
            self.append_log("---- harness: daemon SIGKILLed ----\n");
        }
    }

    /// SIGTERM the daemon and wait for it to exit; returns its exit status.
    pub fn term(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("no daemon running");
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                self.append_log("---- harness: daemon exited after SIGTERM ----\n");
                return st;
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!("daemon did not exit within 60 s of SIGTERM\n{}", self.log_tail(60));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGKILL then start again.
    pub fn restart(&mut self) {
        self.kill9();
        self.start_daemon();
    }

    /// Has the daemon exited on its own? (Returns the status and forgets the child.)
    pub fn daemon_exited(&mut self) -> Option<ExitStatus> {
        let st = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if st.is_some() {
            self.child = None;
        }
        st
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let s = fs::read_to_string(&self.log_path).unwrap_or_default();
        let v: Vec<&str> = s.lines().collect();
        let from = v.len().saturating_sub(lines);
        format!("---- daemon log ({}) tail ----\n{}\n---- end ----", self.log_path.display(), v[from..].join("\n"))
    }

    /// Run `runspool daemon` in the foreground expecting it to exit by itself;
    /// returns (status, stderr+stdout). Panics if it is still running after `timeout`.
    pub fn run_daemon_expect_exit(&self, root: &Path, timeout: Duration) -> (ExitStatus, String) {
        let out_path = self.base().join(format!("{}.out", unique("daemon-refusal")));
        let out = File::create(&out_path).unwrap();
        let mut c = Command::new(BIN)
            .arg("daemon")
            .arg("--root")
            .arg(root)
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("RUNSPOOL_ROOT")
            .env("XDG_CONFIG_HOME", self.base().join("xdg"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return (st, fs::read_to_string(&out_path).unwrap_or_default());
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!(
                    "daemon on {} was still running after {:?}; output:\n{}",
                    root.display(),
                    timeout,
                    fs::read_to_string(&out_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    // Custom daemon launches (security tests): extra environment, umask, another uid.

    /// The daemon command line the harness uses for `root`, as `bin`; callers
    /// add environment, credentials or a umask before spawning it.
    pub fn daemon_command_for(&self, bin: &Path, root: &Path) -> Command {
        let mut cmd = Command::new(bin);
        cmd.arg("daemon")
            .arg("--root")
            .arg(root)
            .arg("--config")
            .arg(&self.config_path)
            .env_remove("RUNSPOOL_ROOT")
            .env_remove("PI_SUBAGENTS_TEMP_ROOT")
            .env("XDG_CONFIG_HOME", self.base().join("xdg"))
            .env("RUNSPOOL_LOG", std::env::var("RUNSPOOL_TEST_LOG").unwrap_or_else(|_| "debug".into()))
            .stdin(Stdio::null());
        cmd
    }

    /// Start the daemon from a command built by `daemon_command_for` (its output
    /// goes to the harness log) and wait until it reports itself ready.
    pub fn start_daemon_command(&mut self, mut cmd: Command) {
        assert!(self.child.is_none(), "daemon already started");
        self.append_log("---- harness: starting daemon (custom command) ----\n");
        let log = OpenOptions::new().create(true).append(true).open(&self.log_path).unwrap();
        cmd.stdout(Stdio::from(log.try_clone().unwrap())).stderr(Stdio::from(log));
        let child = spawn_retrying_busy(&mut cmd);
        let pid = child.id() as i64;
        self.child = Some(child);
        self.wait_ready(pid);
    }

    /// Run a daemon command expected to exit by itself; (status, output).
    pub fn run_command_expect_exit(&self, mut cmd: Command, timeout: Duration) -> (ExitStatus, String) {
        let out_path = self.base().join(format!("{}.out", unique("daemon-refusal")));
        let out = File::create(&out_path).unwrap();
        let _ = fs::set_permissions(&out_path, fs::Permissions::from_mode(0o666));
        cmd.stdout(Stdio::from(out.try_clone().unwrap())).stderr(Stdio::from(out));
        let mut c = spawn_retrying_busy(&mut cmd);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return (st, fs::read_to_string(&out_path).unwrap_or_default());
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!(
                    "daemon was still running after {:?}; output:\n{}",
                    timeout,
                    fs::read_to_string(&out_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    // External-job tests: a daemon with extra environment (PATH with wrappers,
    // SLURM_CONF), started again after the harness or a wrapper killed it.

    /// Start the daemon with extra environment variables and wait until it is ready.
    pub fn start_daemon_env(&mut self, vars: &[(&str, String)]) {
        let mut cmd = self.daemon_command_for(Path::new(BIN), &self.root);
        cmd.args(&self.extra_args);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        self.start_daemon_command(cmd);
    }

    /// Wait until the daemon started by the harness has exited (killed by someone else).
    pub fn wait_daemon_exit(&mut self) -> ExitStatus {
        let mut st = None;
        let ok = poll_until(LONG, || {
            st = self.daemon_exited();
            st.is_some()
        });
        assert!(ok, "the daemon did not exit\n{}", self.log_tail(60));
        self.append_log("---- harness: daemon exited ----\n");
        st.unwrap()
    }
}
