//! The runner fork server (Linux): one `runspool-runner --fork-server`
//! process per daemon, which forks a runner for each run the daemon asks
//! for, so a run's start costs a `fork` of a small, already initialised
//! process instead of an `exec` (program loading, dynamic linking, the C and
//! Rust runtimes' set-up: about 0.2 ms of CPU per run on the machine of
//! docs/performance.md, and the same off the path from claim to `running`).
//!
//! The forked runner is what `runspool-runner <runDir>` would be after its
//! `main` started: the server's environment (the daemon's, scrubbed as for
//! any child), stdio on /dev/null, the run directory as its working
//! directory, no other descriptor, the signal mask and dispositions the
//! program started with, and `runspool-runner <runDir>` as its command line
//! (`ps`, /proc/PID/cmdline, as one string in the way of setproctitle(3);
//! the server reserves the room for it, `ROOM`).
//!
//! The conversation, on a socket pair that is the server's stdin:
//! - the daemon writes a run directory's path and a NUL;
//! - the server opens that directory, forks, and answers `S <serial> <pid>`,
//!   or `E <serial> <errno>` when it could not (`serial` counts requests
//!   from 1, so the daemon can match answers to requests);
//! - when a runner it forked exits, the server reaps it and writes
//!   `X <serial> <wait status>`;
//! - at end of file (the daemon closed its end, stopped or died) the server
//!   exits; its runners live on, re-parented like any orphan, and the next
//!   daemon finds them by their `runner.lock` (PROTOCOL §12).
//!
//! The daemon keeps using a plain exec whenever the server is not usable:
//! not Linux, no sibling `runspool-runner`, a run directory path too long
//! for the command line, the program file replaced since the server started
//! (an upgrade: new runs run the new file), or a server that died or stopped
//! answering.

use std::io::{self, BufRead, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The argument that makes `runspool-runner` a fork server.
pub const FLAG: &str = "--fork-server";

/// Bytes of command line the server reserves (an argument of this many
/// spaces) for each runner's `<program> <runDir>`. A run directory whose
/// command line would not fit is started with an exec instead.
pub const ROOM: usize = 2048;

/// How long the daemon waits for the server's answer to one request before
/// it gives up on the server (a stopped or wedged process).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------- server

/// Serve fork requests on stdin until end of file; `runner` runs in each
/// forked child with the run directory and returns its exit code. Returns
/// the server's own exit code. The caller must be single-threaded (a
/// fresh `runspool-runner` process): a fork copies only the calling thread.
#[cfg(target_os = "linux")]
pub fn serve(runner: fn(&Path) -> i32) -> i32 {
    match Server::new() {
        Ok(mut s) => s.run(runner),
        Err(e) => {
            eprintln!("runspool-runner {FLAG}: cannot start: {e}");
            1
        }
    }
}

#[cfg(target_os = "linux")]
struct Server {
    title: Option<Title>,
    devnull: i32,
    sigchld: i32,
    /// The signal mask the program started with, restored in each runner.
    mask: libc::sigset_t,
    serial: u64,
    /// Live runners: (pid, serial). Not a HashMap: its hash keys would be
    /// drawn here once and inherited by every runner.
    runners: Vec<(i32, u64)>,
}

#[cfg(target_os = "linux")]
impl Server {
    fn new() -> io::Result<Server> {
        // SAFETY: plain system calls on values we own; the sets are initialised before use.
        unsafe {
            let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if devnull < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut mask: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut mask) != 0 {
                return Err(io::Error::last_os_error());
            }
            let sigchld = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if sigchld < 0 {
                return Err(io::Error::last_os_error());
            }
            let title = Title::of_self();
            if let Some(t) = &title {
                // `ps` shows the server as what it is, not the reserved room.
                t.set(&[t.program.as_os_str().as_bytes(), FLAG.as_bytes()]);
            }
            // Our own process group: a terminal's Ctrl-C or hang-up meant for a
            // foreground daemon does not kill the server (the daemon stops it).
            libc::setpgid(0, 0);
            // No run directory is kept busy as our working directory between forks.
            libc::chdir(c"/".as_ptr());
            Ok(Server { title, devnull, sigchld, mask, serial: 0, runners: Vec::new() })
        }
    }

    fn run(&mut self, runner: fn(&Path) -> i32) -> i32 {
        let mut pending: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let mut fds = [
                libc::pollfd { fd: 0, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.sigchld, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: `fds` is a valid array of two pollfd.
            if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return 1;
            }
            if fds[1].revents != 0 && self.reap().is_err() {
                return 0; // the daemon is gone
            }
            if fds[0].revents == 0 {
                continue;
            }
            // SAFETY: reading into a buffer we own, at most its length.
            let n = unsafe { libc::read(0, chunk.as_mut_ptr().cast(), chunk.len()) };
            if n == 0 {
                return 0; // end of file: the daemon closed its end
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) {
                    continue;
                }
                return 0;
            }
            pending.extend_from_slice(&chunk[..n as usize]);
            while let Some(end) = pending.iter().position(|&b| b == 0) {
                let dir: Vec<u8> = pending.drain(..=end).take(end).collect();
                self.serial += 1;
                let answer = match self.fork(&dir, runner) {
                    Ok(pid) => format!("S {} {pid}\n", self.serial),
                    Err(e) => format!("E {} {}\n", self.serial, e.raw_os_error().unwrap_or(libc::EIO)),
                };
                if write_all(answer.as_bytes()).is_err() {
                    return 0;
                }
            }
        }
    }

    /// Fork a runner for `dir`. Returns its pid in the server; never returns in the runner.
    fn fork(&mut self, dir: &[u8], runner: fn(&Path) -> i32) -> io::Result<i32> {
        let path = std::ffi::CString::new(dir).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // The runner's working directory, entered before the fork as an
        // exec'd runner's would be: a failure is the answer, not a runner
        // that exits at once.
        // SAFETY: chdir(2) of a NUL-terminated path.
        if unsafe { libc::chdir(path.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: this process is single-threaded (`serve`), so the child may run any code.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The runner: the state an exec'd `runspool-runner <dir>` would start in.
            // SAFETY: plain system calls on descriptors and a mask we own.
            unsafe {
                libc::pthread_sigmask(libc::SIG_SETMASK, &self.mask, std::ptr::null_mut());
                libc::close(self.sigchld);
                // Stdio on /dev/null until the runner opens its logs; the
                // socket to the daemon (stdin) is closed with it.
                for fd in 0..3 {
                    libc::dup2(self.devnull, fd);
                }
                libc::close(self.devnull);
            }
            if let Some(t) = &self.title {
                t.set(&[t.program.as_os_str().as_bytes(), dir]);
            }
            let code = runner(Path::new(std::ffi::OsStr::from_bytes(dir)));
            std::process::exit(code);
        }
        let err = io::Error::last_os_error();
        // SAFETY: chdir(2) of a static path.
        unsafe { libc::chdir(c"/".as_ptr()) };
        if pid < 0 {
            return Err(err);
        }
        self.runners.push((pid, self.serial));
        Ok(pid)
    }

    /// Reap every runner that exited and tell the daemon.
    fn reap(&mut self) -> io::Result<()> {
        let mut info = [0u8; 128]; // struct signalfd_siginfo
                                   // SAFETY: draining the signalfd into a buffer of its record size.
        while unsafe { libc::read(self.sigchld, info.as_mut_ptr().cast(), info.len()) } > 0 {}
        loop {
            let mut status = 0;
            // SAFETY: waitpid(2) writes into `status`.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                return Ok(());
            }
            if let Some(i) = self.runners.iter().position(|r| r.0 == pid) {
                let (_, serial) = self.runners.swap_remove(i);
                write_all(format!("X {serial} {status}\n").as_bytes())?;
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn write_all(mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: writing from a buffer we own, at most its length.
        let n = unsafe { libc::write(0, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// The memory of this process's command line (/proc/self/stat's
/// `arg_start` and `arg_end`), rewritten in place as setproctitle(3) does.
#[cfg(target_os = "linux")]
struct Title {
    start: usize,
    end: usize,
    program: PathBuf,
}

#[cfg(target_os = "linux")]
impl Title {
    fn of_self() -> Option<Title> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name (which may hold spaces) start at field 3.
        let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
        let start: usize = fields.get(48 - 3)?.parse().ok()?;
        let end: usize = fields.get(49 - 3)?.parse().ok()?;
        let program = PathBuf::from(std::env::args_os().next()?);
        (end > start).then_some(Title { start, end, program })
    }

    /// Show `parts`, joined by spaces, as the command line. As with
    /// setproctitle(3), the last byte of the area is not NUL, so the kernel
    /// reports the area up to the first NUL: one string, with no trace of
    /// the reserved room. Nothing is written when the parts do not fit.
    fn set(&self, parts: &[&[u8]]) {
        let text = parts.join(&b' ');
        let room = self.end - self.start;
        if text.len() + 2 > room {
            return;
        }
        // SAFETY: [start, end) is this process's argument area, which the
        // kernel placed on the main stack, and text, its NUL and the last
        // byte fit in it. std keeps pointers to the argument strings for
        // `std::env::args`, which from now on reads the new text: the server
        // and the runner read their arguments before this call, never after.
        unsafe {
            let at = self.start as *mut u8;
            std::ptr::copy_nonoverlapping(text.as_ptr(), at, text.len());
            std::ptr::write_bytes(at.add(text.len()), 0, room - text.len() - 1);
            *at.add(room - 1) = b' ';
        }
    }
}

// ---------------------------------------------------------------- daemon side

/// A runner the server forked: `serial` names it in the server's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forked {
    pub serial: u64,
    pub pid: u32,
}

enum Answer {
    Started(Forked),
    Failed(u64, i32),
}

/// The daemon's handle on its fork server.
pub struct Client {
    sock: std::os::unix::net::UnixStream,
    server: Child,
    answers: Receiver<Answer>,
    exits: Arc<Mutex<Vec<(u64, ExitStatus)>>>,
    dead: Arc<AtomicBool>,
    sent: u64,
    program: PathBuf,
    /// The program file the server runs (device, inode): a replaced file means a new server.
    file: (u64, u64),
}

/// Why the server did not fork a runner.
#[derive(Debug)]
pub enum StartError {
    /// The server's fork or open failed with this error (EAGAIN, ENOMEM, ENOENT...).
    Os(io::Error),
    /// The server is gone or does not answer; it is not used again.
    Server(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Os(e) => write!(f, "{e}"),
            StartError::Server(why) => f.write_str(why),
        }
    }
}

impl Client {
    /// Start a fork server from `program` (`runspool-runner`). `wake` is
    /// called from the client's reader thread when a runner exits or the
    /// server is gone.
    pub fn spawn(program: &Path, wake: Box<dyn Fn() + Send>) -> io::Result<Client> {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(program)?;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let reader = ours.try_clone()?;
        let mut cmd = super::exec::command(program, super::exec::Detach::default());
        cmd.arg(FLAG).arg(" ".repeat(ROOM));
        // stderr: the daemon's, so the server's own messages reach its log;
        // each runner gets /dev/null as stdio until it opens its logs.
        cmd.stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs))).stdout(Stdio::null()).stderr(Stdio::inherit());
        let mut server = cmd.spawn()?;
        let (tx, answers) = channel();
        let exits = Arc::new(Mutex::new(Vec::new()));
        let dead = Arc::new(AtomicBool::new(false));
        let (exits2, dead2) = (exits.clone(), dead.clone());
        let thread = std::thread::Builder::new().name("fork-server".into()).spawn(move || {
            for line in io::BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                let mut f = line.split(' ');
                let (kind, serial, value) = (f.next(), f.next().and_then(|s| s.parse().ok()), f.next());
                match (kind, serial, value.and_then(|v| v.parse::<i64>().ok())) {
                    (Some("S"), Some(serial), Some(pid)) if pid > 0 && pid <= i32::MAX as i64 => {
                        let _ = tx.send(Answer::Started(Forked { serial, pid: pid as u32 }));
                    }
                    (Some("E"), Some(serial), Some(errno)) => {
                        let _ = tx.send(Answer::Failed(serial, errno as i32));
                    }
                    (Some("X"), Some(serial), Some(status)) => {
                        if let Ok(mut v) = exits2.lock() {
                            v.push((serial, ExitStatus::from_raw(status as i32)));
                        }
                        wake();
                    }
                    _ => break, // not our server's language: stop using it
                }
            }
            dead2.store(true, Ordering::SeqCst);
            wake();
        });
        if let Err(e) = thread {
            let _ = server.kill();
            let _ = server.wait();
            return Err(e);
        }
        Ok(Client {
            sock: ours,
            server,
            answers,
            exits,
            dead,
            sent: 0,
            program: program.to_path_buf(),
            file: (md.dev(), md.ino()),
        })
    }

    /// Is this server still the way to start `program`? Not when it died,
    /// or when `program` is no longer the file it runs (an upgrade).
    pub fn is_current(&self, program: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        !self.is_dead()
            && program == self.program
            && std::fs::metadata(program).is_ok_and(|m| (m.dev(), m.ino()) == self.file)
    }

    /// Does the command line `<program> <dir>` fit in the room the server reserved?
    pub fn fits(&self, dir: &Path) -> bool {
        self.program.as_os_str().len() + dir.as_os_str().len() + 3 <= ROOM
    }

    /// Is the server gone (its runners are no longer reported)?
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Fork a runner for `dir` (an absolute path).
    pub fn start(&mut self, dir: &Path) -> Result<Forked, StartError> {
        let mut msg = dir.as_os_str().as_bytes().to_vec();
        if msg.contains(&0) {
            return Err(StartError::Os(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        msg.push(0);
        if let Err(e) = self.sock.write_all(&msg) {
            return Err(self.give_up(format!("could not be written to: {e}")));
        }
        self.sent += 1;
        match self.answers.recv_timeout(ANSWER_TIMEOUT) {
            Ok(Answer::Started(f)) if f.serial == self.sent => Ok(f),
            Ok(Answer::Failed(serial, errno)) if serial == self.sent => {
                Err(StartError::Os(io::Error::from_raw_os_error(errno)))
            }
            Ok(_) => Err(self.give_up("answered out of turn".into())),
            Err(RecvTimeoutError::Timeout) => Err(self.give_up(format!("did not answer within {ANSWER_TIMEOUT:?}"))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(self.give_up("exited, or wrote what a fork server does not write".into()))
            }
        }
    }

    /// The runners that exited since the last call, by serial.
    pub fn take_exits(&self) -> Vec<(u64, ExitStatus)> {
        self.exits.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }

    /// Is the server stopped (SIGSTOP, a debugger)? It then reports no exit,
    /// and the slots of its runners would never free.
    pub fn is_stopped(&self) -> bool {
        super::procs::stat(self.server.id()).is_some_and(|s| matches!(s.state, 'T' | 't'))
    }

    /// Stop using the server: kill it (its runners live on, in their own sessions).
    pub fn give_up(&mut self, why: String) -> StartError {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.server.kill();
        let _ = self.server.wait();
        StartError::Server(format!(
            "the runner fork server `{} {FLAG}` (pid {}) {why}",
            self.program.display(),
            self.server.id()
        ))
    }
}

impl Drop for Client {
    /// Close our end: the server exits at end of file, its runners live on.
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        for _ in 0..100 {
            if !matches!(self.server.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}
