//! The daemon's log in the systemd journal (docs/logging.md): with its stderr
//! being the journal stream (JOURNAL_STREAM = dev:ino of fd 2) it sends
//! structured entries through the native protocol, and one run's story is
//! found with `journalctl RUN_ID=<id>`, each entry with the priority of its
//! level. Root only: it starts `systemd-journald` by hand when none runs, and
//! then stops it and removes what it created.

use crate::common;

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SOCKET: &str = "/run/systemd/journal/socket";

fn fixtures(tools: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures.sh");
    let st = Command::new("bash").arg(script).args(tools).status().expect("run scripts/fixtures.sh");
    assert!(st.success(), "scripts/fixtures.sh {tools:?} failed");
}

/// Is a journald listening on the native socket? (An empty datagram is
/// discarded by journald; without a listener sending fails.)
fn journal_listening() -> bool {
    UnixDatagram::unbound().and_then(|s| s.send_to(&[], SOCKET)).is_ok()
}

/// A journald for the test: the machine's own when one runs (left alone), else
/// one started here, stopped on drop together with the directories that
/// were missing before it started (and so are its own).
struct Journald {
    child: Option<Child>,
    created: Vec<PathBuf>,
    stderr: Option<tempfile::NamedTempFile>,
    _lock: MachineLock,
}

impl Journald {
    fn ensure() -> Journald {
        // One journald starter at a time, across checkouts, and never beside a user manager.
        let lock = MachineLock::acquire(RUN_SYSTEMD_LOCK, Duration::from_secs(600));
        if journal_listening() {
            eprintln!("journald: using the journald already running on this machine");
            return Journald { child: None, created: vec![], stderr: None, _lock: lock };
        }
        let bin = ["/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("systemd-journald (scripts/fixtures.sh journald installs it)");
        // What journald creates when started by hand (a namespace-less instance).
        let mut created: Vec<PathBuf> =
            ["/run/systemd", "/run/systemd/journal", "/run/systemd/system", "/run/log", "/run/log/journal"]
                .iter()
                .map(PathBuf::from)
                .filter(|p| fs::symlink_metadata(p).is_err())
                .collect();
        // Deepest first, so removing a child never races its parent's removal.
        created.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        fs::create_dir_all("/run/systemd/journal").unwrap();
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(bin)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr.reopen().unwrap()))
            .spawn()
            .expect("start systemd-journald");
        let mut jd = Journald { child: Some(child), created, stderr: Some(stderr), _lock: lock };
        let started = Instant::now();
        while !journal_listening() {
            if let Some(st) = jd.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("systemd-journald exited with {st}:\n{}", jd.stderr_text());
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "systemd-journald not listening on {SOCKET} after 30 s:\n{}",
                jd.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("journald: started systemd-journald (pid {}) for this test", jd.child.as_ref().unwrap().id());
        jd
    }

    fn stderr_text(&self) -> String {
        self.stderr.as_ref().map(|f| fs::read_to_string(f.path()).unwrap_or_default()).unwrap_or_default()
    }
}

impl Drop for Journald {
    fn drop(&mut self) {
        let Some(mut c) = self.child.take() else { return };
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        if !poll_until(Duration::from_secs(10), || c.try_wait().ok().flatten().is_some()) {
            let _ = c.kill();
            let _ = c.wait();
        }
        for p in &self.created {
            if let Err(e) = fs::remove_dir_all(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    eprintln!("journald: cannot remove {}: {e}", p.display());
                }
            }
        }
    }
}

/// Entries matching `matches` (journalctl FIELD=value terms), as JSON objects.
fn journal(matches: &[String]) -> Vec<Value> {
    let o = Command::new("journalctl")
        .args(["--no-pager", "-q", "-o", "json"])
        .args(matches)
        .output()
        .expect("run journalctl");
    String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn field<'a>(e: &'a Value, name: &str) -> &'a str {
    e[name].as_str().unwrap_or("")
}

/// Wait until an entry among `matches` has a MESSAGE containing `message`; return it.
fn wait_entry(matches: &[String], message: &str, daemon_log: &dyn Fn() -> String) -> Value {
    let mut found = None;
    let ok = poll_until(Duration::from_secs(60), || {
        found = journal(matches).into_iter().find(|e| field(e, "MESSAGE").contains(message));
        found.is_some()
    });
    assert!(
        ok,
        "no journal entry {matches:?} with a message containing {message:?} after 60 s; entries:\n{:#?}\n{}",
        journal(matches)
            .iter()
            .map(|e| (field(e, "PRIORITY").to_string(), field(e, "MESSAGE").to_string()))
            .collect::<Vec<_>>(),
        daemon_log()
    );
    found.unwrap()
}

#[test]
fn one_runs_story_is_found_by_run_id_with_priorities() {
    if !is_root() {
        println!("SKIP journald: needs root to start systemd-journald by hand");
        return;
    }
    fixtures(&["journald"]);
    let _jd = Journald::ensure();
    let mut env = TestEnv::new();
    let out_path = env.base().join("daemon.stdout");
    let err_path = env.base().join("daemon.stderr");
    let out = File::create(&out_path).unwrap();
    let err = File::create(&err_path).unwrap();
    // What systemd does for a unit whose stderr is the journal: JOURNAL_STREAM
    // names the (device, inode) of that stream; here it names our file, so
    // the daemon's detection rule picks the journal.
    let md = err.metadata().unwrap();
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    cmd.env("JOURNAL_STREAM", format!("{}:{}", md.dev(), md.ino()))
        .env_remove("RUNSPOOL_LOG_OUTPUT")
        .env("RUNSPOOL_LOG", "debug")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    let child = cmd.spawn().expect("spawn runspool daemon");
    let pid = child.id() as i64;
    env.child = Some(child);
    let files = |out: &Path, err: &Path| {
        format!(
            "---- daemon stdout ----\n{}\n---- daemon stderr ----\n{}",
            fs::read_to_string(out).unwrap_or_default(),
            fs::read_to_string(err).unwrap_or_default()
        )
    };
    let log = || files(&out_path, &err_path);
    wait_until(LONG, "daemon.json naming the daemon", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["pid"].as_i64() == Some(pid))
    });
    let by_pid = vec![format!("_PID={pid}")];
    let started = wait_entry(&by_pid, "runspool daemon started", &log);
    assert_eq!(field(&started, "PRIORITY"), "6", "info is priority 6: {started:#}");
    assert_eq!(field(&started, "SYSLOG_IDENTIFIER"), "runspool", "{started:#}");
    let chosen = wait_entry(&by_pid, "log output chosen", &log);
    assert_eq!(field(&chosen, "PRIORITY"), "7", "debug is priority 7: {chosen:#}");

    // A run whose runner is killed: info (claimed, started) and warn (runner
    // died, run repaired) entries, all carrying RUN_ID.
    let id = unique("journald-run");
    let gate = env.work.join("never-opened");
    env.submit(&request(
        Some(&id),
        &env.work,
        vec![sh_step("wait", &format!("while [ ! -e '{}' ]; do sleep 0.05; done", gate.display()))],
    ));
    let st = env.wait_state(&id, "running");
    let runner = st["pid"].as_i64().expect("runner pid in status.json");
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed", "{st}");
    let by_run = vec![format!("RUN_ID={id}")];
    for (message, priority) in [("claimed", "6"), ("runner started", "6"), ("repaired a run whose runner died", "4")] {
        let e = wait_entry(&by_run, message, &log);
        assert_eq!(field(&e, "PRIORITY"), priority, "{message:?}: {e:#}");
        assert_eq!(field(&e, "RUN_ID"), id, "{e:#}");
        assert!(e.get("F_RUN_ID").is_none(), "fields carry no prefix: {e:#}");
        assert_eq!(field(&e, "_PID"), pid.to_string(), "{e:#}");
    }
    let story = journal(&by_run);
    assert!(story.iter().all(|e| field(e, "RUN_ID") == id), "every entry of the story is this run's: {story:#?}");
    let ended = wait_entry(&by_run, "run ended", &log);
    assert_eq!(field(&ended, "STATE"), "failed", "{ended:#}");

    // Each run's end: one entry with its outcome as fields.
    let three = unique("journald-three");
    env.submit(&request(Some(&three), &env.work, vec![sh_step("three", "exit 3")]));
    let st = env.wait_terminal(&three);
    let by_three = vec![format!("RUN_ID={three}")];
    let e = wait_entry(&by_three, "run ended", &log);
    assert_eq!(field(&e, "PRIORITY"), "6", "{e:#}");
    assert_eq!(field(&e, "STATE"), "failed", "{e:#}");
    assert_eq!(field(&e, "EXIT_CODE"), "3", "{e:#}");
    assert_eq!(field(&e, "TIMED_OUT"), "false", "{e:#}");
    assert_eq!(field(&e, "LANE"), "default", "{e:#}");
    let took = st["endedAt"].as_i64().unwrap() - st["startedAt"].as_i64().unwrap();
    assert_eq!(field(&e, "DURATION_MS"), took.to_string(), "endedAt - startedAt: {e:#}");
    let ends = journal(&by_three).into_iter().filter(|e| field(e, "MESSAGE").contains("run ended")).count();
    assert_eq!(ends, 1, "one entry per run end");

    // An error: a config refused on SIGHUP, found by its CONFIG field.
    env.write_config("max_running = 2\nno_such_key = 1\n");
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGHUP);
    }
    let by_config = vec![format!("CONFIG={}", env.config_path.display()), format!("_PID={pid}")];
    let refused = wait_entry(&by_config, "configuration refused", &log);
    assert_eq!(field(&refused, "PRIORITY"), "3", "error is priority 3: {refused:#}");
    assert!(field(&refused, "MESSAGE").contains("no_such_key"), "{refused:#}");

    let code = env.term();
    assert_eq!(code.code(), Some(0), "{}", log());
    wait_entry(&by_pid, "runspool daemon stopped", &log);

    let stdout = fs::read_to_string(&out_path).unwrap();
    assert!(stdout.is_empty(), "nothing on the daemon's stdout, ever:\n{}", log());
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert!(
        !stderr.contains("runner started"),
        "with the journal chosen, log lines are not also written to stderr:\n{}",
        log()
    );
}
