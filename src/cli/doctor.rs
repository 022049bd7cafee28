//! `runspool doctor` and `runspool status` without a run: the daemon's health.

use std::path::Path;

use serde_json::{json, Value};

use crate::store::{fsutil, Layout};

struct Check {
    name: &'static str,
    level: &'static str, // ok | warn | fail
    detail: String,
}

fn check(name: &'static str, level: &'static str, detail: impl Into<String>) -> Check {
    Check { name, level, detail: detail.into() }
}

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

/// daemon.json is rewritten at least every 60 s (PROTOCOL §10): older than
/// three such periods while the daemon holds its lock, its loop is not
/// turning (stopped, stuck, or unable to write anything).
pub const STALE_AFTER_MS: i64 = 180_000;

/// `runspool status` exit codes (besides 1 for an error).
pub const EXIT_NOT_RUNNING: i32 = 3;
pub const EXIT_DEGRADED: i32 = 4;
pub const EXIT_UNRESPONSIVE: i32 = 5;

/// The daemon's health as the CLI sees it: daemon.json, checked against the
/// lock, the clock and the filesystem itself.
struct Health {
    alive: bool,
    daemon: Option<Value>,
    /// How old daemon.json is, when the daemon holds its lock and the file
    /// is older than `STALE_AFTER_MS`.
    stale_ms: Option<i64>,
    /// Candidate requests (`*.json`) in the spool.
    spool_waiting: usize,
    storage_state: String,
    storage_reason: Option<String>,
}

impl Health {
    /// `config_min`: the config's `storage.min_free_bytes`, used when
    /// daemon.json does not name the daemon's own floor.
    fn read(layout: &Layout, config_min: Option<u64>) -> Health {
        let alive = fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false);
        let daemon = read_json(&layout.daemon_json());
        let d = daemon.as_ref().filter(|_| alive);
        let stale_ms =
            d.and_then(|d| d["updatedAt"].as_i64()).map(|u| crate::now_ms() - u).filter(|age| *age > STALE_AFTER_MS);
        // The CLI's own statvfs: a daemon that could not write `degraded` (a
        // 100% full disk) must not make a full disk look fine.
        let min = d.and_then(|d| d["storage"]["minFreeBytes"].as_u64()).or(config_min).unwrap_or(16 << 20);
        let root = if layout.root.exists() { layout.root.as_path() } else { Path::new("/") };
        let own = crate::daemon::report::space_shortage(root, min);
        let daemon_reason = d.and_then(|d| d["storage"]["reason"].as_str()).map(str::to_string);
        let (storage_state, storage_reason) = match (d.and_then(|d| d["storage"]["state"].as_str()), own) {
            (Some(s), _) if s != "ok" => (s.to_string(), daemon_reason),
            (_, Some(why)) => ("degraded".to_string(), Some(why)),
            (s, None) => (s.unwrap_or("ok").to_string(), daemon_reason),
        };
        Health { alive, daemon, stale_ms, spool_waiting: spool_waiting(layout), storage_state, storage_reason }
    }

    fn running(&self) -> bool {
        self.alive && self.daemon.is_some()
    }

    fn pid(&self) -> String {
        self.daemon.as_ref().map(|d| d["pid"].to_string()).unwrap_or_else(|| "?".into())
    }

    /// One line on an unresponsive daemon: how old daemon.json is and what waits.
    fn unresponsive(&self) -> Option<String> {
        let age = self.stale_ms?;
        let n = self.spool_waiting;
        Some(format!(
            "unresponsive (pid {}): daemon.json was last rewritten {} s ago (it is rewritten at least every 60 s; unresponsive after {} s); {n} request{} waiting in the spool",
            self.pid(),
            age / 1000,
            STALE_AFTER_MS / 1000,
            if n == 1 { "" } else { "s" },
        ) + if self.storage_state == "ok" {
            ""
        } else {
            "; storage is degraded, which may be what keeps it from rewriting daemon.json"
        })
    }

    fn fix(&self) -> String {
        let pid = self.pid();
        format!(
            "see its log (journalctl --user -u runspool), resume it if it was stopped (kill -CONT {pid}), or restart it (systemctl --user restart runspool, or kill {pid} and start `runspool daemon`)"
        )
    }

    fn storage_text(&self) -> String {
        format!(
            "{}{}",
            self.storage_state,
            self.storage_reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        )
    }

    fn exit_code(&self) -> i32 {
        if !self.running() {
            EXIT_NOT_RUNNING
        } else if self.stale_ms.is_some() {
            EXIT_UNRESPONSIVE
        } else if self.storage_state != "ok" {
            EXIT_DEGRADED
        } else {
            0
        }
    }
}

/// Requests waiting in the spool: `*.json` entries that are not dot names.
fn spool_waiting(layout: &Layout) -> usize {
    let Ok(rd) = std::fs::read_dir(layout.spool()) else { return 0 };
    rd.flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            !n.starts_with('.') && n.ends_with(".json") && e.file_type().is_ok_and(|t| t.is_file())
        })
        .count()
}

pub fn doctor(layout: &Layout, config: Option<&Path>, as_json: bool) -> anyhow::Result<i32> {
    let mut checks = Vec::new();
    // Root safety.
    for p in [layout.root.clone(), layout.spool(), layout.runs()] {
        match crate::store::safety::check_dir(&p) {
            Ok(true) => checks.push(check("root", "ok", format!("{} is safe", p.display()))),
            Ok(false) => {
                checks.push(check("root", "warn", format!("{} does not exist yet; the daemon creates it", p.display())))
            }
            Err(e) => checks.push(check("root", "fail", e.to_string())),
        }
    }
    // Config.
    let cfg = match crate::config::Config::load(config) {
        Ok(c) => {
            checks.push(check("config", "ok", "configuration is valid"));
            Some(c)
        }
        Err(e) => {
            checks.push(check("config", "fail", e));
            None
        }
    };
    // Daemon.
    let health = Health::read(layout, cfg.as_ref().map(|c| c.storage.min_free_bytes));
    let dj = health.daemon.clone();
    match (&dj, health.alive) {
        (Some(d), true) => {
            match health.unresponsive() {
                Some(why) => checks.push(check("daemon", "fail", format!("{why}; fix: {}", health.fix()))),
                None => checks.push(check("daemon", "ok", format!("running, pid {}", d["pid"]))),
            }
            checks.push(check(
                "watch",
                "ok",
                format!(
                    "{} ({}): {}",
                    d["watch"]["strategy"].as_str().unwrap_or("?"),
                    d["watch"]["backend"].as_str().unwrap_or("?"),
                    d["watch"]["reason"].as_str().unwrap_or("")
                ),
            ));
            let level = if health.storage_state == "ok" { "ok" } else { "fail" };
            checks.push(check(
                "storage",
                level,
                format!(
                    "{}{}",
                    health.storage_state,
                    health.storage_reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
                ),
            ));
            // A paused queue or an ignored queue file is why nothing starts: say so.
            if let Some(line) = super::queue_cmd::describe_report(&d["queue"]) {
                let level = if d["queue"]["paused"] == true || d["queue"]["error"].is_string() { "warn" } else { "ok" };
                checks.push(check("queue", level, line));
            }
        }
        _ => checks.push(check(
            "daemon",
            "warn",
            format!(
                "no daemon holds {}; start it with `runspool daemon` or `systemctl --user start runspool`",
                layout.daemon_lock().display()
            ),
        )),
    }
    // Filesystem and space.
    let fs = crate::daemon::watch::fs_type(if layout.root.exists() { &layout.root } else { Path::new("/") });
    let choice = crate::daemon::watch::choose(
        std::env::consts::OS,
        fs.as_deref(),
        crate::daemon::watch::Strategy::from_config(cfg.as_ref().map(|c| c.watch.strategy.as_str()).unwrap_or("auto")),
    );
    checks.push(check(
        "filesystem",
        "ok",
        format!(
            "{} is on {}; strategy would be {:?}: {}",
            layout.root.display(),
            fs.as_deref().unwrap_or("?"),
            choice.strategy,
            choice.reason
        ),
    ));
    if let Some(u) = crate::platform::inotify_usage() {
        let (inst, max_inst) = (u.instances, u.max_user_instances.unwrap_or(0));
        let level = if max_inst > 0 && inst >= max_inst { "warn" } else { "ok" };
        checks.push(check(
            "inotify",
            level,
            format!(
                "{inst}/{max_inst} instances, {}/{} watches in use by you (sysctl fs.inotify.max_user_instances / max_user_watches)",
                u.watches,
                u.max_user_watches.map_or("?".to_string(), |m| m.to_string())
            ),
        ));
    }
    if let Ok((bytes, inodes)) =
        crate::platform::free_space(if layout.root.exists() { &layout.root } else { Path::new("/") })
    {
        let min = cfg.as_ref().map(|c| c.storage.min_free_bytes).unwrap_or(16 << 20);
        let level = if bytes < min || inodes == 0 { "warn" } else { "ok" };
        checks.push(check(
            "space",
            level,
            format!("{} MiB and {inodes} inodes free (claiming pauses below {} MiB)", bytes >> 20, min >> 20),
        ));
    }
    if cfg!(target_os = "macos") {
        if let Some(why) = crate::service::missing_user_manager() {
            checks.push(check("manager", "warn", why.replace('\n', " ")));
        }
    }
    // Service integration (Linux user services).
    if cfg!(target_os = "linux") {
        let journal = Path::new("/run/systemd/journal/socket").exists();
        checks.push(check("journald", if journal { "ok" } else { "warn" }, if journal {
            "journal socket reachable; the service logs there (journalctl --user -u runspool RUN_ID=<run>)"
        } else {
            "no journal socket: a service's log is lost unless its stderr goes to a file (a drop-in with StandardOutput=append:FILE, see docs/operations.md); `runspool daemon` in a terminal logs to stderr"
        }));
        // The same diagnosis `runspool service ...` prints before refusing.
        let no_manager = crate::service::missing_user_manager();
        checks.push(match &no_manager {
            None => check("manager", "ok", "systemd user manager reachable (systemctl --user)"),
            Some(why) => check("manager", "warn", why.replace('\n', " ")),
        });
        if let Some(home) = std::env::var_os("HOME") {
            // Installed by `runspool service install` (per user) or by the package (system-wide).
            let unit = [
                Path::new(&home).join(".config/systemd/user/runspool.service"),
                "/usr/lib/systemd/user/runspool.service".into(),
            ]
            .into_iter()
            .find(|p| p.exists());
            let enabled = Path::new(&home).join(".config/systemd/user/default.target.wants/runspool.service").exists();
            checks.push(match (unit, enabled) {
                (Some(u), true) => check("unit", "ok", format!("{} installed and enabled", u.display())),
                (Some(u), false) => check(
                    "unit",
                    "warn",
                    format!("{} installed but not enabled: systemctl --user enable --now runspool", u.display()),
                ),
                (None, _) if no_manager.is_some() => check(
                    "unit",
                    "warn",
                    "no user unit installed, and none can be without a user manager (see `manager`); run `runspool daemon` yourself",
                ),
                (None, _) => {
                    check("unit", "warn", "no user unit installed: `runspool service install` writes and enables one")
                }
            });
        }
        if let Some(user) = nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten() {
            let linger = Path::new("/var/lib/systemd/linger").join(&user.name).exists();
            checks.push(check(
                "linger",
                if linger { "ok" } else { "warn" },
                if linger {
                    "lingering is on: the service survives logout".to_string()
                } else {
                    format!(
                        "lingering is off: a user service stops at logout; enable it with `loginctl enable-linger {}`",
                        user.name
                    )
                },
            ));
        }
    }
    // Providers.
    if let Some(c) = &cfg {
        for (name, p) in &c.providers {
            let exe = if p.kind == "slurm" { "sinfo".to_string() } else { p.command[0].clone() };
            let found = find_executable(&exe);
            checks.push(check(
                "provider",
                if found { "ok" } else { "fail" },
                format!(
                    "{name} ({}): `{exe}` {}",
                    p.kind,
                    if found {
                        "found"
                    } else {
                        "not found or not executable; install it or fix the path in the config"
                    }
                ),
            ));
        }
    }
    // Hook programs (they run with the daemon's PATH).
    if let Some(c) = &cfg {
        for (key, cmd) in [("hooks.on_complete", &c.hooks.on_complete), ("hooks.on_failure", &c.hooks.on_failure)] {
            if let Some(prog) = cmd.first() {
                let found = find_executable(prog);
                checks.push(check(
                    "hook",
                    if found { "ok" } else { "warn" },
                    format!(
                        "{key}: `{prog}` {}",
                        if found { "found" } else { "not found on PATH; the hook will fail until it is installed" }
                    ),
                ));
            }
        }
    }
    let failed = checks.iter().any(|c| c.level == "fail");
    if as_json {
        let v: Vec<Value> =
            checks.iter().map(|c| json!({"check": c.name, "level": c.level, "detail": c.detail})).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"ok": !failed, "checks": v, "daemon": dj, "inotify": crate::platform::inotify_usage()})
            )?
        );
    } else {
        for c in &checks {
            println!("{:<5} {:<11} {}", c.level, c.name, c.detail);
        }
    }
    Ok(if failed { 1 } else { 0 })
}

pub fn find_executable(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let ok = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if name.contains('/') {
        return ok(Path::new(name));
    }
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| ok(&d.join(name))))
}

/// `runspool status` with no run: the daemon's own status. Exit codes: 0
/// healthy, 3 not running, 4 storage degraded, 5 unresponsive.
pub fn daemon_status(layout: &Layout, as_json: bool) -> anyhow::Result<i32> {
    let config_min = crate::config::Config::load(None).ok().map(|c| c.storage.min_free_bytes);
    let h = Health::read(layout, config_min);
    let code = h.exit_code();
    if as_json {
        let v = json!({
            "alive": h.alive,
            "daemon": h.daemon,
            "responsive": h.running() && h.stale_ms.is_none(),
            "staleMs": h.stale_ms,
            "spoolWaiting": h.spool_waiting,
            "storage": {"state": h.storage_state, "reason": h.storage_reason},
            "queue": h.daemon.as_ref().filter(|_| h.alive).map(|d| d["queue"].clone()),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(code);
    }
    match (h.alive, h.daemon.as_ref()) {
        (true, Some(d)) => {
            match h.unresponsive() {
                Some(why) => {
                    println!("daemon    {why}");
                    println!("fix       {}", h.fix());
                }
                None => println!(
                    "daemon    running (pid {}, version {})",
                    d["pid"],
                    d["runspoolVersion"].as_str().unwrap_or("?")
                ),
            }
            println!("root      {}", layout.root.display());
            println!(
                "watch     {} ({}): {}",
                d["watch"]["strategy"].as_str().unwrap_or("?"),
                d["watch"]["backend"].as_str().unwrap_or("?"),
                d["watch"]["reason"].as_str().unwrap_or("")
            );
            println!("storage   {}", h.storage_text());
            println!("runs      {} running, {} queued", d["runs"]["running"], d["runs"]["queued"]);
            if let Some(line) = super::queue_cmd::describe_report(&d["queue"]) {
                println!("queue     {line}");
            }
            Ok(code)
        }
        _ => {
            println!("daemon    not running on {} (start it with `runspool daemon`)", layout.root.display());
            if let Some(line) = super::queue_cmd::describe_file(layout) {
                println!("queue     {line}");
            }
            Ok(code)
        }
    }
}
