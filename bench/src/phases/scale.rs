//! Phase 4, the CLI at scale: `runspool list/status` with many runs stored.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::fabricate;
use crate::pipelines::Env;
use crate::stats::{ms, Stats};

/// One timed command.
#[derive(Clone, Debug)]
pub struct CliResult {
    pub what: String,
    pub stats: Stats,
    /// Files the command opened beyond `runspool --version` (None without strace).
    pub opens: Option<usize>,
}

/// Successful opens of `bin args` under strace, or None without strace.
fn opens_of(bin: &Path, args: &[String]) -> Option<usize> {
    let log = std::env::temp_dir().join(format!("runspool-bench-strace-{}.txt", std::process::id()));
    let st = Command::new("strace")
        .args(["-f", "-qq", "-e", "trace=open,openat,openat2", "-o"])
        .arg(&log)
        .arg(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    let text = fs::read_to_string(&log).ok();
    let _ = fs::remove_file(&log);
    if !st.success() {
        return None;
    }
    // Successful opens only.
    Some(text?.lines().filter(|l| l.contains("open") && !l.contains("= -1")).count())
}

fn time_cli(env: &Env, root: &Path, args: &[&str], calls: usize) -> anyhow::Result<CliResult> {
    time_cli_with(env, root, args, calls, "", &mut || Ok(()))
}

/// `calls` timed runs of `runspool --root ROOT args` after one untimed;
/// `before` runs ahead of each call, outside the timing.
fn time_cli_with(
    env: &Env,
    root: &Path,
    args: &[&str],
    calls: usize,
    note: &str,
    before: &mut dyn FnMut() -> std::io::Result<()>,
) -> anyhow::Result<CliResult> {
    let mut full: Vec<String> = vec!["--root".into(), root.display().to_string()];
    full.extend(args.iter().map(|s| s.to_string()));
    let mut v = Vec::new();
    for i in 0..calls + 1 {
        before()?;
        let t = Instant::now();
        let st = Command::new(&env.runspool)
            .args(&full)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        let d = ms(t.elapsed());
        if !st.success() {
            anyhow::bail!("runspool {} failed ({st})", args.join(" "));
        }
        if i > 0 {
            v.push(d);
        }
    }
    let base = opens_of(&env.runspool, &["--version".to_string()]);
    let opens = opens_of(&env.runspool, &full).zip(base).map(|(a, b)| a.saturating_sub(b));
    Ok(CliResult { what: format!("runspool {}{note}", args.join(" ")), stats: Stats::of(v), opens })
}

/// The floor of a full listing: `ls -f` reads every name of `dir` and sorts none.
fn ls_floor(dir: &Path, runs: usize, calls: usize) -> anyhow::Result<CliResult> {
    let mut v = Vec::new();
    for i in 0..calls + 1 {
        let t = Instant::now();
        let st = Command::new("ls").arg("-f").arg(dir).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
        if !st.success() {
            anyhow::bail!("ls -f {} failed ({st})", dir.display());
        }
        if i > 0 {
            v.push(ms(t.elapsed()));
        }
    }
    Ok(CliResult {
        what: format!(
            "`ls -f` of the session directory (reads all {runs} names, sorts none: the floor of a full listing)"
        ),
        stats: Stats::of(v),
        opens: None,
    })
}

/// The commands in report order: `list --recent 20` on a quiet index, then on
/// one that just changed, `list --active`, `status` of a terminal run (when
/// `runs` > 0) and of an active one (when `active` > 0), the `ls -f` floor.
pub fn measure(env: &Env, runs: usize, active: usize, calls: usize) -> anyhow::Result<Vec<CliResult>> {
    let root = env.fresh_root("scale")?;
    let term = fabricate::terminal(&root, runs)?;
    let act = fabricate::active(&root, active)?;
    let mut out = Vec::new();
    // `list --recent` reuses the newest names of a session directory unchanged
    // for 2 s (runspool/recent-cache): measure a quiet index, then one that
    // changed just before each call (a run ended: the full listing).
    let sdir = root.join("async-subagent-runs/.terminal-runs/default");
    std::thread::sleep(Duration::from_millis(3100));
    out.push(time_cli_with(env, &root, &["list", "--recent", "20"], calls, " (quiet index)", &mut || Ok(()))?);
    let touch = sdir.join(".bench-change");
    out.push(time_cli_with(env, &root, &["list", "--recent", "20"], calls, " (index just changed)", &mut || {
        fs::write(&touch, b"")?;
        fs::remove_file(&touch)
    })?);
    out.push(time_cli(env, &root, &["list", "--active"], calls)?);
    if let Some(id) = term.get(runs / 2) {
        out.push(time_cli(env, &root, &["status", id], calls)?);
    }
    if let Some(id) = act.first() {
        out.push(time_cli(env, &root, &["status", id], calls)?);
    }
    out.push(ls_floor(&sdir, runs, calls)?);
    Ok(out)
}
