//! The one child supervisor: every process runspool starts and must bound
//! (a run's steps, the daemon's hooks, the providers' commands) is spawned
//! here in a process group of its own, reaped with a non-blocking
//! `try_wait` from its owner's poll loop, and stopped by one ladder of
//! signals to its whole group (`Ladder`: a signal, a grace, the next).
//! `signal_group` is the only place runspool signals a process group; the
//! subreaper that lets the runner find what escaped its steps is here too.
//!
//! Written here rather than taken from `process-wrap`: it brings a second
//! `nix`, has no subreaper and no ladder, and its group `try_wait` reaps
//! every member of the group, which races the runner's own reaping of what
//! it adopted (docs/design.md, "The child supervisor", has the numbers).

use std::io;
use std::os::unix::process::CommandExt as _;
use std::process::{ChildStdin, Command, ExitStatus};
use std::time::{Duration, Instant};

pub use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Send `sig` to process group `pgid`: the one spelling of a group signal.
/// A pgid of 0 or 1 (the caller's own group, or every process) is refused.
/// False when nothing was signalled (the group is gone, or not ours).
pub fn signal_group(pgid: u32, sig: Signal) -> bool {
    if pgid <= 1 || pgid > i32::MAX as u32 {
        return false;
    }
    nix::sys::signal::killpg(Pid::from_raw(pgid as i32), sig).is_ok()
}

/// Make this process a child subreaper (`PR_SET_CHILD_SUBREAPER`): orphans
/// among its descendants (a `setsid`'d or double-forked grandchild whose
/// parent exited) are re-parented to it instead of to init, so it can find
/// and kill them. False where the platform has no such thing.
pub fn become_subreaper() -> bool {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) == 0 }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        false
    }
}

/// Reap `pid` (a process a subreaper adopted) if it has exited. True when it
/// is gone: reaped now, or not our child.
pub fn reap_adopted(pid: u32) -> bool {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    match waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) => false,
        Ok(_) => true,
        Err(_) => true,
    }
}

/// How a child is stopped: each rung's signal, then the grace before the
/// next rung. The last rung has no grace: nothing comes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ladder(&'static [(Signal, Duration)]);

impl Ladder {
    /// SIGTERM, then SIGKILL 3 s later: a stop, a timeout.
    pub const STOP: Ladder = Ladder(&[(Signal::SIGTERM, Duration::from_secs(3)), (Signal::SIGKILL, Duration::ZERO)]);
    /// SIGINT, SIGTERM 1 s later, SIGKILL 3 s after that: an interrupt.
    pub const INTERRUPT: Ladder = Ladder(&[
        (Signal::SIGINT, Duration::from_secs(1)),
        (Signal::SIGTERM, Duration::from_secs(3)),
        (Signal::SIGKILL, Duration::ZERO),
    ]);
    /// SIGKILL at once: a command with nothing to save.
    pub const KILL: Ladder = Ladder(&[(Signal::SIGKILL, Duration::ZERO)]);
}

/// When a child is due which signal: its own deadline (which starts the
/// `on_timeout` ladder) and the ladder under way. Knows nothing of what is
/// signalled, so a step that is not a process (an external job) climbs the
/// same ladder as one that is.
#[derive(Debug)]
pub struct Schedule {
    deadline: Option<Instant>,
    on_timeout: Ladder,
    /// The ladder under way, its next rung and when that is due.
    climbing: Option<(Ladder, usize, Instant)>,
    timed_out: bool,
}

impl Schedule {
    pub fn new(deadline: Option<Instant>, on_timeout: Ladder) -> Schedule {
        Schedule { deadline, on_timeout, climbing: None, timed_out: false }
    }

    /// Start `ladder` from its first rung (replacing one under way): the
    /// signal to send now.
    pub fn start(&mut self, ladder: Ladder, now: Instant) -> Signal {
        let (sig, grace) = ladder.0[0];
        self.climbing = (ladder.0.len() > 1).then(|| (ladder, 1, now + grace));
        sig
    }

    /// The signal due at `now`, if any: the deadline passing (once; it
    /// starts the timeout ladder over whatever was under way), or the next
    /// rung of the ladder under way.
    pub fn due(&mut self, now: Instant) -> Option<Signal> {
        if self.deadline.is_some_and(|d| now >= d) {
            self.deadline = None;
            self.timed_out = true;
            return Some(self.start(self.on_timeout, now));
        }
        let (ladder, rung, at) = self.climbing?;
        if now < at {
            return None;
        }
        let (sig, grace) = ladder.0[rung];
        self.climbing = (rung + 1 < ladder.0.len()).then(|| (ladder, rung + 1, now + grace));
        Some(sig)
    }

    /// When `due` has something next.
    pub fn next_wake(&self) -> Option<Instant> {
        [self.deadline, self.climbing.map(|c| c.2)].into_iter().flatten().min()
    }

    /// The deadline passed (the timeout ladder was started).
    pub fn timed_out(&self) -> bool {
        self.timed_out
    }
}

/// A child in a process group of its own, with its `Schedule`. Signals go
/// to the whole group; the owner polls `try_wait` and calls `tick`.
#[derive(Debug)]
pub struct Child {
    inner: std::process::Child,
    schedule: Schedule,
}

impl Child {
    /// Spawn `cmd` as the leader of a new process group. At `deadline` the
    /// group climbs `on_timeout` (as `tick`s come).
    pub fn spawn(cmd: &mut Command, deadline: Option<Instant>, on_timeout: Ladder) -> io::Result<Child> {
        // std sets the group with posix_spawn's SETPGROUP where it can: no fork, no pre_exec.
        cmd.process_group(0);
        let inner = cmd.spawn()?;
        Ok(Child { inner, schedule: Schedule::new(deadline, on_timeout) })
    }

    /// The leader's pid, which is the group's id.
    pub fn id(&self) -> u32 {
        self.inner.id()
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.inner.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.inner.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.inner.stderr.take()
    }

    /// Has the leader exited? Reaps it if so; never blocks.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.inner.try_wait()
    }

    /// Wait for the leader (after `kill`, or for a child known to end).
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        self.inner.wait()
    }

    /// Signal the group.
    pub fn signal(&self, sig: Signal) -> bool {
        signal_group(self.id(), sig)
    }

    /// SIGKILL the group: what is left of it once its leader is gone, or all of it.
    pub fn kill(&self) {
        self.signal(Signal::SIGKILL);
    }

    /// Start stopping the group by `ladder` (its first signal goes now).
    pub fn stop(&mut self, ladder: Ladder, now: Instant) {
        let sig = self.schedule.start(ladder, now);
        self.signal(sig);
    }

    /// Send whatever signal is due at `now` (the deadline, the next rung).
    pub fn tick(&mut self, now: Instant) {
        if let Some(sig) = self.schedule.due(now) {
            self.signal(sig);
        }
    }

    pub fn next_wake(&self) -> Option<Instant> {
        self.schedule.next_wake()
    }

    pub fn timed_out(&self) -> bool {
        self.schedule.timed_out()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    /// Poll like an owner's loop until the leader exits.
    fn run_out(c: &mut Child) -> ExitStatus {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < until, "the child never ended");
            c.tick(Instant::now());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn ladders_climb_rung_by_rung_and_the_deadline_fires_once() {
        let t0 = Instant::now();
        let mut s = Schedule::new(Some(t0 + Duration::from_secs(10)), Ladder::STOP);
        assert_eq!(s.next_wake(), Some(t0 + Duration::from_secs(10)));
        assert_eq!(s.start(Ladder::INTERRUPT, t0), Signal::SIGINT);
        assert_eq!(s.due(t0 + Duration::from_millis(999)), None);
        assert_eq!(s.due(t0 + Duration::from_secs(1)), Some(Signal::SIGTERM));
        assert_eq!(s.next_wake(), Some(t0 + Duration::from_secs(4)));
        assert_eq!(s.due(t0 + Duration::from_secs(4)), Some(Signal::SIGKILL));
        assert_eq!(s.due(t0 + Duration::from_secs(5)), None, "nothing after SIGKILL");
        assert!(!s.timed_out());
        // The deadline starts the timeout ladder, once.
        assert_eq!(s.due(t0 + Duration::from_secs(10)), Some(Signal::SIGTERM));
        assert!(s.timed_out());
        assert_eq!(s.due(t0 + Duration::from_secs(11)), None);
        assert_eq!(s.due(t0 + Duration::from_secs(13)), Some(Signal::SIGKILL));
        assert_eq!(s.next_wake(), None);
        let mut k = Schedule::new(None, Ladder::KILL);
        assert_eq!(k.start(Ladder::KILL, t0), Signal::SIGKILL);
        assert_eq!(k.next_wake(), None);
    }

    #[test]
    fn a_child_leads_its_own_group_and_a_timeout_takes_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("bg");
        // A background member of the group that would outlive its leader, and a leader that ignores SIGTERM.
        let script = format!("sleep 60 & echo $! > {}; trap '' TERM; sleep 60", pidfile.display());
        let deadline = Instant::now() + Duration::from_millis(300);
        let mut c = Child::spawn(&mut sh(&script), Some(deadline), Ladder::STOP).unwrap();
        assert_eq!(crate::platform::procs::stat(c.id()).map(|s| s.pgrp), Some(c.id()), "its own group");
        let st = run_out(&mut c);
        assert!(c.timed_out());
        assert_eq!(st.signal(), Some(libc::SIGKILL), "SIGTERM was ignored, SIGKILL was not: {st:?}");
        let bg: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        // The background member got the same signals (its parent reaps it, or init does).
        let until = Instant::now() + Duration::from_secs(30);
        while crate::platform::procs::stat(bg as u32).is_some_and(|s| s.state != 'Z') {
            assert!(Instant::now() < until, "the group's other member survived the ladder");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_child_that_ends_in_time_is_not_signalled() {
        let mut c =
            Child::spawn(&mut sh("exit 3"), Some(Instant::now() + Duration::from_secs(60)), Ladder::KILL).unwrap();
        assert_eq!(run_out(&mut c).code(), Some(3));
        assert!(!c.timed_out());
        assert!(!signal_group(0, Signal::SIGKILL) && !signal_group(1, Signal::SIGKILL), "never our own group or all");
    }
}
