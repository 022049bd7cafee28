//! Running the `runspool` CLI against the test root, and reading its output.

use std::fs::{self, File};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{unique, TestEnv, BIN};

impl TestEnv {
    fn cli_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        let mut it = args.iter();
        if let Some(first) = it.next() {
            cmd.arg(first);
        }
        cmd.arg("--root").arg(&self.root);
        cmd.args(it);
        cmd.env("RUNSPOOL_ROOT", &self.root).env("XDG_CONFIG_HOME", self.base().join("xdg")).stdin(Stdio::null());
        cmd
    }

    /// Run a CLI subcommand (`--root` is inserted after the subcommand name).
    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_timeout(args, Duration::from_secs(120))
    }

    pub fn cli_timeout(&self, args: &[&str], timeout: Duration) -> Output {
        let mut cmd = self.cli_command(args);
        let out_p = self.base().join(format!("{}.stdout", unique("cli")));
        let err_p = self.base().join(format!("{}.stderr", unique("cli")));
        cmd.stdout(Stdio::from(File::create(&out_p).unwrap()));
        cmd.stderr(Stdio::from(File::create(&err_p).unwrap()));
        let mut c = cmd.spawn().expect("spawn runspool cli");
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
                let _ = c.wait();
                panic!("`runspool {}` did not finish within {:?}", args.join(" "), timeout);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = fs::read(&out_p).unwrap_or_default();
        let stderr = fs::read(&err_p).unwrap_or_default();
        let _ = fs::remove_file(&out_p);
        let _ = fs::remove_file(&err_p);
        Output { status, stdout, stderr }
    }
}

pub fn stdout_str(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr_str(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn describe(o: &Output) -> String {
    format!("status {:?}\nstdout:\n{}\nstderr:\n{}", o.status, stdout_str(o), stderr_str(o))
}
