//! `runspool submit`: build (or take) a request and publish it atomically.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use serde_json::{json, Value};

use super::text::visible;
use crate::client::{self, daemon_running, Client, Publish};
use crate::store::Layout;

#[derive(Args)]
#[command(
    after_help = concat!(
        "Examples:\n  runspool submit -- make test\n  runspool submit --wait --run-timeout 10m --env CI=1 -- ./build.sh\n  runspool submit --wait --wait-timeout 30s -- true   # give up waiting after 30 s (exit 124)\n  runspool submit --follow -- ./build.sh   # print its output as it comes, exit with its code\n  runspool submit --file request.json\n  runspool submit --lane gpu --after build-42 -- ./train.sh   # after build-42 completed, one gpu run at a time\n  runspool submit --hold --delay 10m -- ./nightly.sh   # not before 10 minutes from now, and only once released\n\n\
Environment: by default the request carries only the --env variables: its steps get the DAEMON's environment\n\
plus those (under systemd, the service manager's PATH, not this shell's). --env-all captures this shell's environment;\n\
--env-file FILE adds NAME=value lines; --env NAME=value wins over both.\n\
The run's time limit defaults to the daemon's `default_timeout_ms` (none unless configured).\n\
Without --wait or --follow, submit exits 0 once the request is published.\n\n",
        exit_code_table!()
    )
)]
pub struct SubmitArgs {
    /// Publish this request file as it is (a runId is added when it has none)
    #[arg(long, value_name = "FILE", conflicts_with_all = ["command", "cwd", "env", "env_all", "env_file", "run_timeout", "timeout", "priority", "session"])]
    file: Option<PathBuf>,
    /// Run id (default: a new UUID)
    #[arg(long, value_name = "ID")]
    run_id: Option<String>,
    /// Session id (default: "default")
    #[arg(long, value_name = "ID")]
    session: Option<String>,
    /// Working directory (default: the current directory)
    #[arg(long, value_name = "DIR")]
    cwd: Option<PathBuf>,
    /// Environment variable for the steps, repeatable; wins over --env-file and --env-all
    #[arg(long, value_name = "K=V")]
    env: Vec<String>,
    /// Capture this shell's whole environment into the request (at most 256 variables; names outside
    /// [A-Za-z_][A-Za-z0-9_]* are skipped with a note)
    #[arg(long)]
    env_all: bool,
    /// Read variables from FILE (NAME=value lines, `#` comments, blank lines), repeatable; wins over --env-all
    #[arg(long, value_name = "FILE")]
    env_file: Vec<PathBuf>,
    /// The run's time limit (500ms, 30s, 5m, 1h; default: the daemon's default_timeout_ms, none unless configured)
    #[arg(long, value_name = "DUR", value_parser = super::args::parse_duration, conflicts_with = "timeout")]
    run_timeout: Option<Duration>,
    /// Deprecated: the run's time limit; use --run-timeout (or --wait-timeout for how long --wait waits)
    #[arg(long, value_name = "DUR", value_parser = super::args::parse_duration, hide = true)]
    timeout: Option<Duration>,
    /// Queue priority, -1000 to 1000; higher runs first
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    priority: i64,
    /// Wait for the run to end and exit with its exit code
    #[arg(long)]
    wait: bool,
    /// Print the run's output as it comes (like `logs -f`) and exit with the run's exit code
    #[arg(short, long, conflicts_with_all = ["wait", "wait_timeout"])]
    follow: bool,
    /// With --wait: give up waiting after this long (exit 124; the run goes on)
    #[arg(long, value_name = "DUR", value_parser = super::args::parse_duration, requires = "wait")]
    wait_timeout: Option<Duration>,
    #[command(flatten)]
    schedule: super::schedule::ScheduleArgs,
    /// The command and its arguments (after --)
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

pub fn submit(layout: &Layout, mut a: SubmitArgs) -> anyhow::Result<i32> {
    if let Some(t) = a.timeout.take() {
        eprintln!(
            "runspool: warning: `submit --timeout` is deprecated: it sets the run's time limit, not how long --wait \
             waits; use --run-timeout for the run's limit and --wait-timeout for the wait"
        );
        a.run_timeout = Some(t);
    }
    let (bytes, run_id) = match &a.file {
        Some(f) => from_file(f, a.run_id.as_deref())?,
        None => from_args(&a)?,
    };
    let submitted = Client::from_layout(layout.clone()).publish(&bytes, &run_id, Publish::Rename)?;
    println!("{run_id}");
    if !daemon_running(layout) {
        eprintln!(
            "runspool: note: no daemon holds {}; the request waits in the spool until one starts (`runspool daemon`)",
            layout.daemon_lock().display()
        );
    }
    if a.follow {
        // Like `logs -f`: waits for the claim of the request still in the spool, then for the end.
        return super::logs::follow_target(layout, &submitted.target(), None, None);
    }
    if a.wait {
        return super::wait::wait_target(layout, &submitted.target(), a.wait_timeout, false);
    }
    Ok(0)
}

/// Check a request as the daemon would and publish it in the spool as
/// `<run_id>.json` (never replacing one); returns its file name there.
pub(crate) fn publish(layout: &Layout, bytes: &[u8], run_id: &str) -> anyhow::Result<String> {
    Ok(Client::from_layout(layout.clone()).publish(bytes, run_id, Publish::Rename)?.name)
}

fn from_file(f: &PathBuf, run_id: Option<&str>) -> anyhow::Result<(Vec<u8>, String)> {
    let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
    let mut v: Value = serde_json::from_slice(&bytes).with_context(|| format!("{} is not valid JSON", f.display()))?;
    let obj = v.as_object_mut().with_context(|| format!("{} must hold a JSON object", f.display()))?;
    match (obj.get("runId").and_then(Value::as_str).map(str::to_string), run_id) {
        (Some(id), None) => Ok((bytes, id)),
        (Some(id), Some(flag)) if id == flag => Ok((bytes, id)),
        (Some(id), Some(flag)) => bail!("{} has runId `{id}` but --run-id says `{flag}`; drop one", f.display()),
        (None, flag) => {
            let id = flag.map(str::to_string).unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            obj.insert("runId".into(), json!(id));
            Ok((serde_json::to_vec_pretty(&v)?, id))
        }
    }
}

/// The request's `env`: --env-all, then each --env-file, then each --env (the later wins).
fn request_env(a: &SubmitArgs) -> anyhow::Result<BTreeMap<String, String>> {
    let captured = a.env_all.then(|| {
        let c = client::capture_env();
        for s in &c.skipped {
            eprintln!("runspool: note: --env-all skips {}", visible(s));
        }
        c.env
    });
    let files = a.env_file.iter().map(|f| client::parse_env_file(f)).collect::<anyhow::Result<Vec<_>>>()?;
    let explicit = a.env.iter().map(|kv| client::parse_env_arg(kv)).collect::<anyhow::Result<Vec<_>>>()?;
    client::merge_env(captured, files, explicit)
}

fn from_args(a: &SubmitArgs) -> anyhow::Result<(Vec<u8>, String)> {
    if a.command.is_empty() {
        bail!("nothing to run: put the command after --, e.g. `runspool submit -- echo hello`, or use --file");
    }
    let cwd = match &a.cwd {
        Some(c) => std::path::absolute(c).with_context(|| format!("bad --cwd {}", c.display()))?,
        None => std::env::current_dir().context("cannot read the current directory; pass --cwd")?,
    };
    let env = request_env(a)?;
    let run_id = a.run_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let mut req = json!({
        "version": 1,
        "runId": run_id,
        "cwd": cwd.display().to_string(),
        "steps": [{ "command": a.command }],
    });
    if let Some(s) = &a.session {
        req["sessionId"] = json!(s);
    }
    if !env.is_empty() {
        req["env"] = json!(env);
    }
    if let Some(t) = a.run_timeout {
        req["timeoutMs"] = json!(t.as_millis() as u64);
    }
    if a.priority != 0 {
        req["priority"] = json!(a.priority);
    }
    super::schedule::apply(&a.schedule, &mut req);
    Ok((serde_json::to_vec_pretty(&req)?, run_id))
}
