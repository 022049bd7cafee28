//! The `runspool` command line. Every command reads and writes the same
//! files any client could (PROTOCOL.md); nothing talks to the daemon directly.

/// The exit-code rule of every command that follows a run to its end
/// (`wait`, `submit --wait/--follow`, `logs -f`), shown in their `--help`
/// and in README.md.
macro_rules! exit_code_table {
    () => {
        "Exit codes (wait, submit --wait or --follow, logs -f), the run's exitCode or why there is none:\n  \
         0    the run completed\n  \
         N    it failed: the first failed step's exit code (a step killed by signal S counts 128+S)\n  \
         143  it timed out: its steps got SIGTERM (137 when one needed SIGKILL)\n  \
         1    it was stopped or paused (`runspool stop`, also of a request not yet claimed), or failed without a step's code\n  \
         2    the request was refused before it ran; stderr names the code and the error file\n  \
         124  --timeout (--wait-timeout) expired; the run goes on\n  \
         3    it expired with the request still in the spool and no daemon running\n  \
         130  Ctrl-C ended the wait; the run goes on"
    };
}

mod args;
mod config_cmd;
mod docs;
mod doctor;
mod edit;
mod events_cmd;
mod health;
mod inspect;
mod logs;
mod manage;
mod pending;
mod queue_cmd;
mod schedule;
mod submit;
mod text;
mod top;
mod wait;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};

use crate::store::Layout;
use args::parse_duration;

#[derive(Parser)]
#[command(
    name = "runspool",
    version,
    about = "A per-user supervisor for background runs, driven by JSON files in a spool directory",
    long_about = "runspool supervises background runs. Clients drop launch requests (JSON) into <root>/spool/; \
the daemon claims each exactly once, runs its steps under a detached runner and records everything under \
<root>/async-subagent-runs/<runId>/.\n\nStart the daemon with `runspool daemon`, then try:\n  \
runspool submit --wait -- echo hello\n  runspool list\n  runspool logs <run>",
    after_help = "Examples:
  runspool service install && runspool service start
  runspool submit --wait -- make test   # run, wait, exit with its code
  runspool list --active                # what is pending, queued or running
  runspool logs --follow <run>          # watch a run's output
  runspool doctor                       # check root, daemon, service

The root is --root, else $RUNSPOOL_ROOT, else $PI_SUBAGENTS_TEMP_ROOT, else $TMPDIR/pi-subagents-uid-<uid>.
Run `runspool <command> --help` for each command's options and examples."
)]
pub struct Cli {
    /// Root directory (default: $RUNSPOOL_ROOT, $PI_SUBAGENTS_TEMP_ROOT, or $TMPDIR/pi-subagents-uid-<uid>)
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the resident daemon in the foreground (what the systemd/launchd unit starts)
    #[command(after_help = "Examples:
  runspool daemon                       # foreground, logs on stderr
  RUNSPOOL_LOG=debug runspool --root /tmp/rs daemon   # scratch root

To keep it running across logouts and crashes use `runspool service install` instead.")]
    Daemon {
        /// Config file (default: $XDG_CONFIG_HOME/runspool/config.toml)
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Run one run directory (started by the daemon; not for interactive use)
    #[command(hide = true)]
    Runner { run_dir: PathBuf },
    /// Publish a launch request; prints the run id
    Submit(Box<submit::SubmitArgs>),
    /// Show one run, or without a run the daemon's health
    #[command(after_help = "Examples:
  runspool status                 # is the daemon up, how many runs are queued or running
  runspool status 3f2a9c1e        # one run, by a unique prefix of its id
  runspool status --json <run>    # status.json as written on disk

Without a run, exit codes: 0 the daemon runs and is healthy; 3 no daemon runs; 4 its storage is degraded
(checked by the CLI too, under the root, against storage.min_free_bytes); 5 it is unresponsive
(daemon.json not rewritten for over 180 s while the daemon holds its lock).")]
    Status {
        /// Run id (also of a request still in the spool, or its file name), or a unique prefix of 8 or more characters
        run: Option<String>,
        /// Print status.json as it is on disk
        #[arg(long)]
        json: bool,
    },
    /// List runs: requests still in the spool (pending), active runs, then the most recent finished ones
    #[command(after_help = "Examples:
  runspool list                   # pending and active runs, then the most recent finished ones
  runspool list --active          # only pending, queued and running
  runspool list --recent 5        # pending and active runs, then the last five finished runs
  runspool list --wide            # full run ids and whole commands
  runspool list --session ci --json | jq '.[].state'
  runspool list --lane gpu        # only the runs of lane gpu

A request still in the spool is a run in state `pending` until a daemon claims it.
The RUN column shows each id's shortest prefix of 8 or more characters unique among the root's runs and
pending requests (every command takes it; ids of 12 characters or fewer stay whole); rows are cut to the terminal's width ($COLUMNS when piped).")]
    List {
        /// Only pending requests and active (queued or running) runs
        #[arg(long, conflicts_with = "recent")]
        active: bool,
        /// The N most recent finished runs (after the pending and active ones)
        #[arg(long, value_name = "N")]
        recent: Option<usize>,
        /// Only runs of this session
        #[arg(long, value_name = "ID")]
        session: Option<String>,
        /// Only runs (and pending requests) of this lane; runs without one are in lane `default`
        #[arg(long, value_name = "NAME")]
        lane: Option<String>,
        /// Full run ids and whole commands, whatever the terminal's width
        #[arg(long)]
        wide: bool,
        /// Print a JSON array of status objects (a pending request: runId, state "pending", spoolFile, publishedAt)
        #[arg(long)]
        json: bool,
    },
    /// Wait for a run to end; exits with the run's exit code
    #[command(
        after_help = concat!("On a terminal, a live line shows the state, steps done, the running step and the elapsed time;\n\
        otherwise a plain line is printed whenever the state or the running step changes.\n\n\
        A request still in the spool is waited on through its claim.\n\n",
        exit_code_table!(),
        "\n\nExamples:\n  runspool wait 3f2c9a1e\n  runspool wait build-42 --timeout 10m --json > final-status.json")
    )]
    Wait {
        /// Run id (also of a request still in the spool, or its file name), or a unique prefix of 8 or more characters
        run: String,
        /// Give up after this long (500ms, 30s, 5m, 1h); exit code 124
        #[arg(long, value_name = "DUR", value_parser = parse_duration)]
        timeout: Option<Duration>,
        /// Print the final status.json on stdout
        #[arg(long)]
        json: bool,
    },
    /// Ask a run to stop (writes a stop request; the runner acts on it), or withdraw a request not yet claimed
    #[command(after_help = "Examples:
  runspool stop <run> --reason \"superseded by a newer build\"
  runspool stop --interrupt <run>   # SIGINT; the run ends `paused`

A request still in the spool is withdrawn: moved to spool/rejected/ with code `withdrawn`, under the same lock
the daemon's claim takes, so it either never runs or, when the daemon claimed it first, its run is stopped.")]
    Stop {
        /// Run id (also of a request still in the spool, which is then withdrawn), or a unique prefix of 8 or more
        /// characters
        run: String,
        /// Why, recorded in the run's status and events
        #[arg(long)]
        reason: Option<String>,
        /// Interrupt instead (SIGINT; the run ends `paused`)
        #[arg(long)]
        interrupt: bool,
    },
    /// Install and control the daemon as a user service (systemd --user or launchd)
    #[command(
        subcommand,
        after_help = "Examples:
  runspool service install && runspool service start
  runspool --root ~/spool service install --config ~/.config/runspool/ci.toml
  runspool service logs --follow
  runspool service unit --bin /usr/bin/runspool   # the unit a package ships

A packaged runspool ships the unit in /usr/lib/systemd/user/, so
`systemctl --user enable --now runspool` is enough there; `runspool service
install` writes a per-user copy (for another root or config) that overrides it.

`install` and `unit` put the root this shell's commands use into ExecStart
(`--root`, else $RUNSPOOL_ROOT, else $PI_SUBAGENTS_TEMP_ROOT), so the service
watches the same root; with none of them the config's `root` or the default
decides.

Without a user manager (no systemctl or no user bus; on macOS no launchctl)
every command but `unit` and `uninstall` changes nothing, says what is
missing and how to get it, and exits 69; `runspool daemon` runs without one."
    )]
    Service(ServiceCmd),
    /// Check the root, the daemon, watching, free space, the service and providers
    #[command(after_help = "Examples:
  runspool doctor
  runspool doctor --json | jq '.checks[] | select(.level != \"ok\")'

Exits 1 when a check fails: among others an unresponsive daemon (daemon.json older than 180 s)
or degraded storage (a full disk, or free space below storage.min_free_bytes).")]
    Doctor {
        /// Config file to check (default: $XDG_CONFIG_HOME/runspool/config.toml)
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the checks as JSON
        #[arg(long)]
        json: bool,
    },
    /// List the configured external-job providers and check each (command
    /// executable, `sinfo` reachable for Slurm; with a daemon running and no
    /// --config, those of the config it loaded); exits 1 when a check fails
    Providers {
        /// Config file (default: $XDG_CONFIG_HOME/runspool/config.toml)
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the providers and their checks as JSON
        #[arg(long)]
        json: bool,
    },
    /// Check the configuration file the daemon would load
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Print a run's step output
    #[command(after_help = concat!("Examples:
  runspool logs <run>               # every step's output so far
  runspool logs --step 1 <run>      # only the second step
  runspool logs -f <run>            # keep printing until the run ends
  runspool logs -n 20 <run>         # the last 20 lines of each step's output

Without -f, a run refused before it ran has no output: stderr says why (its code and error file)
and the exit code is 2. With -f, the exit code is the run's once it ends:

", exit_code_table!()))]
    Logs {
        /// Run id (also of a request still in the spool: -f waits for its claim), or a unique prefix of 8 or more
        /// characters
        run: String,
        /// Only this flat step index
        #[arg(long, value_name = "N")]
        step: Option<usize>,
        /// Keep printing new output until the run ends, then exit with the run's exit code
        #[arg(short, long)]
        follow: bool,
        /// Only the last N lines of each step's output (then, with -f, what follows)
        #[arg(short = 'n', long, value_name = "N")]
        lines: Option<usize>,
        /// Print each step's output as a JSON array (step, agent, status, exitCode, output)
        #[arg(long, conflicts_with_all = ["follow", "lines"])]
        json: bool,
    },
    /// Print every run's events as JSON lines, one stream across runs
    #[command(after_help = "Examples:
  runspool events                          # every event recorded so far
  runspool events --since 1h               # those of the last hour
  runspool events -f | jq -c 'select(.type == \"subagent.run.completed\")'

Each line is an event as its run's events.jsonl holds it (with its `runId`), each exactly once, in the
order it was written within its run. With --follow, from now on (or from --since) as runs start, write
and end, until interrupted; a run removed meanwhile (retention, `runspool rm`) just stops.")]
    Events {
        /// Keep printing events as runs start, write and end
        #[arg(short, long)]
        follow: bool,
        /// Only events at or after this time: ms since the epoch, or a duration ago (30s, 5m, 1h, 2d)
        #[arg(long, value_name = "MS|DUR")]
        since: Option<String>,
    },
    /// Print a shell completion script for bash, zsh, fish, elvish or powershell
    #[command(after_help = "Examples:
  runspool completions bash > ~/.local/share/bash-completion/completions/runspool
  runspool completions zsh > \"${fpath[1]}/_runspool\"
  runspool completions fish > ~/.config/fish/completions/runspool.fish")]
    Completions {
        /// The shell to complete for
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), or write one page per command into a directory
    #[command(after_help = "Examples:
  runspool man | man -l -
  runspool man --dir ~/.local/share/man/man1")]
    Man {
        /// Write runspool.1 and a runspool-<command>.1 for every command here instead
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Submit a finished run's request again as a new run (prints the new run id)
    #[command(after_help = "Examples:
  runspool restart 3f2a9c1e                 # prints the new run id
  runspool wait \"$(runspool restart build-42)\"

The new request is the old run's request.json with a new runId and `restartOf` naming the old run
(shown in the new run's status.json). Only finished runs runspool launched can be restarted.")]
    Restart {
        /// Run id, or a unique prefix of 8 or more characters, of a finished run runspool launched
        run: String,
        /// Print {"runId", "restartOf", "request"} as JSON
        #[arg(long)]
        json: bool,
    },
    /// Remove finished runs of runspool's: their results, index entries and run directories
    #[command(after_help = "Examples:
  runspool rm 3f2a9c1e build-42

Every run is checked first and nothing is removed when one is refused: an active run, a run whose runner
still holds its lock after a 5 s wait (it exits just after its run ends), or a run another host launched (runspool never removes those).")]
    Rm {
        /// Run ids, or unique prefixes of 8 or more characters, of finished runs runspool launched
        #[arg(required = true)]
        runs: Vec<String>,
        /// Print {"removed": [...]} as JSON
        #[arg(long)]
        json: bool,
    },
    /// Remove every finished run of runspool's, or those older than a duration or in one state
    #[command(after_help = "Examples:
  runspool clean --dry-run                 # list what would go
  runspool clean --older-than 7d
  runspool clean --state failed --json

`paused` runs are kept unless --state paused; active runs and other hosts' runs are never removed.")]
    Clean {
        /// Only runs that ended longer ago than this (500ms, 30s, 5m, 1h, 2d)
        #[arg(long, value_name = "DUR", value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// Only runs in this state (complete, failed, stopped, rejected, paused, ...)
        #[arg(long, value_name = "STATE")]
        state: Option<String>,
        /// List what would be removed, remove nothing
        #[arg(long)]
        dry_run: bool,
        /// Print {"removed": [...], "dryRun": bool} as JSON
        #[arg(long)]
        json: bool,
    },
    /// List run ids for shell completion (used by the scripts `completions` prints)
    #[command(name = "__complete-runs", hide = true)]
    CompleteRuns,
    /// Pause the queue: nothing is claimed from the spool and no queued run starts; running runs go on
    #[command(after_help = "Examples:
  runspool pause --reason \"disk maintenance\"
  runspool status                  # queue  paused for 12s (disk maintenance) ...
  runspool resume

Writes <root>/runspool/queue.json, which the daemon honours at once (also across restarts) and
reports in daemon.json `queue`. Requests submitted meanwhile wait in the spool.")]
    Pause {
        /// Why, shown by `runspool status` and in daemon.json
        #[arg(long)]
        reason: Option<String>,
    },
    /// Resume a paused queue: claiming and starting go on
    #[command(after_help = "Examples:
  runspool resume
  runspool resume --reset          # also drop a max-running override, or replace an invalid queue file")]
    Resume {
        /// Also drop the max-running override (the config's max_running applies again) and replace an invalid
        /// queue file
        #[arg(long)]
        reset: bool,
    },
    /// Hold a queued run: it stays queued and never starts until `runspool release`
    #[command(after_help = "Examples:
  runspool hold build-43
  runspool status build-43         # held, waiting: held
  runspool release build-43

Writes control/hold.json into the run; the daemon records `\"held\": true` in its status.json,
which survives daemon restarts. Only a queued run of runspool's can be held; submit with --hold
to queue a run held from the start.")]
    Hold {
        /// Run id, or a unique prefix of 8 or more characters
        run: String,
    },
    /// Release a held run: it starts as its lane, dependencies and limits allow
    Release {
        /// Run id, or a unique prefix of 8 or more characters
        run: String,
    },
    /// Edit a held run's request in $EDITOR before it starts (validated as the daemon's claim would)
    #[command(after_help = "Examples:
  runspool submit --hold -- make test   # queued held: it waits for `release`
  runspool edit <run>                   # change its steps, lane, priority, ...
  runspool release <run>                # it starts with the edited request

Opens the run's request.json in $EDITOR (else $VISUAL, else vi). The edited request must pass the checks
a claim makes and keep its runId; it then replaces request.json and the run's queued status is rebuilt from
it, under the run's status lock. Only a queued, held run of runspool's can be edited: hold a queued run
first. When the edited text is refused, or the run was released meanwhile, the request stays as it was, the
command exits 1 and prints the file holding the edited text.")]
    Edit {
        /// Run id, or a unique prefix of 8 or more characters
        run: String,
    },
    /// A live view in the terminal: the queue by lane and reason, running runs with their output, recent ends
    #[command(after_help = "Shows the daemon, the queue (paused or not, max-running, queued runs per lane and per
reason they wait), storage and watching (daemon.json), then the running runs with their elapsed time and
the last lines of their current step's output, the queued runs and why each waits (lane, max_running,
dependencies, not-before, held, paused), the requests still in the spool, and the most recent ends with
their state and exit code. It redraws when those files change (and every 2 s).

Keys:
  ↑ ↓ j k      select a run (PgUp/PgDn, g/G: further)
  s            stop the selected run (`runspool stop`; a request in the spool is withdrawn)
  h / r        hold / release the selected queued run (`runspool hold` / `release`)
  l            the selected run's output in a scrolling pane (q, Esc or l goes back)
  p            pause the queue, or resume it when paused (`runspool pause` / `resume`)
  q, Ctrl-C    quit (the terminal is restored, also on SIGINT, SIGTERM and SIGHUP)

Needs a terminal; NO_COLOR turns colours off. Scripts read `runspool list --json` and `status --json`.")]
    Top,
    /// Show or change how many runs may run at once, over the config's max_running, at run time
    #[command(after_help = "Examples:
  runspool max-running 1           # one at a time from now on (running runs are not stopped)
  runspool max-running 8
  runspool max-running --clear     # back to the config's max_running
  runspool max-running             # what applies

The override is kept in <root>/runspool/queue.json: it survives daemon restarts and wins over
the config's max_running, also after a SIGHUP reload, until `--clear` or `resume --reset`.")]
    MaxRunning {
        /// Runs allowed at once (at least 1)
        #[arg(conflicts_with = "clear")]
        n: Option<usize>,
        /// Drop the override: the config's max_running applies again
        #[arg(long)]
        clear: bool,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Load and validate the file exactly as the daemon does; exit 1 (naming
    /// the key) when the daemon would refuse it, warn about hook programs
    /// that are not on PATH
    Check {
        /// Config file (default: $XDG_CONFIG_HOME/runspool/config.toml)
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print the verdict as JSON
        #[arg(long)]
        json: bool,
    },
    /// Print the default config file path
    Path,
}

#[derive(Subcommand)]
enum ServiceCmd {
    /// Write the unit (or plist) for this binary and root, and enable it
    Install {
        /// Config file the service's daemon reads
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Disable and remove the unit (runs keep running)
    Uninstall,
    /// Start the service
    Start,
    /// Stop the service (runs keep running)
    Stop,
    /// Restart the service (runs keep running and are re-adopted)
    Restart,
    /// Show the service manager's view, with the daemon's STATUS line
    Status {
        /// Print the manager's properties (state, MainPID, NRestarts, StatusText) as JSON
        #[arg(long)]
        json: bool,
    },
    /// Show the daemon's log (journalctl --user -u runspool)
    Logs {
        /// Keep printing new lines
        #[arg(short, long)]
        follow: bool,
    },
    /// Print the systemd user unit `install` would write, without writing it
    Unit {
        /// The runspool binary the unit starts (default: this one)
        #[arg(long, value_name = "PATH")]
        bin: Option<PathBuf>,
        /// Config file the service's daemon reads
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
}

/// The dispatch: one short arm per subcommand, hence its length.
pub fn main() -> i32 {
    // Perf: a runner is exec'd for every run, so `runspool runner DIR` skips
    // building clap's whole command tree (a tenth of its start-up time).
    let mut args = std::env::args_os().skip(1);
    if let (Some(sub), Some(dir), None) = (args.next(), args.next(), args.next()) {
        if sub == "runner" && !dir.to_string_lossy().starts_with('-') {
            crate::logging::init_runner();
            return crate::runner::main(std::path::Path::new(&dir));
        }
    }
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Daemon { .. } | Cmd::Runner { .. }) {
        // A reader piped into `head` should end quietly, like any Unix tool.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.cmd {
        Cmd::Runner { run_dir } => {
            crate::logging::init_runner();
            crate::runner::main(&run_dir)
        }
        Cmd::Providers { config, json } => {
            crate::providers::cli_main(config.as_deref(), json, &Layout::resolve(cli.root.as_deref(), None))
        }
        Cmd::Config(ConfigCmd::Check { config, json }) => config_cmd::check(config.as_deref(), json),
        Cmd::Config(ConfigCmd::Path) => config_cmd::path(),
        Cmd::Completions { shell } => docs::completions(shell, Cli::command()),
        Cmd::Man { dir } => docs::man(Cli::command(), dir.as_deref()),
        Cmd::Daemon { config } => {
            crate::platform::close_inherited_fds();
            let level = crate::config::Config::load(config.as_deref()).map(|c| c.log.level).unwrap_or_default();
            crate::logging::init(&level.to_string(), true);
            crate::platform::sdnotify::take_service_env();
            let d = match crate::daemon::Daemon::start(crate::daemon::Options { root: cli.root, config }) {
                Ok(d) => d,
                Err(e) => {
                    crate::logging::fatal(&e.to_string());
                    return 1;
                }
            };
            d.run()
        }
        cmd => {
            let layout = Layout::resolve(cli.root.as_deref(), None);
            let r = match cmd {
                Cmd::Submit(a) => submit::submit(&layout, *a),
                Cmd::Status { run: Some(run), json } => inspect::status(&layout, &run, json),
                Cmd::Status { run: None, json } => health::daemon_status(&layout, json),
                Cmd::Doctor { config, json } => doctor::doctor(&layout, config.as_deref(), json),
                Cmd::List { active, recent, session, lane, wide, json } => {
                    inspect::list(&layout, active, recent, (session.as_deref(), lane.as_deref()), wide, json)
                }
                Cmd::Wait { run, timeout, json } => wait::wait(&layout, &run, timeout, json),
                Cmd::Stop { run, reason, interrupt } => inspect::stop(&layout, &run, reason, interrupt),
                Cmd::Logs { run, step, follow, lines, json } => logs::logs(&layout, &run, step, follow, lines, json),
                Cmd::Events { follow, since } => events_cmd::events(&layout, since.as_deref(), follow),
                Cmd::Pause { reason } => queue_cmd::pause(&layout, reason),
                Cmd::Resume { reset } => queue_cmd::resume(&layout, reset),
                Cmd::MaxRunning { n, clear } => queue_cmd::max_running(&layout, n, clear),
                Cmd::Top => top::top(&layout),
                Cmd::Hold { run } => schedule::hold(&layout, &run, true),
                Cmd::Release { run } => schedule::hold(&layout, &run, false),
                Cmd::Edit { run } => edit::edit(&layout, &run),
                Cmd::Service(sc) => service(cli.root.as_deref(), sc),
                Cmd::Restart { run, json } => manage::restart(&layout, &run, json),
                Cmd::Rm { runs, json } => manage::rm(&layout, &runs, json),
                Cmd::Clean { older_than, state, dry_run, json } => {
                    manage::clean(&layout, older_than, state.as_deref(), dry_run, json)
                }
                Cmd::CompleteRuns => Ok(manage::complete_runs(&layout)),
                Cmd::Daemon { .. }
                | Cmd::Runner { .. }
                | Cmd::Providers { .. }
                | Cmd::Config(_)
                | Cmd::Completions { .. }
                | Cmd::Man { .. } => unreachable!(),
            };
            match r {
                Ok(code) => code,
                Err(e) => {
                    // An error may quote a file (an error file's message, a status's error).
                    eprintln!("runspool: {}", text::visible_lines(&format!("{e:#}")));
                    1
                }
            }
        }
    }
}

/// `runspool service ...`: the unit's paths are made absolute, as the
/// service manager starts it from another directory.
/// The root goes into the unit the way the CLI resolves it (PROTOCOL §1):
/// `--root`, else `$RUNSPOOL_ROOT`, else `$PI_SUBAGENTS_TEMP_ROOT`, so the
/// service watches the root this shell's commands use; without any of them the
/// config's `root` key or the default decides, as for the CLI.
fn service(root: Option<&Path>, sc: ServiceCmd) -> anyhow::Result<i32> {
    let from_env = root.is_none().then(service_root_from_env).flatten();
    let root = root.map(Path::to_path_buf).or(from_env);
    let root = root.as_deref();
    match sc {
        ServiceCmd::Install { config } => {
            let config = config.map(|c| std::path::absolute(&c).unwrap_or(c));
            let root = root.map(|r| std::path::absolute(r).unwrap_or_else(|_| r.to_path_buf()));
            crate::service::install(root.as_deref(), config.as_deref())
        }
        ServiceCmd::Uninstall => crate::service::uninstall(),
        ServiceCmd::Start => crate::service::control("start"),
        ServiceCmd::Stop => crate::service::control("stop"),
        ServiceCmd::Restart => crate::service::control("restart"),
        ServiceCmd::Status { json: false } => crate::service::control("status"),
        ServiceCmd::Status { json: true } => crate::service::status_json(),
        ServiceCmd::Logs { follow } => crate::service::logs(follow),
        ServiceCmd::Unit { bin, config } => {
            let config = config.map(|c| std::path::absolute(&c).unwrap_or(c));
            let root = root.map(|r| std::path::absolute(r).unwrap_or_else(|_| r.to_path_buf()));
            crate::service::print_unit(bin.as_deref(), root.as_deref(), config.as_deref())
        }
    }
}

/// `$RUNSPOOL_ROOT`, else `$PI_SUBAGENTS_TEMP_ROOT` (the first one set and
/// non-empty), for `service install`/`unit`.
fn service_root_from_env() -> Option<PathBuf> {
    ["RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"]
        .into_iter()
        .find_map(|var| std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    /// `--help` never shows an argument or option with a blank help line.
    #[test]
    fn every_argument_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = a.get_id().as_str();
                if a.get_help().is_none() && a.get_long_help().is_none() && !matches!(id, "help" | "version") {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "runspool", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}
