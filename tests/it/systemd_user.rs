//! The systemd user service, for real: a real `systemd --user` manager runs
//! as the unprivileged test user (scripts/ci-user.sh) in its own delegated
//! cgroup (scripts/systemd-user-manager.sh), and everything below is done as
//! that user through `runspool service` and `systemctl --user`:
//!
//! - `runspool service install` writes and enables the unit, which
//!   `systemd-analyze --user verify` accepts with nothing on stderr;
//! - `systemctl --user start` returns once the daemon sent READY=1, with its
//!   STATUS= text shown by `systemctl --user status` and `runspool service status`;
//! - `reload` is a SIGHUP (same daemon), a run survives `restart` and finishes
//!   with its own exit code, its steps inherit no sandboxing and no notify socket;
//! - `kill -9` of the daemon and a daemon frozen with SIGSTOP (caught by the
//!   watchdog, pinged at half of `WatchdogSec=`) are both restarted;
//! - what logging out without lingering does (the manager exits, what is left
//!   in its cgroup is killed): the next session starts the enabled daemon by
//!   itself and it reports the interrupted run as failed.
//!
//! Needs root and systemd installed but not running as PID 1 (CI): otherwise
//! it prints a SKIP line saying why. Set RUNSPOOL_SYSTEMD_TRANSCRIPT=FILE to
//! keep the commands and their real output (docs/operations.md quotes them).

use crate::common;

use common::*;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/systemd-user-manager.sh");
/// The short watchdog of the test's drop-in (the shipped unit says 120s).
const WATCHDOG_S: u64 = 4;

/// A user manager started for the test, stopped (with everything left in its
/// cgroup) when dropped, even after a failed assertion.
struct Session {
    /// Root-owned (0711): `state/` (root's) and `home/` (the user's).
    #[allow(dead_code)]
    base: tempfile::TempDir,
    state: PathBuf,
    home: PathBuf,
    user: String,
    uid: u32,
    gid: u32,
    runtime: PathBuf,
    manager_pid: Option<i64>,
    seq: u32,
    transcript: String,
    _lock: MachineLock,
}

enum Start {
    Up,
    Skip(String),
}

impl Session {
    fn new() -> Session {
        // One user manager per test user at a time, across checkouts too, and never beside journald.rs.
        let lock = MachineLock::acquire(RUN_SYSTEMD_LOCK, Duration::from_secs(600));
        let base = tempfile::Builder::new().prefix("rsum-").tempdir().unwrap();
        fs::set_permissions(base.path(), fs::Permissions::from_mode(0o711)).unwrap();
        let base_path = fs::canonicalize(base.path()).unwrap();
        let state = base_path.join("state");
        let home = base_path.join("home");
        mkdir_0700(&state);
        mkdir_0700(&home);
        Session {
            base,
            state,
            home,
            user: String::new(),
            uid: 0,
            gid: 0,
            runtime: PathBuf::new(),
            manager_pid: None,
            seq: 0,
            transcript: String::new(),
            _lock: lock,
        }
    }

    /// Create the test user (scripts/ci-user.sh) and hand it the home, with
    /// a copy of the binary it owns (the checkout may not be readable by it).
    fn prepare_home(&mut self) {
        let o = Command::new("bash").arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ci-user.sh")).output().unwrap();
        assert!(o.status.success(), "scripts/ci-user.sh failed:\n{}", describe(&o));
        let name = std::env::var("RUNSPOOL_TEST_USER").unwrap_or_else(|_| "runspool-ci".into());
        let id = |flag: &str| -> u32 {
            let o = Command::new("id").arg(flag).arg(&name).output().unwrap();
            stdout_str(&o).trim().parse().unwrap_or_else(|_| panic!("id {flag} {name}: {}", describe(&o)))
        };
        let (uid, gid) = (id("-u"), id("-g"));
        assert_ne!(uid, 0, "the test user must not be root");
        std::os::unix::fs::chown(&self.home, Some(uid), Some(gid)).unwrap();
        for d in ["bin", "work"] {
            let p = self.home.join(d);
            mkdir_0700(&p);
            std::os::unix::fs::chown(&p, Some(uid), Some(gid)).unwrap();
        }
        let bin = self.bin();
        fs::copy(BIN, &bin).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&bin, Some(uid), Some(gid)).unwrap();
    }

    /// `scripts/systemd-user-manager.sh start`: Skip when this host cannot run a manager.
    fn start_manager(&mut self) -> Start {
        let o = Command::new("bash")
            .arg(SCRIPT)
            .arg("start")
            .arg(&self.state)
            .arg(&self.home)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/systemd-user-manager.sh");
        let out = stdout_str(&o);
        if o.status.code() == Some(77) {
            return Start::Skip(
                out.lines().find_map(|l| l.strip_prefix("SKIP: ")).unwrap_or("the script said so").to_string(),
            );
        }
        assert!(o.status.success(), "scripts/systemd-user-manager.sh start failed:\n{}", describe(&o));
        let kv: HashMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
        self.user = kv["user"].to_string();
        self.uid = kv["uid"].parse().unwrap();
        self.gid = kv["gid"].parse().unwrap();
        self.runtime = PathBuf::from(kv["runtime_dir"]);
        self.manager_pid = Some(kv["pid"].parse().unwrap());
        Start::Up
    }

    /// `scripts/systemd-user-manager.sh stop`: the manager exits, what is
    /// left in its cgroup is killed, the cgroups and runtime dir are removed.
    fn stop_manager(&mut self) -> Output {
        let o = Command::new("bash").arg(SCRIPT).arg("stop").arg(&self.state).stdin(Stdio::null()).output().unwrap();
        self.manager_pid = None;
        o
    }

    fn bin(&self) -> PathBuf {
        self.home.join("bin/runspool")
    }
    fn root(&self) -> PathBuf {
        self.home.join("root")
    }
    fn work(&self) -> PathBuf {
        self.home.join("work")
    }
    fn run_dir(&self, id: &str) -> PathBuf {
        self.root().join("async-subagent-runs").join(id)
    }
    fn status(&self, id: &str) -> Option<Value> {
        read_json(&self.run_dir(id).join("status.json"))
    }

    /// A command run as the test user, with what a login session gives it.
    fn as_user(&self, prog: &str, args: &[&str]) -> Command {
        let mut c = Command::new(prog);
        c.args(args)
            .uid(self.uid)
            .gid(self.gid)
            .env_clear()
            .env("HOME", &self.home)
            .env("USER", &self.user)
            .env("LOGNAME", &self.user)
            .env("XDG_RUNTIME_DIR", &self.runtime)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LANG", "C.UTF-8")
            .current_dir(&self.home)
            .stdin(Stdio::null());
        c
    }

    /// Run `cmd` (at most 2 minutes), keep `shown` and its output in the transcript.
    fn run(&mut self, shown: &str, mut cmd: Command) -> Output {
        self.seq += 1;
        let out_p = self.state.join(format!("cmd-{}.out", self.seq));
        let err_p = self.state.join(format!("cmd-{}.err", self.seq));
        cmd.stdout(File::create(&out_p).unwrap()).stderr(File::create(&err_p).unwrap());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {shown}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("`{shown}` did not finish in 2 minutes\n{}", self.transcript);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let o = Output { status, stdout: fs::read(&out_p).unwrap(), stderr: fs::read(&err_p).unwrap() };
        self.transcript.push_str(&format!("$ {shown}\n{}{}", stdout_str(&o), stderr_str(&o)));
        match (o.status.code(), o.status.signal()) {
            (Some(0), _) => {}
            (Some(c), _) => self.transcript.push_str(&format!("[exit {c}]\n")),
            (None, s) => self.transcript.push_str(&format!("[signal {s:?}]\n")),
        }
        self.transcript.push('\n');
        o
    }

    /// `cmd` as the user, transcribed; panics unless it exits 0.
    fn ok(&mut self, shown: &str, prog: &str, args: &[&str]) -> Output {
        let cmd = self.as_user(prog, args);
        let o = self.run(shown, cmd);
        assert!(o.status.success(), "`{shown}` failed:\n{}", describe(&o));
        o
    }

    /// `systemctl --user show -p ...` as a map (not transcribed: polled).
    fn show(&self, props: &str) -> HashMap<String, String> {
        let o = self
            .as_user("systemctl", &["--user", "show", "-p", props, "runspool.service"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(o.status.success(), "systemctl --user show: {}", describe(&o));
        stdout_str(&o).lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Wait until the service runs a daemon other than `old` (any when 0).
    fn wait_active_other_than(&self, old: i64, what: &str) -> HashMap<String, String> {
        let mut last = HashMap::new();
        let ok = poll_until(LONG, || {
            last = self.show("ActiveState,SubState,MainPID,NRestarts,Result,StatusText");
            let pid: i64 = last["MainPID"].parse().unwrap_or(0);
            last["ActiveState"] == "active" && last["SubState"] == "running" && pid != 0 && pid != old
        });
        assert!(ok, "{what}: the service did not come back with a new daemon; last: {last:?}");
        last
    }

    /// Publish a request in the daemon's spool as the user would: a dot file
    /// the user owns, renamed into place.
    fn submit(&self, id: &str, steps: Vec<Value>) {
        let spool = self.root().join("spool");
        let bytes = serde_json::to_vec_pretty(&request(Some(id), &self.work(), steps)).unwrap();
        let tmp = spool.join(format!(".submit-{id}"));
        write_file_mode(&tmp, &bytes, 0o600);
        std::os::unix::fs::chown(&tmp, Some(self.uid), Some(self.gid)).unwrap();
        fs::rename(&tmp, spool.join(format!("{id}.json"))).unwrap();
    }

    fn wait_state(&self, id: &str, pred: impl Fn(&str) -> bool, what: &str) -> Value {
        let mut last = None;
        let ok = poll_until(LONG, || {
            last = self.status(id);
            last.as_ref().and_then(|s| s["state"].as_str()).is_some_and(&pred)
        });
        assert!(ok, "run {id}: {what}; last status: {last:?}\n{}", self.runner_stderr(id));
        last.unwrap()
    }

    fn runner_stderr(&self, id: &str) -> String {
        fs::read_to_string(self.run_dir(id).join("runner.stderr.log")).unwrap_or_default()
    }

    /// A step that reports its sandboxing and environment, says it started,
    /// waits for `gate`, then exits 3.
    fn gated_step(&self, id: &str) -> (Value, PathBuf, PathBuf) {
        let started = self.work().join(format!("{id}.started"));
        let gate = self.work().join(format!("{id}.gate"));
        let script = format!(
            "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status; echo \"NOTIFY_SOCKET=${{NOTIFY_SOCKET:-unset}}\"; \
             touch {s}; while [ ! -e {g} ]; do sleep 0.1; done; exit 3",
            s = started.display(),
            g = gate.display()
        );
        (sh_step("gated", &script), started, gate)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let log = fs::read_to_string(self.state.join("manager.log")).unwrap_or_default();
        // Whatever start got to (the script keeps a list), even after a failed start.
        let o = self.stop_manager();
        if !o.status.success() {
            eprintln!("scripts/systemd-user-manager.sh stop failed:\n{}", describe(&o));
        }
        if std::thread::panicking() {
            eprintln!("---- transcript ----\n{}\n---- user manager log ----\n{log}", self.transcript);
        }
        // Then `base` is removed, the user's home with it.
    }
}

fn proc_env(pid: i64) -> Vec<String> {
    fs::read(format!("/proc/{pid}/environ"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

#[test]
fn systemd_user_service() {
    if !cfg!(target_os = "linux") {
        report("systemd_user_service: SKIP: not Linux");
        return;
    }
    if !is_root() {
        report(
            "systemd_user_service: SKIP: needs root (to create the test user, its runtime dir and a delegated cgroup)",
        );
        return;
    }
    let mut s = Session::new();
    s.prepare_home();
    if let Start::Skip(why) = s.start_manager() {
        report(&format!("systemd_user_service: SKIP: {why}"));
        return;
    }
    let home = s.home.display().to_string();
    let bin = s.bin().display().to_string();
    let root = s.root().display().to_string();
    let unit_path = s.home.join(".config/systemd/user/runspool.service");

    // ---- install: the unit is written for this binary and root, and enabled.
    let o = s.ok("runspool service install", &bin, &["--root", &root, "service", "install"]);
    let unit = fs::read_to_string(&unit_path).unwrap();
    assert!(unit.lines().any(|l| l == format!("ExecStart={bin} daemon --root {root}")), "{unit}");
    assert!(
        s.home.join(".config/systemd/user/default.target.wants/runspool.service").exists(),
        "not enabled:\n{}",
        describe(&o)
    );
    s.ok("systemctl --user is-enabled runspool", "systemctl", &["--user", "is-enabled", "runspool"]);

    // ---- systemd's own checker, inside the user's session: nothing on stderr.
    for target in [unit_path.display().to_string(), "runspool.service".to_string()] {
        let o = s.run(
            &format!("systemd-analyze --user verify {target}"),
            s.as_user("systemd-analyze", &["--user", "verify", &target]),
        );
        assert!(
            o.status.success() && o.stderr.is_empty() && o.stdout.is_empty(),
            "systemd-analyze --user verify {target}:\n{}",
            describe(&o)
        );
    }

    // ---- start returns only after READY=1: active/running with the STATUS text at once.
    s.ok("systemctl --user start runspool", "systemctl", &["--user", "start", "runspool"]);
    let st = s.show("ActiveState,SubState,StatusText,MainPID,Type,NotifyAccess");
    assert_eq!((st["ActiveState"].as_str(), st["SubState"].as_str()), ("active", "running"), "{st:?}");
    assert!(st["StatusText"].starts_with("watching "), "no STATUS= text right after start: {st:?}");
    s.ok(
        "systemctl --user show -p ActiveState,SubState,StatusText runspool",
        "systemctl",
        &["--user", "show", "-p", "ActiveState,SubState,StatusText", "runspool"],
    );
    let o = s.ok("systemctl --user status runspool", "systemctl", &["--user", "status", "--no-pager", "runspool"]);
    assert!(
        stdout_str(&o).contains(&format!("Status: \"{}", st["StatusText"].split(';').next().unwrap())),
        "{}",
        describe(&o)
    );
    let o = s.ok("runspool service status", &bin, &["service", "status"]);
    assert!(stdout_str(&o).contains("Status: \"watching "), "{}", describe(&o));
    let o = s.ok("runspool service status --json", &bin, &["service", "status", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("service status --json prints JSON");
    assert_eq!((j["ActiveState"].as_str(), j["SubState"].as_str()), (Some("active"), Some("running")), "{j}");
    assert_eq!(j["MainPID"].as_i64().map(|p| p.to_string()), Some(st["MainPID"].clone()), "{j}");
    assert!(j["StatusText"].as_str().unwrap_or("").starts_with("watching "), "{j}");
    // doctor under a real user manager: it finds the manager and the enabled unit.
    let cmd = s.as_user(&bin, &["--root", &root, "doctor"]);
    let o = s.run("runspool doctor", cmd);
    let text = stdout_str(&o);
    assert!(text.lines().any(|l| l.starts_with("ok    manager ")), "{}", describe(&o));
    assert!(
        text.lines().any(|l| l.starts_with("ok    unit ") && l.contains("installed and enabled")),
        "{}",
        describe(&o)
    );
    // docs/operations.md's doctor sample: each check line it shows is this output's, with
    // <home> and <user> for the paths and the name ("..." stands for lines left out).
    let doc = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md")).unwrap();
    let start = doc.find("$ runspool doctor\n").expect("docs/operations.md has a doctor sample");
    let real: Vec<String> =
        text.lines().map(|l| l.replace(&s.home.display().to_string(), "<home>").replace(&s.user, "<user>")).collect();
    for want in doc[start..].lines().skip(1).take_while(|l| !l.starts_with("```")) {
        if want == "..." || want.contains("pid <pid>") {
            continue;
        }
        assert!(
            real.iter().any(|l| l == want),
            "docs/operations.md's doctor line is not real output: {want}\nreal:\n{}",
            real.join("\n")
        );
    }
    let first = st["MainPID"].parse::<i64>().unwrap();
    let d = read_json(&s.root().join("runspool/daemon.json")).expect("daemon.json");
    assert_eq!(d["pid"].as_i64(), Some(first), "daemon.json names the service's MainPID");

    // ---- reload is SIGHUP to the same daemon.
    s.ok("systemctl --user reload runspool", "systemctl", &["--user", "reload", "runspool"]);
    let st = s.show("ActiveState,SubState,MainPID");
    assert_eq!((st["ActiveState"].as_str(), st["MainPID"].parse::<i64>().unwrap()), ("active", first), "{st:?}");

    // ---- a run survives `systemctl --user restart` and ends with its own exit code.
    let (step, started, gate) = s.gated_step("survivor");
    s.submit("survivor", vec![step]);
    let running = s.wait_state("survivor", |st| st == "running", "never running");
    wait_until(LONG, "the survivor's step to start", || started.exists());
    let runner = running["runner"]["pid"].as_i64().or(running["pid"].as_i64()).expect("runner pid");
    assert!(process_alive(runner));
    s.ok("systemctl --user restart runspool", "systemctl", &["--user", "restart", "runspool"]);
    let st = s.wait_active_other_than(first, "restart");
    let second: i64 = st["MainPID"].parse().unwrap();
    assert!(!process_alive(first), "the old daemon {first} is still alive after restart");
    assert!(process_alive(runner), "the runner {runner} did not survive the daemon's restart (KillMode=process)");
    s.ok("runspool service status", &bin, &["service", "status"]);
    fs::write(&gate, b"").unwrap();
    let done = s.wait_state("survivor", is_terminal_state, "never finished after the restart");
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(done["exitCode"], 3, "{done}");
    assert_eq!(done["steps"][0]["exitCode"], 3, "{done}");
    let out = fs::read_to_string(s.run_dir("survivor").join("output-0.log")).unwrap();
    // Steps get no notify socket, and nothing of the unit's sandboxing:
    // a run does the same under the service as from a shell.
    assert!(out.contains("NOTIFY_SOCKET=unset"), "{out}");
    assert!(
        out.contains("NoNewPrivs:\t0") && out.contains("Seccomp:\t0"),
        "the unit's sandboxing leaks into steps:\n{out}"
    );

    // ---- kill -9: Restart=on-failure brings a new daemon.
    let before = s.show("NRestarts")["NRestarts"].parse::<u32>().unwrap();
    unsafe { libc::kill(second as libc::pid_t, libc::SIGKILL) };
    s.transcript.push_str(&format!("$ kill -9 {second}\n\n"));
    let st = s.wait_active_other_than(second, "kill -9");
    let third: i64 = st["MainPID"].parse().unwrap();
    assert!(st["NRestarts"].parse::<u32>().unwrap() > before, "{st:?}");
    s.ok("systemctl --user status runspool", "systemctl", &["--user", "status", "--no-pager", "runspool"]);

    // ---- watchdog: a short WatchdogSec from a drop-in; the daemon pings at half of it.
    let dropin_dir = s.home.join(".config/systemd/user/runspool.service.d");
    s.ok("mkdir -p ~/.config/systemd/user/runspool.service.d", "mkdir", &["-p", &dropin_dir.display().to_string()]);
    let conf = dropin_dir.join("watchdog.conf");
    let body = format!("[Service]\nWatchdogSec={WATCHDOG_S}s\n");
    fs::write(&conf, &body).unwrap();
    std::os::unix::fs::chown(&conf, Some(s.uid), Some(s.gid)).unwrap();
    s.transcript.push_str(&format!("$ cat ~/.config/systemd/user/runspool.service.d/watchdog.conf\n{body}\n"));
    s.ok("systemctl --user daemon-reload", "systemctl", &["--user", "daemon-reload"]);
    s.ok("systemctl --user restart runspool", "systemctl", &["--user", "restart", "runspool"]);
    let st = s.wait_active_other_than(third, "restart with the drop-in");
    let fourth: i64 = st["MainPID"].parse().unwrap();
    let env = proc_env(fourth);
    assert!(env.iter().any(|v| v == &format!("WATCHDOG_USEC={}", WATCHDOG_S * 1_000_000)), "{env:?}");
    s.ok(
        "systemctl --user show -p WatchdogUSec,WatchdogTimestampMonotonic runspool",
        "systemctl",
        &["--user", "show", "-p", "WatchdogUSec,WatchdogTimestampMonotonic", "runspool"],
    );
    // Watch the pings for three watchdog periods: the daemon stays, and its
    // pings come about every WatchdogSec/2 (never much faster).
    let mut pings: Vec<u64> = vec![];
    let until = Instant::now() + Duration::from_secs(3 * WATCHDOG_S);
    while Instant::now() < until {
        let t: u64 = s.show("WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"].parse().unwrap();
        if pings.last() != Some(&t) {
            pings.push(t);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = s.show("MainPID,ActiveState,NRestarts");
    assert_eq!(st["MainPID"].parse::<i64>().unwrap(), fourth, "a healthy daemon was restarted: {st:?}");
    let gaps: Vec<f64> = pings.windows(2).map(|w| (w[1] - w[0]) as f64 / 1e6).collect();
    assert!(gaps.len() >= 3, "too few watchdog pings seen in {}s: {pings:?}", 3 * WATCHDOG_S);
    let mut sorted = gaps.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = sorted[sorted.len() / 2];
    let half = WATCHDOG_S as f64 / 2.0;
    assert!(median >= half * 0.8 && median < WATCHDOG_S as f64, "pings every {gaps:?} s; expected about {half} s");
    s.transcript.push_str(&format!("(watchdog pings seen {gaps:.2?} s apart)\n\n"));
    // Frozen: no pings, so the manager aborts it and Restart= brings a new one.
    let before = st["NRestarts"].parse::<u32>().unwrap();
    unsafe { libc::kill(fourth as libc::pid_t, libc::SIGSTOP) };
    s.transcript.push_str(&format!("$ kill -STOP {fourth}\n\n"));
    let mut results = vec![];
    let ok = poll_until(LONG, || {
        let st = s.show("ActiveState,SubState,MainPID,Result,NRestarts");
        let r = format!("{}/{}/{}", st["ActiveState"], st["SubState"], st["Result"]);
        if results.last() != Some(&r) {
            results.push(r);
        }
        let pid: i64 = st["MainPID"].parse().unwrap_or(0);
        st["ActiveState"] == "active" && pid != 0 && pid != fourth
    });
    assert!(ok, "the frozen daemon was not replaced; states seen: {results:?}");
    assert!(results.iter().any(|r| r.ends_with("/watchdog")), "no Result=watchdog seen: {results:?}");
    wait_until(LONG, "the frozen daemon to be gone", || !process_alive(fourth));
    assert!(s.show("NRestarts")["NRestarts"].parse::<u32>().unwrap() > before);
    s.transcript.push_str(&format!("(states seen after the SIGSTOP: {})\n\n", results.join(", ")));
    s.ok("systemctl --user status runspool", "systemctl", &["--user", "status", "--no-pager", "runspool"]);
    fs::remove_file(&conf).unwrap();
    fs::remove_dir(&dropin_dir).unwrap();
    s.ok("systemctl --user daemon-reload", "systemctl", &["--user", "daemon-reload"]);

    // ---- logs, whatever this host's journal has.
    s.run("runspool service logs", s.as_user(&bin, &["service", "logs"]));
    s.run(
        "journalctl --user -u runspool --no-pager -n 20",
        s.as_user("journalctl", &["--user", "-u", "runspool", "--no-pager", "-n", "20"]),
    );

    // ---- logout without lingering: the manager exits and user@.service kills
    // what is left in its cgroup, runners included. The next session starts
    // the enabled daemon by itself, which reports the run as failed.
    let (step, started, _gate) = s.gated_step("interrupted");
    s.submit("interrupted", vec![step]);
    let running = s.wait_state("interrupted", |st| st == "running", "never running");
    wait_until(LONG, "the interrupted run's step to start", || started.exists());
    let runner = running["runner"]["pid"].as_i64().or(running["pid"].as_i64()).expect("runner pid");
    let o = s.stop_manager();
    assert!(o.status.success(), "stop: {}", describe(&o));
    assert!(!process_alive(runner), "the runner outlived the session");
    s.transcript.push_str("(logged out without lingering: the user manager exited and its cgroup was emptied)\n\n");
    match s.start_manager() {
        Start::Up => {}
        Start::Skip(why) => panic!("the user manager started once but not twice: {why}"),
    }
    let st = s.wait_active_other_than(0, "the enabled service at the next session");
    s.ok("systemctl --user status runspool", "systemctl", &["--user", "status", "--no-pager", "runspool"]);
    let failed = s.wait_state("interrupted", is_terminal_state, "not repaired by the next daemon");
    assert_eq!(failed["state"], "failed", "{failed}");
    let err = failed["error"].as_str().unwrap_or("");
    assert!(err.contains("exited before recording a result"), "{failed}");
    s.run(
        &format!("runspool --root {root} status interrupted"),
        s.as_user(&bin, &["--root", &root, "status", "interrupted"]),
    );

    // ---- uninstall: disabled, stopped, unit gone.
    let daemon: i64 = st["MainPID"].parse().unwrap();
    s.ok("runspool service uninstall", &bin, &["service", "uninstall"]);
    assert!(!unit_path.exists());
    wait_until(LONG, "the daemon to stop on uninstall", || !process_alive(daemon));

    if let Ok(p) = std::env::var("RUNSPOOL_SYSTEMD_TRANSCRIPT") {
        let t = s.transcript.replace(&home, "~").replace(&format!("/run/user/{}", s.uid), "/run/user/<uid>");
        fs::write(&p, t).unwrap();
        report(&format!("systemd_user_service: transcript written to {p}"));
    }
}
