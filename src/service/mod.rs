//! `runspool service ...`: install the daemon as a systemd user service
//! (Linux) or a launchd agent (macOS) for the current binary and root, and
//! wrap `systemctl --user` / `launchctl` / `journalctl` so nobody has to
//! remember them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

pub const UNIT_NAME: &str = "runspool.service";
pub const LAUNCHD_LABEL: &str = "dev.runspool.daemon";

/// The daemon's command line: the current binary, `daemon`, and the root and
/// config given to `install` (none: the defaults the daemon resolves itself).
pub fn daemon_args(exe: &Path, root: Option<&Path>, config: Option<&Path>) -> Vec<String> {
    let mut a = vec![exe.display().to_string(), "daemon".to_string()];
    if let Some(r) = root {
        a.push("--root".into());
        a.push(r.display().to_string());
    }
    if let Some(c) = config {
        a.push("--config".into());
        a.push(c.display().to_string());
    }
    a
}

/// Quote one argument for a systemd `ExecStart=` line.
fn systemd_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-=:+,@".contains(c)) {
        s.to_string()
    } else {
        format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\"").replace('%', "%%").replace('$', "$$"))
    }
}

/// The user unit, the same as systemd/runspool.service with ExecStart filled in.
pub fn render_unit(args: &[String]) -> String {
    let template = include_str!("../../systemd/runspool.service");
    let exec: Vec<String> = args.iter().map(|a| systemd_quote(a)).collect();
    template
        .lines()
        .map(|l| if l.starts_with("ExecStart=") { format!("ExecStart={}", exec.join(" ")) } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The LaunchAgent plist, the same as launchd/ with the program and log path filled in.
pub fn render_plist(args: &[String], log: &Path) -> String {
    let template = include_str!("../../launchd/dev.runspool.daemon.plist");
    let program: String = args.iter().map(|a| format!("    <string>{}</string>\n", xml_escape(a))).collect();
    let start = template.find("  <key>ProgramArguments</key>").expect("template has ProgramArguments");
    let end =
        template[start..].find("</array>").map(|i| start + i + "</array>\n".len()).expect("template closes the array");
    let mut out = String::new();
    out.push_str(&template[..start]);
    out.push_str("  <key>ProgramArguments</key>\n  <array>\n");
    out.push_str(&program);
    out.push_str("  </array>\n");
    out.push_str(&template[end..]);
    out.replace(
        "<string>/tmp/runspool.stderr.log</string>",
        &format!("<string>{}</string>", xml_escape(&log.display().to_string())),
    )
}

/// Where a distribution package installs the user unit (the deb and the RPM
/// spec in packaging/). A unit `install` writes under ~/.config overrides it.
pub const PACKAGED_UNIT: &str = "/usr/lib/systemd/user/runspool.service";

/// `runspool service unit`: the unit `install` would write, on stdout. With
/// `--bin /usr/bin/runspool` this is the unit the packages ship, so the
/// packaging scripts render it from here rather than keeping a copy.
pub fn print_unit(bin: Option<&Path>, root: Option<&Path>, config: Option<&Path>) -> anyhow::Result<i32> {
    let exe = match bin {
        Some(b) => b.to_path_buf(),
        None => std::env::current_exe().context("cannot find the runspool binary's own path")?,
    };
    print!("{}", render_unit(&daemon_args(&exe, root, config)));
    Ok(0)
}

fn home() -> anyhow::Result<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from).context("HOME is not set; runspool service needs your home directory")
}

pub fn unit_path() -> anyhow::Result<PathBuf> {
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => home()?.join(".config"),
    };
    Ok(base.join("systemd/user").join(UNIT_NAME))
}

fn plist_path() -> anyhow::Result<PathBuf> {
    Ok(home()?.join("Library/LaunchAgents").join(format!("{LAUNCHD_LABEL}.plist")))
}

/// Exit code of every `runspool service` command that finds no user service
/// manager to talk to (sysexits' EX_UNAVAILABLE): nothing was changed.
pub const EXIT_NO_MANAGER: i32 = 69;

/// How long the probe waits for `systemctl --user show-environment`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first executable `name` on PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    crate::platform::exec::find_executable(name).ok()
}

/// Why a probe of the service manager did not succeed; `shown` is the
/// command line, quoted.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("cannot run {shown}: {source}")]
    Spawn { shown: String, source: std::io::Error },
    #[error("{shown} did not answer within {secs} s")]
    Timeout { shown: String, secs: u64 },
    #[error("{shown} exited with {code}")]
    Exited { shown: String, code: i32 },
    #[error("{shown} failed: {stderr}")]
    Failed { shown: String, stderr: String },
}

/// Run `cmd` with its output captured, killing it after `limit`; `Err` says
/// why it did not succeed (its stderr, its exit code, or the timeout).
fn probe(cmd: &mut Command, limit: Duration) -> Result<(), ProbeError> {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let shown = format!("`{shown}`");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ProbeError::Spawn { shown: shown.clone(), source })?;
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ProbeError::Timeout { shown, secs: limit.as_secs() });
            }
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        let _ = e.by_ref().take(4096).read_to_string(&mut err);
    }
    let err = err.trim();
    Err(if err.is_empty() {
        ProbeError::Exited { shown, code: status.code().unwrap_or(1) }
    } else {
        ProbeError::Failed { shown, stderr: err.to_string() }
    })
}

/// Why there is no user service manager to install into or control, with
/// how to get one and how to run without one. `None`: there is one.
pub fn missing_user_manager() -> Option<String> {
    let user = nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.name)
        .unwrap_or_else(|| "$USER".into());
    let without = "Without a service manager, run the daemon yourself: `runspool daemon` (in a terminal, tmux, \
or your own supervisor; it keeps the same root and runs)";
    if cfg!(target_os = "macos") {
        return on_path("launchctl").is_none().then(|| {
            format!("no user service manager: `launchctl` is not on PATH, so no launchd agent can be installed or controlled.\n{without}")
        });
    }
    if on_path("systemctl").is_none() {
        return Some(format!(
            "no user service manager: `systemctl` is not on PATH (this system does not run systemd, or PATH lacks it), \
so no user unit can be installed or controlled.\n{without}"
        ));
    }
    let why = probe(Command::new("systemctl").args(["--user", "show-environment"]), PROBE_TIMEOUT).err()?;
    let runtime = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()).map(PathBuf::from);
    let bus = match &runtime {
        None => "XDG_RUNTIME_DIR is not set".to_string(),
        Some(r) if !r.join("bus").exists() => format!("there is no user bus socket at {}", r.join("bus").display()),
        Some(r) => format!("the user bus at {} does not answer", r.join("bus").display()),
    };
    Some(format!(
        "no systemd user manager reachable: {bus} ({why}).\n\
Get one: `loginctl enable-linger {user}` starts a user manager for {user} at boot and keeps it after logout; \
or log in through a real session (ssh or a console login, not `su`/`sudo`) so one starts; \
or, as root, `machinectl shell {user}@` opens a session with one.\n{without}"
    ))
}

/// `Some(exit code)` after printing the diagnosis when there is no user manager.
fn require_user_manager(what: &str) -> Option<i32> {
    let why = missing_user_manager()?;
    eprintln!("runspool: cannot {what}: {why}");
    Some(EXIT_NO_MANAGER)
}

fn run(cmd: &mut Command) -> anyhow::Result<i32> {
    let shown = format!("{cmd:?}");
    let st = cmd.status().with_context(|| format!("cannot run {shown}; is it installed and on PATH?"))?;
    Ok(st.code().unwrap_or(1))
}

fn must(cmd: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{cmd:?}");
    match run(cmd)? {
        0 => Ok(()),
        c => bail!("{shown} exited with {c}"),
    }
}

fn systemctl(args: &[&str]) -> Command {
    let mut c = Command::new("systemctl");
    c.arg("--user").args(args);
    c
}

fn linger_off() -> Option<String> {
    let user = nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten()?;
    (!Path::new("/var/lib/systemd/linger").join(&user.name).exists()).then_some(user.name)
}

fn launchd_domain() -> String {
    format!("gui/{}", nix::unistd::getuid())
}

pub fn install(root: Option<&Path>, config: Option<&Path>) -> anyhow::Result<i32> {
    if let Some(code) = require_user_manager("install the service") {
        return Ok(code);
    }
    let exe = std::env::current_exe().context("cannot find the runspool binary's own path")?;
    let args = daemon_args(&exe, root, config);
    if cfg!(target_os = "macos") {
        let log_dir = home()?.join("Library/Logs/runspool");
        std::fs::create_dir_all(&log_dir).with_context(|| format!("cannot create {}", log_dir.display()))?;
        let path = plist_path()?;
        let made = Written::new(&path, &render_plist(&args, &log_dir.join("runspool.log")))?;
        eprintln!("runspool: wrote {}", path.display());
        must(Command::new("launchctl").args(["bootstrap", &launchd_domain()]).arg(&path))?;
        made.keep();
        eprintln!("runspool: loaded {LAUNCHD_LABEL}; logs in {}", log_dir.display());
        return Ok(0);
    }
    let path = unit_path()?;
    let made = Written::new(&path, &render_unit(&args))?;
    eprintln!("runspool: wrote {}", path.display());
    if Path::new(PACKAGED_UNIT).exists() {
        eprintln!(
            "runspool: note: it overrides the packaged {PACKAGED_UNIT} (`runspool service uninstall` removes it again)"
        );
    }
    must(&mut systemctl(&["daemon-reload"]))?;
    if let Err(e) = must(&mut systemctl(&["enable", UNIT_NAME])) {
        // Undo the reload's effect too once the unit file is gone.
        drop(made);
        let _ = run(&mut systemctl(&["daemon-reload"]));
        return Err(e);
    }
    made.keep();
    eprintln!("runspool: enabled; start it with `runspool service start` (or `systemctl --user start runspool`)");
    if let Some(user) = linger_off() {
        eprintln!(
            "runspool: warning: lingering is off, so the service stops when you log out; keep it running with: loginctl enable-linger {user}"
        );
    }
    Ok(0)
}

/// A file `install` wrote, and the directories it created for it: removed
/// again when dropped unless `keep` was called, so a failed install leaves
/// nothing behind.
struct Written {
    path: PathBuf,
    previous: Option<Vec<u8>>,
    dirs: Vec<PathBuf>,
    keep: bool,
}

impl Written {
    fn new(path: &Path, text: &str) -> anyhow::Result<Written> {
        let parent = path.parent().context("the unit path has no directory")?;
        let mut dirs = Vec::new();
        let mut d = parent;
        while !d.exists() {
            dirs.push(d.to_path_buf());
            match d.parent() {
                Some(p) => d = p,
                None => break,
            }
        }
        let mut w = Written { path: path.to_path_buf(), previous: std::fs::read(path).ok(), dirs, keep: false };
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        w.dirs.reverse();
        Ok(w)
    }

    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Written {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        match &self.previous {
            Some(old) => {
                let _ = std::fs::write(&self.path, old);
            }
            None => {
                let _ = std::fs::remove_file(&self.path);
                // Innermost first; remove_dir fails (and keeps) a directory something else wrote into.
                for d in self.dirs.iter().rev() {
                    let _ = std::fs::remove_dir(d);
                }
            }
        }
        eprintln!(
            "runspool: install failed; undid it ({} {})",
            if self.previous.is_some() { "restored" } else { "removed" },
            self.path.display()
        );
    }
}

pub fn uninstall() -> anyhow::Result<i32> {
    if cfg!(target_os = "macos") {
        let path = plist_path()?;
        let _ = run(Command::new("launchctl").args(["bootout", &format!("{}/{LAUNCHD_LABEL}", launchd_domain())]));
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
        eprintln!("runspool: removed {} (runs keep running)", path.display());
        return Ok(0);
    }
    let path = unit_path()?;
    // Without a user manager there is nothing to disable: remove the file alone.
    let manager = match missing_user_manager() {
        Some(why) => {
            eprintln!("runspool: note: {}; removing the unit file only", why.lines().next().unwrap_or_default());
            false
        }
        None => true,
    };
    if manager {
        let _ = run(&mut systemctl(&["disable", "--now", UNIT_NAME]));
    }
    if path.exists() {
        std::fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
    }
    // `enable` links the unit into default.target.wants; a disable that could not run leaves it dangling.
    if let Some(wants) = path.parent().map(|p| p.join("default.target.wants").join(UNIT_NAME)) {
        if std::fs::symlink_metadata(&wants).is_ok_and(|m| m.file_type().is_symlink()) && !wants.exists() {
            let _ = std::fs::remove_file(&wants);
        }
    }
    if manager {
        let _ = run(&mut systemctl(&["daemon-reload"]));
    }
    eprintln!("runspool: removed {} (runs keep running: KillMode=process)", path.display());
    Ok(0)
}

/// start, stop, restart, status.
pub fn control(verb: &str) -> anyhow::Result<i32> {
    if let Some(code) = require_user_manager(&format!("{verb} the service")) {
        return Ok(code);
    }
    if cfg!(target_os = "macos") {
        let target = format!("{}/{LAUNCHD_LABEL}", launchd_domain());
        return match verb {
            "start" => run(Command::new("launchctl").args(["kickstart", &target])),
            "restart" => run(Command::new("launchctl").args(["kickstart", "-k", &target])),
            "stop" => run(Command::new("launchctl").args(["kill", "SIGTERM", &target])),
            _ => run(Command::new("launchctl").args(["print", &target])),
        };
    }
    run(&mut systemctl(&[verb, UNIT_NAME]))
}

/// `runspool service status --json`: the service manager's view as one JSON
/// object (systemd: the properties of `systemctl --user show`; launchd: the
/// state and pid lines of `launchctl print`). Exit 0 when the service runs,
/// 3 when it does not (as `systemctl status`).
pub fn status_json() -> anyhow::Result<i32> {
    if let Some(code) = require_user_manager("read the service's status") {
        return Ok(code);
    }
    let mut v = serde_json::Map::new();
    let running = if cfg!(target_os = "macos") {
        let target = format!("{}/{LAUNCHD_LABEL}", launchd_domain());
        v.insert("manager".into(), "launchd".into());
        v.insert("label".into(), LAUNCHD_LABEL.into());
        let o = Command::new("launchctl").args(["print", &target]).output().context("cannot run launchctl")?;
        let text = String::from_utf8_lossy(&o.stdout);
        v.insert("loaded".into(), o.status.success().into());
        for line in text.lines().map(str::trim) {
            for key in ["state", "pid", "last exit code"] {
                if let Some(val) = line.strip_prefix(key).and_then(|r| r.trim_start().strip_prefix('=')) {
                    v.entry(key.replace(' ', "_")).or_insert_with(|| val.trim().into());
                }
            }
        }
        v.get("state").and_then(|s| s.as_str()) == Some("running")
    } else {
        const PROPS: &str = "LoadState,UnitFileState,ActiveState,SubState,Result,MainPID,NRestarts,StatusText,ActiveEnterTimestamp,FragmentPath";
        let o = systemctl(&["show", UNIT_NAME, "-p", PROPS]).output().context(
            "cannot run systemctl --user; is systemd installed and a user manager running (XDG_RUNTIME_DIR)?",
        )?;
        if !o.status.success() {
            bail!("systemctl --user show {UNIT_NAME} failed: {}", String::from_utf8_lossy(&o.stderr).trim());
        }
        v.insert("manager".into(), "systemd".into());
        v.insert("unit".into(), UNIT_NAME.into());
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some((k, val)) = line.split_once('=') {
                let j: serde_json::Value = match k {
                    "MainPID" | "NRestarts" => val.parse::<u64>().map(Into::into).unwrap_or_else(|_| val.into()),
                    _ => val.into(),
                };
                v.insert(k.to_string(), j);
            }
        }
        v.get("ActiveState").and_then(|s| s.as_str()) == Some("active")
    };
    println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(v))?);
    Ok(if running { 0 } else { 3 })
}

pub fn logs(follow: bool) -> anyhow::Result<i32> {
    if let Some(code) = require_user_manager("show the service's log") {
        return Ok(code);
    }
    if cfg!(target_os = "macos") {
        let log = home()?.join("Library/Logs/runspool/runspool.log");
        let mut c = Command::new("tail");
        c.args(if follow { vec!["-n", "100", "-F"] } else { vec!["-n", "100"] }).arg(&log);
        return run(&mut c);
    }
    let mut c = Command::new("journalctl");
    c.args(["--user", "-u", UNIT_NAME, "--no-pager"]);
    if follow {
        c.arg("-f");
    }
    run(&mut c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_has_the_binary_root_and_config() {
        let args = daemon_args(
            Path::new("/opt/run spool/bin/runspool"),
            Some(Path::new("/home/a/rs")),
            Some(Path::new("/home/a/c.toml")),
        );
        let unit = render_unit(&args);
        assert!(
            unit.contains(
                "ExecStart=\"/opt/run spool/bin/runspool\" daemon --root /home/a/rs --config /home/a/c.toml\n"
            ),
            "{unit}"
        );
        assert!(unit.contains("Type=notify") && unit.contains("KillMode=process") && unit.contains("WatchdogSec="));
        assert_eq!(unit.matches("ExecStart=").count(), 1);
    }

    #[test]
    fn systemd_specials_are_escaped() {
        assert_eq!(systemd_quote("/usr/bin/runspool"), "/usr/bin/runspool");
        assert_eq!(systemd_quote("50%$x"), "\"50%%$$x\"");
    }

    #[test]
    fn plist_has_the_program_and_log() {
        let args = daemon_args(Path::new("/usr/local/bin/runspool"), None, None);
        let p = render_plist(&args, Path::new("/Users/a/Library/Logs/runspool/runspool.log"));
        assert!(p.contains("<string>/usr/local/bin/runspool</string>\n    <string>daemon</string>\n  </array>"), "{p}");
        assert!(p.contains("<string>/Users/a/Library/Logs/runspool/runspool.log</string>"));
        assert!(p.contains("AbandonProcessGroup") && p.contains("RunAtLoad"));
        assert_eq!(p.matches("<key>ProgramArguments</key>").count(), 1);
    }
}
