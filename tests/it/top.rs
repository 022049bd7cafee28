//! `runspool top` through a real terminal (issue 21 item 4): tmux runs it
//! in a pane of a private server (`tmux -L <unique>`, killed at the end)
//! and `capture-pane` reads what a person would see. Real daemon, real
//! runners. Without tmux (and not root, so scripts/fixtures.sh cannot
//! install it) the tests print why and pass.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// One private tmux server with one pane, killed on drop.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux").arg("-L").arg(&self.socket).args(args).output().expect("run tmux")
    }

    /// A 160×40 pane running `script` under sh.
    fn start(script: &str) -> Tmux {
        let t = Tmux { socket: unique("rs-top") };
        let o = Command::new("tmux")
            .args([
                "-L",
                &t.socket,
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "160",
                "-y",
                "40",
                "sh",
                "-c",
                script,
            ])
            .env_remove("TMUX")
            .env("TERM", "xterm-256color")
            .output()
            .expect("run tmux");
        assert!(o.status.success(), "tmux new-session failed: {}", String::from_utf8_lossy(&o.stderr));
        t
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p"]).stdout).into_owned()
    }

    fn alternate_on(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["display", "-p", "#{alternate_on}"]).stdout).trim().to_string()
    }

    fn keys(&self, keys: &str) {
        let o = self.cmd(&["send-keys", "-l", keys]);
        assert!(o.status.success(), "tmux send-keys failed: {}", String::from_utf8_lossy(&o.stderr));
    }

    /// Wait until the screen satisfies `f`; panic with the screen otherwise.
    fn wait_screen(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
        let mut last = String::new();
        if poll_until(LONG, || {
            last = self.screen();
            f(&last)
        }) {
            return last;
        }
        panic!("timed out waiting for the screen to show {what}; it shows:\n{last}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// tmux is there, or installed by scripts/fixtures.sh as root; false (after
/// saying so) otherwise.
fn have_tmux() -> bool {
    let has = || Command::new("tmux").arg("-V").output().is_ok_and(|o| o.status.success());
    if !has() && is_root() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures.sh");
        let st = Command::new("bash").arg(script).arg("tmux").status().expect("run scripts/fixtures.sh");
        assert!(st.success(), "scripts/fixtures.sh tmux failed");
    }
    if !has() {
        eprintln!("SKIPPED: tmux is not installed and we are not root to install it (scripts/fixtures.sh tmux)");
        return false;
    }
    true
}

/// The pane's script: saves the terminal's settings, runs top, says how it
/// exited, saves the settings again, and keeps the pane open.
fn pane_script(env: &TestEnv) -> (String, PathBuf, PathBuf) {
    let before = env.base().join("stty-before");
    let after = env.base().join("stty-after");
    let script = format!(
        "echo shell-before-top; stty -g > '{b}'; '{bin}' top --root '{root}'; echo \"top exited $?\"; \
         stty -g > '{a}'; exec sleep 600",
        b = before.display(),
        a = after.display(),
        bin = BIN,
        root = env.root.display()
    );
    (script, before, after)
}

/// The pid of the `runspool top` of this root.
fn top_pid(env: &TestEnv) -> Option<i32> {
    let root = env.root.to_str().unwrap();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        (args.first() == Some(&BIN.as_bytes()) && args.get(1) == Some(&&b"top"[..]) && args.contains(&root.as_bytes()))
            .then_some(pid)
    })
}

fn assert_restored(env: &TestEnv, t: &Tmux, before: &Path, after: &Path) {
    let screen = t.wait_screen("top's exit line", |s| s.contains("top exited"));
    assert!(screen.contains("top exited 0"), "top did not exit 0:\n{screen}");
    // The alternate screen is left: the shell's earlier output is back.
    assert!(screen.contains("shell-before-top"), "the screen before top did not come back:\n{screen}");
    assert_eq!(t.alternate_on(), "0", "the pane is still on the alternate screen:\n{screen}");
    wait_until(LONG, "the pane to save the terminal settings after top", || after.exists());
    let (b, a) = (std::fs::read_to_string(before).unwrap(), std::fs::read_to_string(after).unwrap());
    assert_eq!(b.trim(), a.trim(), "top left the terminal's settings changed (stty -g before/after)");
    let _ = env;
}

/// It shows the running run, its output's last line and why the queued run
/// waits; `s` stops the selected (running) run, which ends `stopped` while
/// the queued one then starts; `q` restores the terminal.
#[test]
fn top_shows_runs_stops_the_selected_one_and_restores_the_terminal() {
    if !have_tmux() {
        return;
    }
    let mut env = TestEnv::with_config("max_running = 1\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let marker = format!("top-marker-{}", std::process::id());
    let running = "aaaa1111-top-running";
    let queued = "bbbb2222-top-queued";
    env.submit(&request(Some(running), &env.work, vec![sh_step("loop", &format!("echo {marker}; exec sleep 300"))]));
    wait_until(LONG, "the first run to run and print its line", || {
        env.state(running).as_deref() == Some("running") && env.output_log(running, 0).contains(&marker)
    });
    env.submit(&request(Some(queued), &env.work, vec![cmd_step("sleeper", &["sleep", "300"])]));
    wait_until(LONG, "the second run to wait for max_running", || {
        env.status(queued).is_some_and(|s| s["waiting"] == "max_running")
    });

    let (script, before, after) = pane_script(&env);
    let t = Tmux::start(&script);
    let screen = t.wait_screen("both runs, the output line and the wait reason", |s| {
        s.contains(&marker) && s.contains("aaaa1111") && s.contains("bbbb2222") && s.contains("max_running")
    });
    let row = |s: &str, id: &str| s.lines().find(|l| l.starts_with(id)).unwrap_or_default().to_string();
    assert!(row(&screen, "aaaa1111").contains("running"), "the running run's row:\n{screen}");
    assert!(row(&screen, "bbbb2222").contains("waiting: max_running"), "the queued run's row:\n{screen}");
    assert!(screen.contains("RUNNING (1)") && screen.contains("QUEUED (1)"), "sections:\n{screen}");
    assert_eq!(t.alternate_on(), "1", "top draws on the alternate screen");
    // Rows are cut to the width, never wrapped.
    assert!(screen.lines().all(|l| l.chars().count() <= 160), "a line is wider than the pane:\n{screen}");

    // The first row, selected at start, is the running run.
    t.keys("s");
    let end = env.wait_terminal(running);
    assert_eq!(end["state"], "stopped", "the selected run did not end stopped: {end}");
    wait_until(LONG, "the queued run to start once the slot is free", || {
        env.state(queued).as_deref() == Some("running")
    });
    let screen = t.wait_screen("the stopped run among the recent ends", |s| {
        row(s, "aaaa1111").contains("stopped") && row(s, "bbbb2222").contains("running")
    });
    assert!(screen.contains("RECENT (1)"), "{screen}");

    t.keys("q");
    assert_restored(&env, &t, &before, &after);
    assert_eq!(env.state(queued).as_deref(), Some("running"), "quitting top must not touch the runs");
}

/// SIGTERM ends top as `q` does: the terminal is restored.
#[test]
fn sigterm_restores_the_terminal() {
    if !have_tmux() {
        return;
    }
    let mut env = TestEnv::new();
    env.start_daemon();
    let (script, before, after) = pane_script(&env);
    let t = Tmux::start(&script);
    t.wait_screen("top's view", |s| s.contains("runspool top") && s.contains("daemon running"));
    assert_eq!(t.alternate_on(), "1");
    let mut pid = None;
    wait_until(Duration::from_secs(10), "top's process", || {
        pid = top_pid(&env);
        pid.is_some()
    });
    unsafe {
        libc::kill(pid.unwrap(), libc::SIGTERM);
    }
    assert_restored(&env, &t, &before, &after);
}
