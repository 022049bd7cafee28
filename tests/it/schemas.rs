//! The JSON Schemas in schemas/ against what runspool really writes and
//! decides. A real daemon runs runs of every mode and outcome (complete,
//! failed, timed out, stopped, paused, repaired, rejected, withdrawn,
//! restarted, an external-job step through a command provider, bridge
//! requests of another host's run); then every status.json, events.jsonl
//! line, request, result, result index entry, terminal marker, rejection
//! error file, bridge request, response and claim file, stop request, queue
//! file and daemon.json under the root is validated against its schema. And
//! the request schema is held against the daemon's own accept/reject
//! decisions: the hostile corpus (tests/corpus/manifest.json) and more
//! cases decided by runspool's request validator.
//!
//! Validation runs in Python's `jsonschema` (draft 2020-12), installed pinned
//! into `target/py-venv` by scripts/pyenv.sh, one Python process per test
//! (scripts/validate-json.py). Without python3, its venv module or pip, each
//! test prints a SKIPPED line and passes.

use crate::common;

use common::*;
use runspool::protocol::request::{self, RejectionCode};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const JSONSCHEMA: &str = "jsonschema==4.26.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv's python with `jsonschema`, or None when Python is unavailable
/// (reported as SKIPPED). An installation that fails otherwise fails the test.
fn python() -> Option<PathBuf> {
    python_with(JSONSCHEMA, "the schemas")
}

/// One document (a file or a text) to validate against `schema`
/// (`name.schema.json`, optionally `#/$defs/x`).
struct Check {
    label: String,
    schema: String,
    source: Value,
    jsonl: bool,
}

fn file_check(schema: &str, path: &Path) -> Check {
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    Check { label: path.display().to_string(), schema: schema.into(), source: json!({"file": path}), jsonl }
}

fn text_check(label: &str, schema: &str, text: &str) -> Check {
    Check { label: label.into(), schema: schema.into(), source: json!({"text": text}), jsonl: false }
}

/// Validate every check in one Python process; the errors of each, in order.
fn validate(py: &Path, checks: &[Check]) -> Vec<Vec<String>> {
    let list: Vec<Value> = checks
        .iter()
        .map(|c| {
            let mut o = json!({"label": c.label, "schema": c.schema, "jsonl": c.jsonl});
            o.as_object_mut().unwrap().extend(c.source.as_object().unwrap().clone());
            o
        })
        .collect();
    let job = json!({"schemas": repo().join("schemas"), "checks": list});
    let input = std::env::temp_dir().join(unique("schema-checks"));
    fs::write(&input, serde_json::to_vec(&job).unwrap()).unwrap();
    let out = Command::new(py)
        .arg(repo().join("scripts/validate-json.py"))
        .stdin(fs::File::open(&input).unwrap())
        .output()
        .expect("run the validator");
    let _ = fs::remove_file(&input);
    assert!(out.status.success(), "scripts/validate-json.py failed:\n{}", describe(&out));
    let res: Vec<Value> = serde_json::from_slice(&out.stdout).expect("the validator prints JSON");
    assert_eq!(res.len(), checks.len());
    res.iter()
        .map(|r| r["errors"].as_array().unwrap().iter().map(|e| e.as_str().unwrap().to_string()).collect())
        .collect()
}

/// A job engine speaking the command-provider protocol (docs/protocol.md
/// §8.4): jobs run the prompt with sh in the background. While `hold-status`
/// exists, a `status` call waits (touching `status-waiting`) until
/// `release-status` exists, so the test can read the runner's request file.
const ENGINE: &str = r#"#!/bin/sh
set -u
E='@DIR@'
op=$1
input=$(cat)
field() { printf '%s' "$input" | sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p"; }
case "$op" in
start)
    id="j$(date +%s%N)-$$"
    d="$E/jobs/$id"
    mkdir "$d"
    printf '%b\n' "$(field prompt)" > "$d/script"
    ( cd "$d" && sh ./script > out 2>&1; echo $? > rc ) </dev/null >/dev/null 2>&1 &
    echo "{\"providerJobId\":\"$id\",\"state\":\"queued\",\"handleUrl\":\"file://$d\"}"
    ;;
status|reattach|result|cancel)
    id=$(field providerJobId)
    d="$E/jobs/$id"
    if [ ! -d "$d" ]; then
        echo "{\"code\":\"no-such-job\",\"message\":\"engine knows no job $id\"}"
        exit 2
    fi
    if [ "$op" = status ] && [ -e "$E/hold-status" ]; then
        touch "$E/status-waiting"
        while [ ! -e "$E/release-status" ]; do sleep 0.05; done
    fi
    state=running
    [ -f "$d/rc" ] && state=completed
    extra=""
    [ "$op" = result ] && extra=",\"output\":\"$(tr -d '\n"\\' < "$d/out")\""
    printf '%s\n' "{\"providerJobId\":\"$id\",\"state\":\"$state\"$extra}"
    ;;
*)
    echo "{\"code\":\"unknown-operation\",\"message\":\"engine cannot $op\"}"
    exit 2
    ;;
esac
"#;

fn runner_pid(env: &TestEnv, id: &str) -> i32 {
    let mut pid = 0;
    wait_until(LONG, &format!("{id} running with a runner pid"), || {
        let s = env.status(id).unwrap_or(Value::Null);
        pid = s["pid"].as_i64().unwrap_or(0) as i32;
        s["state"] == "running" && pid > 0 && s["steps"][0]["status"] == "running"
    });
    pid
}

fn signal(pid: i32, sig: libc::c_int) {
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Copy every regular `*.json` of `dir` into `keep` (for files that are
/// consumed soon after they are written); the copies.
fn keep_json_files(dir: &Path, keep: &Path, prefix: &str) -> Vec<PathBuf> {
    fs::create_dir_all(keep).unwrap();
    let mut out = vec![];
    for name in list_names(dir) {
        let p = dir.join(&name);
        if name.ends_with(".json") && fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) {
            let dst = keep.join(format!("{prefix}-{name}"));
            fs::copy(&p, &dst).unwrap();
            out.push(dst);
        }
    }
    out
}

fn json_files_under(dir: &Path) -> Vec<PathBuf> {
    walk_all(dir).into_iter().filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "json")).collect()
}

fn ext_step(prompt: &str) -> Value {
    json!({"agent": "job", "externalJob": {"provider": "engine", "prompt": prompt, "options": {"queue": "short"}}})
}

#[test]
fn files_the_daemon_runner_and_cli_write_match_the_schemas() {
    let Some(py) = python() else { return };
    let mut env = TestEnv::new();
    // Slots for every run at once: the runs held below must not wait for each other.
    let engine = env.base().join("engine");
    fs::create_dir_all(engine.join("jobs")).unwrap();
    let exe = engine.join("engine.sh");
    fs::write(&exe, ENGINE.replace("@DIR@", engine.to_str().unwrap())).unwrap();
    fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
    env.write_config(&format!(
        "max_running = 16\n[watch]\nrescan_interval_s = 5\n[providers.engine]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 30000\n",
        exe.display()
    ));
    let keep = env.base().join("kept");

    // Another host's (pi-subagents') active run, whose bridge requests the
    // daemon services: its responses stay, nobody consumes them. Its pid is
    // this test's, alive, so the steward leaves it alone.
    let pi = env.run_dir("pi-run");
    mkdir_0700(&pi);
    let pi_status = json!({"runId": "pi-run", "sessionId": "pi", "mode": "single", "state": "running",
        "startedAt": now_ms(), "lastUpdate": now_ms(), "pid": std::process::id(), "cwd": env.work,
        "steps": [{"agent": "worker", "status": "running", "model": "m"}], "lifecycleArtifactVersion": 3});
    write_file_mode(&pi.join("status.json"), pi_status.to_string().as_bytes(), 0o600);
    write_file_mode(&env.active_dir().join("pi-run"), b"", 0o600);
    for d in ["external-job-requests", "external-job-responses"] {
        mkdir_0700(&pi.join(d));
    }
    env.start_daemon();

    let prompt = "echo from-pi";
    let digest = sha256_hex(prompt.as_bytes());
    let pi_requests = [
        (
            "pi-start",
            json!({"id": "pi-start", "operation": "start", "provider": "engine", "createdAt": now_ms(),
            "start": {"prompt": prompt, "promptDigest": digest, "cwd": env.work, "runId": "pi-run", "stepIndex": 0,
                      "agent": "worker", "options": {}, "sessionId": "pi"}}),
        ),
        (
            "pi-status",
            json!({"id": "pi-status", "operation": "status", "provider": "engine",
            "providerJobId": "no-such-job", "createdAt": now_ms()}),
        ),
        ("pi-bad", json!({"id": "pi-bad", "operation": "start", "provider": "engine", "createdAt": now_ms()})),
    ];
    for (id, body) in &pi_requests {
        let tmp = pi.join("external-job-requests").join(format!(".{id}.tmp"));
        write_file_mode(&tmp, body.to_string().as_bytes(), 0o600);
        fs::rename(&tmp, pi.join("external-job-requests").join(format!("{id}.json"))).unwrap();
    }

    let req = |id: &str, steps: Vec<Value>| request(Some(id), &env.work, steps);
    // Complete, single, with every optional field.
    let mut single = req("s-single", vec![sh_step("hello", "echo hello")]);
    single["sessionId"] = json!("sess/α");
    single["toolCallId"] = json!("call-1");
    single["completionOwnerId"] = json!("owner-1");
    single["env"] = json!({"GREETING": "hi"});
    single["priority"] = json!(5);
    single["timeoutMs"] = json!(60000);
    env.submit(&single);
    // Failed chain: the second step is skipped.
    env.submit(&req("s-chain", vec![sh_step("fails", "exit 3"), cmd_step("never", &["true"])]));
    // Parallel, one at a time.
    env.submit(&req("s-parallel", vec![parallel(vec![sh_step("a", "echo a"), sh_step("b", "echo b")], Some(1))]));
    // Timed out.
    let mut slow = req("s-timeout", vec![sh_step("slow", "sleep 30")]);
    slow["timeoutMs"] = json!(500);
    env.submit(&slow);
    // Stopped, paused and repaired: long steps acted on below.
    for id in ["s-stopped", "s-paused", "s-repaired"] {
        env.submit(&req(id, vec![sh_step("long", "sleep 60")]));
    }
    // Rejected: a body outside the limits with a valid runId, and a file that is not JSON.
    let mut bad = req("s-rejected", vec![cmd_step("a", &["true"])]);
    bad["priority"] = json!(5000);
    env.submit(&bad);
    env.drop_bytes("junk", b"{ not json");
    // An external-job step; its `status` call is held until its request is read.
    fs::write(engine.join("hold-status"), b"").unwrap();
    env.submit(&req("s-external", vec![ext_step("echo from-job")]));

    wait_until(LONG, "the held status call of s-external", || engine.join("status-waiting").exists());
    let runner_requests = keep_json_files(&env.run_dir("s-external").join("external-job-requests"), &keep, "runner");
    fs::write(engine.join("release-status"), b"").unwrap();

    // `runspool stop` and `stop --interrupt` write into the inbox of a runner
    // held with SIGSTOP, so their files can be read before they are consumed.
    let mut control_files: Vec<(PathBuf, &str)> = vec![];
    let asks = [
        (
            "s-stopped",
            vec!["stop", "s-stopped", "--reason", "schema test"],
            "stop-requests",
            "stop-request.schema.json",
        ),
        ("s-paused", vec!["stop", "--interrupt", "s-paused"], "", "stop-request.schema.json#/$defs/legacy"),
    ];
    for (id, args, sub, schema) in asks {
        let pid = runner_pid(&env, id);
        signal(pid, libc::SIGSTOP);
        let out = env.cli(&args);
        assert!(out.status.success(), "runspool {args:?}: {}", describe(&out));
        let inbox = env.run_dir(id).join("control").join(sub);
        control_files.extend(keep_json_files(&inbox, &keep, id).into_iter().map(|p| (p, schema)));
        signal(pid, libc::SIGCONT);
    }
    let pid = runner_pid(&env, "s-repaired");
    signal(pid, libc::SIGKILL);

    // Withdrawn: the queue is paused, the request submitted by the CLI never
    // claimed, then withdrawn; the queue file is read while paused and after.
    let queue_json = env.root.join("runspool/queue.json");
    let out = env.cli(&["pause", "--reason", "schema test"]);
    assert!(out.status.success(), "{}", describe(&out));
    let mut queue_files = vec![keep.join("queue-paused.json")];
    fs::copy(&queue_json, &queue_files[0]).unwrap();
    let out = env.cli(&["submit", "--run-id", "s-withdrawn", "--cwd", env.work.to_str().unwrap(), "--", "true"]);
    assert!(out.status.success(), "{}", describe(&out));
    let out = env.cli(&["stop", "s-withdrawn"]);
    assert!(out.status.success(), "{}", describe(&out));
    let out = env.cli(&["resume"]);
    assert!(out.status.success(), "{}", describe(&out));
    queue_files.push(queue_json.clone());
    let out = env.cli(&["max-running", "3"]);
    assert!(out.status.success(), "{}", describe(&out));
    queue_files.push(keep.join("queue-max.json"));
    fs::copy(&queue_json, &queue_files[2]).unwrap();

    let mut ids = vec!["s-single", "s-chain", "s-parallel", "s-timeout", "s-stopped", "s-paused", "s-repaired"];
    ids.extend(["s-rejected", "s-withdrawn", "s-external"]);
    let mut states = BTreeSet::new();
    for id in &ids {
        states.insert(env.wait_terminal(id)["state"].as_str().unwrap().to_string());
    }
    // Restarted and CLI-submitted runs (the CLI writes their requests).
    let out = env.cli(&["restart", "s-single"]);
    assert!(out.status.success(), "{}", describe(&out));
    let restarted = stdout_str(&out).trim().to_string();
    let out = env.cli(&["submit", "--run-id", "s-cli", "--session", "cli", "--env", "X=1", "--", "echo", "x"]);
    assert!(out.status.success(), "{}", describe(&out));
    env.wait_terminal(&restarted);
    env.wait_terminal("s-cli");
    assert_eq!(
        states,
        ["complete", "failed", "paused", "rejected", "stopped"].map(String::from).into(),
        "every terminal state runspool writes was reached"
    );
    assert_eq!(env.status("s-timeout").unwrap()["timedOut"], true);
    assert_eq!(env.status(&restarted).unwrap()["restartOf"], "s-single");
    wait_until(LONG, "the daemon's answers to pi-run's three bridge requests", || {
        pi_requests.iter().all(|(id, _)| pi.join(format!("external-job-responses/{id}.json")).exists())
    });

    // Everything under the root, each file against its schema.
    let mut checks = vec![];
    let mut runs = 0;
    for name in list_names(&env.runs()) {
        let dir = env.runs().join(&name);
        if name.starts_with('.') || !dir.is_dir() {
            continue;
        }
        runs += 1;
        let ours = name != "pi-run";
        checks.push(file_check("status.schema.json", &dir.join("status.json")));
        if ours {
            checks.push(file_check("status.schema.json#/$defs/written", &dir.join("status.json")));
            checks.push(file_check("event.schema.json", &dir.join("events.jsonl")));
            checks.push(file_check("event.schema.json#/$defs/written", &dir.join("events.jsonl")));
        }
        if dir.join("request.json").exists() {
            checks.push(file_check("request.schema.json", &dir.join("request.json")));
        }
        for claim in list_names(&dir.join("external-job-requests")).iter().filter(|n| n.ends_with(".claim")) {
            let c = dir.join("external-job-requests").join(claim);
            checks.push(file_check("bridge-claim-owner.schema.json", &c.join("owner.json")));
            checks.push(file_check("bridge-request.schema.json", &c.join("request.json")));
            checks.push(file_check("bridge-response.schema.json#/$defs/handle", &c.join("handle.json")));
            checks.push(file_check("bridge-claim-completed.schema.json", &c.join("completed.json")));
        }
        for p in json_files_under(&dir.join("external-job-responses")) {
            checks.push(file_check("bridge-response.schema.json", &p));
        }
    }
    assert_eq!(runs, ids.len() + 3, "every run directory was looked at: {:?}", list_names(&env.runs()));
    for p in &runner_requests {
        checks.push(file_check("bridge-request.schema.json", p));
    }
    for (p, schema) in &control_files {
        checks.push(file_check(schema, p));
    }
    for p in &queue_files {
        checks.push(file_check("queue.schema.json", p));
    }
    let results = env.results();
    for name in list_names(&results).iter().filter(|n| n.ends_with(".json")) {
        checks.push(file_check("result.schema.json", &results.join(name)));
        checks.push(file_check("result.schema.json#/$defs/written", &results.join(name)));
    }
    let index = json_files_under(&results.join("result-index"));
    for p in &index {
        checks.push(file_check("result-index.schema.json", p));
    }
    let markers = json_files_under(&env.terminal_dir());
    for p in &markers {
        checks.push(file_check("terminal-marker.schema.json", p));
    }
    let errors: Vec<PathBuf> = json_files_under(&env.rejected())
        .into_iter()
        .filter(|p| p.to_str().unwrap().ends_with(".error.json"))
        .collect();
    for p in &errors {
        checks.push(file_check("rejection-error.schema.json", p));
    }
    checks.push(file_check("daemon.schema.json", &env.daemon_json()));

    // What was produced covers what the schemas describe.
    let codes: BTreeSet<String> =
        errors.iter().map(|p| read_json(p).unwrap()["code"].as_str().unwrap().to_string()).collect();
    assert_eq!(codes, ["invalid-field", "invalid-json", "withdrawn"].map(String::from).into());
    assert!(index.iter().any(|p| p.to_str().unwrap().contains("/tool-calls/")), "a tool-call index entry: {index:?}");
    assert!(markers.len() >= ids.len(), "terminal markers: {markers:?}");
    assert!(runner_requests.iter().any(|p| read_json(p).unwrap()["operation"] == "status"), "{runner_requests:?}");
    assert_eq!(control_files.len(), 2, "one stop request and one interrupt.json: {control_files:?}");
    let mut types = BTreeSet::new();
    for id in ids.iter().copied().chain([restarted.as_str(), "s-cli"]) {
        types.extend(env.event_types(id));
    }
    for t in [
        "subagent.run.queued",
        "subagent.run.rejected",
        "subagent.run.started",
        "subagent.step.started",
        "subagent.step.completed",
        "subagent.step.failed",
        "subagent.step.stopped",
        "subagent.step.paused",
        "subagent.parallel.started",
        "subagent.parallel.completed",
        "subagent.run.stopped",
        "subagent.run.timed_out",
        "subagent.run.paused",
        "subagent.run.completed",
        "subagent.run.repaired_stale",
        "subagent.run.stop_requested",
        "subagent.external_job.updated",
    ] {
        assert!(types.contains(t), "no run wrote {t}; seen: {types:?}");
    }
    let answers: BTreeSet<(String, bool)> = pi_requests
        .iter()
        .map(|(id, _)| {
            let r = read_json(&pi.join(format!("external-job-responses/{id}.json"))).unwrap();
            (r["code"].as_str().unwrap_or("").to_string(), r["ok"].as_bool().unwrap())
        })
        .collect();
    assert_eq!(
        answers,
        [("".into(), true), ("no-such-job".into(), false), ("malformed-request".into(), false)].into(),
        "pi-run's requests were answered ok, with the provider's code and malformed"
    );

    let results = validate(&py, &checks);
    let mut failures = vec![];
    for (c, errs) in checks.iter().zip(&results) {
        if !errs.is_empty() {
            failures.push(format!("{} against {}:\n    {}", c.label, c.schema, errs.join("\n    ")));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} files do not match their schema:\n{}",
        failures.len(),
        checks.len(),
        failures.join("\n")
    );
    report(&format!("schemas: {} files and documents under the root match their schemas", checks.len()));
}

/// Rejection codes decided by the request's body: the request schema must
/// refuse what runspool rejects with one of them.
const BODY_CODES: [&str; 3] = ["invalid-json", "unsupported-version", "invalid-field"];

/// Corpus entries whose body the daemon rejects although the request schema
/// cannot tell, and why. Every other body-level rejection must be refused by
/// the schema; every other body must be accepted by it.
const BEYOND_THE_SCHEMA: &[(&str, &str)] = &[
    ("c20-version-float.json", "`1.0` is an integer to JSON Schema; runspool wants the integer 1 written as such"),
    ("c24-dup-top-key.json", "a key given twice is gone once the JSON is parsed"),
    ("c25-dup-step-key.json", "a key given twice is gone once the JSON is parsed"),
    ("c26-dup-step-env-key.json", "a key given twice is gone once the JSON is parsed"),
    ("c75-dup-options-key.json", "a key given twice is gone once the JSON is parsed"),
    ("c09-lone-lead-surrogate.json", "the JSON grammar admits a lone surrogate escape; no UTF-8 string holds one"),
    ("c10-lone-trail-surrogate.json", "the JSON grammar admits a lone surrogate escape; no UTF-8 string holds one"),
];

/// Rejections for reasons of the file or the daemon, out of any schema's
/// reach: the body of such an entry (when it has one) is a valid request.
const FILE_LEVEL: [&str; 10] = [
    "bad-name",
    "not-regular-file",
    "bad-owner",
    "bad-permissions",
    "too-large",
    "cwd-missing",
    "unknown-provider",
    "duplicate-run-id",
    "withdrawn",
    // Whether a dependency exists is the daemon's state at the claim.
    "unknown-dependency",
];

fn body_of(e: &Value, work: &str) -> Option<Vec<u8>> {
    let b = fs::read(repo().join("tests/corpus/bodies").join(e["body"].as_str()?)).unwrap();
    let s = String::from_utf8_lossy(&b).into_owned();
    (!s.contains('\u{fffd}')).then(|| s.replace("@WORK@", work).replace("@CANARY@", "/nonexistent-canary").into_bytes())
}

/// runspool's own decision about a body: what the claim's validator says,
/// with every `cwd` existing and every provider configured.
struct Lenient;
impl request::Context for Lenient {
    fn provider_configured(&self, _: &str) -> bool {
        true
    }
    fn is_dir(&self, _: &str) -> bool {
        true
    }
}

fn daemon_decision(body: &[u8]) -> Result<(), RejectionCode> {
    let v = request::parse(body).map_err(|r| r.code)?;
    request::validate(body, &v, &Lenient).map(|_| ()).map_err(|r| r.code)
}

#[test]
fn the_request_schema_refuses_what_the_daemon_rejects_for_the_body() {
    let Some(py) = python() else { return };
    let manifest: Value =
        serde_json::from_slice(&fs::read(repo().join("tests/corpus/manifest.json")).unwrap()).unwrap();
    let work = "/srv/work";
    // (label, body, the schema must accept it, why)
    let mut cases: Vec<(String, String, bool, String)> = vec![];
    let mut excluded = BTreeSet::new();
    for e in manifest["entries"].as_array().unwrap() {
        let file = e["file"].as_str().unwrap();
        let code = e["code"].as_str().unwrap();
        if let Some((_, why)) = BEYOND_THE_SCHEMA.iter().find(|(f, _)| *f == file) {
            excluded.insert(file);
            report(&format!("schemas: corpus {file} ({code}) is beyond JSON Schema: {why}"));
            continue;
        }
        if e["body"].is_null() {
            // A FIFO, socket, directory, symlink or device: no body at all.
            assert!(FILE_LEVEL.contains(&code), "{file}: an entry without a body");
            continue;
        }
        let Some(body) = body_of(e, work) else {
            assert_eq!(code, "invalid-json", "{file}: only bodies that are not UTF-8 are skipped");
            report(&format!("schemas: corpus {file} ({code}) is not UTF-8, so no JSON text: no schema applies"));
            continue;
        };
        let text = String::from_utf8(body).unwrap();
        if BODY_CODES.contains(&code) {
            cases.push((format!("corpus {file} ({code})"), text, false, code.into()));
        } else {
            assert!(FILE_LEVEL.contains(&code), "{file}: classify the code {code} in this test");
            // A body refused for its file's sake may itself be invalid
            // (race.json's is version 2): the daemon's own validator says.
            let ok = daemon_decision(text.as_bytes()).is_ok();
            cases.push((format!("corpus {file} ({code}, a file-level reason)"), text, ok, code.into()));
        }
    }
    assert_eq!(excluded.len(), BEYOND_THE_SCHEMA.len(), "every exclusion names a corpus entry");

    // More bodies, each decided by runspool's request validator: nulls,
    // bounds, nesting and the rules of a step.
    let base = |extra: &str| format!(r#"{{"version":1,"cwd":"/w","steps":[{{"command":["a"]}}]{extra}}}"#);
    let step = |s: &str| format!(r#"{{"version":1,"cwd":"/w","steps":[{s}]}}"#);
    let many = |n: usize, s: &str| vec![s; n].join(",");
    let mut more: Vec<String> = vec![
        base(""),
        base(
            r#","runId":null,"sessionId":null,"toolCallId":null,"completionOwnerId":null,"timeoutMs":null,"restartOf":null"#,
        ),
        base(r#","env":null"#),
        base(r#","priority":null"#),
        base(r#","steps":null"#),
        base(r#","version":null"#),
        base(&format!(r#","runId":"{}""#, "r".repeat(128))),
        base(&format!(r#","runId":"{}""#, "r".repeat(129))),
        base(r#","runId":"run\n""#),
        base(r#","runId":"-run""#),
        base(r#","restartOf":"old-run""#),
        base(r#","restartOf":"../old""#),
        base(&format!(r#","sessionId":"{}""#, "s".repeat(4096))),
        base(&format!(r#","completionOwnerId":"{}""#, "o".repeat(257))),
        base(r#","timeoutMs":604800000,"priority":-1000"#),
        base(r#","timeoutMs":1.5"#),
        base(r#","priority":-1001"#),
        base(r#","env":{"_x1":"v","A":""}"#),
        base(r#","env":{"A-B":"v"}"#),
        base(r#","env":{"A\n":"v"}"#),
        base(r#","env":{"A":null}"#),
        base(&format!(r#","env":{{{}}}"#, (0..256).map(|i| format!(r#""V{i}":"x""#)).collect::<Vec<_>>().join(","))),
        base(r#","cwd":"w""#),
        base(r#","cwd":null"#),
        step(r#"{"command":["a",""],"agent":null,"cwd":null,"timeoutMs":null,"externalJob":null}"#),
        step(r#"{"command":[""]}"#),
        step(r#"{"command":[]}"#),
        step(r#"{"command":["a",1]}"#),
        step(&format!(r#"{{"command":[{}]}}"#, many(4096, r#""a""#))),
        step(&format!(r#"{{"command":[{}]}}"#, many(4097, r#""a""#))),
        step(r#"{"command":null,"externalJob":{"provider":"p","prompt":"x"}}"#),
        step(r#"{"command":null,"externalJob":null}"#),
        step(r#"{"command":["a"],"externalJob":{"provider":"p","prompt":"x"}}"#),
        step(r#"{"externalJob":{"provider":"p","prompt":"x","options":{"deep":[{"k":"v\u0000"}]}}}"#),
        step(r#"{"externalJob":{"provider":"p","prompt":"x","options":{"deep":[{"k":["v",1,null,true]}]}}}"#),
        step(r#"{"externalJob":{"provider":"p","prompt":"x","options":null}}"#),
        step(r#"{"externalJob":{"provider":"p","prompt":"x","extra":1}}"#),
        step(r#"{"externalJob":{"provider":"p"}}"#),
        step(r#"{"command":["a"],"cwd":"/x","env":{"B":"1"},"timeoutMs":1}"#),
        step(r#"{"command":["a"],"timeoutMs":0}"#),
        step(r#""a""#),
        step(r#"{"parallel":[{"command":["a"]}],"concurrency":64}"#),
        step(r#"{"parallel":[{"command":["a"]}],"concurrency":null}"#),
        step(r#"{"parallel":[{"command":["a"]}],"concurrency":0}"#),
        step(r#"{"parallel":null}"#),
        step(r#"{"parallel":[]}"#),
        step(r#"{"parallel":[{"parallel":[{"command":["a"]}]}]}"#),
        step(r#"{"parallel":[{"command":["a"]}],"agent":"x"}"#),
        step(&many(256, r#"{"command":["a"]}"#)),
        step(&many(257, r#"{"command":["a"]}"#)),
    ];
    // Beyond JSON Schema, checked below to be as docs/protocol.md and the
    // request schema's description say: runspool rejects, the schema accepts.
    let gaps: Vec<(String, &str)> = vec![
        (base(&format!(r#","sessionId":"{}""#, "é".repeat(4096))), "byte lengths: 4096 characters, 8192 bytes"),
        (base(&format!(r#","completionOwnerId":"{}""#, "é".repeat(200))), "byte lengths: 200 characters, 400 bytes"),
        (
            step(&format!(
                r#"{{"parallel":[{}]}},{{"parallel":[{}]}}"#,
                many(200, r#"{"command":["a"]}"#),
                many(200, r#"{"command":["a"]}"#)
            )),
            "400 steps in all, in two groups of 200",
        ),
        (base(r#","priority":1.0"#), "an integer written with a fraction"),
        (base(r#","version":1.0"#), "an integer written with a fraction"),
    ];
    for body in more.drain(..) {
        let ok = daemon_decision(body.as_bytes());
        if let Err(c) = ok {
            assert!(BODY_CODES.contains(&c.as_str()), "{body}: {c} is not a body-level code");
        }
        let label: String = body.chars().take(160).collect();
        cases.push((format!("case {label}"), body, ok.is_ok(), format!("{ok:?}")));
    }
    for (body, why) in &gaps {
        assert!(daemon_decision(body.as_bytes()).is_err(), "runspool refuses the gap case ({why})");
        cases.push((format!("documented gap: {why}"), body.clone(), true, "a known gap".into()));
    }

    let checks: Vec<Check> = cases.iter().map(|(l, t, _, _)| text_check(l, "request.schema.json", t)).collect();
    let results = validate(&py, &checks);
    let mut disagreements = vec![];
    for ((label, _, accept, why), errs) in cases.iter().zip(&results) {
        if *accept && !errs.is_empty() {
            disagreements.push(format!("{label}: runspool accepts ({why}), the schema refuses: {}", errs.join("; ")));
        }
        if !*accept && errs.is_empty() {
            disagreements.push(format!("{label}: runspool rejects ({why}), the schema accepts"));
        }
    }
    assert!(
        disagreements.is_empty(),
        "the request schema and runspool disagree on {} of {} bodies:\n{}",
        disagreements.len(),
        cases.len(),
        disagreements.join("\n")
    );
    report(&format!("schemas: the request schema agrees with runspool on {} bodies", cases.len()));
}

/// Every "protocol.md §N" cited by a message, a comment or a doc names a
/// section docs/protocol.md has.
#[test]
fn citations_of_the_protocol_name_sections_it_has() {
    let protocol = fs::read_to_string(repo().join("docs/protocol.md")).unwrap();
    let sections: BTreeSet<String> = protocol
        .lines()
        .filter(|l| l.starts_with("## ") || l.starts_with("### "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|n| n.trim_end_matches('.').to_string())
        .filter(|n| n.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .collect();
    assert!(sections.contains("2.2") && sections.contains("14.1") && sections.contains("17"), "{sections:?}");
    let mut files: Vec<PathBuf> = walk_all(&repo().join("src")).into_iter().filter(|p| p.is_file()).collect();
    files.extend(walk_all(&repo().join("docs")).into_iter().filter(|p| p.is_file()));
    files.extend(walk_all(&repo().join("schemas")).into_iter().filter(|p| p.is_file()));
    files.extend(["README.md", "SECURITY.md"].map(|f| repo().join(f)));
    let mut cited = 0;
    let mut wrong = vec![];
    for f in &files {
        let text = fs::read_to_string(f).unwrap_or_default();
        for (i, _) in text.match_indices("protocol.md §") {
            let rest = &text[i + "protocol.md §".len()..];
            let n: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            let n = n.trim_end_matches('.');
            cited += 1;
            if !sections.contains(n) {
                wrong.push(format!("{}: protocol.md §{n}", f.strip_prefix(repo()).unwrap().display()));
            }
        }
    }
    assert!(cited > 20, "only {cited} citations found");
    assert!(wrong.is_empty(), "citations of sections docs/protocol.md does not have:\n{}", wrong.join("\n"));
}

#[test]
fn the_schemas_are_valid_draft_2020_12_and_cited_by_the_protocol() {
    let Some(py) = python() else { return };
    let dir = repo().join("schemas");
    let names: Vec<String> = list_names(&dir).into_iter().filter(|n| n.ends_with(".schema.json")).collect();
    assert!(names.len() >= 14, "{names:?}");
    // An empty object is validated against each: the validator checks every
    // schema against the metaschema first and reports a broken one.
    let checks: Vec<Check> = names.iter().map(|n| text_check(n, n, "{}")).collect();
    for (n, errs) in names.iter().zip(validate(&py, &checks)) {
        assert!(!errs.iter().any(|e| e.starts_with("schema ")), "{n}: {errs:?}");
    }
    let protocol = fs::read_to_string(repo().join("docs/protocol.md")).unwrap();
    for n in &names {
        assert!(protocol.contains(&format!("schemas/{n}")), "docs/protocol.md does not cite schemas/{n}");
        let s: Value = serde_json::from_slice(&fs::read(dir.join(n)).unwrap()).unwrap();
        assert_eq!(s["$schema"], "https://json-schema.org/draft/2020-12/schema", "{n}");
    }
}
