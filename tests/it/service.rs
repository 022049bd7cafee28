//! `runspool service`: the unit it installs and the service-manager calls it
//! makes, against recording stand-ins for `systemctl` and `journalctl` on
//! PATH (a real user manager is not started here), and the rendered unit
//! checked by `systemd-analyze verify` when it is installed.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_runspool");

fn recorder(dir: &Path, name: &str, log: &Path) {
    let p = dir.join(name);
    fs::write(&p, format!("#!/bin/sh\necho \"{name} $*\" >> {}\n", log.display())).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
}

fn runspool(tmp: &Path, args: &[&str]) -> std::process::Output {
    let path = format!("{}:{}", tmp.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    Command::new(BIN)
        .args(args)
        .env("HOME", tmp.join("home"))
        .env_remove("XDG_CONFIG_HOME")
        .env("PATH", path)
        .output()
        .unwrap()
}

#[test]
fn install_writes_the_unit_and_enables_it() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    fs::create_dir_all(t.join("bin")).unwrap();
    fs::create_dir_all(t.join("home")).unwrap();
    let calls = t.join("calls");
    recorder(&t.join("bin"), "systemctl", &calls);
    recorder(&t.join("bin"), "journalctl", &calls);
    let root = t.join("root");
    let cfg = t.join("config.toml");
    fs::write(&cfg, "").unwrap();

    let out = runspool(t, &["--root", root.to_str().unwrap(), "service", "install", "--config", cfg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let unit_path = t.join("home/.config/systemd/user/runspool.service");
    let unit = fs::read_to_string(&unit_path).unwrap();
    let exec = format!("ExecStart={BIN} daemon --root {} --config {}", root.display(), cfg.display());
    assert!(unit.lines().any(|l| l == exec), "no `{exec}` in\n{unit}");
    for needed in ["Type=notify", "KillMode=process", "WatchdogSec=", "Restart=on-failure", "ExecReload="] {
        assert!(unit.contains(needed), "unit lacks {needed}");
    }
    assert!(!unit.lines().any(|l| l.starts_with("PrivateTmp=")), "PrivateTmp would hide the default root under /tmp");

    for (args, want) in [
        (vec!["service", "start"], "systemctl --user start runspool.service"),
        (vec!["service", "restart"], "systemctl --user restart runspool.service"),
        (vec!["service", "status"], "systemctl --user status runspool.service"),
        (vec!["service", "logs", "--follow"], "journalctl --user -u runspool.service --no-pager -f"),
        (vec!["service", "stop"], "systemctl --user stop runspool.service"),
        (vec!["service", "uninstall"], "systemctl --user disable --now runspool.service"),
    ] {
        let out = runspool(t, &args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let log = fs::read_to_string(&calls).unwrap();
        assert!(log.lines().any(|l| l == want), "{args:?} did not run `{want}`:\n{log}");
    }
    let log = fs::read_to_string(&calls).unwrap();
    // Each command first probes for the user manager (`show-environment`).
    let first: Vec<&str> = log.lines().filter(|l| !l.ends_with(" show-environment")).take(2).collect();
    assert_eq!(first, ["systemctl --user daemon-reload", "systemctl --user enable runspool.service"]);
    assert!(!unit_path.exists(), "uninstall left the unit behind");

    // The rendered unit passes systemd's own checker, with nothing on stderr.
    if Command::new("systemd-analyze").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let check = t.join("runspool.service");
        fs::write(&check, &unit).unwrap();
        let v = Command::new("systemd-analyze").arg("verify").arg(&check).output().unwrap();
        assert!(
            v.status.success() && v.stderr.is_empty(),
            "systemd-analyze verify: {}",
            String::from_utf8_lossy(&v.stderr)
        );
    } else {
        eprintln!("skipped: systemd-analyze is not installed; the unit was not verified");
    }
}

#[test]
fn shipped_unit_and_plist_are_well_formed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let unit = fs::read_to_string(root.join("systemd/runspool.service")).unwrap();
    assert!(unit.contains("[Service]") && unit.contains("Type=notify"));
    let plist = root.join("launchd/dev.runspool.daemon.plist");
    if Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let out = Command::new("python3")
            .args(["-c", "import plistlib,sys; d=plistlib.load(open(sys.argv[1],'rb')); assert d['AbandonProcessGroup'] and d['RunAtLoad'] and d['ProgramArguments'][1]=='daemon', d"])
            .arg(&plist)
            .output()
            .unwrap();
        assert!(out.status.success(), "plist: {}", String::from_utf8_lossy(&out.stderr));
        let keys = Command::new("python3")
            .args([
                "-c",
                "import plistlib,sys; d=plistlib.load(open(sys.argv[1],'rb')); \
                 assert d['KeepAlive']=={'SuccessfulExit': False}, d['KeepAlive']; \
                 assert d['ProcessType']=='Background', d['ProcessType']; \
                 assert d['Label']=='dev.runspool.daemon'; assert 'StandardErrorPath' in d",
            ])
            .arg(&plist)
            .output()
            .unwrap();
        assert!(keys.status.success(), "plist keys: {}", String::from_utf8_lossy(&keys.stderr));
    } else {
        eprintln!("skipped: python3 is not installed; the plist was not parsed");
    }
    // xmllint: well-formed XML (installed by scripts/fixtures.sh when we are root).
    if nix_is_root() {
        let fx = Command::new("bash").arg(root.join("scripts/fixtures.sh")).arg("xmllint").status().unwrap();
        assert!(fx.success(), "scripts/fixtures.sh xmllint failed");
    }
    match Command::new("xmllint").arg("--noout").arg(&plist).output() {
        Ok(o) => assert!(o.status.success() && o.stderr.is_empty(), "xmllint: {}", String::from_utf8_lossy(&o.stderr)),
        Err(_) => {
            eprintln!("SKIP xmllint check: xmllint is not installed and we are not root to install it (libxml2-utils)")
        }
    }
}

fn nix_is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// A `systemctl` stand-in that fails the way the real one does without a
/// user bus, recording every call.
fn busless_systemctl(dir: &Path, log: &Path) {
    let p = dir.join("systemctl");
    fs::write(
        &p,
        format!(
            "#!/bin/sh\necho \"systemctl $*\" >> {}\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n",
            log.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs `runspool` with no user manager to find: XDG_RUNTIME_DIR an empty
/// directory, no session bus, and `path` as the whole PATH.
fn runspool_without_manager(t: &Path, path: &str, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("HOME", t.join("home"))
        .env("XDG_CONFIG_HOME", t.join("xdg"))
        .env("XDG_RUNTIME_DIR", t.join("runtime"))
        .env_remove("DBUS_SESSION_BUS_ADDRESS")
        .env("PATH", path)
        .output()
        .unwrap()
}

fn assert_explains(args: &[&str], out: &std::process::Output, missing: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{args:?}: want exit 69 (no user manager); stderr:\n{err}");
    assert!(err.contains(missing), "{args:?} does not say what is missing ({missing}):\n{err}");
    assert!(err.contains("runspool daemon"), "{args:?} does not say how to run without it:\n{err}");
    assert!(!err.contains("Failed to connect to bus") || err.contains("no systemd user manager"), "{err}");
}

#[test]
fn service_commands_explain_a_missing_user_manager() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    for d in ["bin", "home", "xdg", "runtime", "nosystemd"] {
        fs::create_dir_all(t.join(d)).unwrap();
    }
    let calls = t.join("calls");
    busless_systemctl(&t.join("bin"), &calls);
    recorder(&t.join("bin"), "journalctl", &calls);
    // Only the stand-ins and the basics a shell script needs, never the host's systemctl.
    for tool in ["sh", "echo"] {
        if let Some(src) = ["/bin", "/usr/bin"].iter().map(|d| Path::new(d).join(tool)).find(|p| p.exists()) {
            std::os::unix::fs::symlink(&src, t.join("bin").join(tool)).unwrap();
        }
    }
    let verbs: [&[&str]; 7] = [
        &["service", "install"],
        &["service", "start"],
        &["service", "stop"],
        &["service", "restart"],
        &["service", "status"],
        &["service", "status", "--json"],
        &["service", "logs"],
    ];
    // 1. systemctl exists but cannot reach a user bus.
    let with_bus_less = t.join("bin").display().to_string();
    for args in verbs {
        let out = runspool_without_manager(t, &with_bus_less, args);
        assert_explains(args, &out, "no systemd user manager reachable");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("loginctl enable-linger") && err.contains("machinectl shell"), "{args:?}:\n{err}");
        assert!(err.contains(&format!("no user bus socket at {}", t.join("runtime/bus").display())), "{err}");
    }
    let log = fs::read_to_string(&calls).unwrap_or_default();
    assert!(
        log.lines().all(|l| l == "systemctl --user show-environment"),
        "a service command went on past the probe:\n{log}"
    );
    // 2. No systemctl at all.
    let bare = t.join("nosystemd").display().to_string();
    for args in verbs {
        let out = runspool_without_manager(t, &bare, args);
        assert_explains(args, &out, "`systemctl` is not on PATH");
    }
    // Nothing was written anywhere: no unit, no directories.
    for d in ["home", "xdg"] {
        let left: Vec<_> = walk(&t.join(d));
        assert!(left.is_empty(), "a refused install left {left:?} under {d}");
    }
    // uninstall still removes a unit written earlier (and the enable link), touching no manager.
    let unit = t.join("xdg/systemd/user/runspool.service");
    fs::create_dir_all(unit.parent().unwrap().join("default.target.wants")).unwrap();
    fs::write(&unit, "[Unit]\n").unwrap();
    let wants = unit.parent().unwrap().join("default.target.wants/runspool.service");
    std::os::unix::fs::symlink(&unit, &wants).unwrap();
    let out = runspool_without_manager(t, &bare, &["service", "uninstall"]);
    assert!(out.status.success(), "uninstall: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!unit.exists() && fs::symlink_metadata(&wants).is_err(), "uninstall left the unit or its link");
    // doctor gives the same diagnosis and no longer advises `service install`.
    let out = runspool_without_manager(t, &with_bus_less, &["--root", t.join("root").to_str().unwrap(), "doctor"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("no systemd user manager reachable"), "doctor:\n{text}");
    assert!(!text.contains("`runspool service install` writes"), "doctor still advises service install:\n{text}");
}

fn walk(d: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(d).into_iter().flatten().flatten() {
        out.push(e.path());
        if e.file_type().is_ok_and(|f| f.is_dir()) {
            out.extend(walk(&e.path()));
        }
    }
    out
}

#[test]
fn a_failed_install_leaves_nothing_behind() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    fs::create_dir_all(t.join("bin")).unwrap();
    fs::create_dir_all(t.join("home")).unwrap();
    let calls = t.join("calls");
    // A user manager that answers the probe and the reload but refuses to enable.
    let p = t.join("bin/systemctl");
    fs::write(
        &p,
        format!(
            "#!/bin/sh\necho \"systemctl $*\" >> {}\ncase \"$2\" in enable) echo 'Failed to enable unit: Access denied' >&2; exit 1;; esac\nexit 0\n",
            calls.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    let out = runspool(t, &["--root", t.join("root").to_str().unwrap(), "service", "install"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("Access denied") && err.contains("undid it"), "{err}");
    let left = walk(&t.join("home"));
    assert!(left.is_empty(), "a failed install left {left:?}");
    let log = fs::read_to_string(&calls).unwrap();
    assert_eq!(log.lines().last(), Some("systemctl --user daemon-reload"), "no reload after the undo:\n{log}");
}

/// The service watches the root the CLI uses: `install` (and `unit`) carry
/// `$RUNSPOOL_ROOT` / `$PI_SUBAGENTS_TEMP_ROOT` into ExecStart as `--root`,
/// `--root` still wins, and without any of them no `--root` is written.
#[test]
fn install_carries_the_root_from_the_environment() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    fs::create_dir_all(t.join("bin")).unwrap();
    fs::create_dir_all(t.join("home")).unwrap();
    recorder(&t.join("bin"), "systemctl", &t.join("calls"));
    let env_root = t.join("env root");
    let exec_of = |env: &[(&str, &Path)], args: &[&str]| -> String {
        let path = format!("{}:{}", t.join("bin").display(), std::env::var("PATH").unwrap_or_default());
        let mut c = Command::new(BIN);
        c.args(args)
            .env("HOME", t.join("home"))
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("RUNSPOOL_ROOT")
            .env_remove("PI_SUBAGENTS_TEMP_ROOT")
            .env("PATH", path);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let unit = if args.contains(&"install") {
            fs::read_to_string(t.join("home/.config/systemd/user/runspool.service")).unwrap()
        } else {
            String::from_utf8(out.stdout).unwrap()
        };
        unit.lines().find(|l| l.starts_with("ExecStart=")).unwrap().to_string()
    };
    let quoted = format!("--root \"{}\"", env_root.display());

    let exec = exec_of(&[("RUNSPOOL_ROOT", &env_root)], &["service", "install"]);
    assert!(exec.ends_with(&format!("daemon {quoted}")), "RUNSPOOL_ROOT not in the installed unit: {exec}");
    let exec = exec_of(&[("PI_SUBAGENTS_TEMP_ROOT", &env_root)], &["service", "unit"]);
    assert!(exec.ends_with(&format!("daemon {quoted}")), "PI_SUBAGENTS_TEMP_ROOT not in the unit: {exec}");
    let flag = t.join("flag");
    let exec = exec_of(&[("RUNSPOOL_ROOT", &env_root)], &["--root", flag.to_str().unwrap(), "service", "unit"]);
    assert!(exec.ends_with(&format!("daemon --root {}", flag.display())), "--root must win: {exec}");
    let exec = exec_of(&[], &["service", "unit"]);
    assert!(exec.ends_with(" daemon"), "no root given, none written: {exec}");
}
