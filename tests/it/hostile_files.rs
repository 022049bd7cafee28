//! Files in directories others can write are hostile (issue 12): a FIFO, a
//! directory or a flood of output where runspool expects a small regular file
//! never hangs the daemon or a runner, never makes the daemon loop on it, and
//! never costs memory in proportion to its size. Descriptors the daemon
//! inherits never reach runners and steps.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let n = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A config with a command provider `p` that answers every status poll.
fn provider_env() -> TestEnv {
    let env = TestEnv::new();
    let dir = env.base().join("prov");
    fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("provider.sh");
    fs::write(
        &exe,
        "#!/bin/sh\ncat >/dev/null\nprintf '%s\\n' '{\"providerJobId\":\"job-1\",\"state\":\"running\"}'\n",
    )
    .unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    env.write_config(&format!(
        "{DEFAULT_CONFIG}[providers.p]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 60000\n",
        exe.display()
    ));
    env
}

/// A running run of ours whose "runner" is this test process (it holds
/// runner.lock), with an empty `external-job-requests/`.
fn fake_run(env: &TestEnv, id: &str) -> File {
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    let req = json!({"version": 1, "runId": id, "cwd": env.work, "steps": [{"agent": "x", "externalJob": {"provider": "p", "prompt": "x"}}]});
    write_file_mode(&dir.join("request.json"), req.to_string().as_bytes(), 0o600);
    let now = now_ms();
    let st = json!({
        "runId": id, "sessionId": "default", "mode": "single", "state": "running",
        "startedAt": now, "lastUpdate": now, "timeoutMs": 1800000, "pid": std::process::id(),
        "runner": {"pid": std::process::id(), "hostname": hostname(), "processInstanceId": "test"},
        "cwd": env.work, "queue": {"priority": 0, "claimedAt": now},
        "steps": [{"agent": "x", "status": "running"}]
    });
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
    write_file_mode(&env.active_dir().join(id), b"", 0o600);
    let lock =
        File::options().read(true).write(true).create(true).truncate(false).open(dir.join("runner.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    mkdir_0700(&dir.join("external-job-requests"));
    lock
}

fn reqdir(env: &TestEnv, run: &str) -> PathBuf {
    env.run_dir(run).join("external-job-requests")
}

fn response_path(env: &TestEnv, run: &str, id: &str) -> PathBuf {
    env.run_dir(run).join("external-job-responses").join(format!("{id}.json"))
}

fn wait_response(env: &TestEnv, run: &str, id: &str) -> Value {
    let p = response_path(env, run, id);
    let mut v = None;
    let ok = poll_until(LONG, || {
        v = read_json(&p);
        v.is_some()
    });
    assert!(ok, "no response {} after {:?}\n{}", p.display(), LONG, env.log_tail(60));
    v.unwrap()
}

/// A status request answered proves a full sweep of `run` happened after everything before it.
fn probe(env: &TestEnv, run: &str, n: usize) {
    let id = format!("probe-{n}");
    let body =
        json!({"id": id, "operation": "status", "provider": "p", "providerJobId": "job-1", "createdAt": now_ms()});
    let d = reqdir(env, run);
    let tmp = d.join(format!(".{id}.tmp"));
    write_file_mode(&tmp, body.to_string().as_bytes(), 0o600);
    fs::rename(&tmp, d.join(format!("{id}.json"))).unwrap();
    let r = wait_response(env, run, &id);
    assert_eq!(r["ok"], true, "{r}");
}

/// Issue 12 item 1: a FIFO `<id>.json` in a bridge inbox is answered
/// `malformed-request` and removed, and the daemon loop never blocks on it.
#[test]
fn fifo_bridge_request_is_answered_malformed_and_removed_without_blocking() {
    let mut env = provider_env();
    let _lock = fake_run(&env, "hf-fifo");
    let fifo = reqdir(&env, "hf-fifo").join("fifo-req.json");
    mkfifo(&fifo);
    env.start_daemon();
    let r = wait_response(&env, "hf-fifo", "fifo-req");
    assert_eq!(r["ok"], false, "{r}");
    assert_eq!(r["code"], "malformed-request", "{r}");
    assert!(r["message"].as_str().unwrap().contains("fifo-req.json"), "{r}");
    wait_until(LONG, "the FIFO request to be removed", || fs::symlink_metadata(&fifo).is_err());
    // The loop still serves the bridge and claims runs.
    probe(&env, "hf-fifo", 1);
    env.submit(&request(Some("hf-after-fifo"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-after-fifo")["state"], "complete");
}

/// Issue 12 item 11: a directory `<id>.json` in a bridge inbox gets one
/// `malformed-request` answer; the daemon does not answer it again every sweep.
#[test]
fn directory_bridge_request_is_answered_once() {
    let mut env = provider_env();
    let _lock = fake_run(&env, "hf-dir");
    let d = reqdir(&env, "hf-dir");
    // A non-empty directory cannot be removed safely; an empty one is.
    mkdir_0700(&d.join("dir-req.json"));
    write_file_mode(&d.join("dir-req.json").join("inside"), b"x", 0o600);
    mkdir_0700(&d.join("empty-req.json"));
    env.start_daemon();
    let r = wait_response(&env, "hf-dir", "dir-req");
    assert_eq!(r["code"], "malformed-request", "{r}");
    assert!(r["message"].as_str().unwrap().contains("dir-req.json"), "{r}");
    let r = wait_response(&env, "hf-dir", "empty-req");
    assert_eq!(r["code"], "malformed-request", "{r}");
    wait_until(LONG, "the empty directory request to be removed", || !d.join("empty-req.json").exists());
    assert!(d.join("dir-req.json").join("inside").exists(), "a non-empty directory is never deleted");
    // The runner consumed the answers; later sweeps must not write them again.
    fs::remove_file(response_path(&env, "hf-dir", "dir-req")).unwrap();
    fs::remove_file(response_path(&env, "hf-dir", "empty-req")).unwrap();
    for n in 0..3 {
        probe(&env, "hf-dir", n);
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    probe(&env, "hf-dir", 3);
    assert!(!response_path(&env, "hf-dir", "dir-req").exists(), "the directory request was answered again");
    assert!(!response_path(&env, "hf-dir", "empty-req").exists(), "the removed request was answered again");
}

/// Issue 12 item 2: a step that replaces events.jsonl or the next step's
/// output log with a FIFO hangs neither its runner (the timeout still ends
/// the run) nor the daemon's repair of a dead runner.
#[test]
fn fifo_in_place_of_events_or_output_hangs_neither_runner_nor_daemon() {
    let mut env = TestEnv::new();
    env.start_daemon();
    // The events log becomes a FIFO, then the run times out.
    let mut req = request(
        Some("hf-ev"),
        &env.work,
        vec![
            sh_step("plant", "rm -f \"$RUNSPOOL_RUN_DIR/events.jsonl\"; mkfifo \"$RUNSPOOL_RUN_DIR/events.jsonl\""),
            sh_step("sleep", "sleep 600"),
        ],
    );
    req["timeoutMs"] = json!(3000);
    env.submit(&req);
    // The next step's output log becomes a FIFO, and so does the status lock
    // (a FIFO locks like a file: the run's status is still written).
    env.submit(&request(
        Some("hf-out"),
        &env.work,
        vec![
            sh_step(
                "plant",
                "mkfifo \"$RUNSPOOL_RUN_DIR/output-1.log\"; rm -f \"$RUNSPOOL_RUN_DIR/.status.lock\"; mkfifo \"$RUNSPOOL_RUN_DIR/.status.lock\"",
            ),
            sh_step("next", "echo never"),
        ],
    ));
    let st = env.wait_terminal("hf-ev");
    assert_eq!(st["state"], "failed", "{st}");
    let st = env.wait_terminal("hf-out");
    assert_eq!(st["state"], "failed", "{st}");
    let err = st["steps"][1]["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains("output-1.log") && err.contains("not a regular file"), "{st}");
    // The events log becomes a FIFO and the runner dies: the daemon repairs the run.
    env.submit(&request(
        Some("hf-dead"),
        &env.work,
        vec![sh_step(
            "plant",
            "rm -f \"$RUNSPOOL_RUN_DIR/events.jsonl\"; mkfifo \"$RUNSPOOL_RUN_DIR/events.jsonl\"; kill -9 $PPID; sleep 5",
        )],
    ));
    let st = env.wait_terminal("hf-dead");
    assert_eq!(st["state"], "failed", "{st}");
    // And the daemon still claims and runs.
    env.submit(&request(Some("hf-after"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-after")["state"], "complete", "{}", env.log_tail(40));
}

/// Issue 12 item 7: a descriptor the daemon inherits (here a pipe without
/// close-on-exec at fd 47) never reaches a runner or a step.
#[test]
fn inherited_descriptors_do_not_reach_steps() {
    let mut env = TestEnv::new();
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let (r, w) = (fds[0], fds[1]);
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    // SAFETY: dup2 is async-signal-safe; the copy at 47 has no close-on-exec flag.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(w, 47) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    env.start_daemon_command(cmd);
    unsafe {
        libc::close(w);
    }
    env.submit(&request(
        Some("hf-fds"),
        &env.work,
        vec![sh_step("fds", "for f in /proc/self/fd/*; do echo \"fd ${f##*/}\"; done")],
    ));
    assert_eq!(env.wait_terminal("hf-fds")["state"], "complete");
    let out = env.output_log("hf-fds", 0);
    let listed: Vec<u32> = out.lines().filter_map(|l| l.strip_prefix("fd ")?.parse().ok()).collect();
    assert!(listed.contains(&0) && listed.contains(&1), "{out}");
    // 0, 1, 2 and the descriptor the shell opened to list the directory.
    assert!(listed.iter().all(|&fd| fd <= 3), "descriptors leaked into the step: {listed:?}\n{out}");
    unsafe {
        libc::close(r);
    }
}

fn vm_hwm(pid: u32) -> Option<u64> {
    let st = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 =
        st.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Run `runspool logs` on `id`, reading its output through a pipe; returns
/// (success, bytes printed, peak RSS in bytes). The peak is the CLI's own
/// VmHWM, sampled while the full pipe holds it back (getrusage would count
/// the test process it was spawned from).
fn logs_peak_rss(env: &TestEnv, id: &str, json: bool) -> (bool, u64, u64) {
    use std::io::Read;
    let mut cmd = Command::new(BIN);
    cmd.arg("logs").arg("--root").arg(&env.root).arg(id);
    if json {
        cmd.arg("--json");
    }
    cmd.env("XDG_CONFIG_HOME", env.base().join("xdg")).stdin(Stdio::null()).stdout(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let (mut total, mut peak) = (0u64, 0u64);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        peak = peak.max(vm_hwm(child.id()).unwrap_or(0));
        match out.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(e) => panic!("reading runspool logs: {e}"),
        }
    }
    (child.wait().unwrap().success(), total, peak)
}

/// Issue 12 item 10: `runspool logs` streams the output, with and without
/// `--json`: its peak memory stays far below a 256 MiB output.
#[test]
fn logs_streams_large_output_in_bounded_memory() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("hf-big"), &env.work, vec![sh_step("big", "printf 'caf\\303\\251 \\377 end'")]));
    assert_eq!(env.wait_terminal("hf-big")["state"], "complete");
    // The JSON form keeps its shape and lossy text.
    let o = env.cli(&["logs", "hf-big", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("logs --json prints JSON");
    assert_eq!(v[0]["output"], "café \u{fffd} end", "{v}");
    assert_eq!(v[0]["bytes"], 11, "{v}");
    assert_eq!(v[0]["agent"], "big", "{v}");
    assert_eq!(v[0]["status"], "complete", "{v}");
    assert_eq!(v[0]["step"], 0, "{v}");
    let o = env.cli(&["logs", "hf-big"]);
    assert_eq!(o.stdout, b"caf\xc3\xa9 \xff end", "{}", describe(&o));
    // Now 256 MiB of text lines.
    const SIZE: u64 = 256 << 20;
    let mut line = vec![b'x'; 1023];
    line.push(b'\n');
    let chunk = line.repeat(1024);
    let mut f = File::create(env.run_dir("hf-big").join("output-0.log")).unwrap();
    for _ in 0..SIZE >> 20 {
        std::io::Write::write_all(&mut f, &chunk).unwrap();
    }
    drop(f);
    for json in [false, true] {
        let (ok, printed, peak) = logs_peak_rss(&env, "hf-big", json);
        assert!(ok, "runspool logs (json: {json}) failed");
        // Plain: the bytes as they are; JSON: each newline as two characters.
        let want = if json { SIZE + (SIZE >> 10) } else { SIZE };
        assert!(printed >= want, "runspool logs (json: {json}) printed {printed} bytes, want {want}");
        assert!(peak < 64 << 20, "runspool logs (json: {json}) peaked at {} MiB for a 256 MiB output", peak >> 20);
    }
}

/// Issue 12 item 20 (first half): hook.log is capped at 1 MiB however much a
/// hook prints, and the hook is not harmed by the cap.
#[test]
fn hook_log_is_capped() {
    let mut env = TestEnv::new();
    let w = env.work.display().to_string();
    env.write_config(&format!(
        "{DEFAULT_CONFIG}[hooks]\ntimeout_s = 120\non_complete = [\"sh\", \"-c\", \"head -c 20000000 /dev/zero; echo tail >&2; echo done > '{w}/hook-done'\"]\n"
    ));
    env.start_daemon();
    env.submit(&request(Some("hf-hook"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-hook")["state"], "complete");
    let record = env.run_dir("hf-hook").join("hook.json");
    wait_until(LONG, "the hook to end", || read_json(&record).is_some_and(|r| r.get("endedAt").is_some()));
    let r = read_json(&record).unwrap();
    assert_eq!(r["exitCode"], 0, "the hook ran to its end: {r}");
    assert!(env.work.join("hook-done").exists());
    let len = fs::metadata(env.run_dir("hf-hook").join("hook.log")).unwrap().len();
    assert!(len <= (1 << 20) + 4096, "hook.log is {len} bytes");
    assert!(len >= 1 << 20, "hook.log keeps the first MiB: {len} bytes");
}

/// A FIFO planted as a terminal marker (clients and pi hosts write
/// `.terminal-runs/`) does not hang the daemon's retention sweep.
#[test]
fn fifo_terminal_marker_does_not_hang_retention() {
    let mut env = TestEnv::new();
    env.leaves_root_inconsistent("a FIFO stands in place of a terminal marker");
    let sdir = env.terminal_dir().join("default");
    mkdir_0700(&sdir);
    mkfifo(&sdir.join("0000000000000001-old-run.json"));
    env.start_daemon();
    env.submit(&request(Some("hf-ret"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-ret")["state"], "complete");
}

/// A step that turns its run's bridge inboxes into symlinks to another
/// directory does not make the daemon answer or remove files there, nor
/// write responses there.
#[test]
fn symlinked_bridge_directories_are_not_followed() {
    let mut env = provider_env();
    let _lock = fake_run(&env, "hf-link");
    let _other = fake_run(&env, "hf-plain");
    let _probe = fake_run(&env, "hf-probe");
    let outside = env.base().join("outside");
    mkdir_0700(&outside);
    write_file_mode(&outside.join("victim.json"), b"{ not a request", 0o600);
    set_mtime_ago(&outside.join("victim.json"), 30);
    let reqs = reqdir(&env, "hf-link");
    fs::remove_dir(&reqs).unwrap();
    std::os::unix::fs::symlink(&outside, &reqs).unwrap();
    // The responses side: a real request whose answer would land in `outside`.
    let resp_outside = env.base().join("outside-responses");
    mkdir_0700(&resp_outside);
    std::os::unix::fs::symlink(&resp_outside, env.run_dir("hf-plain").join("external-job-responses")).unwrap();
    let body = json!({"id": "garbage", "operation": "status", "provider": "p", "createdAt": 1});
    write_file_mode(&reqdir(&env, "hf-plain").join("garbage.json"), body.to_string().as_bytes(), 0o600);
    set_mtime_ago(&reqdir(&env, "hf-plain").join("garbage.json"), 30);
    env.start_daemon();
    // Several full sweeps (one a second) of every run.
    for n in 0..3 {
        probe(&env, "hf-probe", n);
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    probe(&env, "hf-probe", 3);
    assert!(outside.join("victim.json").exists(), "a file behind a symlinked inbox was removed");
    assert!(!env.run_dir("hf-link").join("external-job-responses").join("victim.json").exists());
    assert!(!resp_outside.join("garbage.json").exists(), "a response was written through a symlink");
}

/// A FIFO planted where a run's active marker goes (`.active-runs/` is
/// written by clients and pi hosts) neither hangs the claim nor the run.
#[test]
fn fifo_active_marker_hangs_nothing() {
    let mut env = TestEnv::new();
    mkfifo(&env.active_dir().join("hf-mark"));
    env.start_daemon();
    env.submit(&request(Some("hf-mark"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-mark")["state"], "complete", "{}", env.log_tail(40));
    env.submit(&request(Some("hf-mark-after"), &env.work, vec![sh_step("a", "echo ok")]));
    assert_eq!(env.wait_terminal("hf-mark-after")["state"], "complete", "{}", env.log_tail(40));
}

/// Issue 12 item 2, stop: a run whose events log became a FIFO still obeys stop.
#[test]
fn fifo_events_log_does_not_block_stop() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("planted");
    env.submit(&request(
        Some("hf-stop"),
        &env.work,
        vec![sh_step(
            "plant",
            &format!(
                "rm -f \"$RUNSPOOL_RUN_DIR/events.jsonl\"; mkfifo \"$RUNSPOOL_RUN_DIR/events.jsonl\"; touch '{}'; sleep 600",
                gate.display()
            ),
        )],
    ));
    wait_until(LONG, "the FIFO to be planted", || gate.exists());
    let o = env.cli(&["stop", "hf-stop"]);
    assert!(o.status.success(), "{}", describe(&o));
    assert_eq!(env.wait_terminal("hf-stop")["state"], "stopped");
}

/// `<id>.claim` entries that are not directories (a file, a symlink to a
/// directory elsewhere) are no claims: the daemon neither answers them every
/// sweep nor writes `owner.json` / `completed.json` through a link.
#[test]
fn claims_that_are_not_directories_are_ignored() {
    let mut env = provider_env();
    let _lock = fake_run(&env, "hf-claim");
    let d = reqdir(&env, "hf-claim");
    write_file_mode(&d.join("c-file.claim"), b"x", 0o600);
    set_mtime_ago(&d.join("c-file.claim"), 600);
    let outside = env.base().join("claim-outside");
    mkdir_0700(&outside);
    set_mtime_ago(&outside, 600);
    std::os::unix::fs::symlink(&outside, d.join("c-link.claim")).unwrap();
    env.start_daemon();
    for n in 0..3 {
        probe(&env, "hf-claim", n);
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    probe(&env, "hf-claim", 3);
    assert!(!response_path(&env, "hf-claim", "c-file").exists(), "a file named .claim was answered");
    assert!(!response_path(&env, "hf-claim", "c-link").exists(), "a symlink named .claim was answered");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "files were written through a .claim symlink");
    assert!(d.join("c-file.claim").exists() && d.join("c-link.claim").exists());
}

/// `submit` refuses a root the daemon would refuse, in the daemon's words,
/// and writes nothing into it.
#[test]
fn submit_refuses_a_root_the_daemon_refuses() {
    let env = TestEnv::new();
    let submit = |root: &Path| {
        Command::new(env!("CARGO_BIN_EXE_runspool"))
            .args(["submit", "--root"])
            .arg(root)
            .args(["--", "true"])
            .env_remove("RUNSPOOL_ROOT")
            .env("XDG_CONFIG_HOME", env.base().join("xdg"))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let check = |root: &Path, what: &str| {
        let o = submit(root);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(1), "{what}: submit accepted it: {err}");
        let msg = err.trim().strip_prefix("runspool: ").unwrap_or_else(|| panic!("{what}: {err}")).to_string();
        let (st, log) = env.run_daemon_expect_exit(root, std::time::Duration::from_secs(60));
        assert!(!st.success(), "{what}: the daemon accepted it");
        assert!(log.contains(&msg), "{what}: submit said `{msg}`, the daemon:\n{log}");
        msg
    };

    // Group- and world-writable.
    let open = env.base().join("open-root");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
    let msg = check(&open, "mode 0777");
    assert!(msg.contains("writable by group or others") && msg.contains("chmod 700"), "{msg}");
    assert!(list_names(&open).is_empty(), "submit wrote into a refused root: {:?}", list_names(&open));

    // A symlink to a good directory.
    let real = env.base().join("real-root");
    fs::create_dir(&real).unwrap();
    fs::set_permissions(&real, fs::Permissions::from_mode(0o700)).unwrap();
    let link = env.base().join("link-root");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let msg = check(&link, "symlink");
    assert!(msg.contains("symbolic link"), "{msg}");
    assert!(list_names(&real).is_empty(), "submit wrote through the symlink: {:?}", list_names(&real));

    // Someone else's (needs root to chown).
    if unsafe { libc::geteuid() } == 0 {
        let theirs = env.base().join("their-root");
        fs::create_dir(&theirs).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let msg = check(&theirs, "another owner");
        assert!(msg.contains("is owned by uid 65534"), "{msg}");
    } else {
        eprintln!("skipped (another owner): needs root to chown a directory");
    }
}
