//! The record: every write the run makes. It alone holds the run's `Status`
//! and the `Writer`, so status.json, events.jsonl, the steps' "runspool:"
//! lines, the heartbeat, and at the end the indexes and result.json are
//! written here, in the order docs/durability.md gives. The other parts
//! read the status through `status()` and say what happened; the `Runner`
//! passes that on here.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::protocol::outcome::{classify, run_ending, Halt, StepEnd};
use crate::protocol::status::{OpenSteps, RunnerInfo, State, Status, StepState};
use crate::store::fsutil;
use crate::store::layout::{RunId, RunPaths};
use crate::store::run::{event_line, lock_status, read_status, update_status_locked};
use crate::store::{index, results, Layout, Writer};

/// How often a running run's `lastUpdate` is refreshed when nothing else
/// writes its status: hourly, far inside pi-subagents 0.67's 24 h stale-run
/// rule and far from a cost (one small write an hour).
/// `RUNSPOOL_STATUS_HEARTBEAT_MS` changes it (tests, or a stricter reader).
const HEARTBEAT: Duration = Duration::from_secs(3600);

fn heartbeat() -> Duration {
    std::env::var("RUNSPOOL_STATUS_HEARTBEAT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms >= 100)
        .map(Duration::from_millis)
        .unwrap_or(HEARTBEAT)
}

/// Which file status.json is: (device, inode, size, mtime, ctime). Every
/// writer replaces it by a rename (PROTOCOL §11), so another writer's status
/// is another inode, written at another time.
type FileId = (u64, u64, u64, i64, i64, i64, i64);

fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()))
}

/// What `mark_running` leaves: the `running` status, and which file it is
/// (taken under the status lock; None when unknown).
pub(super) type Started = (Status, Option<FileId>);

/// The `running` status: this runner's pid, identity and containment, the
/// run's deadline. None when the run is no longer queued.
pub(super) fn mark_running(
    w: &mut Writer,
    dir: &Path,
    pid: u32,
    containment: &str,
) -> std::io::Result<Option<Started>> {
    let now = crate::now_ms();
    let mut started = None;
    let lock = lock_status(dir)?;
    update_status_locked(w, dir, |cur| {
        let mut s = cur?;
        if s.state != State::Queued {
            return None;
        }
        s.state = State::Running;
        s.started_at = now;
        // Why it waited is over (PROTOCOL §15); `notBefore` and `after` stay as asked.
        s.set_waiting(None, &[]);
        // timeoutMs 0: no run time limit (config `default_timeout_ms = 0`).
        s.deadline_at = (s.timeout_ms > 0).then(|| now + s.timeout_ms as i64);
        s.pid = Some(pid);
        s.runner = Some(RunnerInfo {
            pid,
            hostname: crate::platform::hostname(),
            start_identity: crate::platform::start_identity(pid),
            process_instance_id: uuid::Uuid::new_v4().to_string(),
            containment: Some(containment.to_string()),
        });
        started = Some(s.clone());
        Some(s)
    })?;
    let path = RunPaths::status(dir);
    let id = (lock.is_some() && w.pending_for(&path).is_none()).then(|| file_id(&path)).flatten();
    drop(lock);
    Ok(started.map(|s| (s, id)))
}

/// End a queued run whose request.json fails validation: `failed`, every step
/// skipped, the reason in `error`, indexes and result published.
pub(super) fn fail_unvalidated(w: &mut Writer, l: &Layout, run_id: &RunId, message: &str) -> anyhow::Result<()> {
    results::fail_queued(w, l, run_id, message, "skipped: request.json fails validation")?;
    while !w.flush() {
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(())
}

pub(super) struct Record {
    layout: Layout,
    /// The run: its directory's name (`dir`'s last component).
    id: RunId,
    dir: PathBuf,
    status: Status,
    w: Writer,
    /// When a running run's status is rewritten next only to refresh
    /// `lastUpdate` (see `HEARTBEAT`).
    next_heartbeat: Instant,
    /// events.jsonl, opened (O_APPEND, not following a link, refusing
    /// anything but a regular file) at the first event and kept. Perf: one
    /// `write` per event instead of five calls.
    events: Option<std::fs::File>,
    /// status.json as this runner last wrote it, under the status lock.
    written: Option<FileId>,
}

impl Record {
    /// The record of a run whose `running` status (`mark_running`) is written.
    pub(super) fn new(layout: Layout, id: RunId, dir: PathBuf, started: Started, w: Writer) -> Record {
        let (status, written) = started;
        Record { layout, id, dir, status, w, next_heartbeat: Instant::now() + heartbeat(), events: None, written }
    }

    pub(super) fn status(&self) -> &Status {
        &self.status
    }

    /// A failed step, or one stopped on its own by a targeted stop request:
    /// either ends a chain, and the run is `failed` unless it was halted.
    pub(super) fn any_failed(&self) -> bool {
        self.status.steps.iter().any(|s| matches!(s.status, StepState::Failed | StepState::Stopped))
    }

    /// Append one event (`store::run::event`'s line) through the kept
    /// descriptor; a failed write drops it and the next event opens the file
    /// again. Events are diagnostics: on a full disk they are dropped and
    /// counted, never retried.
    pub(super) fn ev(&mut self, kind: &str, fields: Value) {
        use std::io::Write as _;
        let mut line = event_line(&self.status.run_id, kind, fields);
        line.push(b'\n');
        let path = RunPaths::events(&self.dir);
        let res = match self.events.as_mut() {
            Some(f) => f.write_all(&line),
            None => fsutil::open_append(&path).and_then(|mut f| {
                f.write_all(&line)?;
                self.events = Some(f);
                Ok(())
            }),
        };
        if let Err(e) = res {
            self.events = None;
            if fsutil::is_capacity(&e) {
                self.w.dropped_event(&e);
            } else {
                tracing::warn!(run_id = %self.id, error = %e, "could not append event {kind} to {}", path.display());
            }
        }
    }

    fn save(&mut self) {
        let res = lock_status(&self.dir).and_then(|lock| self.write_status(lock.is_some()));
        if let Err(e) = res {
            self.write_own_copy(e);
        }
    }

    fn write_own_copy(&mut self, e: std::io::Error) {
        self.written = None;
        tracing::warn!(error = %e, "status read-merge failed; writing the runner's own copy");
        let bytes = serde_json::to_vec_pretty(&self.status).unwrap_or_default();
        let durable = !self.status.state.is_active();
        if let Err(e) = self.w.write(&RunPaths::status(&self.dir), bytes, durable) {
            crate::note!("cannot write status.json: {e}");
        }
    }

    /// Write the run's status holding the status lock (PROTOCOL §4), with
    /// the fields another writer added kept, and never over a terminal
    /// status another writer left (`store::run::update_status`'s rules).
    /// Perf: while status.json is still the file this runner wrote last
    /// (`FileId`), nobody else has written it and there is nothing to merge:
    /// one `statx` instead of reading and parsing it again.
    /// `locked`: the caller holds the status lock (`lock_status` gave it).
    fn write_status(&mut self, locked: bool) -> std::io::Result<()> {
        let path = RunPaths::status(&self.dir);
        let unchanged =
            locked && self.written.is_some() && self.w.pending_for(&path).is_none() && file_id(&path) == self.written;
        if !unchanged {
            self.written = None;
            let base = match self.w.pending_for(&path) {
                Some(b) => serde_json::from_slice::<Status>(b).ok(),
                None => read_status(&self.dir)?,
            };
            if let Some(c) = base {
                if !c.state.is_active() && self.status.state.is_active() {
                    // A terminal state is never changed back to an active one.
                    self.status.last_update = c.last_update;
                    return Ok(());
                }
                for (k, v) in c.extra {
                    self.status.extra.entry(k).or_insert(v);
                }
            }
        }
        self.status.last_update = crate::now_ms().max(self.status.last_update.saturating_add(1));
        let bytes = serde_json::to_vec_pretty(&self.status).map_err(std::io::Error::other)?;
        // Terminal states are durable (PROTOCOL §11); step progress is not.
        self.w.write(&path, bytes, !self.status.state.is_active())?;
        if locked && self.w.pending_for(&path).is_none() {
            self.written = file_id(&path);
        }
        Ok(())
    }

    pub(super) fn run_started(&mut self, pid: u32) {
        let fields = json!({"mode": self.status.mode, "cwd": self.status.cwd, "pid": pid});
        self.ev("subagent.run.started", fields);
    }

    /// pi-subagents 0.67 fails a run whose pid lives but whose lastUpdate is
    /// over 24 h old; a long step must not look stale.
    pub(super) fn heartbeat(&mut self, now: Instant) {
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + heartbeat();
            self.save();
        }
    }

    /// Top-level item `ti` starts (its members are `members`).
    pub(super) fn group_started(&mut self, ti: usize, members: &[usize], parallel: bool) {
        self.status.current_step = ti;
        if parallel {
            let agents: Vec<String> = members.iter().map(|&i| self.status.steps[i].agent.clone()).collect();
            self.ev("subagent.parallel.started", json!({"stepIndex": ti, "agents": agents, "count": members.len()}));
        }
    }

    pub(super) fn group_ended(&mut self, ti: usize, ok: bool, parallel: bool) {
        if parallel {
            self.ev("subagent.parallel.completed", json!({"stepIndex": ti, "success": ok}));
        }
    }

    /// A pending step a stop request named: it never starts.
    pub(super) fn step_skipped(&mut self, i: usize, why: &str) {
        let agent = self.status.steps[i].agent.clone();
        let st = &mut self.status.steps[i];
        st.status = StepState::Stopped;
        st.stopped = Some(true);
        st.exit_code = Some(-1);
        st.duration_ms = Some(0);
        st.error = Some(format!("{why} before it started"));
        self.save();
        self.ev("subagent.step.stopped", json!({"stepIndex": i, "agent": agent, "exitCode": -1, "durationMs": 0}));
    }

    /// Step `i` is being started at `at` (ms): it runs, its output goes to
    /// its log. Kept in memory: the start (or its failure) writes it.
    pub(super) fn step_starting(&mut self, i: usize, at: i64) {
        let out = RunPaths::output(&self.dir, i).display().to_string();
        let st = &mut self.status.steps[i];
        st.status = StepState::Running;
        st.started_at = Some(at);
        st.output_file = Some(out.clone());
        self.status.output_file = Some(out);
    }

    /// Command step `i` started as process (group) `pid`.
    pub(super) fn step_started(&mut self, i: usize, pid: u32) {
        self.status.steps[i].pid = Some(pid);
        self.save();
        let agent = self.status.steps[i].agent.clone();
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
    }

    /// A step that could not start: its reason goes to its log and status,
    /// with `code` as its exit code (and the external job's record, if any).
    pub(super) fn step_unstarted(&mut self, i: usize, code: i32, msg: String, job: Option<Value>) {
        let agent = self.status.steps[i].agent.clone();
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
        let _ = fsutil::append_line(&RunPaths::output(&self.dir, i), format!("runspool: {msg}").as_bytes());
        let st = &mut self.status.steps[i];
        st.status = StepState::Failed;
        st.exit_code = Some(code);
        st.error = Some(msg);
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(0);
        if job.is_some() {
            st.external_job = job.clone();
        }
        self.save();
        if let Some(job) = job {
            self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
        }
        self.ev("subagent.step.failed", json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": 0}));
    }

    /// Command step `i` exited with `code`. With other steps still running
    /// its status is saved now; else the next write (the next step's start,
    /// or the terminal status) carries it. Perf: one write and one inode
    /// fewer per step.
    pub(super) fn step_exited(&mut self, i: usize, end: StepEnd, code: i32, save_now: bool) {
        let dur = end.duration_ms;
        let outcome = classify(end);
        let st = &mut self.status.steps[i];
        outcome.apply(st);
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(dur);
        let agent = st.agent.clone();
        if save_now {
            self.save();
        }
        self.ev(
            &format!("subagent.step.{}", outcome.event_kind()),
            json!({"stepIndex": i, "agent": agent, "exitCode": code, "durationMs": dur}),
        );
    }

    /// External step `i` is dispatched with the job record `job`.
    pub(super) fn external_started(&mut self, i: usize, job: Value) {
        self.status.steps[i].external_job = Some(job.clone());
        self.save();
        let agent = self.status.steps[i].agent.clone();
        self.ev("subagent.step.started", json!({"stepIndex": i, "agent": agent}));
        self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
    }

    /// External step `i`'s job record changed; `line` goes to its log.
    pub(super) fn external_updated(&mut self, i: usize, job: Value, line: Option<String>) {
        if let Some(l) = line {
            let _ = fsutil::append_line(&RunPaths::output(&self.dir, i), format!("runspool: {l}").as_bytes());
        }
        self.status.steps[i].external_job = Some(job.clone());
        self.save();
        self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
    }

    /// External step `i` ended with the job record `job` (and the output file
    /// the job named, which becomes the run's if the step's log was).
    pub(super) fn external_ended(&mut self, i: usize, end: StepEnd, job: Value, output_file: Option<String>) {
        let dur = end.duration_ms;
        if let Some(f) = &output_file {
            if self.status.output_file == self.status.steps[i].output_file {
                self.status.output_file = Some(f.clone());
            }
        }
        let outcome = classify(end);
        let st = &mut self.status.steps[i];
        st.external_job = Some(job.clone());
        if let Some(f) = &output_file {
            st.output_file = Some(f.clone());
        }
        st.ended_at = Some(crate::now_ms());
        st.duration_ms = Some(dur);
        outcome.apply(st);
        let agent = st.agent.clone();
        self.save();
        self.ev("subagent.external_job.updated", json!({"stepIndex": i, "externalJob": job}));
        self.ev(
            &format!("subagent.step.{}", outcome.event_kind()),
            json!({"stepIndex": i, "agent": agent, "exitCode": outcome.exit_code, "durationMs": dur}),
        );
    }

    /// The run's end: terminal events, then the terminal status, indexes and
    /// result; the runner does not exit with any of them unwritten
    /// (PROTOCOL §11).
    pub(super) fn finish(&mut self, halt: Option<Halt>, halt_reason: &str, step_timed_out: bool) {
        let now = crate::now_ms();
        let (state, skip_status, skip_msg) = run_ending(halt, self.any_failed());
        // Skipped steps are not failed ones: the first error is read before they are skipped.
        let error = (state != State::Complete).then(|| match halt {
            Some(_) => halt_reason.to_string(),
            None => first_error(&self.status),
        });
        self.status.end(state.clone(), error, &OpenSteps::skipped(skip_status, skip_msg), now);
        self.status.timed_out = halt == Some(Halt::Timeout) || step_timed_out;
        let duration = now - self.status.started_at;
        match halt {
            Some(Halt::Stop) => self.ev("subagent.run.stopped", json!({"message": halt_reason})),
            Some(Halt::Timeout) => self.ev(
                "subagent.run.timed_out",
                json!({"timeoutMs": self.status.timeout_ms, "deadlineAt": self.status.deadline_at, "message": halt_reason}),
            ),
            Some(Halt::Interrupt) => self.ev("subagent.run.paused", json!({"message": halt_reason})),
            None => {}
        }
        // The event goes first: a reader that sees the terminal status finds the whole story.
        self.ev(
            "subagent.run.completed",
            json!({"status": state.as_str(), "durationMs": duration, "exitCode": self.status.exit_code}),
        );
        // Perf: the terminal status and its publication under one hold of
        // the status lock (the one `results::finish_terminal` would take
        // again), in the same order: status durable (file and directory,
        // docs/durability.md §5 steps 2–3), result, terminal marker, active
        // marker. Anything that did not go through now (a full disk, an
        // error) is published by `finish_terminal`, which is idempotent.
        let published = match lock_status(&self.dir) {
            Ok(lock) => match self.write_status(lock.is_some()) {
                Ok(()) => lock.is_some() && self.w.is_idle() && self.publish(),
                Err(e) => {
                    drop(lock);
                    self.write_own_copy(e);
                    false
                }
            },
            Err(e) => {
                self.write_own_copy(e);
                false
            }
        };
        if !published {
            if let Err(e) = results::finish_terminal(&mut self.w, &self.layout, &self.id, &self.status) {
                crate::note!("publishing the run's indexes and result failed: {e}");
            }
        }
        let mut waited = 0u64;
        while !self.w.flush() {
            if waited.is_multiple_of(60) {
                crate::note!(
                    "storage full: the terminal status is kept in memory and retried every second ({waited} s so far)"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
            waited += 1;
        }
    }
}

impl Record {
    /// Publish the terminal status just written, holding the status lock:
    /// result, terminal marker, then the active marker removed
    /// (`results::finish_terminal`'s work). False when any of it failed.
    fn publish(&self) -> bool {
        let (l, s) = (&self.layout, &self.status);
        results::publish_result(l, &self.id, s)
            .and_then(|()| index::mark_terminal(l, s))
            .and_then(|()| index::unmark_active(l, &self.id, s.tool_call_id.as_deref()))
            .is_ok()
    }
}

fn first_error(s: &Status) -> String {
    s.steps
        .iter()
        .enumerate()
        .find(|(_, st)| matches!(st.status, StepState::Failed | StepState::Stopped) && st.exit_code != Some(-1))
        .map(|(i, st)| format!("step {i} ({}) {}: {}", st.agent, st.status, st.error.clone().unwrap_or_default()))
        .unwrap_or_else(|| "the run failed".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::outcome::Exit;

    /// A queued run `id` under a fresh root, as a claim leaves it.
    fn queued_run(root: &Path, body: Value) -> (Layout, RunId, PathBuf, crate::protocol::request::Request) {
        let l = Layout::new(root);
        let id = RunId::parse("run-record-test").unwrap();
        let dir = l.run_dir(&id);
        for d in l.dirs() {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::create_dir(&dir).unwrap();
        let req: crate::protocol::request::Request = serde_json::from_value(body).unwrap();
        let queued = Status::queued(&req, id.as_str(), &dir, crate::now_ms());
        crate::store::run::update_status(&mut Writer::new(), &dir, |_| Some(queued)).unwrap();
        (l, id, dir, req)
    }

    fn event_types(dir: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(RunPaths::events(dir)).unwrap_or_default();
        text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["type"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn a_run_is_marked_running_once_then_recorded_to_its_terminal_status() {
        let root = tempfile::tempdir().unwrap();
        let cwd = root.path().display().to_string();
        let (l, id, dir, _) =
            queued_run(root.path(), json!({"version": 1, "cwd": cwd, "steps": [{"command": ["true"]}]}));
        let mut w = Writer::new();
        let s = mark_running(&mut w, &dir, 4242, "subreaper").unwrap().expect("a queued run starts");
        let on_disk = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(on_disk.state, State::Running);
        assert_eq!(on_disk.pid, Some(4242));
        assert_eq!(on_disk.runner.as_ref().and_then(|r| r.containment.as_deref()), Some("subreaper"));
        assert!(mark_running(&mut w, &dir, 4243, "subreaper").unwrap().is_none(), "a running run does not start twice");

        let mut r = Record::new(l.clone(), id.clone(), dir.clone(), s, w);
        r.run_started(4242);
        r.group_started(0, &[0], false);
        r.step_starting(0, crate::now_ms());
        r.step_started(0, 777);
        let running = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(running.steps[0].status, StepState::Running);
        assert_eq!(running.steps[0].pid, Some(777));
        let end = StepEnd {
            exit: Exit::Process { code: 0, signal: None },
            timed_out: false,
            halt: None,
            stopped_alone: None,
            duration_ms: 5,
        };
        // The last step's exit is carried by the terminal write.
        r.step_exited(0, end, 0, false);
        assert_eq!(crate::store::run::read_status(&dir).unwrap().unwrap().steps[0].status, StepState::Running);
        r.group_ended(0, true, false);
        r.finish(None, "", false);

        let done = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(done.state, State::Complete);
        assert_eq!(done.steps[0].status, StepState::Complete);
        assert_eq!(done.steps[0].exit_code, Some(0));
        assert!(l.result_file(&id).exists(), "the result is published");
        let terminal = crate::store::index::terminal_marker_path(&l, &done);
        assert!(terminal.exists(), "the terminal index names the run: {}", terminal.display());
        assert_eq!(
            event_types(&dir),
            ["subagent.run.started", "subagent.step.started", "subagent.step.completed", "subagent.run.completed"]
        );
    }

    #[test]
    fn what_another_writer_left_in_the_status_is_kept_and_its_terminal_state_stays() {
        let root = tempfile::tempdir().unwrap();
        let cwd = root.path().display().to_string();
        let body = json!({"version": 1, "cwd": cwd, "steps": [{"command": ["a"]}, {"command": ["b"]}]});
        let (l, id, dir, _) = queued_run(root.path(), body);
        let mut w = Writer::new();
        let s = mark_running(&mut w, &dir, 4242, "subreaper").unwrap().unwrap();
        let mut r = Record::new(l, id, dir.clone(), s, w);
        r.step_starting(0, crate::now_ms());
        r.step_started(0, 777);
        // Another writer (holding the status lock, as PROTOCOL §4 asks) adds a field.
        let other = |f: &dyn Fn(&mut Status)| {
            crate::store::run::update_status(&mut Writer::new(), &dir, |cur| {
                let mut s = cur?;
                f(&mut s);
                Some(s)
            })
            .unwrap();
        };
        other(&|s| {
            s.extra.insert("hostNote".into(), json!("kept"));
        });
        r.step_starting(1, crate::now_ms());
        r.step_started(1, 778);
        let on_disk = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(on_disk.steps[1].pid, Some(778), "the runner's write happened");
        assert_eq!(on_disk.extra.get("hostNote"), Some(&json!("kept")), "the other writer's field is merged");
        // Another host ends the run meanwhile: the runner never makes it active again.
        other(&|s| {
            s.state = State::Failed;
            s.error = Some("ended by another host".into());
        });
        r.heartbeat(Instant::now() + Duration::from_secs(7200));
        let on_disk = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(on_disk.state, State::Failed);
        assert_eq!(on_disk.error.as_deref(), Some("ended by another host"));
    }

    #[test]
    fn a_step_that_cannot_start_and_a_halt_are_recorded_with_their_reasons() {
        let root = tempfile::tempdir().unwrap();
        let cwd = root.path().display().to_string();
        let body = json!({"version": 1, "cwd": cwd, "steps": [{"command": ["a"]}, {"command": ["b"]}]});
        let (l, id, dir, _) = queued_run(root.path(), body);
        let mut w = Writer::new();
        let s = mark_running(&mut w, &dir, 1, "process-group").unwrap().unwrap();
        let mut r = Record::new(l, id, dir.clone(), s, w);
        r.step_starting(0, crate::now_ms());
        r.step_unstarted(0, 127, "cannot start `a`: not found".into(), None);
        assert!(r.any_failed());
        let log = std::fs::read_to_string(RunPaths::output(&dir, 0)).unwrap();
        assert_eq!(log, "runspool: cannot start `a`: not found\n");
        r.finish(Some(Halt::Stop), "stopped by test", false);
        let done = crate::store::run::read_status(&dir).unwrap().unwrap();
        assert_eq!(done.state, State::Stopped);
        assert_eq!(done.error.as_deref(), Some("stopped by test"));
        assert_eq!(done.steps[0].status, StepState::Failed);
        assert_eq!(done.steps[0].exit_code, Some(127));
        assert_eq!(done.steps[1].status, StepState::Stopped, "the step never started is skipped as stopped");
        assert_eq!(
            event_types(&dir),
            ["subagent.step.started", "subagent.step.failed", "subagent.run.stopped", "subagent.run.completed"]
        );
    }
}
