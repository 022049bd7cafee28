//! Compatibility with the pi-subagents TypeScript extension, driven by
//! pi-subagents 0.67.0's own code (PROTOCOL §4, §6, §7, §8, §9, §14).
//!
//! The package is installed pinned from the npm registry, once per target
//! directory, and `tests/pi/driver.mjs` runs its modules through jiti (as a pi
//! host would) one action per call.
//!
//! Direction A: pi writes runs into the root; runspool must show them and
//! leave every byte of them, their markers and their results alone.
//! Direction B: runspool writes runs; pi's readers, reconciler, stop request
//! and external-job bridge must work on them.
//! Both ways: runspool services the bridge requests of pi's runs for the
//! providers it has configured, and only those.
//!
//! Without node or npm on PATH every test prints `skipped: node is not
//! installed` and passes.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::pi::{DRIVER, PI_VERSION};
/// Rescans every second, so "several rescans" takes seconds.
const FAST_RESCAN: &str = "max_running = 4\nretention_days = 30\n[watch]\nrescan_interval_s = 1\n";

// ---------------------------------------------------------------------------
// Installing pi-subagents and calling its code
// ---------------------------------------------------------------------------

/// pi-subagents at PI_VERSION (`common::pi`, shared with tests/it/steward.rs);
/// None when node or npm is missing.
fn pi() -> Option<Pi> {
    common::pi::install().map(|dir| Pi { dir })
}

struct Pi {
    dir: PathBuf,
}

#[derive(Debug)]
struct PiError {
    message: String,
    code: Option<String>,
    output: String,
}

impl Pi {
    fn run(&self, action: &str, arg: &Value, env: Option<&TestEnv>) -> std::process::Output {
        let mut cmd = Command::new("node");
        cmd.arg(DRIVER).arg(action).arg(arg.to_string()).env("PI_SUBAGENTS_INSTALL_DIR", &self.dir);
        if let Some(env) = env {
            // pi's default directories (DIRS) point into the test root.
            cmd.env("PI_SUBAGENTS_TEMP_ROOT", &env.root).current_dir(&env.work);
        }
        let tmp = tempfile::tempdir().unwrap();
        let (o, e) = (tmp.path().join("out"), tmp.path().join("err"));
        cmd.stdin(Stdio::null()).stdout(File::create(&o).unwrap()).stderr(File::create(&e).unwrap());
        let mut child = cmd.spawn().expect("spawn node");
        let deadline = Instant::now() + Duration::from_secs(300);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("node driver {action} {arg} did not finish within 300 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        std::process::Output { status, stdout: fs::read(&o).unwrap(), stderr: fs::read(&e).unwrap() }
    }

    /// Call a driver action; Ok(result) or the error pi's code raised.
    fn call(&self, env: &TestEnv, action: &str, arg: Value) -> Result<Value, PiError> {
        let out = self.run(action, &arg, Some(env));
        let text = describe(&out);
        if out.status.success() {
            return serde_json::from_slice(&out.stdout).map_err(|e| PiError {
                message: format!("driver output is not JSON: {e}"),
                code: None,
                output: text,
            });
        }
        let err: Value = stderr_str(&out)
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| json!({"error": stderr_str(&out)}));
        Err(PiError {
            message: err["error"].as_str().unwrap_or("").to_string(),
            code: err["code"].as_str().map(str::to_string),
            output: text,
        })
    }

    /// Call a driver action that must succeed.
    fn ok(&self, env: &TestEnv, action: &str, arg: Value) -> Value {
        match self.call(env, action, arg.clone()) {
            Ok(v) => v,
            Err(e) => panic!("pi {PI_VERSION} {action}({arg}) failed: {} (code {:?})\n{}", e.message, e.code, e.output),
        }
    }

    /// Write a run as a pi host does (see `writePiRun` in the driver).
    fn write_run(
        &self,
        env: &TestEnv,
        run_id: &str,
        session: &str,
        state: &str,
        mode: &str,
        pid: Option<u32>,
    ) -> Value {
        let mut spec = json!({
            "asyncDirRoot": env.runs(), "resultsDir": env.results(), "runId": run_id, "sessionId": session,
            "toolCallId": format!("toolu_{run_id}/call+1"), "state": state, "mode": mode, "cwd": env.work,
        });
        if let Some(p) = pid {
            spec["pid"] = json!(p);
        }
        if mode == "workflow" {
            let t = now_ms() - 30_000;
            spec["steps"] = json!([
                {"agent": "planner", "status": "completed", "phase": "plan", "workflowKey": "plan", "startedAt": t, "endedAt": t + 5000, "durationMs": 5000, "exitCode": 0},
                {"agent": "reviewer", "status": "rejected", "phase": "review", "workflowKey": "review", "startedAt": t + 5000, "endedAt": t + 9000, "durationMs": 4000, "exitCode": 1, "error": "review rejected the plan"},
            ]);
            spec["extra"] = json!({"workflow": {"goal": "[prompt redacted]"}, "workflowKey": "wf-main"});
        }
        let v = self.ok(env, "writePiRun", spec);
        // The run is one pi itself accepts, and nobody has rewritten it since.
        let st = self.ok(env, "readStatus", json!({"asyncDir": env.run_dir(run_id)}));
        assert_eq!(
            st["state"],
            state,
            "pi wrote {run_id} in state {state}, but its status.json says {} moments later: another writer \
             (the runspool daemon?) rewrote a run it did not launch:\n{st}\n{}",
            st["state"],
            env.log_tail(20)
        );
        v
    }
}

macro_rules! pi_or_skip {
    () => {
        match pi() {
            Some(p) => p,
            None => return,
        }
    };
}

/// A process the test started (`sleep 1000` standing in for a pi runner);
/// killed on drop.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Sleeper {
        Sleeper(Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().expect("spawn sleep"))
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---------------------------------------------------------------------------
// Snapshots of whole trees: names, types, modes and contents
// ---------------------------------------------------------------------------

type Snapshot = BTreeMap<String, String>;

fn snap_into(root: &Path, p: &Path, skip: &dyn Fn(&str) -> bool, out: &mut Snapshot) {
    let Ok(md) = fs::symlink_metadata(p) else { return };
    let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
    if skip(&rel) {
        return;
    }
    let mode = md.mode() & 0o7777;
    let ft = md.file_type();
    if ft.is_dir() {
        out.insert(rel, format!("dir {mode:o}"));
        for name in list_names(p) {
            snap_into(root, &p.join(name), skip, out);
        }
    } else if ft.is_symlink() {
        out.insert(rel, format!("symlink -> {}", fs::read_link(p).unwrap().display()));
    } else if ft.is_file() {
        let mut bytes = vec![];
        File::open(p).unwrap().read_to_end(&mut bytes).unwrap();
        out.insert(rel, format!("file {mode:o} {} bytes sha256 {}", bytes.len(), sha256_hex(&bytes)));
    } else {
        out.insert(rel, format!("special {:o}", md.mode()));
    }
}

/// Everything a pi run owns: its run directories, the active and terminal
/// indexes and the results tree, minus paths naming `except` (runspool's own
/// runs in the same root).
fn snapshot(env: &TestEnv, pi_runs: &[&str], except: &[&str]) -> Snapshot {
    let skip = |rel: &str| except.iter().any(|x| rel.contains(x));
    let mut out = Snapshot::new();
    for id in pi_runs {
        snap_into(&env.root, &env.run_dir(id), &skip, &mut out);
    }
    snap_into(&env.root, &env.active_dir(), &skip, &mut out);
    snap_into(&env.root, &env.terminal_dir(), &skip, &mut out);
    snap_into(&env.root, &env.results(), &skip, &mut out);
    out
}

fn assert_same(before: &Snapshot, after: &Snapshot, what: &str) {
    let mut diffs = vec![];
    for (k, v) in before {
        match after.get(k) {
            None => diffs.push(format!("removed  {k} ({v})")),
            Some(w) if w != v => diffs.push(format!("changed  {k}: {v} -> {w}")),
            _ => {}
        }
    }
    for (k, v) in after {
        if !before.contains_key(k) {
            diffs.push(format!("added    {k} ({v})"));
        }
    }
    assert!(diffs.is_empty(), "{what}: pi's files changed:\n  {}", diffs.join("\n  "));
}

// ---------------------------------------------------------------------------
// Daemon and CLI helpers
// ---------------------------------------------------------------------------

fn last_rescan(env: &TestEnv) -> i64 {
    read_json(&env.daemon_json()).and_then(|d| d["lastRescanAt"].as_i64()).unwrap_or(0)
}

/// Wait until daemon.json's `lastRescanAt` has advanced `n` times.
fn wait_rescans(env: &TestEnv, n: usize) {
    for i in 0..n {
        let before = last_rescan(env);
        wait_until(Duration::from_secs(90), &format!("rescan {} of {n} (lastRescanAt past {before})", i + 1), || {
            last_rescan(env) > before
        });
    }
}

fn list_json(env: &TestEnv, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["list", "--json"];
    args.extend_from_slice(extra);
    let out = env.cli(&args);
    assert!(out.status.success(), "runspool {}:\n{}", args.join(" "), describe(&out));
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("runspool {} printed no JSON ({e}):\n{}", args.join(" "), describe(&out)));
    v.as_array().unwrap_or_else(|| panic!("runspool {} is not an array: {v}", args.join(" "))).clone()
}

fn entry_id(e: &Value) -> Option<&str> {
    e["runId"].as_str().or_else(|| e["id"].as_str())
}

fn find_entry<'a>(list: &'a [Value], id: &str) -> Option<&'a Value> {
    list.iter().find(|e| entry_id(e) == Some(id))
}

fn assert_listed_as(list: &[Value], id: &str, launched_by: &str) {
    let e = find_entry(list, id).unwrap_or_else(|| {
        panic!("run {id} is missing from `runspool list --json`: {:?}", list.iter().map(entry_id).collect::<Vec<_>>())
    });
    assert_eq!(e["launchedBy"], launched_by, "list entry of {id}: {e}");
}

fn runspool_request(env: &TestEnv, id: &str, session: &str, steps: Vec<Value>) -> Value {
    let mut r = request(Some(id), &env.work, steps);
    r["sessionId"] = json!(session);
    r["toolCallId"] = json!(format!("tc/{id} 1"));
    r
}

const ENGINE: &str = r#"#!/bin/sh
# A command provider (PROTOCOL 8.4) that records every call and answers at once.
E='@DIR@'
op=$1
input=$(cat)
printf '%s %s\n' "$op" "$input" >> "$E/calls.log"
field() { printf '%s' "$input" | sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p"; }
case "$op" in
start)
    n=$(wc -l < "$E/calls.log" | tr -d ' ')
    printf '{"providerJobId":"job-%s","state":"queued"}\n' "$n" ;;
follow-up)
    printf '{"providerJobId":"fu-%s","state":"queued"}\n' "$(field requestId)" ;;
status|reattach|cancel)
    printf '{"providerJobId":"%s","state":"running"}\n' "$(field providerJobId)" ;;
result)
    printf '{"providerJobId":"%s","state":"completed","output":"done"}\n' "$(field providerJobId)" ;;
*)
    printf '{"code":"unknown-operation","message":"engine cannot %s"}\n' "$op"; exit 2 ;;
esac
"#;

struct Engine {
    dir: PathBuf,
}

impl Engine {
    /// Install the engine and configure it as provider `engine` (fast rescans).
    fn configure(env: &TestEnv) -> Engine {
        let dir = env.base().join("engine");
        fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("engine.sh");
        fs::write(&exe, ENGINE.replace("@DIR@", dir.to_str().unwrap())).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        env.write_config(&format!(
            "{FAST_RESCAN}[providers.engine]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 30000\n",
            exe.display()
        ));
        Engine { dir }
    }
    fn calls(&self) -> Vec<(String, String)> {
        fs::read_to_string(self.dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (op, input) = l.split_once(' ').unwrap_or((l, ""));
                (op.to_string(), input.to_string())
            })
            .collect()
    }
}

fn claims(run_dir: &Path) -> Vec<PathBuf> {
    let d = run_dir.join("external-job-requests");
    list_names(&d).into_iter().filter(|n| n.ends_with(".claim")).map(|n| d.join(n)).collect()
}

/// Nothing of the bridge is left waiting: no request file (claims stay as
/// tombstones) and no response (pi's client removes the one it read).
fn assert_bridge_drained(run_dir: &Path) {
    let reqs: Vec<String> =
        list_names(&run_dir.join("external-job-requests")).into_iter().filter(|n| !n.ends_with(".claim")).collect();
    assert!(reqs.is_empty(), "requests left in {}: {reqs:?}", run_dir.display());
    let resp = list_names(&run_dir.join("external-job-responses"));
    assert!(resp.is_empty(), "responses left in {}: {resp:?}", run_dir.display());
}

fn start_input(env: &TestEnv, run_id: &str, prompt: &str, session: &str) -> Value {
    json!({
        "prompt": prompt, "promptDigest": sha256_hex(prompt.as_bytes()), "cwd": env.work, "runId": run_id,
        "stepIndex": 1, "agent": "worker", "options": {"model": "remote-large"}, "sessionId": session,
    })
}

// ---------------------------------------------------------------------------
// Direction A: pi writes, runspool reads and leaves everything alone
// ---------------------------------------------------------------------------

/// pi's runs (live `running` with a live pid, `partial`, `paused`, a
/// `workflow`) survive rescans and two daemon restarts byte for byte, and the
/// CLI shows them read-only next to runspool's own.
#[test]
fn pi_runs_stay_byte_for_byte_across_restarts_and_rescans() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let own = "rs-own-run";
    env.submit(&runspool_request(&env, own, "rs-own-session", vec![sh_step("a", "echo own")]));
    env.wait_terminal(own);

    let live = Sleeper::start();
    let session = "pi-session-a";
    pi.write_run(&env, "pi-live", session, "running", "chain", Some(live.pid()));
    pi.write_run(&env, "pi-partial", session, "partial", "chain", None);
    pi.write_run(&env, "pi-paused", session, "paused", "parallel", None);
    pi.write_run(&env, "pi-workflow", session, "complete", "workflow", None);
    let ids = ["pi-live", "pi-partial", "pi-paused", "pi-workflow"];
    assert!(env.active_dir().join("pi-live").is_file());
    assert_eq!(list_names(&env.terminal_dir().join(seg(session))).len(), 3);
    let before = snapshot(&env, &ids, &[own]);

    wait_rescans(&env, 3);
    assert_same(&before, &snapshot(&env, &ids, &[own]), "after 3 rescans");
    env.term();
    env.start_daemon();
    wait_rescans(&env, 3);
    assert_same(&before, &snapshot(&env, &ids, &[own]), "after a SIGTERM restart and 3 rescans");
    env.restart();
    wait_rescans(&env, 3);
    assert_same(&before, &snapshot(&env, &ids, &[own]), "after a SIGKILL restart and 3 rescans");

    // The CLI shows them, marked as another host's.
    let all = list_json(&env, &[]);
    for id in ids {
        assert_listed_as(&all, id, "other");
    }
    assert_listed_as(&all, own, "runspool");
    let by_session = list_json(&env, &["--session", session]);
    for id in ids {
        assert!(find_entry(&by_session, id).is_some(), "{id} missing from list --session: {by_session:?}");
    }
    let active = list_json(&env, &["--active"]);
    assert_listed_as(&active, "pi-live", "other");
    let out = env.cli(&["list"]);
    assert!(out.status.success(), "{}", describe(&out));
    for id in ids {
        assert!(stdout_str(&out).contains(id), "`runspool list` does not show {id}:\n{}", describe(&out));
        let out = env.cli(&["status", id]);
        assert!(out.status.success(), "runspool status {id}:\n{}", describe(&out));
        assert!(
            stdout_str(&out).to_lowercase().contains("another host"),
            "`runspool status {id}` does not say the run was launched by another host:\n{}",
            describe(&out)
        );
        let out = env.cli(&["status", id, "--json"]);
        assert!(out.status.success(), "runspool status {id} --json:\n{}", describe(&out));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}:\n{}", describe(&out)));
        assert_eq!(v["runId"], id, "{v}");
    }
    assert_same(&before, &snapshot(&env, &ids, &[own]), "after list and status");
    assert!(process_alive(live.pid() as i64), "the stand-in pi runner was killed");
}

/// `runspool stop` on a pi run refuses, says why, and writes nothing.
#[test]
fn runspool_stop_refuses_a_pi_run() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let live = Sleeper::start();
    pi.write_run(&env, "pi-stop-me", "pi-session-s", "running", "single", Some(live.pid()));
    let before = snapshot(&env, &["pi-stop-me"], &[]);
    let out = env.cli(&["stop", "pi-stop-me", "--reason", "test"]);
    assert!(!out.status.success(), "`runspool stop` of a pi run succeeded:\n{}", describe(&out));
    let text = format!("{}{}", stdout_str(&out), stderr_str(&out)).to_lowercase();
    assert!(text.contains("another host"), "the refusal does not say the run is another host's:\n{}", describe(&out));
    wait_rescans(&env, 2);
    assert_same(&before, &snapshot(&env, &["pi-stop-me"], &[]), "after `runspool stop`");
    assert!(process_alive(live.pid() as i64));
}

/// A pi run whose status.json does not parse is reported by the CLI, never
/// deleted, and its active marker, alias and terminal marker stay.
#[test]
fn pi_run_with_unparsable_status_is_reported_never_deleted() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    let live = Sleeper::start();
    let session = "pi-session-c";
    pi.write_run(&env, "pi-garbled-live", session, "running", "chain", Some(live.pid()));
    pi.write_run(&env, "pi-garbled-done", session, "partial", "chain", None);
    for id in ["pi-garbled-live", "pi-garbled-done"] {
        // A torn write by a host that crashed (pi would never leave this, but
        // disks and other tools do).
        fs::write(env.run_dir(id).join("status.json"), b"{\"runId\": \"pi-garbled\", \"state\": \"runn").unwrap();
    }
    let ids = ["pi-garbled-live", "pi-garbled-done"];
    let before = snapshot(&env, &ids, &[]);
    assert!(before.keys().any(|k| k.contains(".terminal-runs")), "{before:?}");
    env.start_daemon();
    wait_rescans(&env, 3);
    assert_same(&before, &snapshot(&env, &ids, &[]), "after start-up and 3 rescans");

    let all = list_json(&env, &[]);
    assert!(
        find_entry(&all, "pi-garbled-live").is_some(),
        "the run with an unparsable status is not reported by `runspool list --json`: {all:?}"
    );
    let out = env.cli(&["list"]);
    assert!(out.status.success(), "{}", describe(&out));
    for id in ids {
        let out = env.cli(&["status", id]);
        let text = format!("{}{}", stdout_str(&out), stderr_str(&out));
        assert!(text.contains(id), "`runspool status {id}` does not report the run:\n{}", describe(&out));
        assert!(!text.contains("panicked"), "{}", describe(&out));
    }
    let out = env.cli(&["list", "--session", session]);
    assert!(out.status.success(), "{}", describe(&out));
    env.restart();
    wait_rescans(&env, 2);
    assert_same(&before, &snapshot(&env, &ids, &[]), "after list, status and a restart");
}

/// `runspool list` in all its forms never removes the terminal marker of a
/// pi run whose state is `partial` or whose mode is `workflow`, daemon or not.
#[test]
fn runspool_list_keeps_terminal_markers_of_partial_and_workflow_pi_runs() {
    let pi = pi_or_skip!();
    let env = TestEnv::with_config(FAST_RESCAN);
    let session = "pi-session-d";
    pi.write_run(&env, "pi-d-partial", session, "partial", "chain", None);
    pi.write_run(&env, "pi-d-workflow", session, "complete", "workflow", None);
    pi.write_run(&env, "pi-d-workflow-partial", session, "partial", "workflow", None);
    let ids = ["pi-d-partial", "pi-d-workflow", "pi-d-workflow-partial"];
    let markers = list_names(&env.terminal_dir().join(seg(session)));
    assert_eq!(markers.len(), 3, "{markers:?}");
    let before = snapshot(&env, &ids, &[]);
    for args in [
        vec!["list"],
        vec!["list", "--json"],
        vec!["list", "--recent", "5"],
        vec!["list", "--recent", "5", "--json"],
        vec!["list", "--session", session],
        vec!["list", "--session", session, "--json"],
    ] {
        let out = env.cli(&args);
        assert!(out.status.success(), "runspool {}:\n{}", args.join(" "), describe(&out));
        assert_eq!(list_names(&env.terminal_dir().join(seg(session))), markers, "after runspool {}", args.join(" "));
    }
    let listed = list_json(&env, &["--session", session]);
    for id in ids {
        assert_listed_as(&listed, id, "other");
    }
    assert_same(&before, &snapshot(&env, &ids, &[]), "after every form of `runspool list`");
}

/// pi 0.67's own retention pass (`cleanupAsyncRetention`) beside a live
/// daemon. pi removes its old runs and runspool's alike (the limit
/// docs/protocol-notes.md describes), keeps a run whose recheck fails by
/// renaming its tombstone back, and leaves a tombstone of a pass cut short;
/// runspool's daemon (rescans, restarts), its retention sweep and `runspool
/// clean` then leave pi's kept run, tombstone, tombstone marker and
/// maintenance files byte for byte.
#[test]
fn pi_retention_beside_a_live_daemon_keeps_pis_tombstones_and_kept_runs() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.leaves_root_inconsistent("pi's tombstones: terminal markers pi keeps for runs it removed");
    env.start_daemon();
    env.submit(&runspool_request(&env, "rs-old", "sess-ret", vec![sh_step("a", "true")]));
    env.wait_terminal("rs-old");
    for id in ["pi-ret-gone", "pi-ret-kept"] {
        pi.write_run(&env, id, "pi-session-ret", "complete", "chain", None);
    }
    let day = 86_400_000i64;
    let r = pi.ok(
        &env,
        "cleanupAsyncRetention",
        json!({"asyncDirRoot": env.runs(), "resultsDir": env.results(), "nowOffsetMs": 40 * day, "waitOnRunId": "pi-ret-kept"}),
    );
    assert_eq!(r["acquired"], true, "{r}");
    assert!(r["skipped"]["recheck-wait-reference"].as_i64() == Some(1), "the recheck path was not taken: {r}");
    assert!(!env.run_dir("pi-ret-gone").exists(), "pi's pass did not remove its old run: {r}");
    assert!(
        !env.run_dir("rs-old").exists(),
        "pi's pass no longer removes runspool's old runs; fix docs/protocol-notes.md: {r}"
    );
    assert!(env.run_dir("pi-ret-kept").join("status.json").is_file(), "pi's kept run is gone: {r}");
    pi.write_run(&env, "pi-ret-tomb", "pi-session-ret", "complete", "chain", None);
    let t = pi.ok(&env, "leaveRunTombstone", json!({"asyncDirRoot": env.runs(), "runId": "pi-ret-tomb"}));
    let tomb = PathBuf::from(t["tombstonePath"].as_str().unwrap());
    let marker = PathBuf::from(t["marker"].as_str().unwrap());

    let pis = |env: &TestEnv| {
        let mut s = snapshot(env, &["pi-ret-kept"], &["rs-old"]);
        for p in [
            &tomb,
            &marker,
            &env.root.join("wait-subscriptions"),
            &env.root.join("async-retention-maintenance.jsonl"),
            &env.root.join(".async-retention-cursor.json"),
        ] {
            snap_into(&env.root, p, &|_| false, &mut s);
        }
        s
    };
    let before = pis(&env);
    assert!(before.keys().any(|k| k.contains(".deleting-run-")), "{before:?}");
    wait_rescans(&env, 2);
    runspool::daemon::retention::sweep(&runspool::store::Layout::new(&env.root), 30);
    let out = env.cli(&["clean"]);
    assert!(out.status.success(), "runspool clean:\n{}", describe(&out));
    env.restart();
    wait_rescans(&env, 2);
    env.term();
    env.start_daemon();
    wait_rescans(&env, 2);
    assert_same(&before, &pis(&env), "beside a live daemon, its retention sweep and `runspool clean`");
}

// ---------------------------------------------------------------------------
// Direction B: runspool writes, pi 0.67 reads and controls
// ---------------------------------------------------------------------------

/// pi's readers accept runspool's status, indexes and results, and read the
/// same facts from them.
#[test]
fn pi_reads_runspool_runs() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let session = "sess-b";
    env.submit(&runspool_request(&env, "rs-done", session, vec![sh_step("one", "echo hello"), sh_step("two", "true")]));
    env.submit(&runspool_request(&env, "rs-live", session, vec![sh_step("sleeper", "sleep 120")]));
    env.wait_terminal("rs-done");
    env.wait_state("rs-live", "running");

    let st = pi.ok(&env, "readStatus", json!({"asyncDir": env.run_dir("rs-live")}));
    assert_eq!(st["runId"], "rs-live");
    assert_eq!(st["state"], "running");
    assert_eq!(st["sessionId"], session);
    assert!(st["pid"].is_i64(), "{st}");
    let st = pi.ok(&env, "readStatus", json!({"asyncDir": env.run_dir("rs-done")}));
    assert_eq!(st["state"], "complete");

    let active = pi.ok(&env, "readActiveRunIndex", json!({"asyncDirRoot": env.runs()}));
    let active: Vec<&str> = active.as_array().expect("an active index").iter().filter_map(|v| v.as_str()).collect();
    assert!(active.contains(&"rs-live"), "{active:?}");
    assert!(!active.contains(&"rs-done"), "{active:?}");

    let marker_dir = env.terminal_dir().join(seg(session));
    let markers = list_names(&marker_dir);
    let recent = pi.ok(
        &env,
        "readRecentTerminalRunIndex",
        json!({"asyncDirRoot": env.runs(), "options": {"sessionId": session, "limit": 10}}),
    );
    assert_eq!(recent, json!(["rs-done"]));
    assert_eq!(list_names(&marker_dir), markers, "pi removed runspool's terminal marker as invalid");

    let runs =
        pi.ok(&env, "listAsyncRuns", json!({"asyncDirRoot": env.runs(), "options": {"resultsDir": env.results()}}));
    let runs = runs.as_array().expect("a run list");
    let find = |id: &str| {
        runs.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("listAsyncRuns lacks {id}: {runs:?}")).clone()
    };
    let live = find("rs-live");
    assert_eq!(live["state"], "running");
    assert_eq!(live["sessionId"], session);
    assert_eq!(live["steps"][0]["agent"], "sleeper");
    let done = find("rs-done");
    assert_eq!(done["state"], "complete");
    assert_eq!(done["steps"].as_array().map(Vec::len), Some(2));
    let by_session = pi.ok(
        &env,
        "listAsyncRuns",
        json!({"asyncDirRoot": env.runs(), "options": {"resultsDir": env.results(), "sessionId": session, "states": ["complete"]}}),
    );
    assert_eq!(
        by_session.as_array().map(|a| a.iter().map(|r| r["id"].clone()).collect::<Vec<_>>()),
        Some(vec![json!("rs-done")])
    );

    let path = pi.ok(
        &env,
        "resultPayloadPathForSessionRun",
        json!({"resultsDir": env.results(), "sessionId": session, "runId": "rs-done"}),
    );
    assert_eq!(path, json!(env.result_path("rs-done")));

    // Reading changed nothing.
    assert_eq!(env.state("rs-live").as_deref(), Some("running"));
    assert!(env.active_dir().join("rs-live").is_file());
    assert_eq!(list_names(&marker_dir), markers);
    env.check_consistency();
}

/// pi 0.67's own lookups by tool call (`resultFilesForToolCall`) and by run
/// (`resultPayloadPathForIndexedRun`) find a finished runspool run's result,
/// which carries the run's `toolCallId` and its first step's `agent`; a run
/// without a tool call is found by run. `runspool rm` takes every index
/// entry away with the result.
#[test]
fn pi_finds_runspool_results_by_tool_call_and_by_run() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let (id, bare) = ("rs-indexed", "rs-indexed-no-call");
    let req = runspool_request(&env, id, "sess-i", vec![sh_step("first", "echo one"), sh_step("second", "echo two")]);
    let tool_call = req["toolCallId"].as_str().unwrap().to_string();
    env.submit(&req);
    let mut req = runspool_request(&env, bare, "sess-i", vec![sh_step("only", "true")]);
    req.as_object_mut().unwrap().remove("toolCallId");
    env.submit(&req);
    env.wait_terminal(id);
    env.wait_terminal(bare);

    let result = env.result(id).expect("result file");
    assert_eq!(result["toolCallId"], json!(tool_call), "{result:#}");
    assert_eq!(result["agent"], "first", "{result:#}");
    let result = env.result(bare).expect("result file");
    assert!(result.get("toolCallId").is_none(), "a run without a tool call got one: {result:#}");
    assert_eq!(result["agent"], "only", "{result:#}");

    let files = pi.ok(&env, "resultFilesForToolCall", json!({"resultsDir": env.results(), "toolCallId": tool_call}));
    assert_eq!(files, json!([format!("{id}.json")]), "pi's lookup by tool call");
    for run in [id, bare] {
        let path = pi.ok(&env, "resultPayloadPathForIndexedRun", json!({"resultsDir": env.results(), "runId": run}));
        assert_eq!(path, json!(env.result_path(run)), "pi's lookup by run id of {run}");
    }
    // The entries are those pi writes for a result of its own: same content in each.
    let name = format!("{}.json", seg250(id));
    let by_session = read_json(&env.results().join("result-index/sessions").join(seg("sess-i")).join(&name));
    let by_run = read_json(&env.results().join("result-index/runs").join(&name));
    let by_call = read_json(&env.results().join("result-index/tool-calls").join(seg(&tool_call)).join(&name));
    assert!(by_session.is_some(), "no session index entry");
    assert_eq!(by_run, by_session, "the run index entry differs from the session one");
    assert_eq!(by_call, by_session, "the tool-call index entry differs from the session one");

    let out = env.cli(&["rm", id, bare]);
    assert!(out.status.success(), "runspool rm:\n{}", describe(&out));
    let files = pi.ok(&env, "resultFilesForToolCall", json!({"resultsDir": env.results(), "toolCallId": tool_call}));
    assert_eq!(files, json!([]), "pi still finds a removed run by its tool call");
    for run in [id, bare] {
        let path = pi.ok(&env, "resultPayloadPathForIndexedRun", json!({"resultsDir": env.results(), "runId": run}));
        assert_eq!(path, Value::Null, "pi still finds removed run {run}");
        assert!(!env.results().join("result-index/runs").join(format!("{}.json", seg250(run))).exists());
    }
    assert!(
        !env.results().join("result-index/tool-calls").join(seg(&tool_call)).exists(),
        "the tool call's index directory stayed"
    );
}

/// pi's stale-run reconciler leaves a live runspool run alone.
#[test]
fn pi_reconcile_leaves_a_live_runspool_run_running() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "rs-reconcile";
    env.submit(&runspool_request(&env, id, "sess-r", vec![sh_step("sleeper", "sleep 120")]));
    env.wait_state(id, "running");
    let status_before = file_bytes(&env.run_dir(id).join("status.json"));
    let r = pi.ok(&env, "reconcileAsyncRun", json!({"asyncDir": env.run_dir(id), "resultsDir": env.results()}));
    assert_eq!(r["repaired"], false, "{r}");
    assert_eq!(r["status"]["state"], "running", "{r}");
    let status_after = file_bytes(&env.run_dir(id).join("status.json"));
    if status_after != status_before {
        // Only the runner may have written meanwhile; it never says anything but running here.
        assert_eq!(env.state(id).as_deref(), Some("running"));
    }
    assert!(!env.result_path(id).exists(), "pi wrote a result for a live run");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(env.state(id).as_deref(), Some("running"));
}

/// Pids of live processes whose environment holds `RUNSPOOL_RUN_ID=<run_id>`.
fn processes_of_run(run_id: &str) -> Vec<i64> {
    let needle = format!("RUNSPOOL_RUN_ID={run_id}");
    let mut out = vec![];
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i64>().ok()) else { continue };
        let Ok(env) = fs::read(format!("/proc/{pid}/environ")) else { continue };
        if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) && process_alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// True once no process has `pid` any more (a zombie still answers kill 0).
fn pid_gone(pid: i64) -> bool {
    unsafe { libc::kill(pid as libc::pid_t, 0) != 0 && *libc::__errno_location() == libc::ESRCH }
}

/// A runspool run whose runner and daemon were SIGKILLed, then failed by pi
/// 0.67's own stale-run reconciler: the next daemon kills its step
/// processes (a `sleep 300` and its background sibling) and cancels its
/// live external job through the configured provider, keeps the status pi
/// wrote byte for byte, and says what it did in a
/// `subagent.run.leftovers_cleaned` event and a log line naming the run.
#[test]
fn leftovers_of_a_runspool_run_pi_ended_are_cleaned_up_and_its_status_kept() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.leaves_root_inconsistent("pi ended this run of runspool's and wrote its result in pi's own form");
    let engine = Engine::configure(&env);
    env.start_daemon();
    let id = "rs-ended-by-pi";
    let remote = json!({"agent": "remote", "externalJob": {"provider": "engine", "prompt": "echo hi", "options": {}}});
    let steps = vec![parallel(vec![sh_step("sleeper", "sleep 300 & sleep 300"), remote], None)];
    env.submit(&runspool_request(&env, id, "sess-p", steps));
    let mut st = Value::Null;
    wait_until(LONG, "the step to run and the external job to be started", || {
        st = env.status(id).unwrap_or(Value::Null);
        st["steps"][0]["pid"].is_i64()
            && st["steps"][1]["externalJob"]["providerJobId"].is_string()
            && processes_of_run(id).len() >= 2
    });
    let job = st["steps"][1]["externalJob"]["providerJobId"].as_str().unwrap().to_string();
    let runner = st["pid"].as_i64().unwrap();
    env.kill9();
    unsafe {
        libc::kill(runner as libc::pid_t, libc::SIGKILL);
    }
    wait_until(LONG, "the runner to be gone", || pid_gone(runner));
    let left = processes_of_run(id);
    assert!(!left.is_empty(), "the step processes died with their runner: nothing to clean up");

    // No runspool daemon: a pi host reconciles the run as stale.
    let r = pi.ok(&env, "reconcileAsyncRun", json!({"asyncDir": env.run_dir(id), "resultsDir": env.results()}));
    assert_eq!(r["repaired"], true, "{r}");
    assert_eq!(r["status"]["state"], "failed", "{r}");
    let status_path = env.run_dir(id).join("status.json");
    let written_by_pi = file_bytes(&status_path);
    assert!(env.active_dir().join(id).symlink_metadata().is_err(), "pi left the active marker");
    assert!(engine.calls().iter().all(|(op, _)| op != "cancel"), "{:?}", engine.calls());

    env.start_daemon();
    wait_until(Duration::from_secs(120), "every process of the run pi ended to be killed", || {
        processes_of_run(id).is_empty()
    });
    wait_until(LONG, "the live external job to be cancelled", || {
        engine.calls().iter().any(|(op, input)| op == "cancel" && input.contains(&job))
    });
    wait_until(LONG, "the leftovers_cleaned event", || {
        env.event_types(id).iter().any(|t| t == "subagent.run.leftovers_cleaned")
    });
    let ev = env.events(id).into_iter().find(|e| e["type"] == "subagent.run.leftovers_cleaned").unwrap();
    assert_eq!(ev["runId"], id, "{ev}");
    assert!(ev["pids"].as_array().is_some_and(|p| !p.is_empty()), "{ev}");
    assert_eq!(ev["externalJobs"][0]["providerJobId"], json!(job), "{ev}");
    assert!(
        env.log_tail(400).lines().any(|l| l.contains(id) && l.contains("leftovers")),
        "no log line names the run:\n{}",
        env.log_tail(60)
    );
    assert_eq!(file_bytes(&status_path), written_by_pi, "runspool rewrote the status pi wrote");
    // Not again: neither on rescans nor after a restart.
    wait_rescans(&env, 2);
    env.restart();
    wait_rescans(&env, 2);
    assert_eq!(engine.calls().iter().filter(|(op, _)| op == "cancel").count(), 1, "{:?}", engine.calls());
    assert_eq!(env.event_types(id).iter().filter(|t| *t == "subagent.run.leftovers_cleaned").count(), 1);
    assert_eq!(file_bytes(&status_path), written_by_pi, "runspool rewrote the status pi wrote");
}

/// pi's own stop request (control/stop-requests/) stops a runspool run.
#[test]
fn pi_stop_request_stops_a_runspool_run() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    env.start_daemon();
    let id = "rs-pi-stop";
    env.submit(&runspool_request(&env, id, "sess-s", vec![sh_step("sleeper", "sleep 300")]));
    env.wait_state(id, "running");
    let r = pi.ok(
        &env,
        "requestAsyncStop",
        json!({"asyncDir": env.run_dir(id), "payload": {"source": "pi-subagents", "reason": "user asked"}}),
    );
    let req = PathBuf::from(r["requestPath"].as_str().unwrap());
    assert!(req.starts_with(env.run_dir(id).join("control").join("stop-requests")), "{r}");
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st:#}");
    assert!(!req.exists(), "the stop request was not consumed");
    // pi sees the end the same way.
    let seen = pi.ok(&env, "readStatus", json!({"asyncDir": env.run_dir(id)}));
    assert_eq!(seen["state"], "stopped");
    let recent = pi.ok(
        &env,
        "readRecentTerminalRunIndex",
        json!({"asyncDirRoot": env.runs(), "options": {"sessionId": "sess-s"}}),
    );
    assert_eq!(recent, json!([id]));
}

/// A `follow-up` bridge request written by pi's requestExternalJobOperation
/// into a live runspool run is dispatched once to the configured command
/// provider, answered with its handle, and tombstoned.
#[test]
fn pi_follow_up_bridge_request_is_answered_for_a_runspool_run() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    let engine = Engine::configure(&env);
    env.start_daemon();
    let id = "rs-follow-up";
    env.submit(&runspool_request(&env, id, "sess-f", vec![sh_step("sleeper", "sleep 300")]));
    env.wait_state(id, "running");
    let mut follow_up = start_input(&env, id, "continue with the review", "sess-f");
    follow_up["sourceRunId"] = json!("earlier-run");
    follow_up["sourceStepIndex"] = json!(0);
    follow_up["parentProviderJobId"] = json!("job-parent-1");
    follow_up["requestId"] = json!("req-42");
    follow_up["requestDigest"] = json!(sha256_hex(b"req-42"));
    let r = pi.ok(
        &env,
        "requestExternalJobOperation",
        json!({"asyncDir": env.run_dir(id), "request": {"operation": "follow-up", "provider": "engine", "followUp": follow_up}, "waitMs": 90000}),
    );
    assert_eq!(r["result"], json!({"providerJobId": "fu-req-42", "state": "queued"}));
    let calls = engine.calls();
    let fu: Vec<_> = calls.iter().filter(|(op, _)| op == "follow-up").collect();
    assert_eq!(fu.len(), 1, "{calls:?}");
    let input: Value =
        serde_json::from_str(&fu[0].1).unwrap_or_else(|e| panic!("follow-up stdin is not JSON ({e}): {calls:?}"));
    assert_eq!(input, follow_up, "the provider got another follow-up object");
    let c = claims(&env.run_dir(id));
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].join("completed.json").is_file(), "no tombstone in {}", c[0].display());
    assert_eq!(read_json(&c[0].join("handle.json")), Some(r["result"].clone()));
    assert_bridge_drained(&env.run_dir(id));
    // Never dispatched twice.
    wait_rescans(&env, 2);
    assert_eq!(engine.calls().iter().filter(|(op, _)| op == "follow-up").count(), 1);
    assert_eq!(env.state(id).as_deref(), Some("running"));
}

// ---------------------------------------------------------------------------
// The bridge of pi's own runs, with no pi host running
// ---------------------------------------------------------------------------

/// runspool services `status` and `start` requests that pi wrote into a run
/// pi launched, through its configured provider, and touches nothing else of
/// that run.
#[test]
fn runspool_services_bridge_requests_of_a_pi_run() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    let engine = Engine::configure(&env);
    let live = Sleeper::start();
    let id = "pi-bridge";
    pi.write_run(&env, id, "pi-session-e", "running", "chain", Some(live.pid()));
    let owned = |env: &TestEnv| {
        let mut s = snapshot(env, &[id], &[]);
        s.retain(|k, _| !k.contains("external-job-"));
        s
    };
    let before = owned(&env);
    env.start_daemon();

    let r = pi.ok(
        &env,
        "requestExternalJobOperation",
        json!({"asyncDir": env.run_dir(id), "request": {"operation": "status", "provider": "engine", "providerJobId": "job-known"}, "timeoutMs": 60000}),
    );
    assert_eq!(r["result"], json!({"providerJobId": "job-known", "state": "running"}));

    let start = start_input(&env, id, "#!/bin/sh\necho remote work\n", "pi-session-e");
    let r = pi.ok(
        &env,
        "requestExternalJobOperation",
        json!({"asyncDir": env.run_dir(id), "request": {"operation": "start", "provider": "engine", "start": start}, "waitMs": 90000}),
    );
    assert_eq!(r["result"]["state"], "queued", "{r}");
    assert!(r["result"]["providerJobId"].as_str().is_some_and(|j| j.starts_with("job-")), "{r}");
    let calls = engine.calls();
    assert_eq!(calls.iter().filter(|(op, _)| op == "start").count(), 1, "{calls:?}");
    let c = claims(&env.run_dir(id));
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].join("completed.json").is_file());
    let owner = read_json(&c[0].join("owner.json")).expect("owner.json");
    assert_eq!(owner["pid"].as_i64(), env.daemon_pid(), "{owner}");
    assert_eq!(read_json(&c[0].join("handle.json")), Some(r["result"].clone()));
    assert_bridge_drained(&env.run_dir(id));

    wait_rescans(&env, 2);
    assert_same(&before, &owned(&env), "after servicing the bridge");
    assert!(!env.run_dir(id).join("request.json").exists());
    assert!(process_alive(live.pid() as i64));
}

/// A bridge request of a pi run for a provider runspool does not have is
/// another servicer's: no response, the request stays.
#[test]
fn bridge_request_of_a_pi_run_for_an_unconfigured_provider_is_left_alone() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::with_config(FAST_RESCAN);
    let engine = Engine::configure(&env);
    let live = Sleeper::start();
    let id = "pi-bridge-other";
    pi.write_run(&env, id, "pi-session-f", "running", "chain", Some(live.pid()));
    env.start_daemon();
    let e = pi
        .call(
            &env,
            "requestExternalJobOperation",
            json!({"asyncDir": env.run_dir(id), "request": {"operation": "status", "provider": "surf", "providerJobId": "surf-1"}, "timeoutMs": 4000}),
        )
        .expect_err("a request for an unconfigured provider was answered");
    assert_eq!(e.code.as_deref(), Some("bridge-timeout"), "{e:?}");
    let reqs = env.run_dir(id).join("external-job-requests");
    let pending = list_names(&reqs);
    assert_eq!(pending.len(), 1, "{pending:?}");
    let bytes = file_bytes(&reqs.join(&pending[0]));
    wait_rescans(&env, 3);
    assert_eq!(list_names(&reqs), pending);
    assert_eq!(file_bytes(&reqs.join(&pending[0])), bytes);
    let responses = list_names(&env.run_dir(id).join("external-job-responses"));
    assert!(responses.is_empty(), "runspool answered another host's request: {responses:?}");
    assert!(engine.calls().is_empty(), "{:?}", engine.calls());
}
