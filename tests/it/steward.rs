//! The steward (PROTOCOL §14.1): a pi-subagents run whose runner is gone is
//! reconciled by the daemon exactly as pi-subagents 0.67.0's own
//! `reconcileAsyncRun` would reconcile it, byte for byte, and only then.
//!
//! Each byte-identity check runs 0.67's code (installed pinned from npm, as
//! in tests/it/pi_compat.rs, driven through tests/pi/driver.mjs with its clock
//! frozen) on a root, saves the tree, restores the original root at the same
//! path, lets the daemon's steward act on it with the same frozen clock
//! (`RUNSPOOL_STEWARD_NOW_MS`), and compares the trees: names, modes and
//! contents. `RUNSPOOL_STEWARD_CONFIRM_MS` shortens the 30 s between the two
//! looks.
//!
//! Without node or npm on PATH every test prints `skipped: node is not
//! installed` and passes.

use crate::common;

use common::*;
use runspool::protocol::jsjson;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::pi::{tool_present, DRIVER, PI_VERSION};
/// A pid above Linux's `pid_max` limit (2^22): `kill(pid, 0)` is ESRCH for
/// node and the daemon alike, whatever runs on the machine.
const DEAD_PID: i64 = 2_147_483_646;
const HOUR: i64 = 3_600_000;

// ---------------------------------------------------------------------------
// pi-subagents 0.67.0 (the same pinned install as tests/it/pi_compat.rs)
// ---------------------------------------------------------------------------

struct Pi {
    dir: PathBuf,
}

/// pi-subagents at PI_VERSION (`common::pi`, shared with tests/it/pi_compat.rs);
/// None when node or npm is missing.
fn pi() -> Option<Pi> {
    common::pi::install().map(|dir| Pi { dir })
}

impl Pi {
    /// One driver action that must succeed; `now` freezes pi's Date.now.
    fn call(&self, env: Option<&TestEnv>, action: &str, arg: Value, now: Option<i64>) -> Value {
        let mut cmd = Command::new("node");
        cmd.arg(DRIVER).arg(action).arg(arg.to_string()).env("PI_SUBAGENTS_INSTALL_DIR", &self.dir);
        if let Some(env) = env {
            cmd.env("PI_SUBAGENTS_TEMP_ROOT", &env.root).current_dir(&env.work);
        }
        if let Some(t) = now {
            cmd.env("PI_DRIVER_NOW_MS", t.to_string());
        }
        let out = cmd.stdin(Stdio::null()).output().expect("spawn node");
        assert!(out.status.success(), "pi {PI_VERSION} {action}({arg}) failed:\n{}", describe(&out));
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("driver output is not JSON ({e}):\n{}", describe(&out)))
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

/// `sleep 1000` standing in for a live pi runner; killed on drop.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Sleeper {
        Sleeper(Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().expect("spawn sleep"))
    }
    fn pid(&self) -> i64 {
        self.0.id() as i64
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---------------------------------------------------------------------------
// Building pi runs, saving and comparing trees
// ---------------------------------------------------------------------------

/// A pi run on disk: status.json exactly `status` (pi writes it without a
/// trailing newline), its active marker and, for a `toolCallId`, its alias.
fn pi_run(env: &TestEnv, id: &str, status: &str) {
    let dir = env.run_dir(id);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("status.json"), status).unwrap();
    fs::write(dir.join("events.jsonl"), format!("{{\"type\":\"subagent.run.started\",\"ts\":1,\"runId\":\"{id}\"}}\n"))
        .unwrap();
    fs::write(env.active_dir().join(id), "").unwrap();
    if let Ok(v) = serde_json::from_str::<Value>(status) {
        if let Some(tc) = v["toolCallId"].as_str() {
            let d = env.active_dir().join("tool-calls").join(seg(tc));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join(id), "").unwrap();
        }
    }
}

/// A status as a pi host writes it (JSON.stringify(v, null, 2)).
fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap()
}

/// Steps of a chain whose second step was running when the runner died.
fn steps(t: i64) -> Value {
    json!([
        {"agent": "scout", "status": "completed", "startedAt": t - 4 * HOUR, "endedAt": t - 3 * HOUR, "durationMs": HOUR, "exitCode": 0, "model": "anthropic/claude-sonnet-4"},
        {"agent": "worker", "status": "running", "startedAt": t - 3 * HOUR, "activityState": "active", "lastActivityAt": t - 2 * HOUR, "currentTool": "bash"},
    ])
}

fn base_status(id: &str, session: Option<&str>, pid: i64, t: i64) -> Value {
    let mut s = json!({
        "lifecycleArtifactVersion": 3,
        "runId": id,
        "toolCallId": format!("toolu_{id}/call+1"),
        "completionOwnerId": "owner-1",
        "mode": "chain",
        "state": "running",
        "activityState": "active",
        "startedAt": t - 4 * HOUR,
        "lastUpdate": t - 2 * HOUR,
        "pid": pid,
        "cwd": "/home/user/project",
        "currentStep": 1,
        "chainStepCount": 2,
        "steps": steps(t),
        "piHostFutureField": {"kept": true},
    });
    if let Some(sess) = session {
        s["sessionId"] = json!(sess);
    }
    s
}

type Snapshot = BTreeMap<String, String>;

fn snap_into(root: &Path, p: &Path, out: &mut Snapshot) {
    let Ok(md) = fs::symlink_metadata(p) else { return };
    let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
    let mode = md.mode() & 0o7777;
    if md.is_dir() {
        out.insert(rel, format!("dir {mode:o}"));
        for name in list_names(p) {
            snap_into(root, &p.join(name), out);
        }
    } else if md.is_file() {
        let mut bytes = vec![];
        File::open(p).unwrap().read_to_end(&mut bytes).unwrap();
        let shown = if bytes.len() <= 6000 {
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            format!("{} bytes sha256 {}", bytes.len(), sha256_hex(&bytes))
        };
        out.insert(rel, format!("file {mode:o} {shown}"));
    } else {
        out.insert(rel, format!("other {:o}", md.mode()));
    }
}

/// Everything 0.67's reconciliation may write: the runs root (run
/// directories and indexes) and the results tree.
fn snapshot(env: &TestEnv) -> Snapshot {
    let mut out = Snapshot::new();
    snap_into(&env.root, &env.runs(), &mut out);
    snap_into(&env.root, &env.results(), &mut out);
    out
}

fn diff(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let mut d = vec![];
    for (k, v) in a {
        match b.get(k) {
            None => d.push(format!("only in 0.67's tree: {k}: {v}")),
            Some(w) if w != v => d.push(format!("differs: {k}\n  0.67:     {v:?}\n  runspool: {w:?}")),
            _ => {}
        }
    }
    for (k, v) in b {
        if !a.contains_key(k) {
            d.push(format!("only in runspool's tree: {k}: {v}"));
        }
    }
    d
}

/// `cp -a` (names, contents, modes).
fn copy_tree(from: &Path, to: &Path) {
    let st = Command::new("cp").arg("-a").arg(from).arg(to).status().expect("cp");
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

/// Put the saved copy of the root's runs and results back in place.
fn restore(env: &TestEnv, saved: &Path) {
    for d in [env.runs(), env.results()] {
        fs::remove_dir_all(&d).unwrap();
        copy_tree(&saved.join(d.file_name().unwrap()), &d);
    }
}

fn save(env: &TestEnv, to: &Path) {
    fs::create_dir_all(to).unwrap();
    copy_tree(&env.runs(), &to.join("async-subagent-runs"));
    copy_tree(&env.results(), &to.join("async-subagent-results"));
}

fn reconciled_in_log(env: &TestEnv) -> Vec<String> {
    let log = fs::read_to_string(&env.log_path).unwrap_or_default();
    log.lines()
        .filter(|l| l.contains("steward: reconciled"))
        .filter_map(|l| l.split("run_id=").nth(1).map(|r| r.split_whitespace().next().unwrap_or("").to_string()))
        .collect()
}

/// Run 0.67's reconcileAsyncRun on every run of `ids` at `t`, then the
/// daemon's steward on the same root at `t`, and compare the trees.
/// Returns 0.67's verdicts by run.
fn compare_with_pi(pi: &Pi, env: &mut TestEnv, ids: &[&str], t: i64) -> BTreeMap<String, Value> {
    let saved = env.base().join("saved");
    save(env, &saved);
    let dirs: Vec<PathBuf> = ids.iter().map(|id| env.run_dir(id)).collect();
    let verdicts = pi.call(Some(env), "reconcileAll", json!({"asyncDirs": dirs, "resultsDir": env.results()}), Some(t));
    let verdicts: BTreeMap<String, Value> =
        ids.iter().zip(verdicts.as_array().unwrap()).map(|(id, v)| (id.to_string(), v.clone())).collect();
    let repaired: Vec<&str> = ids.iter().copied().filter(|id| verdicts[*id]["repaired"] == true).collect();
    let by_pi = snapshot(env);
    restore(env, &saved);

    env.extra_env =
        vec![("RUNSPOOL_STEWARD_NOW_MS".into(), t.to_string()), ("RUNSPOOL_STEWARD_CONFIRM_MS".into(), "1500".into())];
    env.start_daemon();
    wait_until(Duration::from_secs(90), "the steward reconciled every run 0.67 reconciled", || {
        let mut done = reconciled_in_log(env);
        done.sort();
        let mut want: Vec<String> = repaired.iter().map(|s| s.to_string()).collect();
        want.sort();
        done == want
    });
    // More looks than one confirmation takes: nothing else may follow.
    std::thread::sleep(Duration::from_secs(4));
    env.term();
    let by_runspool = snapshot(env);
    let d = diff(&by_pi, &by_runspool);
    assert!(
        d.is_empty(),
        "the steward's tree differs from 0.67's:\n{}\n\ndaemon log:\n{}",
        d.join("\n"),
        env.log_tail(40)
    );
    let mut done = reconciled_in_log(env);
    done.sort();
    let mut want: Vec<String> = repaired.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(done, want, "runs the steward reconciled (log) vs 0.67");
    verdicts
}

// ---------------------------------------------------------------------------
// Byte identity with 0.67
// ---------------------------------------------------------------------------

/// The core cases: a dead pid (with tool-call aliases, an empty alias
/// directory of another run, the stderr tail, lifecycle v3 without
/// `processTerminal`), a result already published for a running run, a run
/// without `sessionId`, and a status with floats, integers above 2^53,
/// non-ASCII text, escapes and integer-like keys.
#[test]
fn steward_writes_what_pi_0_67_writes_core() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::new();
    env.leaves_root_inconsistent("pi's tool-call alias of a run that is not there");
    let t = now_ms();

    // Dead pid, with aliases under two tool-call directories and an empty one.
    pi_run(&env, "pi-dead", &pretty(&base_status("pi-dead", Some("sess-a"), DEAD_PID, t)));
    let extra_alias = env.active_dir().join("tool-calls").join("older-call");
    fs::create_dir_all(&extra_alias).unwrap();
    fs::write(extra_alias.join("pi-dead"), "").unwrap();
    fs::create_dir_all(env.active_dir().join("tool-calls").join("empty-call")).unwrap();
    let other = env.active_dir().join("tool-calls").join("other-call");
    fs::create_dir_all(&other).unwrap();
    fs::write(other.join("someone-else"), "").unwrap();
    fs::write(env.run_dir("pi-dead").join("runner.stderr.log"), "node: warning\r\nError: the model went away\n\n")
        .unwrap();

    // A result published for a running run (pi's runner died after writing it).
    let mut st = base_status("pi-result", Some("sess-a"), DEAD_PID, t);
    st["processTerminal"] = json!({"version": 1, "state": "pending", "runId": "pi-result"});
    st["steps"][0]["status"] = json!("running");
    st["steps"][0]["model"] = json!("anthropic/claude-sonnet-4:high");
    st["steps"][1]["model"] = json!("openai/gpt-5");
    st["steps"][1]["thinking"] = json!("low");
    pi_run(&env, "pi-result", &pretty(&st));
    pi.call(
        Some(&env),
        "writeResult",
        json!({"resultsDir": env.results(), "runId": "pi-result", "data": {
            "id": "pi-result", "runId": "pi-result", "sessionId": "sess-a", "agent": "scout", "mode": "chain",
            "state": "failed", "success": false, "summary": "worker failed", "exitCode": 1,
            "results": [{"agent": "scout", "success": true, "model": "anthropic/claude-sonnet-4:medium", "sessionName": "s1"},
                        {"agent": "worker", "success": false, "error": "tool crashed", "attemptedModels": ["a", "b"]}],
            "timestamp": t - HOUR, "durationMs": 3 * HOUR, "asyncDir": env.run_dir("pi-result"),
        }}),
        Some(t - HOUR),
    );

    // No sessionId: no result, no terminal marker; an empty step list.
    let mut st = base_status("pi-nosession", None, DEAD_PID, t);
    st["steps"] = json!([]);
    st.as_object_mut().unwrap().remove("toolCallId");
    pi_run(&env, "pi-nosession", &pretty(&st));

    // Numbers and strings as only JavaScript prints them.
    let numbers = format!(
        r#"{{
  "runId": "pi-numbers",
  "sessionId": "sess-ü 日本/x+y",
  "toolCallId": "call é",
  "10": "ten", "2": "two", "01": "zero-one",
  "mode": "single",
  "state": "running",
  "startedAt": {start}.75,
  "lastUpdate": 1.5e12,
  "pid": {DEAD_PID},
  "big": 9007199254740993,
  "bigger": 123456789012345678901234567890,
  "tiny": 1.5e-7, "small": 0.000001, "negzero": -0, "huge": 1e21, "exp": 2.5E+25, "third": 0.30000000000000004,
  "text": "naïve café – “quoted” \u2028 \ud800 tab\there \u0001 😀",
  "dup": 1, "dup": 2,
  "steps": [
    {{"agent": "one", "status": "pending", "startedAt": {start}.25, "ratio": 0.1}},
    {{"agent": "two", "status": "running", "exitCode": -0, "error": null}}
  ]
}}"#,
        start = t - 2 * HOUR
    );
    pi_run(&env, "pi-numbers", &numbers);

    let ids = ["pi-dead", "pi-result", "pi-nosession", "pi-numbers"];
    let verdicts = compare_with_pi(&pi, &mut env, &ids, t);
    for id in ids {
        assert_eq!(verdicts[id]["repaired"], true, "0.67 did not repair {id}: {verdicts:?}");
    }
    assert_eq!(verdicts["pi-result"]["state"], "failed");
    // What the trees hold, beyond being equal.
    let st = env.status("pi-dead").unwrap();
    assert_eq!(st["state"], "failed");
    assert_eq!(st["processTerminal"]["reason"], "stale-repair");
    assert!(st["steps"][1]["error"].as_str().unwrap().contains("Error: the model went away"), "{st}");
    assert!(!env.active_dir().join("pi-dead").exists());
    assert!(!extra_alias.exists(), "the alias directory left empty stays");
    assert!(!env.active_dir().join("tool-calls/empty-call").exists());
    assert!(other.join("someone-else").exists());
    assert_eq!(env.result("pi-dead").unwrap()["state"], "failed");
    assert_eq!(env.event_types("pi-dead").last().map(String::as_str), Some("subagent.run.repaired_stale"));
    assert!(!env.result_path("pi-nosession").exists());
    assert_eq!(env.status("pi-result").unwrap()["steps"][0]["thinking"], "medium");
}

/// The stderr tail where 0.67 cuts it: the 64 KiB window starting inside a
/// UTF-8 sequence, more than 30 lines with CRLF, more than 4000 UTF-16
/// units cut inside a surrogate pair, U+0085 (not whitespace to
/// JavaScript's trim); and the rest of lifecycle v3: a `processTerminal`
/// that is not pending stays, `mission.json` adds the mission index, a
/// status without `startedAt` has no duration; a live pid whose status is
/// 25 hours old.
#[test]
fn steward_writes_what_pi_0_67_writes_edges() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::new();
    let t = now_ms();
    let live = Sleeper::start();

    pi_run(&env, "pi-cut", &pretty(&base_status("pi-cut", Some("sess-b"), DEAD_PID, t)));
    let mut cut = b"first line\n".to_vec();
    cut.extend("😀😀😀😀abc\u{85}".as_bytes());
    // The window (last 65536 bytes) starts two bytes into the first emoji.
    let tail_len = 2 + 12 + 3 + 2;
    cut.extend(std::iter::repeat_n(b' ', 65536 - tail_len));
    fs::write(env.run_dir("pi-cut").join("runner.stderr.log"), &cut).unwrap();

    pi_run(&env, "pi-long", &pretty(&base_status("pi-long", Some("sess-b"), DEAD_PID, t)));
    let mut long = String::new();
    for i in 0..40 {
        long.push_str(&format!("line {i} \u{feff}\r\n"));
    }
    long.push_str(&"😀".repeat(2500));
    long.push_str("a\r\n\r\n");
    fs::write(env.run_dir("pi-long").join("runner.stderr.log"), &long).unwrap();

    let mut st = base_status("pi-exited", Some("sess-b"), DEAD_PID, t);
    st["processTerminal"] = json!({"version": 1, "state": "exited", "runId": "pi-exited", "exitCode": 0});
    pi_run(&env, "pi-exited", &pretty(&st));
    fs::write(env.run_dir("pi-exited").join("mission.json"), "{\"mission\":\"m-1\"}").unwrap();

    let mut st = base_status("pi-nostart", Some("sess-b"), DEAD_PID, t);
    let o = st.as_object_mut().unwrap();
    o.remove("startedAt");
    o.remove("lastUpdate");
    o.remove("lifecycleArtifactVersion");
    st["steps"] = json!([{"agent": "solo", "status": "running"}]);
    pi_run(&env, "pi-nostart", &pretty(&st));

    let mut st = base_status("pi-stale-live", Some("sess-b"), live.pid(), t);
    st["lastUpdate"] = json!(t - 25 * HOUR);
    pi_run(&env, "pi-stale-live", &pretty(&st));

    // A queued run whose result says stopped: `stopped: true`, steps stopped.
    let mut st = base_status("pi-queued-result", Some("sess-b"), DEAD_PID, t);
    st["state"] = json!("queued");
    st["displayDismissedAt"] = json!(t - HOUR);
    st["steps"][0]["status"] = json!("pending");
    pi_run(&env, "pi-queued-result", &pretty(&st));
    pi.call(
        Some(&env),
        "writeResult",
        json!({"resultsDir": env.results(), "runId": "pi-queued-result", "data": {
            "id": "pi-queued-result", "sessionId": "sess-b", "state": "stopped", "success": false, "exitCode": 1,
            "results": ["not an object", {"success": null, "error": "stopped by user", "model": "m:xhigh"}],
        }}),
        Some(t - HOUR),
    );

    // No sessionId, a plain result file with exitCode 0 (paused), no index.
    let mut st = base_status("pi-plain-result", None, DEAD_PID, t);
    st["steps"][1]["status"] = json!("pending");
    st["endedAt"] = json!(t - 5 * HOUR);
    pi_run(&env, "pi-plain-result", &pretty(&st));
    fs::write(env.result_path("pi-plain-result"), "{\"exitCode\": 0, \"results\": 7}").unwrap();

    let ids = ["pi-cut", "pi-long", "pi-exited", "pi-nostart", "pi-stale-live", "pi-queued-result", "pi-plain-result"];
    let verdicts = compare_with_pi(&pi, &mut env, &ids, t);
    for id in ids {
        assert_eq!(verdicts[id]["repaired"], true, "0.67 did not repair {id}: {verdicts:?}");
    }
    let err = env.status("pi-cut").unwrap()["steps"][1]["error"].as_str().unwrap().to_string();
    assert!(err.ends_with("\u{fffd}\u{fffd}😀😀😀abc\u{85}"), "{err:?}");
    let status_text = fs::read_to_string(env.run_dir("pi-long").join("status.json")).unwrap();
    assert!(status_text.contains("[stderr tail truncated]") && status_text.contains("\\ude00"), "no cut surrogate");
    assert_eq!(env.status("pi-exited").unwrap()["processTerminal"]["state"], "exited");
    assert!(env.results().join("result-index/observers/mission/pi-exited.json").is_file());
    assert_eq!(env.result("pi-nostart").unwrap()["durationMs"], Value::Null);
    assert!(env.status("pi-stale-live").unwrap()["steps"][1]["error"]
        .as_str()
        .unwrap()
        .contains("still has a live PID"));
    assert!(process_alive(live.pid()), "the steward signalled a live process");
    let st = env.status("pi-queued-result").unwrap();
    assert_eq!((&st["state"], &st["stopped"]), (&json!("stopped"), &json!(true)), "{st}");
    assert!(st.get("displayDismissedAt").is_none(), "{st}");
    assert_eq!(env.state("pi-plain-result").as_deref(), Some("paused"));
}

/// What 0.67 leaves alone the steward leaves alone, byte for byte: a live
/// pid with a fresh status, a dismissed run, a queued run, a status that
/// does not parse; and a run runspool claimed is never the steward's.
#[test]
fn steward_leaves_alone_what_pi_0_67_leaves_alone() {
    let pi = pi_or_skip!();
    let mut env = TestEnv::new();
    let t = now_ms();
    let live = Sleeper::start();

    pi_run(&env, "pi-fresh", &pretty(&base_status("pi-fresh", Some("sess-c"), live.pid(), t)));
    let mut st = base_status("pi-dismissed", Some("sess-c"), DEAD_PID, t);
    st["displayDismissedAt"] = json!(t - HOUR);
    pi_run(&env, "pi-dismissed", &pretty(&st));
    let mut st = base_status("pi-queued", Some("sess-c"), DEAD_PID, t);
    st["state"] = json!("queued");
    pi_run(&env, "pi-queued", &pretty(&st));
    pi_run(&env, "pi-garbled", "{\"runId\": \"pi-garbled\", \"state\": \"running\", \"pid\": 2147483646, ");
    let mut st = base_status("pi-other-id", Some("sess-c"), DEAD_PID, t);
    st["runId"] = json!("pi-somewhere-else");
    pi_run(&env, "pi-other-id", &pretty(&st));

    let ids = ["pi-fresh", "pi-dismissed", "pi-queued", "pi-garbled"];
    let before = snapshot(&env);
    let verdicts = compare_with_pi(&pi, &mut env, &ids, t);
    for id in ["pi-fresh", "pi-dismissed", "pi-queued"] {
        assert_eq!(verdicts[id]["repaired"], false, "0.67 repaired {id}: {verdicts:?}");
    }
    assert!(verdicts["pi-garbled"]["error"].is_string(), "{verdicts:?}");
    let d = diff(&before, &snapshot(&env));
    assert!(d.is_empty(), "runs 0.67 leaves alone were changed:\n{}", d.join("\n"));
    assert!(process_alive(live.pid()));
}

// ---------------------------------------------------------------------------
// Two looks, on/off, reporting
// ---------------------------------------------------------------------------

/// A dead pi run is reconciled only after two looks `confirm` apart with
/// status.json unchanged: while it keeps changing nothing happens; a live one
/// is never touched.
#[test]
fn dead_run_is_reconciled_only_after_two_looks_with_status_unchanged() {
    let mut env = TestEnv::new();
    let t = now_ms();
    let live = Sleeper::start();
    pi_run(&env, "pi-live", &pretty(&base_status("pi-live", Some("sess-d"), live.pid(), t)));
    let status = |n: i64| {
        let mut s = base_status("pi-changing", Some("sess-d"), DEAD_PID, t);
        s["lastUpdate"] = json!(t - 2 * HOUR + n);
        pretty(&s)
    };
    pi_run(&env, "pi-changing", &status(0));
    let confirm = Duration::from_millis(3000);
    env.extra_env = vec![("RUNSPOOL_STEWARD_CONFIRM_MS".into(), confirm.as_millis().to_string())];
    let live_before = file_bytes(&env.run_dir("pi-live").join("status.json"));
    env.start_daemon();
    // A writer that keeps changing the status (as a live host would): never acted on.
    let changing = env.run_dir("pi-changing").join("status.json");
    let until = Instant::now() + Duration::from_secs(8);
    let mut n = 0;
    let mut last_change = Instant::now();
    while Instant::now() < until {
        n += 1;
        fs::write(&changing, status(n)).unwrap();
        last_change = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(env.state("pi-changing").as_deref(), Some("running"), "reconciled while status.json changed");
    }
    wait_until(Duration::from_secs(60), "pi-changing reconciled", || {
        env.state("pi-changing").as_deref() == Some("failed")
    });
    wait_until(Duration::from_secs(30), "the reconciliation logged", || !reconciled_in_log(&env).is_empty());
    assert!(
        last_change.elapsed() >= confirm,
        "reconciled {:?} after the last change, before the {confirm:?} between two looks",
        last_change.elapsed()
    );
    assert_eq!(reconciled_in_log(&env), vec!["pi-changing".to_string()]);
    assert_eq!(file_bytes(&env.run_dir("pi-live").join("status.json")), live_before, "a live run was touched");
    assert!(env.active_dir().join("pi-live").exists());
    assert!(process_alive(live.pid()));
}

/// `steward = false` leaves every pi run alone; daemon.json, `runspool
/// status` and `runspool doctor` say whether the steward is on, and SIGHUP
/// turns it on.
#[test]
fn steward_false_turns_it_off_and_reports_say_so() {
    let mut env = TestEnv::new();
    env.write_config("steward = false\n");
    let t = now_ms();
    pi_run(&env, "pi-dead-off", &pretty(&base_status("pi-dead-off", Some("sess-e"), DEAD_PID, t)));
    let before = snapshot(&env);
    env.extra_env = vec![("RUNSPOOL_STEWARD_CONFIRM_MS".into(), "300".into())];
    env.start_daemon();
    assert_eq!(read_json(&env.daemon_json()).unwrap()["steward"], json!({"enabled": false}));
    let out = env.cli(&["status"]);
    assert!(stdout_str(&out).contains("steward   off"), "{}", describe(&out));
    let out = env.cli(&["doctor"]);
    assert!(stdout_str(&out).contains("steward") && stdout_str(&out).contains("off"), "{}", describe(&out));
    std::thread::sleep(Duration::from_secs(3));
    let d = diff(&before, &snapshot(&env));
    assert!(d.is_empty(), "the steward acted while off:\n{}", d.join("\n"));

    env.write_config("steward = true\n");
    let pid = env.daemon_pid().unwrap();
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    wait_until(Duration::from_secs(30), "daemon.json says the steward is on", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["steward"] == json!({"enabled": true}))
    });
    let out = env.cli(&["status"]);
    assert!(stdout_str(&out).contains("steward   on"), "{}", describe(&out));
    let out = env.cli(&["doctor"]);
    assert!(stdout_str(&out).contains("pi-subagents runs whose runner is gone are reconciled"), "{}", describe(&out));
    wait_until(Duration::from_secs(60), "pi-dead-off reconciled (and logged) once the steward is on", || {
        !reconciled_in_log(&env).is_empty()
    });
    assert_eq!(reconciled_in_log(&env), vec!["pi-dead-off".to_string()]);
    assert_eq!(env.state("pi-dead-off").as_deref(), Some("failed"));
}

// ---------------------------------------------------------------------------
// The JSON writer against node
// ---------------------------------------------------------------------------

/// xorshift64*, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_number(r: &mut Rng) -> String {
    match r.below(5) {
        0 => {
            let x = f64::from_bits(r.next());
            if x.is_finite() {
                format!("{x:e}")
            } else {
                "0".into()
            }
        }
        1 => format!("{}", r.next() as i64),
        2 => format!("{}.{}", r.below(100000), r.next() % 1_000_000_000_000),
        3 => format!("{}e{}{}", r.below(1000), if r.below(2) == 0 { "-" } else { "+" }, r.below(330)),
        _ => {
            let digits: String = (0..1 + r.below(30)).map(|_| char::from(b'0' + r.below(10) as u8)).collect();
            format!("-{}{}", if digits.starts_with('0') { "1" } else { "" }, digits)
        }
    }
}

fn random_string(r: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "a",
        "Z",
        " ",
        "é",
        "日本",
        "😀",
        "\\n",
        "\\t",
        "\\\"",
        "\\\\",
        "\\/",
        "\\u0001",
        "\\u001f",
        "\\ud800",
        "\\udc00",
        "\\ud83d\\ude00",
        "\\u2028",
        "\u{7f}",
        "\u{85}",
        "\\b",
        "\\f",
        "\\r",
        "\\u00e9",
    ];
    let s: String = (0..r.below(8)).map(|_| PIECES[r.below(PIECES.len())]).collect();
    format!("\"{s}\"")
}

fn random_value(r: &mut Rng, depth: usize) -> String {
    match if depth > 3 { r.below(4) } else { r.below(6) } {
        0 => random_number(r),
        1 => random_string(r),
        2 => ["true", "false", "null"][r.below(3)].into(),
        3 => random_number(r),
        4 => {
            let items: Vec<String> = (0..r.below(4)).map(|_| random_value(r, depth + 1)).collect();
            format!("[{}]", items.join(","))
        }
        _ => {
            const KEYS: &[&str] =
                &["\"a\"", "\"b\"", "\"10\"", "\"2\"", "\"01\"", "\"-1\"", "\"4294967295\"", "\"é\"", "\"\\u0000\""];
            let items: Vec<String> = (0..r.below(5))
                .map(|_| format!("{}: {}", KEYS[r.below(KEYS.len())], random_value(r, depth + 1)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// `JSON.stringify(JSON.parse(text), null, 2)` and `JSON.stringify(JSON.parse(text))`
/// in node, against `jsjson`, for thousands of random texts.
#[test]
fn js_json_writer_matches_node() {
    if !tool_present("node") {
        report("skipped: node is not installed");
        return;
    }
    let mut r = Rng(0x5eed_1234_abcd_0001);
    let texts: Vec<String> = (0..4000).map(|_| random_value(&mut r, 0)).collect();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.json");
    let output = dir.path().join("out.json");
    fs::write(&input, serde_json::to_string(&texts).unwrap()).unwrap();
    let script = "const fs=require('fs');const t=JSON.parse(fs.readFileSync(process.env.IN,'utf8'));\
        fs.writeFileSync(process.env.OUT,JSON.stringify(t.map(x=>{const v=JSON.parse(x);\
        return [JSON.stringify(v,null,2),JSON.stringify(v)]})));";
    let out = Command::new("node").arg("-e").arg(script).env("IN", &input).env("OUT", &output).output().unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    // Node's output holds lone surrogates only as escapes, so it is valid UTF-8.
    let want: Vec<(String, String)> = serde_json::from_slice(&fs::read(&output).unwrap()).unwrap();
    for (text, (pretty_js, compact_js)) in texts.iter().zip(want) {
        let v = jsjson::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(jsjson::stringify_pretty(&v).unwrap(), pretty_js, "pretty {text}");
        assert_eq!(jsjson::stringify(&v).unwrap(), compact_js, "compact {text}");
    }
}
