//! The client core: everything a program needs to drive runspool through its
//! files (PROTOCOL.md), and what the `runspool` CLI itself is built on.
//!
//! A [`Client`] is bound to one root. It publishes launch requests
//! ([`Client::submit`], both ways of PROTOCOL §2.1), resolves what a run
//! argument names ([`Client::resolve`]), tells at which [`Stage`] a run is
//! ([`Client::status`]), waits for its end ([`Client::wait`]), follows its
//! steps' output ([`Client::follow`]), stops it or withdraws the request
//! ([`Client::stop`]), lists runs ([`Client::list`]) and streams every run's
//! events ([`Client::events`]).
//!
//! A request is a run from the moment `submit` returns: every call that
//! takes a run handles each stage it can be at (pending in the spool,
//! claimed without its status yet, queued, running, ended, rejected or
//! withdrawn), whatever the daemon's watch strategy; none of them fails
//! because the daemon has not got to the request yet.
//!
//! Nothing here talks to the daemon: it reads and writes the same files any
//! client in any language could, with the same rules (`store`).
//!
//! ```no_run
//! use std::time::Duration;
//! use runspool::client::Client;
//!
//! let client = Client::new(None); // the root of PROTOCOL §1
//! let id = client.submit_argv(&["make", "test"])?;
//! match client.wait(id.as_str(), Some(Duration::from_secs(600))) {
//!     Ok(status) => println!("{id} ended {} (exit {:?})", status.state, status.exit_code),
//!     Err(e) => eprintln!("{id}: {e}"),
//! }
//! # Ok::<(), anyhow::Error>(())
//! ```

mod env;
mod events;
mod follow;
mod target;

pub use env::{
    capture_env, merge_env, parse_env_arg, parse_env_file, parse_env_text, valid_env_name, Captured, MAX_ENV_ENTRIES,
};
pub use events::{Event, Events};
pub use follow::{Follow, Lines, Output};
pub use target::{
    await_claim, daemon_running, error_file, pending_names, pending_request, read_error, resolve, short_ids, Pending,
    Target,
};

use std::io::Write as _;
use std::ops::ControlFlow;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::protocol::daemon::DaemonStatus;
use crate::protocol::request;
use crate::protocol::status::{State, Status};
use crate::store::layout::RunPaths;
use crate::store::spool::withdraw::{self as spool_withdraw, Withdrawal};
use crate::store::{fsutil, index, run, Layout, RunId};

/// A client of one runspool root.
#[derive(Debug, Clone)]
pub struct Client {
    layout: Layout,
}

/// How a request is made to appear complete in the spool (PROTOCOL §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Publish {
    /// Write `spool/.<anything>`, then rename it to `spool/<name>.json`
    /// without replacing anything (the default).
    #[default]
    Rename,
    /// Create `spool/<name>.json` and hold an exclusive `flock` on it from
    /// before the first byte until the last byte is written.
    Flock,
}

/// A request published in the spool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    /// The run id it gets when claimed (its `runId`).
    pub run_id: RunId,
    /// Its file name in the spool, `<runId>.json`.
    pub name: String,
    /// When it was published, ms since the epoch.
    pub at_ms: i64,
}

impl Submitted {
    /// What the request is right after its publication: a pending request,
    /// to hand to [`Client::wait_for`] so that a rejection is seen even
    /// before (or without) a run directory.
    pub fn target(&self) -> Target {
        Target::Pending(Pending { run_id: self.run_id.clone(), name: self.name.clone(), since_ms: self.at_ms })
    }
}

/// Where a run is, from the moment its request is published.
#[derive(Debug, Clone)]
pub enum Stage {
    /// Waiting in the spool to be claimed.
    Pending(Pending),
    /// Claimed (its request is in its run directory) but its status.json is
    /// not written yet; the daemon writes it next, or at its next start.
    Claimed(RunId),
    /// Claimed and waiting for a free slot.
    Queued(Box<Status>),
    /// Its runner is at work.
    Running(Box<Status>),
    /// Ended: the status in a terminal state (`complete`, `failed`,
    /// `stopped`, `paused`, and `rejected` for a request refused, or
    /// withdrawn, with a run id of its own).
    Ended(Box<Status>),
    /// Refused before any run directory existed.
    Rejected(Refusal),
    /// Withdrawn (`runspool stop` of a pending request) before any run
    /// directory existed.
    Withdrawn(Refusal),
}

impl Stage {
    /// The status, once there is one.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Stage::Queued(s) | Stage::Running(s) | Stage::Ended(s) => Some(s),
            _ => None,
        }
    }

    /// Has it come to an end (ended, rejected or withdrawn)?
    pub fn is_final(&self) -> bool {
        matches!(self, Stage::Ended(_) | Stage::Rejected(_) | Stage::Withdrawn(_))
    }

    /// A word for the stage: `pending`, `claimed`, the status's state, `rejected` or `withdrawn`.
    pub fn name(&self) -> &str {
        match self {
            Stage::Pending(_) => "pending",
            Stage::Claimed(_) => "claimed",
            Stage::Queued(s) | Stage::Running(s) | Stage::Ended(s) => s.state.as_str(),
            Stage::Rejected(_) => "rejected",
            Stage::Withdrawn(_) => "withdrawn",
        }
    }
}

/// A request refused or withdrawn, as its error file in `spool/rejected/`
/// says (PROTOCOL §2.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Its file name in the spool.
    pub name: String,
    /// The rejection code (`invalid-field`, `withdrawn`, ...).
    pub code: String,
    /// Why, in the daemon's (or the withdrawing client's) words.
    pub message: String,
    /// The file that says more: its error file, or for a `rejected` run
    /// published under another name, its status.json.
    pub error_file: PathBuf,
}

impl Refusal {
    fn read(name: &str, error_file: PathBuf) -> Refusal {
        let (code, message) = read_error(&error_file);
        Refusal { name: name.to_string(), code, message, error_file }
    }

    fn into_stage(self) -> Stage {
        if self.code == WITHDRAWN {
            Stage::Withdrawn(self)
        } else {
            Stage::Rejected(self)
        }
    }
}

const WITHDRAWN: &str = "withdrawn";

/// Why [`Client::wait`] (or [`Client::follow`]) returned without a run that ended.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The timeout passed first; the run (or the request) goes on. `stage`:
    /// where it was then.
    #[error("gave up waiting for {run} after {:?}; it is still {} (it goes on)", .after, .stage.name())]
    Timeout {
        /// The run waited on.
        run: String,
        /// How long the wait lasted.
        after: Duration,
        /// Where the run was when the wait gave up.
        stage: Box<Stage>,
    },
    /// The request was refused (`status`: its `rejected` run, when it has one).
    #[error("the request was rejected ({}): {} (see {})", .refusal.code, .refusal.message, .refusal.error_file.display())]
    Rejected {
        /// Its code and message, and where they are.
        refusal: Refusal,
        /// Its `rejected` run's status, when it has a run.
        status: Option<Box<Status>>,
    },
    /// The request was withdrawn before it was claimed (`status`: its
    /// `rejected` run, when it has one).
    #[error("the request was withdrawn before it ran: {} (see {})", .refusal.message, .refusal.error_file.display())]
    Withdrawn {
        /// The withdrawal's message, and where it is.
        refusal: Refusal,
        /// Its `rejected` run's status, when it has a run.
        status: Option<Box<Status>>,
    },
    /// The caller's observer asked to stop waiting.
    #[error("stopped waiting for {run}; it goes on")]
    Cancelled {
        /// The run waited on.
        run: String,
    },
    /// Anything else: no such run, an unreadable status, ...
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// What [`Client::stop`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// A stop (or interrupt) request is in the run's control inbox: its
    /// runner (or the daemon, while the run is queued) acts on it, and the
    /// run ends `stopped` (`paused` for an interrupt).
    Requested {
        /// The run asked.
        run_id: RunId,
        /// The request written into its control inbox.
        request: PathBuf,
    },
    /// The request was withdrawn from the spool before any daemon claimed
    /// it: it never runs.
    Withdrawn(Withdrawn),
}

/// A request withdrawn from the spool ([`Client::withdraw`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withdrawn {
    /// The run id it would have had.
    pub run_id: RunId,
    /// Where the request is now, in `spool/rejected/` (None: withdrawn by
    /// someone else, see `error_file`).
    pub entry: Option<PathBuf>,
    /// Its error file (code `withdrawn`) in `spool/rejected/`.
    pub error_file: PathBuf,
    /// Why its error file or `rejected` run is not written yet (a full
    /// disk): the daemon finishes it.
    pub unfinished: Option<String>,
}

/// What [`Client::withdraw`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WithdrawOutcome {
    /// Withdrawn: it never runs.
    Withdrawn(Withdrawn),
    /// The daemon claimed it first: this run exists (stop it instead).
    ClaimedFirst(RunId),
}

/// Which runs [`Client::list`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only active (queued or running) runs and pending requests.
    pub active_only: bool,
    /// The active runs and pending requests, then the N most recent
    /// terminal runs; None: N is `DEFAULT_RECENT`.
    pub recent: Option<usize>,
    /// Only runs of this session.
    pub session: Option<String>,
    /// Only runs and requests of this lane (PROTOCOL §15; none: `default`).
    pub lane: Option<String>,
}

/// The runs [`Client::list`] found, from the indexes (PROTOCOL §6).
#[derive(Debug)]
pub struct Listing {
    /// Active runs (oldest claim first), then terminal runs (newest first).
    pub runs: Vec<index::Listed>,
    /// Requests still in the spool (oldest first): runs from the moment
    /// they are published, in state `pending` until a daemon claims them.
    pub pending: Vec<Pending>,
    /// True when older terminal runs were left out.
    pub capped: bool,
}

/// How many finished runs [`Client::list`] returns without `recent`.
pub const DEFAULT_RECENT: usize = 20;

struct AnyProvider;
impl request::Context for AnyProvider {
    // The daemon knows its providers; the client checks everything else early.
    fn provider_configured(&self, _: &str) -> bool {
        true
    }
}

impl Client {
    /// A client of the root `root`, else the root of PROTOCOL §1
    /// (`$RUNSPOOL_ROOT`, `$PI_SUBAGENTS_TEMP_ROOT`, or
    /// `$TMPDIR/pi-subagents-uid-<uid>`). Nothing is read or created yet.
    pub fn new(root: Option<PathBuf>) -> Client {
        Client { layout: Layout::resolve(root.as_deref(), None) }
    }

    /// A client of the root `layout` describes.
    pub fn from_layout(layout: Layout) -> Client {
        Client { layout }
    }

    /// The paths under the root.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.layout.root
    }

    /// Does a daemon hold the root's lock (`runspool/daemon.lock`)?
    pub fn daemon_running(&self) -> bool {
        daemon_running(&self.layout)
    }

    /// daemon.json as the last daemon wrote it (PROTOCOL §10), read bounded
    /// and never through a link; None when there is none or it does not
    /// parse. See [`Client::daemon_running`] for whether that daemon still runs.
    pub fn daemon_report(&self) -> Option<DaemonStatus> {
        crate::store::daemon_json::read(&self.layout)
    }

    /// Publish a request (a JSON object, PROTOCOL §2.2), adding a new UUID
    /// `runId` when it has none; returns its run id. It is checked as the
    /// daemon would first (every rule but the providers it has configured):
    /// a request the daemon would reject is refused here with the same words.
    pub fn submit(&self, request: &Value) -> anyhow::Result<RunId> {
        let mut v = request.clone();
        let obj = v.as_object_mut().context("a request must be a JSON object")?;
        let run_id = match obj.get("runId") {
            Some(Value::String(id)) => id.clone(),
            Some(other) => bail!("the request's runId must be a string, not {other}"),
            None => {
                let id = uuid::Uuid::new_v4().to_string();
                obj.insert("runId".into(), json!(id));
                id
            }
        };
        let bytes = serde_json::to_vec_pretty(&v)?;
        Ok(self.publish(&bytes, &run_id, Publish::Rename)?.run_id)
    }

    /// Publish a one-step request running `argv` in the current directory;
    /// returns its run id.
    pub fn submit_argv<S: AsRef<str>>(&self, argv: &[S]) -> anyhow::Result<RunId> {
        let argv: Vec<&str> = argv.iter().map(AsRef::as_ref).collect();
        if argv.is_empty() {
            bail!("nothing to run: the command needs at least its program name");
        }
        let cwd = std::env::current_dir().context("cannot read the current directory")?;
        self.submit(&json!({"version": 1, "cwd": cwd.display().to_string(), "steps": [{"command": argv}]}))
    }

    /// Check the request `bytes` as the daemon would and publish them as
    /// `spool/<run_id>.json`, never replacing a file there, the way `how`
    /// says. The body's `runId` should be `run_id` (the file's name only
    /// names the request).
    pub fn publish(&self, bytes: &[u8], run_id: &str, how: Publish) -> anyhow::Result<Submitted> {
        let value = request::parse(bytes).map_err(|r| anyhow::anyhow!("{}", r.message))?;
        if let Err(r) = request::validate(bytes, &value, &AnyProvider) {
            bail!("the request would be rejected ({}): {}", r.code, r.message);
        }
        let id = RunId::parse(run_id)
            .with_context(|| format!("run id `{run_id}` is not in the run-id grammar [A-Za-z0-9][A-Za-z0-9._-]*"))?;
        // Refused by the daemon, a request there would never be claimed: say so with its words.
        crate::store::safety::check_layout(&self.layout)?;
        let spool = self.layout.spool();
        fsutil::mkdir_private_all(&spool).with_context(|| format!("cannot create {}", spool.display()))?;
        let name = format!("{run_id}.json");
        let target = spool.join(&name);
        if std::fs::symlink_metadata(&target).is_ok() {
            bail!("{} already exists: a request with run id `{run_id}` is waiting to be claimed", target.display());
        }
        match how {
            Publish::Rename => {
                let tmp = spool.join(format!(".submit-{}.tmp", uuid::Uuid::new_v4()));
                fsutil::write_atomic(&tmp, bytes, true).with_context(|| format!("cannot write {}", tmp.display()))?;
                if let Err(e) = crate::platform::rename_noreplace(&tmp, &target) {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(e).with_context(|| format!("cannot publish {}", target.display()));
                }
            }
            Publish::Flock => publish_locked(&target, bytes)?,
        }
        Ok(Submitted { run_id: id, name, at_ms: crate::now_ms() })
    }

    /// What `arg` names: a run id (of any length), a pending request's run
    /// id or spool file name, or a unique prefix of 8 or more characters of
    /// either kind of run id. An error says there is none, or that the
    /// prefix is ambiguous (naming the matches).
    pub fn resolve(&self, arg: &str) -> anyhow::Result<Target> {
        resolve(&self.layout, arg)
    }

    /// Where the run `arg` names is now ([`Client::resolve`], then [`Client::stage`]).
    pub fn status(&self, arg: &str) -> anyhow::Result<Stage> {
        self.stage(&self.resolve(arg)?)
    }

    /// Where `target` is now. A pending request claimed meanwhile is
    /// reported at its run's stage, never as missing.
    pub fn stage(&self, target: &Target) -> anyhow::Result<Stage> {
        match target {
            Target::Run(id) => self.run_stage(id),
            Target::Pending(p) => {
                if std::fs::symlink_metadata(self.layout.spool().join(&p.name)).is_ok() {
                    return Ok(Stage::Pending(p.clone()));
                }
                // Gone from the spool: claimed, rejected, withdrawn (or being so).
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    if let Some(s) = self.settled(&p.run_id, &p.name)? {
                        return Ok(s);
                    }
                    if std::fs::symlink_metadata(self.layout.spool().join(&p.name)).is_ok() {
                        // Put back (a claim that found it replaced): still pending.
                        return Ok(Stage::Pending(p.clone()));
                    }
                    if Instant::now() > deadline {
                        bail!(
                            "request {} left the spool but neither run {} nor a rejection in {} appeared; \
                             another client may have removed it",
                            self.layout.spool().join(&p.name).display(),
                            self.layout.run_dir(&p.run_id).display(),
                            self.layout.rejected().display()
                        );
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Target::Rejected { name, error_file } => {
                // A rejection with a run id may have made a run: its status says more.
                if let Some(id) = target.run_id() {
                    if let Ok(Some(s)) = run::read_status(&self.layout.run_dir(&id)) {
                        return Ok(status_stage(s));
                    }
                }
                Ok(Refusal::read(name, error_file.clone()).into_stage())
            }
        }
    }

    /// The stage of the run directory `id`.
    fn run_stage(&self, id: &RunId) -> anyhow::Result<Stage> {
        let dir = self.layout.run_dir(id);
        match run::read_status(&dir)? {
            Some(s) => Ok(status_stage(s)),
            None if run::claimed(&dir) => Ok(Stage::Claimed(id.clone())),
            None => bail!("{} has no status.json (and no request.json): it is no run of runspool's", dir.display()),
        }
    }

    /// The stage of a request that left the spool as `name`: its run's, or
    /// its refusal's; None while neither is on disk yet.
    fn settled(&self, id: &RunId, name: &str) -> anyhow::Result<Option<Stage>> {
        let dir = self.layout.run_dir(id);
        if let Some(s) = run::read_status(&dir)? {
            return Ok(Some(status_stage(s)));
        }
        if run::claimed(&dir) {
            return Ok(Some(Stage::Claimed(id.clone())));
        }
        let ef = error_file(&self.layout, name);
        if std::fs::symlink_metadata(&ef).is_ok_and(|m| m.is_file()) {
            return Ok(Some(Refusal::read(name, ef).into_stage()));
        }
        Ok(None)
    }

    /// Wait until the run `arg` names ends; `timeout` None waits for ever.
    /// Ok: its terminal status (`complete`, `failed`, `stopped`, `paused`).
    /// A request refused or withdrawn is [`WaitError::Rejected`] or
    /// [`WaitError::Withdrawn`], whether or not it got a run.
    pub fn wait(&self, arg: &str, timeout: Option<Duration>) -> Result<Status, WaitError> {
        let target = self.resolve(arg)?;
        self.wait_for(&target, timeout, |_| ControlFlow::Continue(()))
    }

    /// [`Client::wait`] for a resolved target, calling `observe` with the
    /// stage on every look (about ten a second); `observe` returning
    /// `Break` ends the wait ([`WaitError::Cancelled`]).
    pub fn wait_for(
        &self,
        target: &Target,
        timeout: Option<Duration>,
        mut observe: impl FnMut(&Stage) -> ControlFlow<()>,
    ) -> Result<Status, WaitError> {
        let start = Instant::now();
        let run = target.run_id().map(|i| i.to_string()).unwrap_or_else(|| format!("{target:?}"));
        loop {
            let stage = self.stage(target)?;
            match stage {
                Stage::Ended(s) => return ended(&self.layout, *s),
                Stage::Rejected(refusal) => return Err(WaitError::Rejected { refusal, status: None }),
                Stage::Withdrawn(refusal) => return Err(WaitError::Withdrawn { refusal, status: None }),
                _ => {}
            }
            if observe(&stage).is_break() {
                return Err(WaitError::Cancelled { run });
            }
            if let Some(t) = timeout.filter(|t| start.elapsed() >= *t) {
                return Err(WaitError::Timeout { run, after: t, stage: Box::new(stage) });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Follow the output of every step of the run `arg` names, as
    /// `runspool logs -f` does: a request still in the spool is waited on
    /// through its claim, a claimed run through its first status; the
    /// iterator then yields what the steps write until the run ends.
    /// A request refused or withdrawn before it ran is an error
    /// ([`WaitError::Rejected`], [`WaitError::Withdrawn`]).
    pub fn follow(&self, arg: &str) -> Result<Follow, WaitError> {
        let target = self.resolve(arg)?;
        self.follow_target(&target)
    }

    /// [`Client::follow`] for a resolved target.
    pub fn follow_target(&self, target: &Target) -> Result<Follow, WaitError> {
        loop {
            match self.stage(target)? {
                Stage::Queued(s) | Stage::Running(s) | Stage::Ended(s) => {
                    if s.state == State::Rejected {
                        return Err(refused(&self.layout, *s));
                    }
                    let id = RunId::parse(&s.run_id).context("a status names its own directory")?;
                    return Ok(Follow::new(self.layout.run_dir(&id), id, *s, true));
                }
                Stage::Rejected(refusal) => return Err(WaitError::Rejected { refusal, status: None }),
                Stage::Withdrawn(refusal) => return Err(WaitError::Withdrawn { refusal, status: None }),
                Stage::Pending(_) | Stage::Claimed(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// The output the steps of run `id` have written so far, once: the
    /// same iterator as [`Client::follow`] without the wait for the end.
    /// An error when the run has no status yet.
    pub fn output(&self, id: &RunId) -> anyhow::Result<Follow> {
        let dir = self.layout.run_dir(id);
        let s = run::read_status(&dir)?.with_context(|| format!("{} has no status.json yet", dir.display()))?;
        Ok(Follow::new(dir, id.clone(), s, false))
    }

    /// Ask the run `arg` names to stop (a stop request in its control
    /// inbox, PROTOCOL §9), with `reason` recorded in its status and events.
    /// A request still in the spool is withdrawn instead (it never runs),
    /// unless the daemon claims it first, when its run is stopped.
    pub fn stop(&self, arg: &str, reason: Option<&str>) -> anyhow::Result<Stopped> {
        self.signal(&self.resolve(arg)?, reason, false)
    }

    /// As [`Client::stop`], but an interrupt: the run ends `paused`.
    pub fn interrupt(&self, arg: &str, reason: Option<&str>) -> anyhow::Result<Stopped> {
        self.signal(&self.resolve(arg)?, reason, true)
    }

    /// [`Client::stop`] (or an interrupt) of a resolved target.
    pub fn signal(&self, target: &Target, reason: Option<&str>, interrupt: bool) -> anyhow::Result<Stopped> {
        let id = match target {
            Target::Run(id) => id.clone(),
            // Not yet claimed: withdrawn (an interrupt too: there is nothing to pause), unless the daemon wins.
            Target::Pending(p) => match self.withdraw(p, reason)? {
                WithdrawOutcome::Withdrawn(w) => return Ok(Stopped::Withdrawn(w)),
                WithdrawOutcome::ClaimedFirst(id) => id,
            },
            Target::Rejected { name, error_file } => {
                let (code, message) = read_error(error_file);
                bail!(
                    "{name} was refused before it ran ({code}: {message}); nothing to stop (see {})",
                    error_file.display()
                )
            }
        };
        let dir = self.layout.run_dir(&id);
        match run::read_status(&dir)? {
            Some(s) => {
                if !run::ownership(&dir, Some(&s)).is_ours() {
                    bail!(
                        "run {id} was launched by another host (pi-subagents), not by runspool; runspool never \
                         writes into it. Stop it from the host that launched it"
                    );
                }
                if !s.state.is_active() {
                    bail!("run {id} already ended ({}); nothing to stop", s.state.as_str());
                }
            }
            // Being claimed: the request is in its run, status.json follows. The
            // request goes into the inbox all the same: the daemon reads it while
            // the run is queued, the runner at its start, so it is never lost.
            None if run::claimed(&dir) => {}
            None => bail!("{} has no status.json yet", dir.display()),
        }
        let kind = if interrupt { "interrupt" } else { "stop" };
        let ts = crate::now_ms();
        let mut body = json!({"type": kind, "ts": ts, "source": "runspool-cli"});
        if let Some(r) = reason {
            body["reason"] = json!(r);
        }
        // A stop in pi-subagents 0.67's form (control/stop-requests/<ts>-<uuid>.json),
        // which 0.67 runners and runspool's both consume; an interrupt in the one
        // form both know, control/interrupt.json. Written by descriptor, never
        // through a symlinked control/ or stop-requests/.
        let (sub, name) = if interrupt {
            (None, crate::store::layout::CONTROL_INTERRUPT.to_string())
        } else {
            let name = crate::protocol::control::stop_request_name(ts, &uuid::Uuid::new_v4().to_string());
            (Some(crate::store::layout::STOP_REQUESTS_DIR), name)
        };
        let request = crate::store::inbox::write(&dir, sub, &name, &serde_json::to_vec(&body)?)
            .with_context(|| format!("cannot write a {kind} request into {}", RunPaths::control(&dir).display()))?;
        Ok(Stopped::Requested { run_id: id, request })
    }

    /// Withdraw the request `p` from the spool under the lock the daemon's
    /// claim takes (PROTOCOL §2.3): moved to `spool/rejected/` with code
    /// `withdrawn`, it never runs; or, when the daemon claimed it first,
    /// its run id (stop that run instead). Exactly one of the two happens.
    pub fn withdraw(&self, p: &Pending, reason: Option<&str>) -> anyhow::Result<WithdrawOutcome> {
        let layout = &self.layout;
        let path = layout.spool().join(&p.name);
        let message = format!(
            "withdrawn by `runspool stop` before it was claimed{}",
            reason.map(|r| format!(": {r}")).unwrap_or_default()
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let outcome = match spool_withdraw::withdraw(layout, &p.name, &message) {
                Ok(o) => o,
                // Still in the spool: nothing was withdrawn. Gone: settled by
                // someone, maybe us; what is on disk says how (below).
                Err(e) if std::fs::symlink_metadata(&path).is_ok() => {
                    return Err(e).with_context(|| format!("cannot withdraw {}", path.display()))
                }
                Err(_) => Withdrawal::Gone,
            };
            match outcome {
                Withdrawal::Withdrawn { entry, unfinished, .. } => {
                    return Ok(WithdrawOutcome::Withdrawn(Withdrawn {
                        run_id: p.run_id.clone(),
                        entry: Some(entry),
                        error_file: error_file(layout, &p.name),
                        unfinished,
                    }))
                }
                Withdrawal::Gone => break,
                Withdrawal::Busy if Instant::now() > deadline => bail!(
                    "{} stayed locked for 30 s (a writer still at work on it?); nothing was withdrawn: try again",
                    path.display()
                ),
                Withdrawal::Busy => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        // The daemon settled it first: its run, claimed (maybe without its
        // status yet: a stop goes into its inbox all the same), or its refusal.
        if run::claimed(&layout.run_dir(&p.run_id))
            || await_claim(layout, p, Some(Instant::now() + Duration::from_secs(30)))?
        {
            return Ok(WithdrawOutcome::ClaimedFirst(p.run_id.clone()));
        }
        let ef = error_file(layout, &p.name);
        if ef.exists() {
            let (code, message) = read_error(&ef);
            if code == WITHDRAWN {
                return Ok(WithdrawOutcome::Withdrawn(Withdrawn {
                    run_id: p.run_id.clone(),
                    entry: None,
                    error_file: ef,
                    unfinished: None,
                }));
            }
            bail!("{} was refused before it ran ({code}: {message}); nothing to stop (see {})", p.name, ef.display());
        }
        bail!(
            "{} left the spool but run {} did not appear within 30 s; try `runspool stop {}` again",
            path.display(),
            layout.run_dir(&p.run_id).display(),
            p.run_id
        )
    }

    /// Runs from the indexes (PROTOCOL §6): active ones (queued or
    /// running) and the requests still in the spool, always; then the most
    /// recent terminal ones, as `filter` says.
    pub fn list(&self, filter: &ListFilter) -> anyhow::Result<Listing> {
        let layout = &self.layout;
        let session = filter.session.as_deref();
        let mut runs: Vec<index::Listed> = index::list_active(layout)
            .with_context(|| format!("cannot read {}", layout.active().display()))?
            .into_iter()
            .filter(|x| session.is_none_or(|want| x.ok().is_none_or(|s| s.session_id == want)))
            .filter(|x| in_lane(filter, x))
            .collect();
        // A request claimed between the two looks is listed once, as its run.
        let mut pending: Vec<Pending> = target::entries(layout)
            .filter(|p| !runs.iter().any(|r| r.run_id == p.run_id))
            .filter(|p| {
                session.is_none_or(|want| {
                    let body = pending_request(layout, p);
                    body.as_ref().and_then(|b| b.get("sessionId")).and_then(Value::as_str).unwrap_or("default") == want
                })
            })
            .filter(|p| {
                filter.lane.as_deref().is_none_or(|want| {
                    let body = pending_request(layout, p);
                    let lane = body.as_ref().and_then(|b| b.get("lane")).and_then(Value::as_str);
                    lane.unwrap_or(request::DEFAULT_LANE) == want
                })
            })
            .collect();
        pending.sort_by(|a, b| (a.since_ms, &a.name).cmp(&(b.since_ms, &b.name)));
        // One more than returned, to know whether older finished runs were left out.
        let limit = filter.recent.unwrap_or(DEFAULT_RECENT);
        let mut capped = false;
        if !filter.active_only {
            // The index knows no lanes: with one, look further back until
            // enough runs of the lane are found (or 65,536 runs were seen).
            let mut wanted = limit.saturating_add(1);
            let mut finished = loop {
                let mut found = index::list_recent(layout, session, wanted)?;
                let exhausted = found.len() < wanted;
                found.retain(|x| in_lane(filter, x));
                if filter.lane.is_none() || exhausted || found.len() > limit || wanted >= 1 << 16 {
                    break found;
                }
                wanted = wanted.saturating_mul(4).min(1 << 16);
            };
            capped = finished.len() > limit;
            finished.truncate(limit);
            runs.extend(finished);
        }
        Ok(Listing { runs, pending, capped })
    }

    /// Each of `ids` as its shortest prefix of 8 or more characters unique
    /// among every run and pending request of the root (see [`short_ids`]);
    /// `pending`: the spool's requests, when the caller has them.
    pub fn short_ids(&self, pending: &[Pending], ids: &[&str]) -> Vec<String> {
        let runs: Vec<String> = std::fs::read_dir(self.layout.runs())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        short_ids(runs.iter().map(String::as_str).chain(pending.iter().map(|p| p.run_id.as_str())), ids)
    }

    /// Every run's events (PROTOCOL §5) as one stream, each line once.
    /// `since` (ms since the epoch): only events at or after it, from every
    /// run; None: with `follow`, only what is written from now on, else all.
    /// `follow`: keep yielding as runs start, write and end (the iterator
    /// then blocks and never ends; see [`Events::until`]).
    pub fn events(&self, since: Option<i64>, follow: bool) -> Events {
        Events::new(self.layout.clone(), since, follow)
    }
}

/// Is `x` in the lane `filter` asks for (a status that cannot be read: yes)?
fn in_lane(filter: &ListFilter, x: &index::Listed) -> bool {
    filter.lane.as_deref().is_none_or(|want| x.ok().is_none_or(|s| s.lane() == want))
}

/// The stage a status is at.
fn status_stage(s: Status) -> Stage {
    match s.state {
        State::Queued => Stage::Queued(Box::new(s)),
        State::Running => Stage::Running(Box::new(s)),
        _ => Stage::Ended(Box::new(s)),
    }
}

/// The outcome of a wait on a run that ended as `s`.
fn ended(layout: &Layout, s: Status) -> Result<Status, WaitError> {
    if s.state == State::Rejected {
        return Err(refused(layout, s));
    }
    Ok(s)
}

/// A `rejected` run as the error it is: withdrawn or rejected, with the
/// code and message its `error` (`<code>: <message>`) holds. Its error file
/// is `rejected/<runId>.error.json` when the request was published under its
/// run id (as `submit` does); otherwise the run's status.json says it all.
fn refused(layout: &Layout, s: Status) -> WaitError {
    let error = s.error.clone().unwrap_or_default();
    let (code, message) = error.split_once(": ").map(|(c, m)| (c.to_string(), m.to_string())).unwrap_or_default();
    let name = format!("{}.json", s.run_id);
    let mut details = error_file(layout, &name);
    if !details.exists() {
        if let Some(id) = RunId::parse(&s.run_id) {
            details = RunPaths::status(&layout.run_dir(&id));
        }
    }
    let refusal = Refusal { name, code: code.clone(), message, error_file: details };
    if code == WITHDRAWN {
        WaitError::Withdrawn { refusal, status: Some(Box::new(s)) }
    } else {
        WaitError::Rejected { refusal, status: Some(Box::new(s)) }
    }
}

/// PROTOCOL §2.1's second way: create `target` (never replacing a file) and
/// hold an exclusive flock on it from before its first byte to its last.
fn publish_locked(target: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(target)
        .with_context(|| format!("cannot create {}", target.display()))?;
    let written = (|| -> std::io::Result<()> {
        fsutil::flock(&f, false)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        // Half a request must not stay behind: a claim would reject it.
        let _ = std::fs::remove_file(target);
        return Err(e).with_context(|| format!("cannot write {}", target.display()));
    }
    // Closing the file lets go of the lock: the request is complete.
    drop(f);
    Ok(())
}
