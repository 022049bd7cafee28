//! Other local users: the daemon runs as an unprivileged test user (created
//! idempotently by scripts/ci-user.sh) and files planted by root or by a third
//! user (`nobody`) are refused with `bad-owner` and never run; unsafe roots
//! make the daemon refuse to start. Needs root to switch users: otherwise each
//! test prints "skipped: needs root" and returns.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::Value;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

const NOBODY: u32 = 65534;

/// (uid, gid) of the test user, created on first use by scripts/ci-user.sh.
fn test_user() -> (u32, u32) {
    static USER: OnceLock<(u32, u32)> = OnceLock::new();
    *USER.get_or_init(|| {
        let name = std::env::var("RUNSPOOL_TEST_USER").unwrap_or_else(|_| "runspool-ci".into());
        let lookup = |flag: &str| -> Option<u32> {
            let o = Command::new("id").arg(flag).arg(&name).stderr(Stdio::null()).output().ok()?;
            String::from_utf8_lossy(&o.stdout).trim().parse().ok().filter(|_| o.status.success())
        };
        if lookup("-u").is_none() {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/ci-user.sh");
            let o = Command::new("bash").arg(&script).output().expect("run scripts/ci-user.sh");
            assert!(o.status.success(), "scripts/ci-user.sh failed:\n{}", describe(&o));
        }
        let (uid, gid) = (lookup("-u").expect("test user uid"), lookup("-g").expect("test user gid"));
        assert_ne!(uid, 0, "the test user must not be root");
        (uid, gid)
    })
}

fn needs_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    report(&format!("{test}: skipped: needs root (to create a second user and switch to it)"));
    true
}

fn chown_tree(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).unwrap();
    for q in walk_all(p) {
        std::os::unix::fs::lchown(&q, Some(uid), Some(gid)).unwrap();
    }
}

/// A test environment handed over to the test user: the base directory and
/// everything in it are theirs, with a copy of the binary they can execute
/// (the checkout itself may not be readable by them).
struct UserEnv {
    env: TestEnv,
    uid: u32,
    gid: u32,
    bin: PathBuf,
}

impl UserEnv {
    fn new() -> UserEnv {
        let (uid, gid) = test_user();
        let env = TestEnv::new();
        let bin = env.base().join("runspool");
        install_program(std::path::Path::new(BIN), &bin);
        mkdir_0700(&env.work.join("canary"));
        chown_tree(&env.base(), uid, gid);
        // Traversable (not listable, not writable) so a third user can reach the spool path.
        fs::set_permissions(env.base(), fs::Permissions::from_mode(0o711)).unwrap();
        fs::set_permissions(&env.root, fs::Permissions::from_mode(0o711)).unwrap();
        UserEnv { env, uid, gid, bin }
    }

    fn daemon_as_user(&self, root: &Path) -> Command {
        let mut cmd = self.env.daemon_command_for(&self.bin, root);
        cmd.uid(self.uid).gid(self.gid).env("HOME", self.env.base()).current_dir(self.env.base());
        cmd
    }

    fn start(&mut self) {
        let cmd = self.daemon_as_user(&self.env.root.clone());
        self.env.start_daemon_command(cmd);
        let d = read_json(&self.env.daemon_json()).unwrap();
        let pid = d["pid"].as_i64().unwrap();
        let uid = fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
            .unwrap();
        assert_eq!(uid, self.uid.to_string(), "the daemon runs as the test user");
    }

    fn canary(&self) -> PathBuf {
        self.env.work.join("canary")
    }

    fn body(&self, id: &str) -> Vec<u8> {
        let req =
            request(Some(id), &self.env.work, vec![sh_step("a", &format!("touch {}/{id}", self.canary().display()))]);
        serde_json::to_vec(&req).unwrap()
    }

    /// Publish `spool/<name>.json` (staged under a dot name, then renamed),
    /// owned by `owner`, with `mode`.
    fn plant(&self, name: &str, bytes: &[u8], owner: u32, mode: u32) -> PathBuf {
        let tmp = self.env.spool().join(format!(".plant-{name}"));
        write_file_mode(&tmp, bytes, mode);
        std::os::unix::fs::chown(&tmp, Some(owner), Some(owner)).unwrap();
        let dst = self.env.spool().join(format!("{name}.json"));
        fs::rename(&tmp, &dst).unwrap();
        dst
    }

    fn expect(&self, name: &str, code: &str) -> Value {
        let e = self.env.wait_rejection(name);
        assert_eq!(e["code"], code, "{name}: {e}");
        assert!(!self.env.spool().join(format!("{name}.json")).exists(), "{name} left in the spool");
        assert!(!self.env.run_dir(name).exists(), "{name} became a run");
        e
    }
}

/// Run `sh -c script` as `uid`; true when it succeeded.
fn sh_as(uid: u32, script: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn files_planted_by_other_users_never_run() {
    if needs_root("files_planted_by_other_users_never_run") {
        return;
    }
    let mut u = UserEnv::new();
    u.start();
    let env = &u.env;

    // The user's own request runs, as the user.
    let own = u.body("own-request");
    u.plant("own-request", &own, u.uid, 0o600);
    assert_eq!(env.wait_terminal("own-request")["state"], "complete");
    let made = fs::metadata(u.canary().join("own-request")).unwrap();
    assert_eq!(made.uid(), u.uid, "the step ran as the daemon's user");

    // Planted by root (0600 and 0644) and by a third user: bad-owner, never run.
    u.plant("by-root", &u.body("by-root"), 0, 0o600);
    u.plant("by-root-readable", &u.body("by-root-readable"), 0, 0o644);
    u.plant("by-nobody", &u.body("by-nobody"), NOBODY, 0o600);
    // The user's file, but group-writable: bad-permissions.
    u.plant("own-group-writable", &u.body("own-group-writable"), u.uid, 0o660);
    // A symlink owned by a third user, to the user's own valid request.
    let target = env.work.join("target.json");
    fs::write(&target, u.body("via-nobody-link")).unwrap();
    std::os::unix::fs::chown(&target, Some(u.uid), Some(u.gid)).unwrap();
    let link = env.spool().join(".plant-link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(NOBODY), Some(NOBODY)).unwrap();
    fs::rename(&link, env.spool().join("nobody-link.json")).unwrap();

    for (name, code) in [
        ("by-root", RejectionCode::BadOwner.as_str()),
        ("by-root-readable", RejectionCode::BadOwner.as_str()),
        ("by-nobody", RejectionCode::BadOwner.as_str()),
        ("own-group-writable", RejectionCode::BadPermissions.as_str()),
        ("nobody-link", RejectionCode::NotRegularFile.as_str()),
    ] {
        let e = u.expect(name, code);
        if code == RejectionCode::BadOwner.as_str() {
            assert!(
                e["message"].as_str().unwrap().contains(&u.uid.to_string()),
                "{name}: message names the daemon's uid: {e}"
            );
        }
    }

    // A third user cannot put anything in the spool or a run's control inbox at all.
    let spool = env.spool();
    assert!(!sh_as(NOBODY, &format!("echo x > {}/nobody-direct.json", spool.display())), "nobody wrote into the spool");
    assert!(!spool.join("nobody-direct.json").exists());
    let control = env.run_dir("own-request").join("control");
    assert!(!sh_as(NOBODY, &format!("echo '{{\"type\":\"stop\"}}' > {}/stop.json", control.display())));
    assert!(!sh_as(NOBODY, &format!("ls {}", env.runs().display())), "the runs root is private");

    // Even if the user later makes the spool world-writable by mistake, a
    // request another user drops there is never run: the daemon stops
    // claiming while the spool is loosened (G20), says why in daemon.json,
    // and refuses the entry (bad-owner) once the mode is fixed.
    fs::set_permissions(&spool, fs::Permissions::from_mode(0o777)).unwrap();
    let body = String::from_utf8(u.body("nobody-dropped")).unwrap().replace('\'', "");
    assert!(
        sh_as(
            NOBODY,
            &format!(
                "umask 077; printf '%s' '{body}' > {s}/.nobody-tmp && mv {s}/.nobody-tmp {s}/nobody-dropped.json",
                s = spool.display()
            )
        ),
        "nobody could write into the world-writable spool"
    );
    wait_until(LONG, "daemon.json names the loosened spool", || {
        read_json(&env.daemon_json()).is_some_and(|d| {
            d["storage"]["state"] == "degraded" && d["storage"]["reason"].as_str().unwrap_or("").contains("chmod 700")
        })
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(spool.join("nobody-dropped.json").exists(), "nothing is claimed from a loosened spool");
    fs::set_permissions(&spool, fs::Permissions::from_mode(0o700)).unwrap();
    u.expect("nobody-dropped", RejectionCode::BadOwner.as_str());

    // The daemon still serves its user, and the only steps that ran are the user's.
    u.plant("own-after", &u.body("own-after"), u.uid, 0o600);
    assert_eq!(env.wait_terminal("own-after")["state"], "complete");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(list_names(&u.canary()), vec!["own-after".to_string(), "own-request".to_string()]);
    assert!(u.env.daemon_exited().is_none(), "the daemon is still running");
}

/// The root, spool/ and the runs root must be real directories owned by the
/// daemon's user and not writable by group or others; otherwise it refuses to
/// start, naming the path and the fix (PROTOCOL §1).
#[test]
fn unsafe_roots_make_the_daemon_refuse_to_start() {
    if needs_root("unsafe_roots_make_the_daemon_refuse_to_start") {
        return;
    }
    let u = UserEnv::new();
    let env = &u.env;
    let refuse = |root: &Path, what: &str, needle: &str| {
        let (st, out) = env.run_command_expect_exit(u.daemon_as_user(root), Duration::from_secs(60));
        assert!(!st.success(), "{what}: the daemon started:\n{out}");
        assert!(out.contains(needle), "{what}: the refusal names {needle:?}:\n{out}");
        assert!(!root.join("runspool/daemon.json").exists(), "{what}: the daemon wrote daemon.json");
    };
    let root = env.root.clone();
    let chmod = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();

    chmod(&root, 0o770);
    refuse(&root, "group-writable root", "chmod 700");
    chmod(&root, 0o703);
    refuse(&root, "world-writable root", &root.display().to_string());
    chmod(&root, 0o711);

    chmod(&env.spool(), 0o720);
    refuse(&root, "group-writable spool", &env.spool().display().to_string());
    chmod(&env.spool(), 0o700);

    chmod(&env.runs(), 0o702);
    refuse(&root, "world-writable runs root", &env.runs().display().to_string());
    chmod(&env.runs(), 0o700);

    std::os::unix::fs::chown(env.spool(), Some(NOBODY), Some(NOBODY)).unwrap();
    refuse(&root, "spool owned by another user", "owned by uid");
    std::os::unix::fs::chown(env.spool(), Some(u.uid), Some(u.gid)).unwrap();

    std::os::unix::fs::chown(&root, Some(0), Some(0)).unwrap();
    refuse(&root, "root owned by root", "owned by uid 0");
    std::os::unix::fs::chown(&root, Some(u.uid), Some(u.gid)).unwrap();

    // A root that is a symlink (to a directory the user owns) is refused too.
    let link = env.base().join("root-link");
    std::os::unix::fs::symlink(&root, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(u.uid), Some(u.gid)).unwrap();
    refuse(&link, "symlinked root", "symbolic link");

    // And with everything fixed, the same user starts fine.
    let mut u = u;
    u.start();
    u.plant("fixed", &u.body("fixed"), u.uid, 0o600);
    assert_eq!(u.env.wait_terminal("fixed")["state"], "complete");
}
