//! `runspool doctor`: a list of small checks over the root, the config, the
//! daemon's report (the typed `DaemonStatus`, through `health`), watching,
//! free space, the service and the configured programs, rendered once as
//! text or JSON.

use std::path::Path;

use serde::Serialize;
use serde_json::json;

use super::health::{describe_report, root_or_slash, steward_text, watch_text, Health, DEFAULT_MIN_FREE};
use crate::config::Config;
use crate::store::Layout;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Level {
    Ok,
    Warn,
    /// `doctor` exits 1 when any check fails.
    Fail,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        }
    }

    /// `Ok` when `good`, else `bad`.
    fn unless(good: bool, bad: Level) -> Level {
        if good {
            Level::Ok
        } else {
            bad
        }
    }
}

/// One line of `doctor`; `--json` prints it as `{"check", "level", "detail"}`.
#[derive(Debug, Serialize)]
struct Check {
    #[serde(rename = "check")]
    name: &'static str,
    level: Level,
    detail: String,
}

fn check(name: &'static str, level: Level, detail: impl Into<String>) -> Check {
    Check { name, level, detail: detail.into() }
}

pub fn doctor(layout: &Layout, config: Option<&Path>, as_json: bool) -> anyhow::Result<i32> {
    let mut checks = root_checks(layout);
    checks.push(identity_check(layout));
    let cfg = match Config::load(config) {
        Ok(c) => {
            checks.push(check("config", Level::Ok, "configuration is valid"));
            Some(c)
        }
        Err(e) => {
            checks.push(check("config", Level::Fail, e.to_string()));
            None
        }
    };
    let cfg = cfg.as_ref();
    let health = Health::read(layout, cfg.map(|c| c.storage.min_free_bytes));
    checks.extend(daemon_checks(layout, &health));
    checks.push(filesystem_check(layout, cfg));
    checks.extend(inotify_check());
    checks.extend(space_check(layout, cfg));
    checks.extend(service_checks());
    if let Some(c) = cfg {
        checks.push(retention_check(layout, c.retention_days));
        checks.extend(provider_checks(c));
        checks.extend(hook_checks(c));
    }
    let failed = checks.iter().any(|c| c.level == Level::Fail);
    if as_json {
        let v = json!({"ok": !failed, "checks": checks, "daemon": health.daemon, "inotify": crate::platform::inotify_usage()});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for c in &checks {
            println!("{:<5} {:<11} {}", c.level.as_str(), c.name, super::text::visible_lines(&c.detail));
        }
    }
    Ok(if failed { 1 } else { 0 })
}

/// The root, the spool and the runs directory: safe to use, or not there yet.
fn root_checks(layout: &Layout) -> Vec<Check> {
    [layout.root.clone(), layout.spool(), layout.runs()]
        .into_iter()
        .map(|p| match crate::store::safety::check_dir(&p) {
            Ok(true) => check("root", Level::Ok, format!("{} is safe", p.display())),
            Ok(false) => {
                check("root", Level::Warn, format!("{} does not exist yet; the daemon creates it", p.display()))
            }
            Err(e) => check("root", Level::Fail, e.to_string()),
        })
        .collect()
}

/// `retention_days` against pi-subagents 0.67's own retention: every pi host
/// runs `cleanupAsyncRetention` 60 s after it loads, which removes every
/// finished run under the root older than 30 days, runspool's included (it
/// checks no ownership). A root that holds runs a pi host launched has pi
/// hosts, so a `retention_days` above 30, or 0 (keep everything), is not
/// what happens to runspool's runs while one runs.
fn retention_check(layout: &Layout, days: u64) -> Check {
    if days != 0 && days <= PI_RETENTION_DAYS {
        return check("retention", Level::Ok, format!("finished runs are kept {days} days"));
    }
    let asked = if days == 0 { "0 (keep everything)".to_string() } else { days.to_string() };
    match pi_launched_run(layout) {
        None => check(
            "retention",
            Level::Ok,
            format!("retention_days = {asked}; no run under the root was launched by a pi-subagents host"),
        ),
        Some(id) => check(
            "retention",
            Level::Warn,
            format!(
                "retention_days = {asked}, but pi-subagents hosts use this root ({} was launched by one), and every \
                 pi-subagents 0.67 host removes finished runs older than {PI_RETENTION_DAYS} days under the root, \
                 runspool's included, 60 s after it loads: runspool's runs are kept {PI_RETENTION_DAYS} days while a \
                 pi host runs; set retention_days to {PI_RETENTION_DAYS} or less, or keep runs elsewhere \
                 (docs/protocol-notes.md, \"Retention\")",
                layout.run_dir(&id).display()
            ),
        ),
    }
}

/// pi-subagents 0.67's `ASYNC_RETENTION_DAYS`.
const PI_RETENTION_DAYS: u64 = 30;

/// A run directory under the root that a pi-subagents host launched: a
/// status.json, no runspool request.json, not a rejection of runspool's.
fn pi_launched_run(layout: &Layout) -> Option<crate::store::RunId> {
    use crate::store::layout::RunPaths;
    use crate::store::{run, RunId};
    for e in std::fs::read_dir(layout.runs()).ok()?.flatten() {
        let Some(id) = e.file_name().to_str().and_then(RunId::parse) else { continue };
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = layout.run_dir(&id);
        let has_status = std::fs::symlink_metadata(RunPaths::status(&dir)).is_ok_and(|m| m.is_file());
        if has_status && run::ownership(&dir, None) == run::Ownership::Foreign {
            return Some(id);
        }
    }
    None
}

/// Run directories that are not their own (DESIGN principle 9): a status
/// whose `runId` is not its directory's name (copied or edited) and entries
/// of the runs root that are symbolic links. runspool leaves both alone; the
/// user should know they are there.
fn identity_check(layout: &Layout) -> Check {
    use crate::store::{run, RunId};
    let Ok(rd) = std::fs::read_dir(layout.runs()) else {
        return check("run identity", Level::Ok, "no run directories yet");
    };
    let (mut bad, mut seen) = (Vec::new(), 0usize);
    for e in rd.flatten() {
        let Some(id) = e.file_name().to_str().and_then(RunId::parse) else { continue };
        seen += 1;
        let link = e.file_type().is_ok_and(|t| t.is_symlink());
        match run::read_status(&layout.run_dir(&id)) {
            _ if link => bad.push(format!("{id} (a symbolic link)")),
            Err(err) if run::is_identity_mismatch(&err) => bad.push(format!("{id} (its status names another run)")),
            _ => {}
        }
    }
    if bad.is_empty() {
        return check("run identity", Level::Ok, format!("{seen} run directories, each its own run"));
    }
    let n = bad.len();
    bad.truncate(5);
    check(
        "run identity",
        Level::Warn,
        format!(
            "{n} of {seen} entries under {} are not runs runspool will touch: {}{}; runspool leaves them alone \
             (a run is its directory): move them out of the runs root, or restore their own status.json",
            layout.runs().display(),
            bad.join(", "),
            if n > 5 { ", ..." } else { "" }
        ),
    )
}

/// Whether a daemon runs and answers, how it watches, its storage and its
/// queue; one warning when none runs.
fn daemon_checks(layout: &Layout, health: &Health) -> Vec<Check> {
    let Some(d) = health.running_report() else {
        return vec![check(
            "daemon",
            Level::Warn,
            format!(
                "no daemon holds {}; start it with `runspool daemon` or `systemctl --user start runspool`",
                layout.daemon_lock().display()
            ),
        )];
    };
    let mut checks = vec![
        match health.unresponsive() {
            Some(why) => check("daemon", Level::Fail, format!("{why}; fix: {}", health.fix())),
            None => check("daemon", Level::Ok, format!("running, pid {}", d.pid)),
        },
        check("watch", Level::Ok, watch_text(d)),
        check("steward", Level::Ok, steward_text(d)),
        check(
            "storage",
            Level::unless(health.storage_state == "ok", Level::Fail),
            format!(
                "{}{}",
                health.storage_state,
                health.storage_reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            ),
        ),
    ];
    // A paused queue or an ignored queue file is why nothing starts: say so.
    if let Some(q) = &d.queue {
        checks.push(check("queue", Level::unless(!q.paused && q.error.is_none(), Level::Warn), describe_report(q)));
    }
    checks
}

/// The filesystem under the root and the watch strategy the daemon would choose on it.
fn filesystem_check(layout: &Layout, cfg: Option<&Config>) -> Check {
    let fs = crate::platform::watch::fs_type(root_or_slash(layout));
    let choice = crate::platform::watch::choose(
        std::env::consts::OS,
        fs.as_deref(),
        cfg.map_or(crate::platform::watch::Strategy::Auto, |c| c.watch.strategy),
    );
    check(
        "filesystem",
        Level::Ok,
        format!(
            "{} is on {}; strategy would be {:?}: {}",
            layout.root.display(),
            fs.as_deref().unwrap_or("?"),
            choice.strategy,
            choice.reason
        ),
    )
}

/// This user's inotify instances and watches against the limits (Linux).
fn inotify_check() -> Option<Check> {
    let u = crate::platform::inotify_usage()?;
    let (inst, max_inst) = (u.instances, u.max_user_instances.unwrap_or(0));
    Some(check(
        "inotify",
        Level::unless(!(max_inst > 0 && inst >= max_inst), Level::Warn),
        format!(
            "{inst}/{max_inst} instances, {}/{} watches in use by you (sysctl fs.inotify.max_user_instances / max_user_watches)",
            u.watches,
            u.max_user_watches.map_or("?".to_string(), |m| m.to_string())
        ),
    ))
}

/// Free bytes and inodes under the root against the config's floor.
fn space_check(layout: &Layout, cfg: Option<&Config>) -> Option<Check> {
    let (bytes, inodes) = crate::platform::free_space(root_or_slash(layout)).ok()?;
    let min = cfg.map(|c| c.storage.min_free_bytes).unwrap_or(DEFAULT_MIN_FREE);
    Some(check(
        "space",
        Level::unless(!(bytes < min || inodes == 0), Level::Warn),
        format!("{} MiB and {inodes} inodes free (claiming pauses below {} MiB)", bytes >> 20, min >> 20),
    ))
}

/// The service integration: on macOS whether launchd is reachable; on Linux
/// the journal, the user manager, the unit and lingering.
fn service_checks() -> Vec<Check> {
    let mut checks = Vec::new();
    if cfg!(target_os = "macos") {
        if let Some(why) = crate::service::missing_user_manager() {
            checks.push(check("manager", Level::Warn, why.replace('\n', " ")));
        }
    }
    if cfg!(target_os = "linux") {
        checks.push(journald_check());
        // The same diagnosis `runspool service ...` prints before refusing.
        let no_manager = crate::service::missing_user_manager();
        checks.push(match &no_manager {
            None => check("manager", Level::Ok, "systemd user manager reachable (systemctl --user)"),
            Some(why) => check("manager", Level::Warn, why.replace('\n', " ")),
        });
        checks.extend(unit_check(no_manager.is_some()));
        checks.extend(linger_check());
    }
    checks
}

fn journald_check() -> Check {
    if Path::new("/run/systemd/journal/socket").exists() {
        check(
            "journald",
            Level::Ok,
            "journal socket reachable; the service logs there (journalctl --user -u runspool RUN_ID=<run>)",
        )
    } else {
        check(
            "journald",
            Level::Warn,
            "no journal socket: a service's log is lost unless its stderr goes to a file (a drop-in with StandardOutput=append:FILE, see docs/operations.md); `runspool daemon` in a terminal logs to stderr",
        )
    }
}

/// The systemd user unit: installed by `runspool service install` (per user)
/// or by the package (system-wide), and enabled. None without a HOME.
fn unit_check(no_manager: bool) -> Option<Check> {
    let home = std::env::var_os("HOME")?;
    let unit = [
        Path::new(&home).join(".config/systemd/user/runspool.service"),
        "/usr/lib/systemd/user/runspool.service".into(),
    ]
    .into_iter()
    .find(|p| p.exists());
    let enabled = Path::new(&home).join(".config/systemd/user/default.target.wants/runspool.service").exists();
    Some(match (unit, enabled) {
        (Some(u), true) => check("unit", Level::Ok, format!("{} installed and enabled", u.display())),
        (Some(u), false) => check(
            "unit",
            Level::Warn,
            format!("{} installed but not enabled: systemctl --user enable --now runspool", u.display()),
        ),
        (None, _) if no_manager => check(
            "unit",
            Level::Warn,
            "no user unit installed, and none can be without a user manager (see `manager`); run `runspool daemon` yourself",
        ),
        (None, _) => check("unit", Level::Warn, "no user unit installed: `runspool service install` writes and enables one"),
    })
}

/// Whether the user's services outlive their logout.
fn linger_check() -> Option<Check> {
    let user = nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten()?;
    Some(if Path::new("/var/lib/systemd/linger").join(&user.name).exists() {
        check("linger", Level::Ok, "lingering is on: the service survives logout")
    } else {
        check(
            "linger",
            Level::Warn,
            format!(
                "lingering is off: a user service stops at logout; enable it with `loginctl enable-linger {}`",
                user.name
            ),
        )
    })
}

/// Each configured provider's program: its command, or `sinfo` for Slurm.
fn provider_checks(c: &Config) -> Vec<Check> {
    c.providers
        .iter()
        .map(|(name, p)| {
            let exe =
                if p.kind == crate::config::ProviderKind::Slurm { "sinfo".to_string() } else { p.command[0].clone() };
            let found = crate::platform::exec::find_executable(&exe).is_ok();
            check(
                "provider",
                Level::unless(found, Level::Fail),
                format!(
                    "{name} ({}): `{exe}` {}",
                    p.kind,
                    if found {
                        "found"
                    } else {
                        "not found or not executable; install it or fix the path in the config"
                    }
                ),
            )
        })
        .collect()
}

/// The hook programs (they run with the daemon's PATH).
fn hook_checks(c: &Config) -> Vec<Check> {
    [("hooks.on_complete", &c.hooks.on_complete), ("hooks.on_failure", &c.hooks.on_failure)]
        .into_iter()
        .filter_map(|(key, cmd)| {
            let prog = cmd.first()?;
            let found = crate::platform::exec::find_executable(prog).is_ok();
            Some(check(
                "hook",
                Level::unless(found, Level::Warn),
                format!(
                    "{key}: `{prog}` {}",
                    if found { "found" } else { "not found on PATH; the hook will fail until it is installed" }
                ),
            ))
        })
        .collect()
}
