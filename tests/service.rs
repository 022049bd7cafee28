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
    let first: Vec<&str> = log.lines().take(2).collect();
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
