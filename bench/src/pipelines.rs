//! The two pipelines under test, runspool and the reference, as the phases
//! start and feed them: fresh roots, daemons stopped on drop, requests.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::fsops::{mkdirs, write_private};

/// SIGTERM, then SIGKILL after 5 s; reaps the child.
pub fn terminate(child: &mut Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Poll `f` every 2 ms until it holds, or fail naming `what`.
pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    while !f() {
        if Instant::now() > until {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// A daemon under test (runspool or the reference), stopped on drop.
pub struct Daemon {
    child: Child,
}

impl Daemon {
    /// A process the benchmark started, stopped (SIGTERM, then SIGKILL) on drop.
    pub fn from_child(child: Child) -> Daemon {
        Daemon { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Runspool,
    Reference,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Runspool => "runspool",
            Kind::Reference => "reference",
        }
    }
}

/// Where the benchmark runs: the binaries and the directory of temporary roots.
pub struct Env {
    pub runspool: PathBuf,
    /// This binary, which also plays the reference daemon and runner.
    pub me: PathBuf,
    pub base: PathBuf,
    pub seq: std::cell::Cell<u32>,
}

impl Env {
    /// A new, empty root under `base`, numbered in creation order.
    pub fn fresh_root(&self, name: &str) -> anyhow::Result<PathBuf> {
        let n = self.seq.get();
        self.seq.set(n + 1);
        let root = self.base.join(format!("{n:02}-{name}"));
        mkdirs(&root)?;
        Ok(root)
    }

    pub fn start_runspool(&self, root: &Path, max_running: usize, strategy: &str) -> anyhow::Result<Daemon> {
        self.start_runspool_with(root, max_running, strategy, "")
    }

    /// A runspool daemon whose config file ends with `extra` (TOML tables, such as providers).
    pub fn start_runspool_with(
        &self,
        root: &Path,
        max_running: usize,
        strategy: &str,
        extra: &str,
    ) -> anyhow::Result<Daemon> {
        let cfg = root.with_extension("toml");
        fs::write(&cfg, format!("max_running = {max_running}\n[watch]\nstrategy = \"{strategy}\"\n{extra}"))?;
        let log = File::create(root.with_extension("daemon.log"))?;
        let child = Command::new(&self.runspool)
            .arg("--root")
            .arg(root)
            .arg("daemon")
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .spawn()?;
        let mut d = Daemon { child };
        let dj = root.join("runspool/daemon.json");
        wait_for("runspool daemon.json", Duration::from_secs(300), || {
            dj.exists() || matches!(d.child.try_wait(), Ok(Some(_)))
        })?;
        if let Ok(Some(st)) = d.child.try_wait() {
            anyhow::bail!("the runspool daemon exited ({st}); see {}", root.with_extension("daemon.log").display());
        }
        Ok(d)
    }

    pub fn start_reference(&self, root: &Path, max_running: usize) -> anyhow::Result<Daemon> {
        let log = File::create(root.with_extension("daemon.log"))?;
        let child = Command::new(&self.me)
            .arg("__ref-daemon")
            .arg(root)
            .arg(max_running.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let d = Daemon { child };
        let ready = root.join("ready");
        wait_for("the reference daemon", Duration::from_secs(60), || ready.exists())?;
        Ok(d)
    }

    pub fn start(&self, kind: Kind, root: &Path, max_running: usize) -> anyhow::Result<Daemon> {
        match kind {
            Kind::Runspool => self.start_runspool(root, max_running, "native"),
            Kind::Reference => self.start_reference(root, max_running),
        }
    }
}

/// Where a pipeline records that a run is fully finished (its last write).
pub fn done_marker(kind: Kind, root: &Path, id: &str) -> PathBuf {
    match kind {
        Kind::Runspool => root.join("async-subagent-results").join(format!("{id}.json")),
        Kind::Reference => root.join("done").join(id),
    }
}

/// Directory holding one entry per terminal run.
pub fn terminal_dir(kind: Kind, root: &Path) -> PathBuf {
    match kind {
        Kind::Runspool => root.join("async-subagent-runs/.terminal-runs/default"),
        Kind::Reference => root.join("done"),
    }
}

/// A one-step `/bin/true` request (PROTOCOL §2).
pub fn request_body(id: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"version": 1, "runId": id, "cwd": "/", "steps": [{"agent": "bench", "command": ["/bin/true"]}]}),
    )
    .unwrap()
}

/// Publish a request the PROTOCOL way (dot temp, then rename) and return the drop instant.
pub fn drop_request(spool: &Path, id: &str) -> std::io::Result<Instant> {
    drop_body(spool, id, &request_body(id))
}

/// [`drop_request`] with a request body of the caller's.
pub fn drop_body(spool: &Path, id: &str, body: &[u8]) -> std::io::Result<Instant> {
    let tmp = spool.join(format!(".{id}.tmp"));
    write_private(&tmp, body)?;
    let t0 = Instant::now();
    fs::rename(&tmp, spool.join(format!("{id}.json")))?;
    Ok(t0)
}
