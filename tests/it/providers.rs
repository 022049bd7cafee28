//! External-job steps end to end through `command` providers (PROTOCOL §8.3,
//! §8.4): a real daemon, real runners, and a small real job engine written in
//! sh (jobs run as local background processes), plus misconfigured providers.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A job engine speaking the command-provider protocol. Jobs run the prompt
/// with sh in their own session; state lives under `E`.
const ENGINE: &str = r#"#!/bin/sh
set -u
E='@DIR@'
op=$1
input=$(cat)
printf '%s %s\n' "$op" "$input" >> "$E/calls.log"
if [ "$op" = result ] && [ -e "$E/result-broken" ]; then
    echo '{"code":"result-broken","message":"the engine lost the output"}'
    exit 3
fi
field() { printf '%s' "$input" | sed -n "s/.*\"$1\":\"\([^\"]*\)\".*/\1/p"; }
escape() { sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/	/\\t/g' "$1" | awk '{ printf "%s%sn", $0, "\\" }'; }
case "$op" in
start|follow-up)
    [ -e "$E/start-gate" ] && while [ ! -e "$E/start-gate-open" ]; do sleep 0.05; done
    d=$(mktemp -d "$E/jobs/j.XXXXXX")
    id=${d##*/}
    printf '%b\n' "$(field prompt)" > "$d/script"
    ( cd "$d" && setsid sh -c 'echo $$ > pid; sh ./script > out 2>&1; echo $? > rc' </dev/null >/dev/null 2>&1 & )
    echo "{\"providerJobId\":\"$id\",\"state\":\"queued\",\"handleUrl\":\"file://$d\"}"
    ;;
status|reattach|result|cancel)
    id=$(field providerJobId)
    d="$E/jobs/$id"
    if [ ! -d "$d" ]; then
        echo "{\"code\":\"no-such-job\",\"message\":\"engine knows no job $id\"}"
        exit 2
    fi
    if [ "$op" = cancel ]; then
        touch "$d/cancelled"
        [ -s "$d/pid" ] && kill -TERM "-$(cat "$d/pid")" 2>/dev/null
    fi
    extra=""
    if [ -f "$d/cancelled" ]; then
        state=stopped
    elif [ -f "$d/rc" ]; then
        rc=$(cat "$d/rc")
        if [ "$rc" = 0 ]; then state=completed; else
            state=failed
            extra=",\"failureCode\":\"exit-$rc\",\"failureMessage\":\"the job exited with status $rc\""
        fi
    else
        state=running
    fi
    if [ "$op" = result ]; then
        extra="$extra,\"output\":\"$(escape "$d/out")\""
    fi
    # printf, not echo: dash's echo would turn the escaped \n back into newlines.
    printf '%s\n' "{\"providerJobId\":\"$id\",\"state\":\"$state\"$extra}"
    ;;
*)
    echo "{\"code\":\"unknown-operation\",\"message\":\"engine cannot $op\"}"
    exit 2
    ;;
esac
"#;

fn write_exe(p: &Path, body: &str) {
    fs::write(p, body).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
}

struct Engine {
    dir: PathBuf,
    exe: PathBuf,
}

impl Engine {
    fn new(env: &TestEnv) -> Engine {
        let dir = env.base().join("engine");
        fs::create_dir_all(dir.join("jobs")).unwrap();
        let exe = dir.join("engine.sh");
        write_exe(&exe, &ENGINE.replace("@DIR@", dir.to_str().unwrap()));
        Engine { dir, exe }
    }
    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    }
    fn count(&self, op: &str) -> usize {
        self.calls().iter().filter(|c| *c == op).count()
    }
}

fn config_with(providers: &str) -> String {
    format!("{DEFAULT_CONFIG}{providers}")
}

fn ext_step(agent: &str, provider: &str, prompt: &str) -> Value {
    json!({"agent": agent, "externalJob": {"provider": provider, "prompt": prompt, "options": {}}})
}

fn env_with_engine(extra: &str) -> (TestEnv, Engine) {
    let env = TestEnv::new();
    let eng = Engine::new(&env);
    env.write_config(&config_with(&format!(
        "[providers.engine]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 30000\n{extra}",
        eng.exe.display()
    )));
    (env, eng)
}

#[test]
fn chain_with_an_external_middle_step_completes() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let id = "ext-chain-1";
    let req = request(
        Some(id),
        &env.work,
        vec![
            sh_step("before", "echo before-output"),
            ext_step("remote", "engine", "echo job-says-hello; sleep 1; echo job-done"),
            sh_step("after", "echo prev=$RUNSPOOL_PREVIOUS_OUTPUT; cat \"$RUNSPOOL_PREVIOUS_OUTPUT\""),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}\n{}", env.output_log(id, 1));
    let s1 = &st["steps"][1];
    assert_eq!(s1["status"], "complete");
    let ej = &s1["externalJob"];
    assert_eq!(ej["provider"], "engine");
    assert_eq!(ej["state"], "completed");
    assert!(ej["providerJobId"].as_str().unwrap().starts_with("j."), "{ej}");
    assert_eq!(ej["promptDigest"], sha256_hex(b"echo job-says-hello; sleep 1; echo job-done"));
    assert!(ej["handleUrl"].as_str().unwrap().starts_with("file://"), "{ej}");
    assert!(ej["startedAt"].as_i64().unwrap() <= ej["updatedAt"].as_i64().unwrap());
    let result_md = env.run_dir(id).join("external-job-1.result.md");
    let text = fs::read_to_string(&result_md).unwrap();
    assert!(text.contains("job-says-hello") && text.contains("job-done"), "{text}");
    assert_eq!(s1["outputFile"].as_str(), Some(result_md.to_str().unwrap()));
    // The next step saw the job's output through RUNSPOOL_PREVIOUS_OUTPUT.
    let after = env.output_log(id, 2);
    assert!(after.contains(&format!("prev={}", result_md.display())), "{after}");
    assert!(after.contains("job-says-hello"), "{after}");
    wait_until(LONG, "the result file", || env.result(id).is_some());
    let res = env.result(id).unwrap();
    assert!(res["summary"].as_str().unwrap().contains("job-says-hello"), "{res}");
    // Exactly one start; status polled; result fetched.
    assert_eq!(eng.count("start"), 1);
    assert!(eng.count("status") >= 1);
    assert_eq!(eng.count("result"), 1);
    // The start claim is complete and the tombstone kept; no request is left.
    let reqs = list_names(&env.run_dir(id).join("external-job-requests"));
    assert_eq!(reqs.iter().filter(|n| n.ends_with(".json")).count(), 0, "{reqs:?}");
    let claims: Vec<&String> = reqs.iter().filter(|n| n.ends_with(".claim")).collect();
    assert_eq!(claims.len(), 1, "{reqs:?}");
    let claim = env.run_dir(id).join("external-job-requests").join(claims[0]);
    for f in ["owner.json", "request.json", "handle.json", "completed.json"] {
        assert!(claim.join(f).is_file(), "{} missing", f);
    }
    let owner = read_json(&claim.join("owner.json")).unwrap();
    assert_eq!(owner["version"], 1);
    assert_eq!(owner["pid"].as_i64(), env.daemon_pid());
    assert!(read_json(&claim.join("request.json")).unwrap()["claimedAt"].is_i64());
    let types = env.event_types(id);
    assert!(types.iter().any(|t| t == "subagent.external_job.updated"), "{types:?}");
    env.check_consistency();
}

/// Issue 23: a 5 s run limit failed a run whose job had completed. The
/// runner's first request is served on its file event (the run directory is
/// watched until `external-job-requests/` appears), not on the next sweep:
/// a trivial job's run ends well inside such a limit.
#[test]
fn a_short_external_job_completes_within_a_five_second_run_limit() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let ids = ["ext-short-1", "ext-short-2", "ext-short-3"];
    for id in ids {
        let mut req = request(Some(id), &env.work, vec![ext_step("remote", "engine", "true")]);
        req["timeoutMs"] = json!(5000);
        env.submit(&req);
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "complete", "{st:#}\n{}", env.output_log(id, 0));
        assert_eq!(st["steps"][0]["externalJob"]["state"], "completed", "{st:#}");
    }
    assert_eq!(eng.count("start"), ids.len());
    env.check_consistency();
}

/// Without native events (`watch.strategy = "poll"`, as when inotify
/// watches run out) the sweep still serves every request.
#[test]
fn external_jobs_are_served_by_the_sweep_when_polling() {
    let env = TestEnv::new();
    let eng = Engine::new(&env);
    let cfg = DEFAULT_CONFIG.replace("[watch]\n", "[watch]\nstrategy = \"poll\"\n");
    assert!(cfg.contains("strategy"), "{cfg}");
    env.write_config(&format!(
        "{cfg}[providers.engine]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 30000\n",
        eng.exe.display()
    ));
    let mut env = env;
    env.start_daemon();
    let d = read_json(&env.daemon_json()).unwrap();
    assert_eq!(d["watch"]["strategy"], "poll", "{d}");
    let id = "ext-poll-1";
    env.submit(&request(Some(id), &env.work, vec![ext_step("remote", "engine", "echo polled")]));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}\n{}", env.output_log(id, 0));
    assert_eq!(eng.count("start"), 1);
    env.check_consistency();
}

#[test]
fn failing_job_fails_the_run_with_the_engine_reason() {
    let (mut env, _eng) = env_with_engine("");
    env.start_daemon();
    let id = "ext-fail-1";
    env.submit(&request(
        Some(id),
        &env.work,
        vec![ext_step("remote", "engine", "echo about-to-fail; exit 3"), sh_step("never", "echo x")],
    ));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed");
    let s0 = &st["steps"][0];
    assert_eq!(s0["status"], "failed");
    let err = s0["error"].as_str().unwrap();
    assert!(err.contains("the job exited with status 3") && err.contains("exit-3"), "{err}");
    assert_eq!(s0["externalJob"]["failureCode"], "exit-3");
    assert_eq!(st["steps"][1]["error"], "skipped: an earlier step failed");
    // The failed job's output was still fetched.
    let text = fs::read_to_string(env.run_dir(id).join("external-job-0.result.md")).unwrap();
    assert!(text.contains("about-to-fail"), "{text}");
    env.check_consistency();
}

#[test]
fn a_failed_result_operation_fails_the_step_and_the_run() {
    let (mut env, eng) = env_with_engine("");
    fs::write(eng.dir.join("result-broken"), "").unwrap();
    env.start_daemon();
    let id = "ext-result-broken";
    env.submit(&request(
        Some(id),
        &env.work,
        vec![ext_step("remote", "engine", "echo fine"), sh_step("never", "echo x")],
    ));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st:#}");
    assert_ne!(st["exitCode"], 0, "{st:#}");
    let s0 = &st["steps"][0];
    assert_eq!(s0["status"], "failed", "{st:#}");
    assert_ne!(s0["exitCode"], 0, "{st:#}");
    let err = s0["error"].as_str().unwrap_or_default();
    assert!(err.contains("result-broken") && err.contains("the engine lost the output"), "{err}");
    assert_eq!(s0["externalJob"]["failureCode"], "result-broken", "{st:#}");
    assert_eq!(st["steps"][1]["error"], "skipped: an earlier step failed");
    assert_eq!(eng.count("result"), 1, "{:?}", eng.calls());
    env.check_consistency();
}

#[test]
fn stop_cancels_the_job_and_the_run_ends_stopped() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let id = "ext-stop-1";
    env.submit(&request(Some(id), &env.work, vec![ext_step("remote", "engine", "echo started; sleep 600")]));
    wait_until(LONG, "the job to run", || {
        env.status(id).is_some_and(|s| s["steps"][0]["externalJob"]["state"] == "running")
    });
    let job = env.status(id).unwrap()["steps"][0]["externalJob"]["providerJobId"].as_str().unwrap().to_string();
    let out = env.cli(&["stop", id, "--reason", "test stop"]);
    assert!(out.status.success(), "{}", describe(&out));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st:#}");
    assert_eq!(st["steps"][0]["status"], "stopped");
    assert_eq!(st["steps"][0]["externalJob"]["state"], "stopped");
    assert_eq!(eng.count("cancel"), 1);
    assert!(eng.dir.join("jobs").join(&job).join("cancelled").exists());
    // The job's process was killed by the engine's cancel.
    let pid: i64 = fs::read_to_string(eng.dir.join("jobs").join(&job).join("pid")).unwrap().trim().parse().unwrap();
    wait_until(LONG, "the job process to die", || !process_alive(pid));
    env.check_consistency();
}

#[test]
fn step_timeout_cancels_the_job() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let id = "ext-timeout-1";
    let mut step = ext_step("remote", "engine", "sleep 600");
    step["timeoutMs"] = json!(1500);
    env.submit(&request(Some(id), &env.work, vec![step]));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed");
    assert_eq!(st["timedOut"], true);
    assert_eq!(st["steps"][0]["timedOut"], true);
    assert!(st["steps"][0]["error"].as_str().unwrap().contains("timed out"), "{st}");
    assert_eq!(eng.count("cancel"), 1);
}

/// Misconfigurations give their documented code in the step, and the daemon
/// keeps serving runs afterwards.
#[test]
fn provider_misconfiguration_gives_named_errors_and_the_daemon_keeps_serving() {
    let mut env = TestEnv::new();
    let bin = env.base().join("bin");
    fs::create_dir_all(&bin).unwrap();
    let garbage = bin.join("garbage.sh");
    write_exe(
        &garbage,
        "#!/bin/sh\ncat >/dev/null\necho 'this is not json'\necho 'engine exploded: disk on fire' >&2\nexit 3\n",
    );
    let badhandle = bin.join("badhandle.sh");
    write_exe(
        &badhandle,
        "#!/bin/sh\ncat >/dev/null\necho '{\"providerJobId\":\"1\",\"state\":\"queued\",\"colour\":\"blue\"}'\n",
    );
    let coded = bin.join("coded.sh");
    write_exe(&coded, "#!/bin/sh\ncat >/dev/null\necho '{\"code\":\"quota-exceeded\",\"message\":\"project lab is over its quota\"}'\nexit 4\n");
    let slow = bin.join("slow.sh");
    write_exe(
        &slow,
        &format!(
            "#!/bin/sh\ncat >/dev/null\nsleep 300 &\necho $! > {}/slow-child.pid\nsleep 300\n",
            env.base().display()
        ),
    );
    let missing = env.base().join("no-such-provider-binary");
    env.write_config(&config_with(&format!(
        "[providers.missing]\ntype = \"command\"\ncommand = [\"{}\"]\n\
         [providers.garbage]\ntype = \"command\"\ncommand = [\"{}\"]\n\
         [providers.badhandle]\ntype = \"command\"\ncommand = [\"{}\"]\n\
         [providers.coded]\ntype = \"command\"\ncommand = [\"{}\"]\n\
         [providers.slow]\ntype = \"command\"\ncommand = [\"{}\"]\ntimeout_ms = 1000\n",
        missing.display(),
        garbage.display(),
        badhandle.display(),
        coded.display(),
        slow.display()
    )));
    env.start_daemon();
    let cases = [
        ("missing", "provider-error", vec![missing.to_str().unwrap().to_string(), "command[0]".into()]),
        (
            "garbage",
            "provider-error",
            vec!["exited with status 3".into(), "disk on fire".into(), "this is not json".into()],
        ),
        ("badhandle", "provider-error", vec!["invalid handle".into(), "colour".into()]),
        ("coded", "quota-exceeded", vec!["project lab is over its quota".into()]),
        ("slow", "provider-timeout", vec!["timeout_ms".into(), "killed".into()]),
    ];
    for (name, code, needles) in cases {
        let id = format!("misconf-{name}");
        env.submit(&request(Some(&id), &env.work, vec![ext_step("remote", name, "echo hi")]));
        let st = env.wait_terminal(&id);
        assert_eq!(st["state"], "failed", "{name}: {st:#}");
        let s0 = &st["steps"][0];
        let err = s0["error"].as_str().unwrap_or("");
        assert!(err.starts_with(&format!("{code}: ")), "{name}: error {err:?}");
        for n in needles {
            assert!(err.contains(&n), "{name}: error {err:?} lacks {n:?}");
        }
        assert_eq!(s0["externalJob"]["failureCode"], code, "{name}");
        assert_eq!(s0["externalJob"]["state"], "failed", "{name}");
        // The daemon still serves plain runs.
        let ok = format!("after-{name}");
        env.submit(&request(Some(&ok), &env.work, vec![sh_step("a", "echo fine")]));
        assert_eq!(env.wait_terminal(&ok)["state"], "complete", "{name}");
    }
    // The timed-out provider's process group was killed, its background child too.
    let pid: i64 = fs::read_to_string(env.base().join("slow-child.pid")).unwrap().trim().parse().unwrap();
    wait_until(LONG, "the slow provider's child to be killed", || !process_alive(pid));
    assert!(env.daemon_exited().is_none(), "the daemon must keep running");
    env.check_consistency();
}

#[test]
fn daemon_killed_during_start_abandons_the_start_and_never_redispatches() {
    let (mut env, eng) = env_with_engine("");
    fs::write(eng.dir.join("start-gate"), b"").unwrap();
    env.start_daemon();
    let id = "ext-kill-start";
    env.submit(&request(Some(id), &env.work, vec![ext_step("remote", "engine", "echo hi")]));
    wait_until(LONG, "the engine to receive the start", || eng.count("start") == 1);
    // The daemon dies while the provider is inside `start`, before any handle exists.
    env.kill9();
    fs::write(eng.dir.join("start-gate-open"), b"").unwrap();
    env.start_daemon();
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(err.starts_with("start-dispatch-abandoned: "), "{err}");
    assert!(err.contains("never dispatches a start twice"), "{err}");
    assert_eq!(eng.count("start"), 1, "the start must not be sent to the provider again");
    env.check_consistency();
}

#[test]
fn daemon_restart_while_polling_keeps_the_run_going() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let id = "ext-restart-poll";
    let gate = env.work.join("job-gate");
    let prompt = format!("while [ ! -e {} ]; do sleep 0.1; done; echo released", gate.display());
    env.submit(&request(Some(id), &env.work, vec![ext_step("remote", "engine", &prompt)]));
    wait_until(LONG, "the job to run", || {
        env.status(id).is_some_and(|s| s["steps"][0]["externalJob"]["state"] == "running")
    });
    env.restart();
    let polls = eng.count("status");
    wait_until(LONG, "status polls by the new daemon", || eng.count("status") > polls + 2);
    env.kill9();
    // Requests pile up while no daemon runs; the next one answers them.
    std::thread::sleep(Duration::from_millis(1500));
    env.start_daemon();
    fs::write(&gate, b"go").unwrap();
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}");
    assert_eq!(eng.count("start"), 1);
    let text = fs::read_to_string(env.run_dir(id).join("external-job-0.result.md")).unwrap();
    assert!(text.contains("released"));
    env.check_consistency();
}

#[test]
fn providers_command_lists_and_checks() {
    let (env, eng) = env_with_engine("[providers.broken]\ntype = \"command\"\ncommand = [\"/nonexistent/provider\"]\n");
    let out = env.cli(&["providers", "--config", env.config_path.to_str().unwrap()]);
    let text = stdout_str(&out);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(text.contains("engine") && text.contains(&format!("{} is executable", eng.exe.display())), "{text}");
    assert!(
        text.contains("broken") && text.contains("FAILED") && text.contains("providers.broken.command[0]"),
        "{text}"
    );
    let out = env.cli(&["providers", "--config", env.config_path.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("providers --json prints JSON");
    let by_name = |n: &str| v.as_array().unwrap().iter().find(|p| p["name"] == n).cloned().unwrap();
    assert_eq!(by_name("engine")["ok"], true, "{v}");
    assert_eq!(by_name("broken")["ok"], false, "{v}");
    assert!(by_name("broken")["check"].as_str().unwrap().contains("providers.broken.command[0]"), "{v}");
    let (env2, _e) = env_with_engine("");
    let out = env2.cli(&["providers", "--config", env2.config_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", describe(&out));
}

#[test]
fn invalid_provider_config_is_refused_with_the_key() {
    let env = TestEnv::new();
    env.write_config(&config_with("[providers.s]\ntype = \"slurm\"\ncommand = [\"/bin/true\"]\n"));
    let (st, out) = env.run_daemon_expect_exit(&env.root, LONG);
    assert!(!st.success());
    assert!(out.contains("providers.s.command"), "{out}");
    env.write_config(&config_with("[providers.k]\ntype = \"command\"\ncommand = [\"/bin/true\"]\ntimeout_ms = 0\n"));
    let (st, out) = env.run_daemon_expect_exit(&env.root, LONG);
    assert!(!st.success());
    assert!(out.contains("providers.k.timeout_ms"), "{out}");
}

#[test]
fn sighup_reload_adds_a_provider() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    // A run that names a provider the daemon does not know is rejected at claim time.
    env.submit(&request(Some("reload-before"), &env.work, vec![ext_step("remote", "later", "echo hi")]));
    assert_eq!(env.wait_terminal("reload-before")["state"], "rejected");
    env.write_config(&config_with(&format!(
        "[providers.engine]\ntype = \"command\"\ncommand = [\"{}\"]\n[providers.later]\ntype = \"command\"\ncommand = [\"{}\"]\n",
        eng.exe.display(),
        eng.exe.display()
    )));
    unsafe {
        libc::kill(env.daemon_pid().unwrap() as i32, libc::SIGHUP);
    }
    wait_until(LONG, "the reload", || {
        fs::read_to_string(&env.log_path).unwrap_or_default().contains("configuration reloaded")
    });
    env.submit(&request(Some("reload-after"), &env.work, vec![ext_step("remote", "later", "echo via-later")]));
    assert_eq!(env.wait_terminal("reload-after")["state"], "complete");
    // An invalid file is refused and the running configuration stays.
    env.write_config("[providers.x]\ntype = \"magic\"\n");
    unsafe {
        libc::kill(env.daemon_pid().unwrap() as i32, libc::SIGHUP);
    }
    wait_until(LONG, "the refusal", || {
        fs::read_to_string(&env.log_path).unwrap_or_default().contains("providers.x.type")
    });
    env.submit(&request(Some("reload-kept"), &env.work, vec![ext_step("remote", "later", "echo still")]));
    assert_eq!(env.wait_terminal("reload-kept")["state"], "complete");
}

/// A queued run on disk whose step 0 already records `externalJob` (as a
/// runner of an earlier life would have left it); the daemon adopts it at start.
fn fabricate_queued(env: &TestEnv, id: &str, prompt: &str, external_job: Value) {
    let dir = env.run_dir(id);
    mkdir_0700(&dir);
    let req = request(Some(id), &env.work, vec![ext_step("remote", "engine", prompt)]);
    write_file_mode(&dir.join("request.json"), req.to_string().as_bytes(), 0o600);
    let now = now_ms();
    let st = json!({
        "runId": id, "sessionId": "default", "mode": "single", "state": "queued",
        "startedAt": now, "lastUpdate": now, "timeoutMs": 1800000, "cwd": env.work,
        "queue": {"priority": 0, "claimedAt": now}, "chainStepCount": 1,
        "steps": [{"agent": "remote", "status": "pending", "externalJob": external_job}]
    });
    write_file_mode(&dir.join("status.json"), st.to_string().as_bytes(), 0o600);
    write_file_mode(&env.active_dir().join(id), b"", 0o600);
}

#[test]
fn recorded_jobs_are_reattached_mismatches_and_redispatches_refused() {
    let (mut env, eng) = env_with_engine("");
    // A job the engine already ran for this step.
    let job = eng.dir.join("jobs/j.manual");
    fs::create_dir_all(&job).unwrap();
    fs::write(job.join("out"), "manual-output\n").unwrap();
    fs::write(job.join("rc"), "0\n").unwrap();
    let prompt = "echo manual-output";
    let digest = sha256_hex(prompt.as_bytes());
    fabricate_queued(
        &env,
        "re-attach",
        prompt,
        json!({"provider": "engine", "providerJobId": "j.manual", "promptDigest": digest, "options": {}, "state": "running", "startedAt": 1, "updatedAt": 1}),
    );
    fabricate_queued(
        &env,
        "re-mismatch",
        prompt,
        json!({"provider": "engine", "providerJobId": "j.other", "promptDigest": sha256_hex(b"another prompt"), "options": {}, "state": "running", "startedAt": 1, "updatedAt": 1}),
    );
    fabricate_queued(
        &env,
        "re-blocked",
        prompt,
        json!({"provider": "engine", "promptDigest": digest, "options": {}, "state": "starting", "startRequestId": "start-0-abc", "startedAt": 1, "updatedAt": 1}),
    );
    env.start_daemon();
    let st = env.wait_terminal("re-attach");
    assert_eq!(st["state"], "complete", "{st:#}");
    assert_eq!(st["steps"][0]["externalJob"]["providerJobId"], "j.manual");
    let text = fs::read_to_string(env.run_dir("re-attach").join("external-job-0.result.md")).unwrap();
    assert_eq!(text, "manual-output\n");
    let st = env.wait_terminal("re-mismatch");
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(err.starts_with("recovery-mismatch: ") && err.contains("j.other"), "{err}");
    let st = env.wait_terminal("re-blocked");
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(err.starts_with("start-redispatch-blocked: ") && err.contains("start-0-abc"), "{err}");
    assert_eq!(eng.count("start"), 0, "nothing was started");
    assert_eq!(eng.count("reattach"), 1);
    env.check_consistency();
}

/// A pi-subagents 0.67 `follow-up` bridge request, written into a run as
/// 0.67's requestExternalJobOperation writes it, is claimed like a start,
/// served by the command provider as `<command> follow-up` with the followUp
/// object on stdin, answered with its handle and tombstoned.
#[test]
fn follow_up_requests_are_claimed_served_and_tombstoned() {
    let (mut env, eng) = env_with_engine("");
    env.start_daemon();
    let gate = env.work.join("gate");
    env.submit(&request(Some("fu-run"), &env.work, vec![sh_step("host", &gate_wait(&gate))]));
    env.wait_state("fu-run", "running");
    let dir = env.run_dir("fu-run");
    let prompt = "echo follow-up-says-hi";
    let body = json!({
        "id": "fu-1", "operation": "follow-up", "provider": "engine", "createdAt": now_ms(),
        "followUp": {
            "prompt": prompt, "promptDigest": sha256_hex(prompt.as_bytes()), "cwd": env.work.to_str().unwrap(),
            "runId": "fu-run", "stepIndex": 0, "agent": "host", "options": {},
            "sourceRunId": "earlier-run", "sourceStepIndex": 0, "parentProviderJobId": "j.parent",
            "requestId": "resume-1", "requestDigest": "d1"
        }
    });
    let reqdir = dir.join("external-job-requests");
    fs::create_dir_all(&reqdir).unwrap();
    fs::write(reqdir.join(".fu-1.json.tmp"), body.to_string()).unwrap();
    fs::rename(reqdir.join(".fu-1.json.tmp"), reqdir.join("fu-1.json")).unwrap();
    let resp = dir.join("external-job-responses/fu-1.json");
    wait_until(LONG, "follow-up answered", || resp.exists());
    let r = read_json(&resp).unwrap();
    assert_eq!(r["ok"], json!(true), "{r}");
    assert_eq!(r["operation"], "follow-up", "{r}");
    assert!(r["result"]["providerJobId"].as_str().unwrap().starts_with("j."), "{r}");
    wait_until(LONG, "claim tombstoned", || reqdir.join("fu-1.claim/completed.json").exists());
    assert!(reqdir.join("fu-1.claim/handle.json").exists(), "the handle is saved in the claim");
    assert!(!reqdir.join("fu-1.json").exists(), "the request file is gone");
    assert_eq!(eng.count("follow-up"), 1, "{:?}", eng.calls());
    let log = fs::read_to_string(eng.dir.join("calls.log")).unwrap();
    assert!(log.contains("\"parentProviderJobId\":\"j.parent\""), "the followUp object on stdin: {log}");
    // Written again (a second servicer, a retry): never dispatched twice.
    fs::write(reqdir.join("fu-1.json"), body.to_string()).unwrap();
    wait_until(LONG, "repeated request removed", || !reqdir.join("fu-1.json").exists());
    assert_eq!(eng.count("follow-up"), 1, "{:?}", eng.calls());
    open_gate(&gate);
    env.wait_terminal("fu-run");
}

/// PROTOCOL §14: the daemon services the bridge requests of runs it did not
/// launch (a pi-subagents host's, with no host running) for the providers it
/// has configured, and leaves requests for other providers alone.
#[test]
fn bridge_requests_of_another_hosts_run_are_served() {
    let (mut env, eng) = env_with_engine("");
    let id = "pi-run-ext";
    let dir = env.run_dir(id);
    fs::create_dir_all(dir.join("external-job-requests")).unwrap();
    let now = now_ms();
    let st = json!({"runId": id, "sessionId": "pi", "mode": "single", "state": "running", "startedAt": now,
                    "lastUpdate": now, "pid": std::process::id(), "steps": [{"agent": "a", "status": "running"}]});
    fs::write(dir.join("status.json"), st.to_string()).unwrap();
    fs::write(env.active_dir().join(id), b"").unwrap();
    env.start_daemon();
    let prompt = "echo from-pi";
    let put = |name: &str, body: Value| {
        let reqdir = dir.join("external-job-requests");
        fs::write(reqdir.join(format!(".{name}.tmp")), body.to_string()).unwrap();
        fs::rename(reqdir.join(format!(".{name}.tmp")), reqdir.join(format!("{name}.json"))).unwrap();
    };
    put(
        "s1",
        json!({"id": "s1", "operation": "start", "provider": "engine", "createdAt": now_ms(),
               "start": {"prompt": prompt, "promptDigest": sha256_hex(prompt.as_bytes()), "cwd": env.work.to_str().unwrap(),
                         "runId": id, "stepIndex": 0, "agent": "a", "options": {}}}),
    );
    put(
        "o1",
        json!({"id": "o1", "operation": "status", "provider": "elsewhere", "providerJobId": "x", "createdAt": now_ms()}),
    );
    let resp = dir.join("external-job-responses/s1.json");
    wait_until(LONG, "the pi run's start answered", || resp.exists());
    let r = read_json(&resp).unwrap();
    assert_eq!(r["ok"], json!(true), "{r}");
    let job = r["result"]["providerJobId"].as_str().unwrap().to_string();
    put(
        "q1",
        json!({"id": "q1", "operation": "status", "provider": "engine", "providerJobId": job, "createdAt": now_ms()}),
    );
    wait_until(LONG, "the pi run's status answered", || dir.join("external-job-responses/q1.json").exists());
    assert_eq!(eng.count("start"), 1);
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(!dir.join("external-job-responses/o1.json").exists(), "a provider this daemon lacks: left for its host");
    assert!(dir.join("external-job-requests/o1.json").exists());
    assert_eq!(read_json(&dir.join("status.json")).unwrap(), st, "the run itself untouched");
    assert!(env.active_dir().join(id).exists());
}

#[test]
fn providers_reports_the_running_daemons_config() {
    let (mut env, eng) = env_with_engine("");
    // Without a daemon, the CLI's own default config (none here): no providers.
    let out = env.cli(&["providers", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&out)));
    assert_eq!(v, json!([]), "{}", describe(&out));

    env.start_daemon();
    let cfg_path = std::path::absolute(&env.config_path).unwrap();
    wait_until(Duration::from_secs(30), "daemon.json names the config", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["config"]["path"] == json!(cfg_path.display().to_string()))
    });
    let d = read_json(&env.daemon_json()).unwrap();
    assert_eq!(d["config"]["providers"], json!([{"name": "engine", "type": "command"}]));

    let out = env.cli(&["providers", "--json"]);
    assert!(out.status.success(), "{}", describe(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&out)));
    let names: Vec<&str> = v.as_array().unwrap().iter().filter_map(|p| p["name"].as_str()).collect();
    assert_eq!(names, ["engine"], "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the config of the running daemon") && err.contains(&cfg_path.display().to_string()), "{err}");

    // The file changes under the daemon: the CLI says the daemon still runs the old set.
    env.write_config(&config_with(&format!(
        "[providers.engine]\ntype = \"command\"\ncommand = [\"{0}\"]\n[providers.second]\ntype = \"command\"\ncommand = [\"{0}\"]\n",
        eng.exe.display()
    )));
    let out = env.cli(&["providers"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("changed since the daemon loaded it") && err.contains("engine (command)"), "{err}");
    // After a reload daemon.json follows.
    let pid = env.daemon_pid().unwrap();
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    wait_until(Duration::from_secs(30), "daemon.json lists the reloaded providers", || {
        read_json(&env.daemon_json()).is_some_and(|d| d["config"]["providers"].as_array().is_some_and(|a| a.len() == 2))
    });
    let out = env.cli(&["providers"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("changed since"), "{}", describe(&out));
}

#[test]
fn config_check_reports_every_error() {
    let env = TestEnv::new();
    let bad = env.base().join("bad.toml");
    fs::write(
        &bad,
        "max_runing = 3\n[watch]\nstrategi = \"poll\"\n\
         [providers.one]\ntype = \"cmd\"\ncommand = [\"x\"]\n\
         [providers.two]\ncommand = [\"x\"]\n\
         [providers.three]\ntype = \"command\"\ncommand = [\"x\"]\ntimeout = 1\n",
    )
    .unwrap();
    let o = env.cli(&["config", "check", "--config", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    for want in ["max_runing", "strategi", "providers.one.type is `cmd`", "providers.two", "`timeout`", "5 errors"] {
        assert!(err.contains(want), "config check does not report {want}:\n{err}");
    }
    let o = env.cli(&["config", "check", "--config", bad.to_str().unwrap(), "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", describe(&o)));
    assert_eq!(v["errors"].as_array().map(Vec::len), Some(5), "{v:#}");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("max_runing")), "{v:#}");
}
