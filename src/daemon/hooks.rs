//! Completion hooks: `[hooks] on_complete` / `on_failure` run a command when a
//! run the daemon supervised ends, with the run's result JSON on stdin.
//!
//! Exactly once, across restarts:
//! - While hooks are configured, every run the daemon sees active (claimed,
//!   re-queued or re-adopted) gets a marker `runspool/hooks-pending/<runId>`.
//!   It carries "this run still owes a hook" across a daemon restart, since a
//!   run can end while no daemon is running.
//! - Firing first creates `<runDir>/hook.json` with rename-without-replace:
//!   only one daemon, once, can create it. Its presence means "fired"; it is
//!   rewritten with the outcome when the hook ends. A daemon killed while a
//!   hook runs does not run it again after the restart: it notes the outcome
//!   as unknown.
//!
//! Hooks never block the loop: children are polled each turn, at most
//! `max_parallel` run at once, and one that outlives `timeout_s` gets SIGTERM
//! to its process group, then SIGKILL 3 s later.
//!
//! Bounded across restarts: each running hook is recorded in
//! `runspool/hooks-running/<runId>` (pid, start identity, deadline). A hook
//! left running by a previous daemon may finish, but the next daemon kills
//! its process group at the recorded deadline, once it has checked that the
//! pid is still that process (its start identity).
//!
//! A SIGHUP applies `[hooks]` at once (`reconfigure`).

use std::collections::{HashSet, VecDeque};
use std::io::{self, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::unistd::Pid;

use serde::{Deserialize, Serialize};

use super::part::Env;
use crate::config::Hooks as HookConfig;
use crate::platform::child::{self, Child, Ladder, Schedule, Signal};
use crate::platform::exec::{self, Detach};
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::{fsutil, results, run, Layout, RunId};

/// hook.log keeps at most this many bytes of a run's hook output (stdout and
/// stderr); the rest is read and discarded, and one line says so
/// (docs/config.md).
pub const HOOK_LOG_MAX: u64 = 1024 * 1024;

/// `<runDir>/hook.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HookRecord {
    pub version: u32,
    /// `on_complete` or `on_failure`.
    pub hook: String,
    pub command: Vec<String>,
    /// The run's state the hook was fired for.
    pub state: String,
    pub started_at: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HookRecord {
    /// The record of a hook about to start, for a run that ended in `state`.
    fn starting(hook: &str, command: &[String], state: &str) -> HookRecord {
        HookRecord {
            version: 1,
            hook: hook.into(),
            command: command.to_vec(),
            state: state.into(),
            started_at: crate::now_ms(),
            pid: None,
            ended_at: None,
            exit_code: None,
            signal: None,
            timed_out: false,
            error: None,
        }
    }
}

pub fn record_path(run_dir: &Path) -> PathBuf {
    RunPaths::hook_json(run_dir)
}

/// `runspool/hooks-running/<runId>`: what a later daemon needs to keep a
/// hook it did not start within its time limit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct RunningRecord {
    run_id: String,
    pid: u32,
    start_identity: String,
    /// Epoch ms: SIGTERM to the process group then, SIGKILL 3 s later.
    deadline: i64,
    timeout_s: u64,
}

/// A hook started by a previous daemon that was still running at our start.
struct Orphan {
    /// The run, from the record's file name (a `runId` inside it is only compared).
    id: RunId,
    rec: RunningRecord,
    /// The record's deadline, then `Ladder::STOP`.
    schedule: Schedule,
    next_check: Instant,
}

struct Running {
    run_id: RunId,
    /// Its deadline is `hooks.timeout_s` from its start, then `Ladder::STOP`.
    child: Child,
    record: HookRecord,
    started: Instant,
}

pub struct Hooks {
    pending_dir: PathBuf,
    running_dir: PathBuf,
    /// Tracked runs (mirrors the pending markers; a marker that could not be
    /// written on a full disk still fires from memory).
    tracked: HashSet<RunId>,
    /// Ended runs waiting for a free hook slot.
    waiting: VecDeque<RunId>,
    running: Vec<Running>,
    orphans: Vec<Orphan>,
}

impl Hooks {
    pub fn new(l: &Layout) -> Hooks {
        Hooks {
            pending_dir: l.hooks_pending(),
            running_dir: l.hooks_running(),
            tracked: HashSet::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            orphans: Vec::new(),
        }
    }

    /// A run the daemon now supervises owes a hook when it ends.
    pub fn track(&mut self, cfg: &HookConfig, run_id: &RunId) {
        if !cfg.enabled() || !self.tracked.insert(run_id.clone()) {
            return;
        }
        let r = fsutil::mkdir_private(&self.pending_dir)
            .and_then(|_| fsutil::touch(&self.pending_dir.join(run_id.as_str())));
        if let Err(e) = r {
            tracing::warn!(run_id = %run_id, error = %e, "cannot record the pending hook on disk; it fires unless the daemon restarts first");
        }
    }

    /// SIGHUP changed `[hooks]`. Hooks now configured are owed by every run
    /// in `active`; with none configured any more, runs stop owing one.
    /// Hooks already running keep their own time limit.
    pub fn reconfigure(&mut self, new: &HookConfig, active: &[RunId]) {
        if new.enabled() {
            for id in active {
                self.track(new, id);
            }
            return;
        }
        // Runs that ended but whose hook has not started yet are let go too.
        let owed: Vec<RunId> = self.tracked.iter().cloned().collect();
        for id in owed {
            self.forget(&id);
        }
        self.waiting.clear();
    }

    /// At start: every run with a pending marker is tracked again; those that
    /// ended while no daemon ran are queued to fire now. Hooks a previous
    /// daemon left running are watched until their deadline.
    pub fn recover(&mut self, l: &Layout) {
        self.recover_running();
        let Ok(rd) = std::fs::read_dir(&self.pending_dir) else { return };
        for e in rd.flatten() {
            let Some(id) = e.file_name().to_str().and_then(RunId::parse) else {
                let _ = std::fs::remove_file(e.path());
                continue;
            };
            match run::read_status(&l.run_dir(&id)) {
                Ok(Some(s)) => {
                    self.tracked.insert(id.clone());
                    if !s.state.is_active() {
                        self.waiting.push_back(id);
                    }
                }
                Ok(None) => {
                    // The run is gone (retention) or never got a status: nothing to report.
                    let _ = std::fs::remove_file(e.path());
                }
                Err(err) => tracing::warn!(run_id = %id, error = %err, "unreadable status.json; its hook waits"),
            }
        }
    }

    /// A tracked run reached a terminal state.
    pub fn ended(&mut self, run_id: &RunId) {
        if self.tracked.contains(run_id) && !self.waiting.iter().any(|w| w == run_id) {
            self.waiting.push_back(run_id.clone());
        }
    }

    pub fn busy(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.orphans.is_empty()
    }

    /// Reap finished hooks, enforce time limits, start waiting ones.
    pub fn turn(&mut self, env: &mut Env) {
        let (l, cfg) = (env.layout, &env.cfg.hooks);
        self.reap(l);
        self.watch_orphans(l);
        while self.running.len() < cfg.max_parallel.max(1) {
            let Some(id) = self.waiting.pop_front() else { break };
            self.fire(l, cfg, &id);
        }
    }

    fn forget(&mut self, run_id: &RunId) {
        self.tracked.remove(run_id);
        let _ = std::fs::remove_file(self.pending_dir.join(run_id.as_str()));
    }

    fn fire(&mut self, l: &Layout, cfg: &HookConfig, run_id: &RunId) {
        let dir = l.run_dir(run_id);
        let s = match run::read_status(&dir) {
            Ok(Some(s)) if !s.state.is_active() => s,
            Ok(Some(_)) => return, // not ended after all (a stale wake): keep tracking
            Ok(None) => return self.forget(run_id),
            Err(e) => {
                tracing::warn!(run_id = %run_id, error = %e, "cannot read the status of an ended run; skipping its hook");
                return self.forget(run_id);
            }
        };
        let (name, command) = if s.state == State::Complete {
            ("on_complete", &cfg.on_complete)
        } else {
            ("on_failure", &cfg.on_failure)
        };
        if command.is_empty() {
            return self.forget(run_id);
        }
        let mut record = HookRecord::starting(name, command, s.state.as_str());
        // The claim on "firing": hook.json appears once, whoever gets there first.
        match create_record(&dir, &record) {
            Ok(true) => {}
            Ok(false) => {
                self.note_unfinished(&dir, run_id);
                return self.forget(run_id);
            }
            Err(e) if fsutil::is_capacity(&e) => {
                tracing::warn!(run_id = %run_id, error = %e, "cannot record the hook (storage full); will retry");
                self.waiting.push_back(run_id.clone());
                return;
            }
            Err(e) => {
                tracing::error!(run_id = %run_id, error = %e, path = %record_path(&dir).display(), "cannot record the hook; not running it");
                return self.forget(run_id);
            }
        }
        let input = serde_json::to_vec_pretty(&results::build_result(l, run_id, &s)).unwrap_or_default();
        match spawn(command, &dir, &s, Duration::from_secs(cfg.timeout_s)) {
            Ok(mut child) => {
                if let Some(mut stdin) = child.take_stdin() {
                    // A thread, so a hook that never reads stdin cannot stall the loop.
                    let _ = std::thread::Builder::new().name("hook-stdin".into()).spawn(move || {
                        let _ = stdin.write_all(&input);
                    });
                }
                record.pid = Some(child.id());
                let _ = write_record(&dir, &record);
                tracing::info!(run_id = %run_id, hook = name, hook_pid = child.id(), "hook started");
                self.record_running(run_id, child.id(), record.started_at, cfg.timeout_s);
                self.running.push(Running { run_id: run_id.clone(), child, record, started: Instant::now() });
            }
            Err(e) => {
                record.ended_at = Some(crate::now_ms());
                record.error = Some(format!("cannot start `{}`: {e}; fix hooks.{name} in the config", command[0]));
                tracing::error!(run_id = %run_id, hook = name, error = %e, command = %command[0], "hook could not start");
                let _ = write_record(&dir, &record);
                self.forget(run_id);
            }
        }
    }

    /// hook.json exists but has no outcome: a previous daemon died while the
    /// hook ran. It is not run again; say so in the record.
    fn note_unfinished(&self, dir: &Path, run_id: &str) {
        let Ok(bytes) = fsutil::read_nofollow(&record_path(dir), 1024 * 1024) else { return };
        let Ok(mut r) = serde_json::from_slice::<HookRecord>(&bytes) else { return };
        if r.ended_at.is_none() && r.error.is_none() {
            r.error =
                Some("the daemon restarted while the hook ran; its outcome is unknown and it is not run again".into());
            tracing::warn!(run_id, hook = %r.hook, "a hook was interrupted by a daemon restart; not running it twice");
            let _ = write_record(dir, &r);
        }
    }

    fn reap(&mut self, l: &Layout) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let h = &mut self.running[i];
            match h.child.try_wait() {
                Ok(Some(st)) => {
                    let mut h = self.running.swap_remove(i);
                    let r = &mut h.record;
                    r.ended_at = Some(crate::now_ms());
                    r.exit_code = st.code();
                    r.signal = st.signal();
                    let ms = h.started.elapsed().as_millis() as u64;
                    if st.success() {
                        tracing::info!(run_id = %h.run_id, hook = %r.hook, duration_ms = ms, "hook finished");
                    } else {
                        let how = match (st.code(), st.signal()) {
                            (Some(c), _) => format!("exit code {c}"),
                            (_, Some(s)) => format!("signal {}", crate::platform::signal_name(s)),
                            _ => "unknown status".into(),
                        };
                        let why = if r.timed_out { format!("timed out after hooks.timeout_s; {how}") } else { how };
                        tracing::warn!(
                            run_id = %h.run_id, hook = %r.hook, duration_ms = ms, outcome = %why,
                            log = %RunPaths::hook_log(&l.run_dir(&h.run_id)).display(), "hook failed"
                        );
                        r.error = Some(why);
                    }
                    let _ = write_record(&l.run_dir(&h.run_id), r);
                    let id = h.run_id.clone();
                    let _ = std::fs::remove_file(self.running_dir.join(id.as_str()));
                    self.forget(&id);
                    continue;
                }
                Ok(None) => {
                    // Past hooks.timeout_s: SIGTERM to its group, SIGKILL 3 s later.
                    h.child.tick(now);
                    h.record.timed_out = h.child.timed_out();
                }
                Err(e) => tracing::warn!(run_id = %h.run_id, error = %e, "cannot poll a hook"),
            }
            i += 1;
        }
    }

    /// How soon the loop should come back for the hooks.
    pub fn next_wake(&self) -> Option<Instant> {
        if self.running.is_empty() && self.waiting.is_empty() && self.orphans.is_empty() {
            return None;
        }
        Some(Instant::now() + Duration::from_millis(200))
    }
}

impl Hooks {
    /// Note a started hook in `hooks-running/` so a later daemon can bound it.
    fn record_running(&self, run_id: &str, pid: u32, started_at: i64, timeout_s: u64) {
        let Some(start_identity) = crate::platform::start_identity(pid) else {
            tracing::warn!(run_id, hook_pid = pid, "no start identity for the hook; a later daemon cannot bound it");
            return;
        };
        let rec = RunningRecord {
            run_id: run_id.to_string(),
            pid,
            start_identity,
            deadline: started_at.saturating_add(timeout_s.saturating_mul(1000) as i64),
            timeout_s,
        };
        let r = fsutil::mkdir_private(&self.running_dir).and_then(|_| {
            fsutil::write_atomic(
                &self.running_dir.join(run_id),
                &serde_json::to_vec(&rec).map_err(io::Error::other)?,
                false,
            )
        });
        if let Err(e) = r {
            tracing::warn!(run_id, error = %e, path = %self.running_dir.display(),
                "cannot record the running hook; should the daemon restart, it cannot be bounded by hooks.timeout_s");
        }
    }

    /// At start: hooks a previous daemon left running (their record names a
    /// live process with the same start identity) are watched until their
    /// deadline; records of hooks that are gone are removed.
    fn recover_running(&mut self) {
        let Ok(rd) = std::fs::read_dir(&self.running_dir) else { return };
        for e in rd.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue; // a temp; sweep_temps owns those
            }
            let rec = fsutil::read_nofollow(&path, 64 * 1024)
                .ok()
                .and_then(|b| serde_json::from_slice::<RunningRecord>(&b).ok())
                .filter(|r| r.run_id == name && r.pid > 1);
            match (rec, RunId::parse(&name)) {
                (Some(rec), Some(id)) if Orphan::alive(&rec) => {
                    tracing::info!(run_id = %rec.run_id, hook_pid = rec.pid, deadline = rec.deadline,
                        "a hook started by the previous daemon still runs; it is killed at its deadline unless it ends first");
                    let left = Duration::from_millis(rec.deadline.saturating_sub(crate::now_ms()).max(0) as u64);
                    let schedule = Schedule::new(Some(Instant::now() + left), Ladder::STOP);
                    self.orphans.push(Orphan { id, rec, schedule, next_check: Instant::now() });
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }

    /// Signal orphaned hooks at their deadline; forget those that are gone.
    fn watch_orphans(&mut self, l: &Layout) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.orphans.len() {
            let o = &mut self.orphans[i];
            if now < o.next_check {
                i += 1;
                continue;
            }
            o.next_check = now + Duration::from_millis(500);
            let members = Orphan::members(&o.rec);
            if members.is_empty() {
                let o = self.orphans.swap_remove(i);
                if o.schedule.timed_out() {
                    note_orphan_killed(&l.run_dir(&o.id), &o.rec);
                }
                let _ = std::fs::remove_file(self.running_dir.join(o.id.as_str()));
                continue;
            }
            let before = o.schedule.timed_out();
            if let Some(sig) = o.schedule.due(now) {
                if !before {
                    tracing::warn!(run_id = %o.rec.run_id, hook_pid = o.rec.pid, timeout_s = o.rec.timeout_s,
                        "killed an orphaned hook at its deadline (hooks.timeout_s); the daemon restarted while it ran");
                }
                o.signal(&members, sig);
            }
            i += 1;
        }
    }
}

impl Orphan {
    /// The hook's leader is still the process that was started (same start identity).
    fn alive(rec: &RunningRecord) -> bool {
        crate::platform::start_identity(rec.pid).as_deref() == Some(rec.start_identity.as_str())
            && !crate::platform::is_zombie(rec.pid)
    }

    /// What is left of the hook: its leader (verified by start identity), or,
    /// once the leader is gone, the processes still in its process group that
    /// carry the hook's `RUNSPOOL_RUN_ID`. Empty: nothing left to bound.
    fn members(rec: &RunningRecord) -> Vec<u32> {
        if Orphan::alive(rec) {
            return vec![rec.pid];
        }
        crate::platform::run_processes_in_group(rec.pid, &rec.run_id)
    }

    fn signal(&self, members: &[u32], sig: Signal) {
        if members == [self.rec.pid] {
            child::signal_group(self.rec.pid, sig);
        } else {
            for p in members {
                let _ = nix::sys::signal::kill(Pid::from_raw(*p as i32), sig);
            }
        }
    }
}

/// The orphaned hook of this run was killed at its deadline: say so in hook.json.
fn note_orphan_killed(dir: &Path, rec: &RunningRecord) {
    let Ok(bytes) = fsutil::read_nofollow(&record_path(dir), 1024 * 1024) else { return };
    let Ok(mut r) = serde_json::from_slice::<HookRecord>(&bytes) else { return };
    if r.pid != Some(rec.pid) || (r.ended_at.is_some() && r.timed_out) {
        return;
    }
    r.timed_out = true;
    r.ended_at = Some(crate::now_ms());
    r.error = Some(format!(
        "the daemon restarted while the hook ran; killed at its deadline (hooks.timeout_s = {} s)",
        rec.timeout_s
    ));
    let _ = write_record(dir, &r);
}

fn spawn(command: &[String], dir: &Path, s: &Status, timeout: Duration) -> io::Result<Child> {
    // The run directory is the steps' to write: a FIFO planted as hook.log is refused, never waited on.
    let log = fsutil::open_append(&RunPaths::hook_log(dir))?;
    // The hook writes into a pipe and a thread copies at most HOOK_LOG_MAX
    // bytes into hook.log, so a hook that prints without end fills no disk.
    let (output, input) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    let output = std::fs::File::from(output);
    let mut cmd = exec::command(&command[0], Detach { own_group: true, die_with_thread: false });
    cmd.args(&command[1..])
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(input.try_clone()?)
        .stderr(Stdio::from(input))
        .env("RUNSPOOL_RUN_ID", &s.run_id)
        .env("RUNSPOOL_STATE", s.state.as_str())
        .env("RUNSPOOL_RUN_DIR", dir)
        .env("RUNSPOOL_SESSION_ID", &s.session_id)
        .env("RUNSPOOL_EXIT_CODE", s.exit_code.unwrap_or(1).to_string());
    let child = Child::spawn(&mut cmd, Some(Instant::now() + timeout), Ladder::STOP)?;
    // Our copies of the pipe's write end must close, or the copier never sees its end.
    drop(cmd);
    let path = RunPaths::hook_log(dir);
    std::thread::Builder::new().name("hook-log".into()).spawn(move || copy_capped(output, log, HOOK_LOG_MAX, &path))?;
    Ok(child)
}

/// Copy `from` into `to` until `to` holds `max` bytes, then read on and
/// discard (the writer never blocks on a full pipe), with one line saying so.
fn copy_capped(mut from: impl io::Read, mut to: std::fs::File, max: u64, path: &Path) {
    let mut used = to.metadata().map(|m| m.len()).unwrap_or(0);
    let mut noted = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let keep = n.min(max.saturating_sub(used) as usize);
        if keep > 0 {
            if let Err(e) = to.write_all(&buf[..keep]) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write hook output; discarding the rest");
                used = max;
                noted = true;
            } else {
                used += keep as u64;
            }
        }
        if keep < n && !noted {
            noted = true;
            let _ = writeln!(to, "\n[runspool: hook output past {max} bytes discarded]");
        }
    }
}

/// Create hook.json only if it does not exist. Ok(false): it already did.
fn create_record(dir: &Path, r: &HookRecord) -> io::Result<bool> {
    let target = record_path(dir);
    // Named as sweep_temps expects: a daemon killed before the rename leaves
    // a temp the next start removes.
    let tmp = fsutil::temp_name(&target);
    fsutil::write_atomic(&tmp, &serde_json::to_vec_pretty(r).map_err(io::Error::other)?, true)?;
    let res = crate::platform::rename_noreplace(&tmp, &target);
    let _ = std::fs::remove_file(&tmp);
    match res {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

fn write_record(dir: &Path, r: &HookRecord) -> io::Result<()> {
    fsutil::write_atomic(&record_path(dir), &serde_json::to_vec_pretty(r).map_err(io::Error::other)?, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;
    use crate::daemon::part::Effect;
    use crate::daemon::spool::intake::{Gate, Intake};

    #[test]
    fn a_tracked_run_that_ends_failed_fires_on_failure_once_with_its_result() {
        let mut cfg = crate::config::Config::default();
        let dir = tempfile::tempdir().unwrap();
        let got = dir.path().join("hook-input.json");
        cfg.hooks.on_failure = vec!["sh".into(), "-c".into(), format!("cat >> '{}'", got.display())];
        let mut r = Root::with(cfg);
        let id = r.drop_request("hooks-1", "true");
        let mut out = Vec::new();
        Intake::default().turn(&mut r.env(), Gate::Open, &mut out);
        assert!(matches!(&out[..], [Effect::Queue(..)]), "{out:?}");
        let mut hooks = Hooks::new(&r.layout);
        hooks.track(&r.cfg.hooks, &id);
        assert!(r.layout.daemon_dir().join("hooks-pending").join("hooks-1").exists(), "owed on disk");
        hooks.turn(&mut r.env());
        assert!(!got.exists(), "no hook before the run ends");

        assert!(results::fail_queued(&mut r.w, &r.layout, &id, "stopped by the test", "skipped").unwrap());
        assert!(r.w.flush());
        hooks.ended(&id);
        hooks.ended(&id);
        let deadline = Instant::now() + Duration::from_secs(30);
        let record_file = record_path(&r.layout.run_dir(&id));
        let done = || {
            std::fs::read(&record_file)
                .ok()
                .and_then(|b| serde_json::from_slice::<HookRecord>(&b).ok())
                .filter(|h| h.ended_at.is_some())
        };
        while done().is_none() && Instant::now() < deadline {
            hooks.turn(&mut r.env());
            std::thread::sleep(Duration::from_millis(20));
        }
        let record = done().expect("the hook ran and its record says so");
        assert_eq!((record.hook.as_str(), record.state.as_str(), record.exit_code), ("on_failure", "failed", Some(0)));
        let input: serde_json::Value = serde_json::from_slice(&std::fs::read(&got).unwrap()).unwrap();
        assert_eq!(input["runId"], "hooks-1", "the hook reads the run's result on stdin (once)");
        assert!(!hooks.busy());
        assert!(!r.layout.daemon_dir().join("hooks-pending").join("hooks-1").exists(), "no longer owed");
    }
}
