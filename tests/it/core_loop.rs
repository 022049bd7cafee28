//! The core loop: spool request -> run -> runner -> terminal state, indexes, results.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

/// Shell snippet that blocks until `gate` exists.
fn types_in_order(types: &[String], want: &[&str]) -> bool {
    let mut i = 0;
    for t in types {
        if i < want.len() && t == want[i] {
            i += 1;
        }
    }
    i == want.len()
}

fn assert_event_basics(env: &TestEnv, id: &str) {
    let evs = env.events(id);
    assert!(!evs.is_empty(), "no events for {id}");
    let mut last_ts = 0;
    for e in &evs {
        assert!(e["type"].is_string(), "event without type: {e}");
        assert_eq!(e["runId"].as_str(), Some(id), "event runId: {e}");
        let ts = e["ts"].as_i64().unwrap_or_else(|| panic!("event ts not integer: {e}"));
        assert!(ts >= last_ts - 5_000, "events badly out of time order: {e}");
        last_ts = last_ts.max(ts);
    }
}

#[test]
fn seg_matches_protocol_examples() {
    seg_examples_hold();
}

#[test]
fn single_step_complete_with_env_indexes_and_result() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-single");
    let id = "single-1";
    let script = format!(
        "echo id=$RUNSPOOL_RUN_ID; echo dir=$RUNSPOOL_RUN_DIR; echo idx=$RUNSPOOL_STEP_INDEX; \
         echo prev=[${{RUNSPOOL_PREVIOUS_OUTPUT-unset}}]; echo run_env=$RUN_VAR; echo step_env=$STEP_VAR; \
         echo pwd=$(pwd); {}; echo last-line-of-output",
        gate_wait(&gate)
    );
    let mut req = request(Some(id), &env.work, vec![sh_step("worker", &script)]);
    req["sessionId"] = json!("sess-a");
    req["toolCallId"] = json!("call/a+b=");
    req["completionOwnerId"] = json!("owner-1");
    req["env"] = json!({"RUN_VAR": "run-value", "STEP_VAR": "overridden"});
    req["steps"][0]["env"] = json!({"STEP_VAR": "step-value"});
    let t0 = now_ms();
    let (_, bytes) = env.submit(&req);

    // While running: status running, active marker and tool-call alias exist.
    let st = env.wait_state(id, "running");
    assert_eq!(st["mode"], "single");
    assert_eq!(st["sessionId"], "sess-a");
    assert_eq!(st["toolCallId"], "call/a+b=");
    let runner_pid = st["pid"].as_i64().expect("status.pid is the runner pid");
    assert!(runner_pid > 0);
    assert_eq!(st["runner"]["pid"].as_i64(), Some(runner_pid), "runner.pid == pid");
    assert!(st["runner"]["processInstanceId"].is_string(), "runner.processInstanceId: {st}");
    assert!(st["runner"]["startIdentity"].as_str().unwrap_or("").starts_with("linux:"), "startIdentity: {st}");
    assert!(env.active_dir().join(id).is_file(), "active marker while running");
    let alias = env.active_dir().join("tool-calls").join("call%2Fa%2Bb%3D").join(id);
    wait_until(LONG, "tool-call alias while active", || alias.exists());
    assert!(!env.spool().join(format!("{id}.json")).exists(), "request left in spool");

    open_gate(&gate);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["exitCode"], 0);
    assert_eq!(st["mode"], "single");
    assert_eq!(st["completionOwnerId"], "owner-1");
    let ended = st["endedAt"].as_i64().expect("endedAt");
    assert!(ended >= t0 && ended <= now_ms(), "endedAt {ended} within test");
    assert!(st["startedAt"].as_i64().unwrap() <= ended);
    assert_eq!(st["timedOut"], json!(false));
    let steps = st["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0]["status"], "complete");
    assert_eq!(steps[0]["exitCode"], 0);
    assert_eq!(steps[0]["agent"], "worker");
    assert_eq!(st["queue"]["priority"], 0);

    // step output and env
    let out = env.output_log(id, 0);
    let rd = env.run_dir(id);
    assert!(out.contains("id=single-1\n"), "RUNSPOOL_RUN_ID in output: {out}");
    assert!(out.contains(&format!("dir={}\n", rd.display())), "RUNSPOOL_RUN_DIR in output: {out}");
    assert!(out.contains("idx=0\n"), "RUNSPOOL_STEP_INDEX in output: {out}");
    assert!(out.contains("run_env=run-value\n"), "request env: {out}");
    assert!(out.contains("step_env=step-value\n"), "step env overrides request env: {out}");
    assert!(out.contains(&format!("pwd={}\n", env.work.display())), "cwd: {out}");

    // request.json byte for byte
    assert_eq!(file_bytes(&rd.join("request.json")), bytes, "request.json is byte-identical");

    // result
    let r = env.result(id).expect("result file");
    assert_eq!(r["id"], id);
    assert_eq!(r["runId"], id);
    assert_eq!(r["sessionId"], "sess-a");
    assert_eq!(r["completionOwnerId"], "owner-1");
    assert_eq!(r["mode"], "single");
    assert_eq!(r["state"], "complete");
    assert_eq!(r["success"], json!(true));
    assert_eq!(r["exitCode"], 0);
    assert!(r["summary"].as_str().unwrap_or("").contains("last-line-of-output"), "summary: {r}");
    assert!(r["summary"].as_str().unwrap().len() <= 4096);
    let res = r["results"].as_array().expect("results array");
    assert_eq!(res.len(), 1);
    assert_eq!(res[0]["agent"], "worker");
    assert_eq!(res[0]["exitCode"], 0);
    assert_eq!(res[0]["success"], json!(true));
    assert_eq!(r["asyncDir"].as_str(), Some(rd.to_str().unwrap()));
    assert_eq!(r["cwd"].as_str(), Some(env.work.to_str().unwrap()));
    assert!(r["durationMs"].is_i64() || r["durationMs"].is_u64());
    assert!(r["timestamp"].is_i64() || r["timestamp"].is_u64());
    // result index
    let idx = read_json(
        &env.results().join("result-index/sessions").join(seg("sess-a")).join(format!("{}.json", seg250(id))),
    )
    .expect("result index entry");
    assert_eq!(idx["version"], 1);
    assert_eq!(idx["runId"], id);
    assert_eq!(idx["sessionId"], "sess-a");
    assert_eq!(idx["file"], format!("{id}.json"), "the bare file name, as pi-subagents 0.67 requires");

    // indexes
    wait_until(LONG, "active marker removed", || !env.active_dir().join(id).exists());
    wait_until(LONG, "tool-call alias removed", || !alias.exists());
    assert!(!alias.parent().unwrap().exists(), "empty alias dir removed");
    let marker = env.terminal_dir().join(seg("sess-a")).join(terminal_marker_name(ended, id));
    let m = read_json(&marker).unwrap_or_else(|| panic!("terminal marker {}", marker.display()));
    assert_eq!(m, json!({"version": 1, "runId": id, "sessionId": "sess-a", "endedAt": ended}));

    // events
    let types = env.event_types(id);
    assert!(
        types_in_order(
            &types,
            &[
                "subagent.run.queued",
                "subagent.run.started",
                "subagent.step.started",
                "subagent.step.completed",
                "subagent.run.completed"
            ]
        ),
        "event order: {types:?}"
    );
    assert_event_basics(&env, id);
    let evs = env.events(id);
    let done = evs.iter().find(|e| e["type"] == "subagent.run.completed").unwrap();
    assert_eq!(done["exitCode"], 0);
    assert_eq!(done["status"], "complete");
    let started = evs.iter().find(|e| e["type"] == "subagent.run.started").unwrap();
    assert_eq!(started["mode"], "single");
    assert_eq!(started["pid"].as_i64(), Some(runner_pid));
    let queued = evs.iter().find(|e| e["type"] == "subagent.run.queued").unwrap();
    assert_eq!(queued["priority"], 0);

    // modes of run dir files: 0700 dirs, 0600 files (request.json keeps the mode it was published with)
    assert_eq!(mode_of(&rd) & 0o077, 0, "run dir not accessible to others");
    for p in walk_all(&rd) {
        if p.file_name().map(|n| n == "request.json").unwrap_or(false) {
            continue;
        }
        assert_eq!(mode_of(&p) & 0o077, 0, "{} is accessible to group/others", p.display());
    }
    for p in [env.result_path(id), marker.clone()] {
        assert_eq!(mode_of(&p) & 0o077, 0, "{} is accessible to group/others", p.display());
    }
    env.check_consistency();
}

#[test]
fn default_run_id_and_session() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let req = request(None, &env.work, vec![cmd_step("a", &["true"])]);
    env.drop_request("no-run-id", &req);
    wait_until(LONG, "a run appears", || env.run_ids().len() == 1);
    let id = env.run_ids()[0].clone();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "default runId is a UUID: {id}");
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "complete");
    assert_eq!(st["sessionId"], "default");
    env.check_consistency();
}

#[test]
fn chain_complete_and_previous_output() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "chain-ok";
    let req = request(
        Some(id),
        &env.work,
        vec![
            sh_step("first", "echo alpha-output"),
            sh_step("second", "echo idx=$RUNSPOOL_STEP_INDEX; echo prev=[$RUNSPOOL_PREVIOUS_OUTPUT]"),
            sh_step("third", "echo idx=$RUNSPOOL_STEP_INDEX"),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["mode"], "chain");
    assert_eq!(st["exitCode"], 0);
    assert_eq!(st["chainStepCount"], 3, "{st}");
    for (i, s) in st["steps"].as_array().unwrap().iter().enumerate() {
        assert_eq!(s["status"], "complete", "step {i}");
        assert_eq!(s["exitCode"], 0, "step {i}");
    }
    let out1 = env.output_log(id, 1);
    assert!(out1.contains("idx=1\n"), "{out1}");
    let prev_line = out1.lines().find(|l| l.starts_with("prev=")).unwrap().to_string();
    assert!(
        prev_line.contains("alpha-output") || prev_line.contains("output-0.log"),
        "RUNSPOOL_PREVIOUS_OUTPUT names or holds step 0's output: {prev_line}"
    );
    assert!(env.output_log(id, 2).contains("idx=2\n"));
    let types = env.event_types(id);
    assert!(
        types_in_order(
            &types,
            &[
                "subagent.run.queued",
                "subagent.run.started",
                "subagent.step.started",
                "subagent.step.completed",
                "subagent.step.started",
                "subagent.step.completed",
                "subagent.step.started",
                "subagent.step.completed",
                "subagent.run.completed"
            ]
        ),
        "{types:?}"
    );
    let step_started: Vec<i64> = env
        .events(id)
        .iter()
        .filter(|e| e["type"] == "subagent.step.started")
        .map(|e| e["stepIndex"].as_i64().unwrap())
        .collect();
    assert_eq!(step_started, vec![0, 1, 2]);
    env.check_consistency();
}

#[test]
fn chain_failure_skips_later_steps() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "chain-fail";
    let req = request(
        Some(id),
        &env.work,
        vec![
            sh_step("a", "echo a"),
            sh_step("b", "echo b; exit 3"),
            sh_step("c", "echo c > should-not-exist-c"),
            sh_step("d", "echo d > should-not-exist-d"),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["exitCode"], 3);
    let steps = st["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    assert_eq!(steps[0]["status"], "complete");
    assert_eq!(steps[0]["exitCode"], 0);
    assert_eq!(steps[1]["status"], "failed");
    assert_eq!(steps[1]["exitCode"], 3);
    for (i, step) in steps.iter().enumerate().skip(2) {
        assert_eq!(step["status"], "failed", "skipped step {i}: {step}");
        assert_eq!(step["exitCode"], -1, "skipped step {i}");
        assert_eq!(step["durationMs"], 0, "skipped step {i}");
        assert_eq!(step["error"], "skipped: an earlier step failed", "skipped step {i}");
    }
    assert!(!env.work.join("should-not-exist-c").exists(), "step c must not run");
    assert!(!env.work.join("should-not-exist-d").exists(), "step d must not run");
    let evs = env.events(id);
    let failed = evs.iter().find(|e| e["type"] == "subagent.step.failed").expect("step.failed event");
    assert_eq!(failed["stepIndex"], 1);
    assert_eq!(failed["exitCode"], 3);
    let done = evs.iter().find(|e| e["type"] == "subagent.run.completed").expect("run.completed");
    assert_eq!(done["exitCode"], 3);
    assert_eq!(done["status"], "failed");
    let r = env.result(id).unwrap();
    assert_eq!(r["success"], json!(false));
    assert_eq!(r["exitCode"], 3);
    assert_eq!(r["state"], "failed");
    assert_eq!(r["results"].as_array().unwrap().len(), 4);
    assert_eq!(r["results"][1]["exitCode"], 3);
    assert_eq!(r["results"][1]["success"], json!(false));
    env.check_consistency();
}

#[test]
fn parallel_runs_concurrently() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "par-barrier";
    let bar = env.work.join("barrier");
    fs::create_dir(&bar).unwrap();
    // Each member waits (up to 60 s) until all three have started: only true concurrency passes.
    let member = |n: usize| {
        sh_step(
            &format!("m{n}"),
            &format!(
                "touch '{b}/{n}'; i=0; while [ $(ls '{b}' | wc -l) -lt 3 ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 9; sleep 0.05; done; echo member-{n}",
                b = bar.display()
            ),
        )
    };
    let req = request(Some(id), &env.work, vec![parallel(vec![member(0), member(1), member(2)], None)]);
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["mode"], "parallel");
    assert_eq!(st["parallelGroups"], json!([{"start": 0, "count": 3, "stepIndex": 0}]));
    for i in 0..3 {
        assert_eq!(st["steps"][i]["status"], "complete");
        assert!(env.output_log(id, i).contains(&format!("member-{i}")));
    }
    let evs = env.events(id);
    let ps = evs.iter().find(|e| e["type"] == "subagent.parallel.started").expect("parallel.started");
    assert_eq!(ps["count"], 3);
    assert_eq!(ps["stepIndex"], 0);
    let pc = evs.iter().find(|e| e["type"] == "subagent.parallel.completed").expect("parallel.completed");
    assert_eq!(pc["success"], json!(true));
    env.check_consistency();
}

#[test]
fn parallel_concurrency_limit_and_failure() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "par-conc";
    let running = env.work.join("running");
    let started = env.work.join("started");
    fs::create_dir(&running).unwrap();
    fs::create_dir(&started).unwrap();
    // Records how many members run at once; members 0 and 1 also wait until two have
    // started, so a limit of 1 would fail them (exit 9) and a limit above 2 shows in the counts.
    let member = |n: usize, code: i32| {
        sh_step(
            &format!("m{n}"),
            &format!(
                "touch '{s}/{n}'; touch '{r}/{n}'; ls '{r}' | wc -l > '{w}/count-{n}'; \
                 i=0; while [ $(ls '{s}' | wc -l) -lt 2 ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 9; sleep 0.05; done; \
                 sleep 0.5; ls '{r}' | wc -l >> '{w}/count-{n}'; rm -f '{r}/{n}'; exit {code}",
                s = started.display(),
                r = running.display(),
                w = env.work.display()
            ),
        )
    };
    let req = request(
        Some(id),
        &env.work,
        vec![parallel(vec![member(0, 0), member(1, 0), member(2, 0), member(3, 0), member(4, 5)], Some(2))],
    );
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["exitCode"], 5);
    assert_eq!(st["mode"], "parallel");
    for i in 0..4 {
        assert_eq!(st["steps"][i]["status"], "complete", "member {i}: {}", st["steps"][i]);
        assert_eq!(st["steps"][i]["exitCode"], 0);
    }
    assert_eq!(st["steps"][4]["status"], "failed");
    assert_eq!(st["steps"][4]["exitCode"], 5);
    for i in 0..5 {
        let c = fs::read_to_string(env.work.join(format!("count-{i}"))).unwrap();
        for n in c.split_whitespace() {
            let n: u32 = n.parse().unwrap();
            assert!((1..=2).contains(&n), "member {i} saw {n} members running at once (limit 2)");
        }
    }
    let pc =
        env.events(id).into_iter().find(|e| e["type"] == "subagent.parallel.completed").expect("parallel.completed");
    assert_eq!(pc["success"], json!(false));
    env.check_consistency();
}

#[test]
fn parallel_group_inside_chain() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "chain-par";
    let req = request(
        Some(id),
        &env.work,
        vec![
            sh_step("A", "echo A idx=$RUNSPOOL_STEP_INDEX"),
            parallel(
                vec![sh_step("B", "echo B idx=$RUNSPOOL_STEP_INDEX"), sh_step("C", "echo C idx=$RUNSPOOL_STEP_INDEX")],
                None,
            ),
            sh_step("D", "echo D idx=$RUNSPOOL_STEP_INDEX"),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(st["mode"], "chain");
    assert_eq!(st["parallelGroups"], json!([{"start": 1, "count": 2, "stepIndex": 1}]));
    let steps = st["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    for (i, name) in ["A", "B", "C", "D"].iter().enumerate() {
        assert_eq!(steps[i]["agent"], *name);
        assert_eq!(steps[i]["status"], "complete");
        let out = env.output_log(id, i);
        assert!(out.contains(&format!("{name} idx={i}")), "output-{i}.log: {out}");
    }
    env.check_consistency();

    // A failing member of the group ends the chain: D is skipped.
    let id2 = "chain-par-fail";
    let req = request(
        Some(id2),
        &env.work,
        vec![
            sh_step("A", "true"),
            parallel(vec![sh_step("B", "exit 0"), sh_step("C", "exit 4")], None),
            sh_step("D", "touch should-not-exist-D"),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(id2);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["exitCode"], 4);
    assert_eq!(st["steps"][1]["status"], "complete");
    assert_eq!(st["steps"][2]["status"], "failed");
    assert_eq!(st["steps"][2]["exitCode"], 4);
    assert_eq!(st["steps"][3]["exitCode"], -1);
    assert_eq!(st["steps"][3]["error"], "skipped: an earlier step failed");
    assert!(!env.work.join("should-not-exist-D").exists());
    env.check_consistency();
}

fn step_pid_script(pidfile: &Path, tail: &str) -> String {
    format!("echo $$ > '{}.tmp'; mv '{}.tmp' '{}'; {}", pidfile.display(), pidfile.display(), pidfile.display(), tail)
}

fn read_pid(p: &Path) -> i64 {
    fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

#[test]
fn run_timeout_fails_with_timed_out() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "run-timeout";
    let pidf = env.work.join("pid-rt");
    let mut req = request(
        Some(id),
        &env.work,
        vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 30")), sh_step("after", "true")],
    );
    req["timeoutMs"] = json!(1500);
    env.submit(&req);
    // (no waiting for the pid file: under load the deadline may pass before the step starts)
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["timedOut"], json!(true), "{st}");
    assert_ne!(st["exitCode"], 0);
    assert_eq!(st["timeoutMs"], 1500);
    assert_eq!(st["steps"][0]["status"], "failed");
    if pidf.exists() {
        let pid = read_pid(&pidf);
        wait_until(LONG, "timed-out step process is gone", || !process_alive(pid));
    }
    assert!(env.event_types(id).contains(&"subagent.run.timed_out".to_string()), "{:?}", env.event_types(id));
    env.check_consistency();
}

#[test]
fn step_timeout_fails_with_timed_out() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "step-timeout";
    let pidf = env.work.join("pid-st");
    let mut s0 = sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 30"));
    s0["timeoutMs"] = json!(1500);
    let req = request(Some(id), &env.work, vec![s0, sh_step("after", "touch should-not-exist")]);
    env.submit(&req);
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["timedOut"], json!(true), "{st}");
    assert_eq!(st["steps"][0]["status"], "failed");
    assert_eq!(st["steps"][0]["timedOut"], json!(true), "{st}");
    assert_eq!(st["steps"][1]["exitCode"], -1);
    assert!(!env.work.join("should-not-exist").exists());
    if pidf.exists() {
        let pid = read_pid(&pidf);
        wait_until(LONG, "timed-out step process is gone", || !process_alive(pid));
    }
    env.check_consistency();
}

#[test]
fn stop_running_run_via_cli() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "stop-me";
    let pidf = env.work.join("pid-stop");
    env.submit(&request(
        Some(id),
        &env.work,
        vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60")), sh_step("after", "true")],
    ));
    env.wait_file(&pidf);
    let pid = read_pid(&pidf);
    env.wait_state(id, "running");
    let o = env.cli(&["stop", id]);
    assert!(o.status.success(), "runspool stop: {}", describe(&o));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st}");
    assert_eq!(st["stopped"], json!(true));
    assert_eq!(st["steps"][0]["status"], "stopped", "{st}");
    wait_until(LONG, "stopped step process gone", || !process_alive(pid));
    wait_until(LONG, "stop request consumed", || list_names(&env.run_dir(id).join("control/stop-requests")).is_empty());
    assert!(env.event_types(id).contains(&"subagent.run.stopped".to_string()));
    let r = env.result(id).unwrap();
    assert_eq!(r["state"], "stopped");
    assert_eq!(r["success"], json!(false));
    env.check_consistency();
}

#[test]
fn stop_escalates_to_sigkill_when_term_is_ignored() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "stop-stubborn";
    let pidf = env.work.join("pid-stubborn");
    env.submit(&request(
        Some(id),
        &env.work,
        vec![sh_step("stubborn", &step_pid_script(&pidf, "trap '' TERM INT; while true; do sleep 0.2; done"))],
    ));
    env.wait_file(&pidf);
    let pid = read_pid(&pidf);
    env.wait_state(id, "running");
    env.write_control(id, "stop");
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st}");
    wait_until(LONG, "stubborn step killed", || !process_alive(pid));
    assert!(!process_group_alive(pid), "step process group is gone");
    env.check_consistency();
}

#[test]
fn interrupt_pauses_run() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "pause-me";
    let pidf = env.work.join("pid-pause");
    env.submit(&request(Some(id), &env.work, vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60"))]));
    env.wait_file(&pidf);
    let pid = read_pid(&pidf);
    env.wait_state(id, "running");
    env.write_control(id, "interrupt");
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "paused", "{st}");
    assert_eq!(st["steps"][0]["status"], "paused", "{st}");
    wait_until(LONG, "interrupted step gone", || !process_alive(pid));
    assert!(env.event_types(id).contains(&"subagent.run.paused".to_string()), "{:?}", env.event_types(id));
    env.check_consistency();
}

#[test]
fn timeout_control_file_fails_run() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "timeout-ctl";
    let pidf = env.work.join("pid-tctl");
    env.submit(&request(Some(id), &env.work, vec![sh_step("sleeper", &step_pid_script(&pidf, "exec sleep 60"))]));
    env.wait_file(&pidf);
    env.wait_state(id, "running");
    env.write_control(id, "timeout");
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["timedOut"], json!(true));
    env.check_consistency();
}

const ONE_AT_A_TIME: &str = "max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n";

#[test]
fn stop_queued_run_never_starts() {
    let mut env = TestEnv::with_config(ONE_AT_A_TIME);
    env.start_daemon();
    let gate = env.work.join("gate-block");
    env.submit(&request(Some("blocker"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("blocker", "running");
    env.submit(&request(Some("queued-victim"), &env.work, vec![sh_step("v", "touch ran-victim")]));
    let st = env.wait_state("queued-victim", "queued");
    assert_eq!(st["steps"][0]["status"], "pending", "{st}");
    assert!(env.active_dir().join("queued-victim").exists(), "queued run has an active marker");
    let o = env.cli(&["stop", "queued-victim"]);
    assert!(o.status.success(), "{}", describe(&o));
    let st = env.wait_terminal("queued-victim");
    assert_eq!(st["state"], "stopped", "{st}");
    assert_eq!(env.state("blocker").as_deref(), Some("running"), "blocker still running");
    open_gate(&gate);
    env.wait_terminal("blocker");
    // Give the scheduler a chance to (wrongly) start it.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!env.work.join("ran-victim").exists(), "stopped queued run must never start");
    assert!(!env.event_types("queued-victim").contains(&"subagent.run.started".to_string()));
    assert_eq!(env.state("queued-victim").as_deref(), Some("stopped"));
    env.check_consistency();
}

/// A run queued for longer than the daemon polls its inbox (5 s) has the
/// inbox watched: a client's stop.json then ends it without waiting for the
/// periodic rescan (set to 10 minutes here).
#[test]
fn stop_of_long_queued_run_is_seen_through_the_watch() {
    let mut env = TestEnv::with_config("max_running = 1\nretention_days = 30\n[watch]\nrescan_interval_s = 600\n");
    env.start_daemon();
    let gate = env.work.join("gate-block");
    env.submit(&request(Some("long-blocker"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("long-blocker", "running");
    env.submit(&request(Some("long-victim"), &env.work, vec![sh_step("v", "touch ran-long-victim")]));
    env.wait_state("long-victim", "queued");
    // Past the polling period: the daemon creates control/ and watches it.
    assert!(
        poll_until(Duration::from_secs(30), || env.run_dir("long-victim").join("control").is_dir()),
        "the daemon never took over the inbox of a run queued for over 5 s"
    );
    env.write_control("long-victim", "stop");
    let st = env.wait_terminal_for("long-victim", Duration::from_secs(30));
    assert_eq!(st["state"], "stopped", "{st}");
    open_gate(&gate);
    env.wait_terminal("long-blocker");
    assert!(!env.work.join("ran-long-victim").exists(), "stopped queued run must never start");
    env.check_consistency();
}

/// The daemon starts `runspool-runner DIR` from its own directory, and
/// `runspool runner DIR` when that file is not there (a lone copy of the
/// binary): each run's step sees which one is its parent.
#[cfg(target_os = "linux")]
#[test]
fn runner_is_the_sibling_binary_or_the_subcommand() {
    let parent = "tr '\\0' ' ' < /proc/$PPID/cmdline";
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("via-sibling"), &env.work, vec![sh_step("p", parent)]));
    assert_eq!(env.wait_terminal("via-sibling")["state"], "complete");
    let out = env.output_log("via-sibling", 0);
    assert!(out.contains("runspool-runner ") && out.contains("via-sibling"), "parent of the step: {out}");
    env.term();
    let lone = env.base().join("lone");
    fs::create_dir_all(&lone).unwrap();
    let bin = lone.join("runspool");
    install_program(Path::new(BIN), &bin);
    let cmd = env.daemon_command_for(&bin, &env.root);
    env.start_daemon_command(cmd);
    env.submit(&request(Some("via-subcommand"), &env.work, vec![sh_step("p", parent)]));
    assert_eq!(env.wait_terminal("via-subcommand")["state"], "complete");
    let out = env.output_log("via-subcommand", 0);
    assert!(out.contains("lone/runspool runner ") && out.contains("via-subcommand"), "parent of the step: {out}");
    env.check_consistency();
}

/// What a step learns about its runner and the runner's parent (Linux).
#[cfg(target_os = "linux")]
const RUNNER_AND_PARENT: &str = r#"r=$PPID; s=$(cut -d' ' -f4 /proc/$r/stat)
printf 'runner=%s\n' "$(tr '\0' ' ' < /proc/$r/cmdline)"
printf 'server=%s\n' "$s"
printf 'server_cmd=%s\n' "$(tr '\0' ' ' < /proc/$s/cmdline)"
printf 'server_parent=%s\n' "$(cut -d' ' -f4 /proc/$s/stat)""#;

/// `key=value` lines of a step's output.
#[cfg(target_os = "linux")]
fn output_fields(out: &str) -> std::collections::HashMap<String, String> {
    out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Runners are forked by one fork server, a child of the daemon, and each
/// shows `runspool-runner <runDir>` as its command line. A server killed
/// under a running run leaves that run to finish and be settled, and the
/// next run gets a new server; so does a run after the runner program file
/// was replaced (an upgrade), which then runs the new file.
#[cfg(target_os = "linux")]
#[test]
fn runners_are_forked_by_a_fork_server_that_is_replaced_when_it_dies_or_its_file_does() {
    let mut env = TestEnv::new();
    let pair = env.base().join("pair");
    fs::create_dir_all(&pair).unwrap();
    let (bin, runner) = (pair.join("runspool"), pair.join("runspool-runner"));
    install_program(Path::new(BIN), &bin);
    install_program(&runner_bin(), &runner);
    let cmd = env.daemon_command_for(&bin, &env.root);
    env.start_daemon_command(cmd);
    let daemon = env.daemon_pid().unwrap().to_string();
    let run = |env: &TestEnv, id: &str| {
        env.submit(&request(Some(id), &env.work, vec![sh_step("p", RUNNER_AND_PARENT)]));
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "complete", "{st}\n{}", env.log_tail(20));
        output_fields(&env.output_log(id, 0))
    };
    let a = run(&env, "forked-a");
    let b = run(&env, "forked-b");
    for (f, id) in [(&a, "forked-a"), (&b, "forked-b")] {
        let want = format!("{} {}", runner.display(), env.run_dir(id).display());
        assert_eq!(f["runner"].trim_end(), want, "the runner's command line names its run: {f:?}");
        assert_eq!(f["server_cmd"].trim_end(), format!("{} --fork-server", runner.display()), "{f:?}");
        assert_eq!(f["server_parent"], daemon, "the fork server is the daemon's child: {f:?}");
    }
    assert_eq!(a["server"], b["server"], "one server forks every runner");

    // The server dies under a running run: the run finishes and is settled.
    let gate = env.work.join("gate-server");
    env.submit(&request(Some("orphaned"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("orphaned", "running");
    let server: i32 = a["server"].parse().unwrap();
    unsafe { libc::kill(server, libc::SIGKILL) };
    wait_until(Duration::from_secs(30), "the killed fork server to be reaped", || {
        !Path::new(&format!("/proc/{server}")).exists()
    });
    let c = run(&env, "after-kill");
    assert_ne!(c["server"], a["server"], "a new server after the old one died: {c:?}");
    open_gate(&gate);
    assert_eq!(env.wait_terminal("orphaned")["state"], "complete");

    // The runner program is replaced: the next run is forked from the new file.
    install_program(&runner_bin(), &runner);
    let d = run(&env, "after-upgrade");
    assert_ne!(d["server"], c["server"], "a new server for the new program file: {d:?}");
    let exe = fs::read_link(format!("/proc/{}/exe", d["server"])).unwrap();
    assert_eq!(exe, runner, "the new server runs the new file");
    wait_until(Duration::from_secs(30), "the replaced server to exit", || {
        !Path::new(&format!("/proc/{}", c["server"])).exists()
    });
    env.check_consistency();
}

/// A fork server that is stopped (SIGSTOP) reports no runner's exit: the
/// daemon replaces it, so the slot of a run that ended under it frees and
/// the queue goes on.
#[cfg(target_os = "linux")]
#[test]
fn a_stopped_fork_server_is_replaced_and_its_runs_slots_free() {
    let mut env = TestEnv::with_config(ONE_AT_A_TIME);
    env.start_daemon();
    let gate = env.work.join("gate-stopped");
    env.submit(&request(Some("under-stopped"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("under-stopped", "running");
    let runner = env.status("under-stopped").unwrap()["runner"]["pid"].as_i64().unwrap();
    let stat = fs::read_to_string(format!("/proc/{runner}/stat")).unwrap();
    let server: i32 = stat[stat.rfind(')').unwrap() + 2..].split(' ').nth(1).unwrap().parse().unwrap();
    let cmd = fs::read(format!("/proc/{server}/cmdline")).unwrap();
    assert!(String::from_utf8_lossy(&cmd).contains("--fork-server"), "the runner's parent is the fork server");
    unsafe { libc::kill(server, libc::SIGSTOP) };
    env.submit(&request(Some("next-in-line"), &env.work, vec![cmd_step("t", &["true"])]));
    env.wait_state("next-in-line", "queued");
    open_gate(&gate);
    assert_eq!(env.wait_terminal("under-stopped")["state"], "complete");
    let st = env.wait_terminal("next-in-line");
    assert_eq!(st["state"], "complete", "the slot freed: {st}\n{}", env.log_tail(20));
    wait_until(Duration::from_secs(30), "the stopped server to be killed and reaped", || {
        !Path::new(&format!("/proc/{server}")).exists()
    });
    assert!(env.log_tail(200).contains("is stopped"), "the log says why the server was replaced");
    env.check_consistency();
}

#[test]
fn priority_higher_first() {
    let mut env = TestEnv::with_config(ONE_AT_A_TIME);
    env.start_daemon();
    let gate = env.work.join("gate-prio");
    let order = env.work.join("order");
    env.submit(&request(Some("prio-blocker"), &env.work, vec![sh_step("block", &gate_wait(&gate))]));
    env.wait_state("prio-blocker", "running");
    let rec = |name: &str| sh_step(name, &format!("echo {} >> '{}'", name, order.display()));
    let mut low = request(Some("prio-low"), &env.work, vec![rec("low")]);
    low["priority"] = json!(-5);
    let mut mid = request(Some("prio-mid"), &env.work, vec![rec("mid")]);
    mid["priority"] = json!(0);
    let mut high = request(Some("prio-high"), &env.work, vec![rec("high")]);
    high["priority"] = json!(10);
    env.submit(&low);
    env.wait_state("prio-low", "queued");
    env.submit(&mid);
    env.wait_state("prio-mid", "queued");
    env.submit(&high);
    let st = env.wait_state("prio-high", "queued");
    assert_eq!(st["queue"]["priority"], 10);
    assert_eq!(env.status("prio-low").unwrap()["queue"]["priority"], -5);
    open_gate(&gate);
    for id in ["prio-blocker", "prio-low", "prio-mid", "prio-high"] {
        assert_eq!(env.wait_terminal(id)["state"], "complete");
    }
    let got = fs::read_to_string(&order).unwrap();
    assert_eq!(got.split_whitespace().collect::<Vec<_>>(), vec!["high", "mid", "low"], "run order");
    let q: Vec<i64> = env
        .events("prio-high")
        .iter()
        .filter(|e| e["type"] == "subagent.run.queued")
        .map(|e| e["priority"].as_i64().unwrap())
        .collect();
    assert_eq!(q, vec![10]);
    env.check_consistency();
}

#[test]
fn max_running_is_respected() {
    let mut env = TestEnv::with_config("max_running = 2\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    let gate = env.work.join("gate-max");
    for i in 0..4 {
        env.submit(&request(Some(&format!("maxr-{i}")), &env.work, vec![sh_step("g", &gate_wait(&gate))]));
    }
    wait_until(LONG, "two running", || {
        (0..4).filter(|i| env.state(&format!("maxr-{i}")).as_deref() == Some("running")).count() == 2
    });
    wait_until(LONG, "all claimed", || (0..4).all(|i| env.state(&format!("maxr-{i}")).is_some()));
    std::thread::sleep(Duration::from_secs(2));
    let running = (0..4).filter(|i| env.state(&format!("maxr-{i}")).as_deref() == Some("running")).count();
    let queued = (0..4).filter(|i| env.state(&format!("maxr-{i}")).as_deref() == Some("queued")).count();
    assert_eq!((running, queued), (2, 2), "max_running = 2");
    if let Some(d) = read_json(&env.daemon_json()) {
        wait_until(LONG, "daemon.json runs counts", || {
            let d = read_json(&env.daemon_json()).unwrap_or(d.clone());
            d["runs"]["running"] == 2 && d["runs"]["queued"] == 2
        });
    }
    open_gate(&gate);
    for i in 0..4 {
        assert_eq!(env.wait_terminal(&format!("maxr-{i}"))["state"], "complete");
    }
    env.check_consistency();
}

#[test]
fn cli_submit_wait_status_list_logs() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let work = env.work.to_str().unwrap().to_string();

    // submit --wait exits with the run's exit code
    let o =
        env.cli(&["submit", "--run-id", "cli-seven", "--cwd", &work, "--wait", "--", "sh", "-c", "echo seven; exit 7"]);
    assert_eq!(o.status.code(), Some(7), "submit --wait exit code: {}", describe(&o));
    assert!(stdout_str(&o).lines().any(|l| l.trim() == "cli-seven"), "submit prints the run id: {}", describe(&o));
    let st = env.status("cli-seven").unwrap();
    assert_eq!(st["state"], "failed");
    assert_eq!(st["exitCode"], 7);

    let o = env.cli(&["submit", "--cwd", &work, "--wait", "--", "true"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));

    // submit without --wait prints just the id; options land in the request
    let o = env.cli(&[
        "submit",
        "--run-id",
        "cli-opts",
        "--session",
        "cli-sess",
        "--cwd",
        &work,
        "--env",
        "FOO=bar baz",
        "--timeout",
        "5m",
        "--priority",
        "7",
        "--",
        "sh",
        "-c",
        "echo foo=$FOO",
    ]);
    assert!(o.status.success(), "{}", describe(&o));
    assert_eq!(stdout_str(&o).trim(), "cli-opts");
    let o = env.cli(&["wait", "cli-opts"]);
    assert_eq!(o.status.code(), Some(0), "wait: {}", describe(&o));
    let req = read_json(&env.run_dir("cli-opts").join("request.json")).unwrap();
    assert_eq!(req["version"], 1);
    assert_eq!(req["runId"], "cli-opts");
    assert_eq!(req["sessionId"], "cli-sess");
    assert_eq!(req["priority"], 7);
    assert_eq!(req["timeoutMs"], 300000);
    assert_eq!(req["cwd"].as_str(), Some(work.as_str()));
    assert!(
        req["env"]["FOO"] == "bar baz" || req["steps"][0]["env"]["FOO"] == "bar baz",
        "--env lands in the request: {req}"
    );
    assert_eq!(env.status("cli-opts").unwrap()["state"], "complete");
    assert!(env.output_log("cli-opts", 0).contains("foo=bar baz"));

    // wait on a failed run exits with its code
    let o = env.cli(&["wait", "cli-seven"]);
    assert_eq!(o.status.code(), Some(7), "wait exit code: {}", describe(&o));

    // status --json
    let o = env.cli(&["status", "cli-opts", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("status --json prints JSON");
    assert_eq!(v, env.status("cli-opts").unwrap());
    let o = env.cli(&["status", "cli-opts"]);
    assert!(o.status.success());
    assert!(stdout_str(&o).contains("complete"), "{}", describe(&o));

    // logs
    let o = env.cli(&["logs", "cli-opts"]);
    assert!(o.status.success(), "{}", describe(&o));
    assert!(stdout_str(&o).contains("foo=bar baz"));
    let o = env.cli(&["logs", "cli-seven", "--step", "0"]);
    assert!(stdout_str(&o).contains("seven"), "{}", describe(&o));

    // list --json, --session filter
    let o = env.cli(&["list", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("list --json prints JSON");
    let ids: Vec<&str> = v.as_array().unwrap().iter().filter_map(|s| s["runId"].as_str()).collect();
    assert!(ids.contains(&"cli-seven"), "{ids:?}");
    let o = env.cli(&["list", "--session", "cli-sess", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).expect("list --session --json");
    let ids: Vec<&str> = v.as_array().unwrap().iter().filter_map(|s| s["runId"].as_str()).collect();
    assert_eq!(ids, vec!["cli-opts"]);

    // submit --file
    let f = env.work.join("req.json");
    let body = request(Some("cli-file"), &env.work, vec![sh_step("f", "exit 2")]);
    fs::write(&f, serde_json::to_vec(&body).unwrap()).unwrap();
    let o = env.cli(&["submit", "--file", f.to_str().unwrap(), "--wait"]);
    assert_eq!(o.status.code(), Some(2), "{}", describe(&o));
    assert_eq!(env.status("cli-file").unwrap()["exitCode"], 2);

    // wait --timeout on a run that does not finish
    let gate = env.work.join("gate-cli");
    env.submit(&request(Some("cli-slow"), &env.work, vec![sh_step("slow", &gate_wait(&gate))]));
    env.wait_state("cli-slow", "running");
    let o = env.cli(&["wait", "cli-slow", "--timeout", "1s"]);
    assert_eq!(o.status.code(), Some(124), "wait --timeout exits 124 on timeout: {}", describe(&o));
    let o = env.cli(&["list", "--active", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("list --active --json");
    let ids: Vec<&str> = v.as_array().unwrap().iter().filter_map(|s| s["runId"].as_str()).collect();
    assert_eq!(ids, vec!["cli-slow"], "only the slow run is active; status: {:?}", env.status("cli-slow"));
    open_gate(&gate);
    let o = env.cli(&["wait", "cli-slow", "--timeout", "90s"]);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    env.check_consistency();
}

#[test]
fn cli_stop_of_unknown_run_fails() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let o = env.cli(&["stop", "no-such-run"]);
    assert!(!o.status.success(), "{}", describe(&o));
    let o = env.cli(&["status", "no-such-run"]);
    assert!(!o.status.success(), "{}", describe(&o));
}

#[test]
fn daemon_term_exits_zero_and_leaves_runner() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let gate = env.work.join("gate-term");
    env.submit(&request(Some("survivor"), &env.work, vec![sh_step("s", &format!("{}; exit 6", gate_wait(&gate)))]));
    let st = env.wait_state("survivor", "running");
    let runner = st["pid"].as_i64().unwrap();
    let asked = Instant::now();
    let code = env.term();
    // The promise is "within 5 s" (flushing deferred writes is bounded at 3 s);
    // with nothing deferred it is far quicker, so this is a deadline, not a benchmark.
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "daemon took {:?} to exit after SIGTERM\n{}",
        asked.elapsed(),
        env.log_tail(30)
    );
    assert_eq!(code.code(), Some(0), "daemon exit status after SIGTERM");
    assert!(process_alive(runner), "runner survives the daemon");
    assert!(env.log_tail(10).contains("stopping on signal SIGTERM; runs keep running"), "{}", env.log_tail(30));
    // The lock is released: a new daemon starts on the same root at once.
    env.start_daemon();
    open_gate(&gate);
    let st = env.wait_terminal("survivor");
    assert_eq!(st["state"], "failed");
    assert_eq!(st["exitCode"], 6);
    std::thread::sleep(Duration::from_secs(1));
    env.check_consistency();
    // SIGINT (a foreground daemon's Ctrl-C) stops it the same way.
    let mut child = env.child.take().unwrap();
    let asked = Instant::now();
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let exited = poll_until(Duration::from_secs(60), || child.try_wait().unwrap().is_some());
    assert!(
        exited && asked.elapsed() < Duration::from_secs(5),
        "daemon took {:?} to exit after SIGINT\n{}",
        asked.elapsed(),
        env.log_tail(30)
    );
    assert_eq!(child.wait().unwrap().code(), Some(0), "daemon exit status after SIGINT\n{}", env.log_tail(30));
}

#[test]
fn step_killed_by_signal_records_128_plus_n() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("sig-kill"), &env.work, vec![sh_step("k", "kill -KILL $$"), sh_step("after", "true")]));
    env.submit(&request(Some("sig-term"), &env.work, vec![sh_step("t", "kill -TERM $$")]));
    let st = env.wait_terminal("sig-kill");
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(st["exitCode"], 137, "{st}");
    assert_eq!(st["steps"][0]["exitCode"], 137, "{st}");
    assert_eq!(st["steps"][0]["signal"], "SIGKILL", "{st}");
    assert_eq!(st["steps"][1]["exitCode"], -1);
    let st = env.wait_terminal("sig-term");
    assert_eq!(st["exitCode"], 143, "{st}");
    assert_eq!(st["steps"][0]["signal"], "SIGTERM", "{st}");
    env.check_consistency();
}

#[test]
fn missing_command_fails_cleanly() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(
        Some("no-such-binary"),
        &env.work,
        vec![cmd_step("x", &["/nonexistent/definitely-not-here"]), cmd_step("y", &["true"])],
    ));
    let st = env.wait_terminal("no-such-binary");
    assert_eq!(st["state"], "failed", "{st}");
    assert_ne!(st["exitCode"], 0);
    assert_eq!(st["steps"][0]["status"], "failed");
    assert_eq!(st["steps"][1]["exitCode"], -1);
    env.check_consistency();
}

#[test]
fn terminal_state_is_final() {
    let mut env = TestEnv::new();
    env.start_daemon();
    env.submit(&request(Some("final"), &env.work, vec![cmd_step("a", &["true"])]));
    let st = env.wait_terminal("final");
    assert_eq!(st["state"], "complete");
    // Late control requests must not change a terminal run.
    env.write_control("final", "stop");
    env.write_control("final", "interrupt");
    let o = env.cli(&["stop", "final"]);
    let _ = o; // may succeed or report that the run is over; either way nothing changes
    std::thread::sleep(Duration::from_secs(7)); // longer than the 5 s rescan
    let st2 = env.status("final").unwrap();
    assert_eq!(st2["state"], "complete", "{st2}");
    assert_eq!(st2["endedAt"], st["endedAt"]);
    assert_eq!(st2["exitCode"], 0);
    env.check_consistency();
}

#[test]
fn sighup_reloads_config_and_keeps_it_on_error() {
    let mut env = TestEnv::with_config(ONE_AT_A_TIME);
    // The config's level only applies without RUNSPOOL_LOG (which the harness sets).
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    cmd.env_remove("RUNSPOOL_LOG");
    env.start_daemon_command(cmd);
    let gate = env.work.join("gate-hup");
    env.submit(&request(Some("hup-a"), &env.work, vec![sh_step("a", &gate_wait(&gate))]));
    env.wait_state("hup-a", "running");
    env.submit(&request(Some("hup-b"), &env.work, vec![sh_step("b", &gate_wait(&gate))]));
    env.wait_state("hup-b", "queued");
    let pid = env.daemon_pid().unwrap();
    let log = |env: &TestEnv| fs::read_to_string(&env.log_path).unwrap_or_default();
    assert!(!log(&env).contains(" DEBUG "), "level info: no debug lines yet\n{}", env.log_tail(30));

    // An invalid file is refused and the daemon keeps going with the old
    // configuration; the report names the file and the key.
    env.write_config("max_running = 2\nno_such_key = 1\n");
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGHUP);
    }
    let config = env.config_path.display().to_string();
    wait_until(LONG, "the refusal in the daemon log", || log(&env).contains("configuration refused"));
    let refusal = log(&env).lines().find(|l| l.contains("configuration refused")).unwrap().to_string();
    assert!(refusal.contains(" ERROR ") && refusal.contains(&config) && refusal.contains("no_such_key"), "{refusal}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        env.daemon_exited().is_none(),
        "an invalid config on SIGHUP must not stop the daemon\n{}",
        env.log_tail(30)
    );
    assert_eq!(env.state("hup-b").as_deref(), Some("queued"), "old max_running = 1 still applies");

    // A valid file is applied, and the report says what changed.
    env.write_config(
        "max_running = 2\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n[log]\nlevel = \"debug\"\n",
    );
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGHUP);
    }
    env.wait_state("hup-b", "running");
    wait_until(LONG, "the reload report in the daemon log", || log(&env).contains("configuration reloaded"));
    let text = log(&env);
    let at = text.find("configuration reloaded").unwrap();
    let report = text[at..].lines().next().unwrap();
    assert!(report.starts_with("configuration reloaded: max_running 1 -> 2; log.level info -> debug"), "{report}");
    // The new level is live: debug lines follow (the periodic rescan logs one every 5 s).
    wait_until(LONG, "a debug line after the reload", || log(&env)[at..].contains(" DEBUG "));
    open_gate(&gate);
    env.wait_terminal("hup-a");
    env.wait_terminal("hup-b");
    env.check_consistency();
}

#[test]
fn sighup_level_change_yields_to_runspool_log() {
    let mut env = TestEnv::with_config(ONE_AT_A_TIME);
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    cmd.env("RUNSPOOL_LOG", "info");
    env.start_daemon_command(cmd);
    let pid = env.daemon_pid().unwrap();
    env.write_config("max_running = 1\nretention_days = 7\n[watch]\nrescan_interval_s = 5\n[log]\nlevel = \"error\"\n");
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGHUP);
    }
    let log = || fs::read_to_string(&env.log_path).unwrap_or_default();
    wait_until(LONG, "the reload report in the daemon log", || log().contains("configuration reloaded"));
    let text = log();
    let report = text[text.find("configuration reloaded").unwrap()..].lines().next().unwrap().to_string();
    assert!(
        report.contains("retention_days 30 -> 7")
            && report.contains("log.level info -> error (not applied: RUNSPOOL_LOG = info is set and wins)"),
        "{report}"
    );
    // Still logging at the variable's level: info lines keep coming.
    env.submit(&request(Some("after-hup"), &env.work, vec![cmd_step("a", &["true"])]));
    env.wait_terminal("after-hup");
    wait_until(LONG, "an info line after the reload", || log().contains("runner started"));
}

#[test]
fn stop_kills_every_parallel_member() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "stop-par";
    let pids: Vec<_> = (0..3).map(|i| env.work.join(format!("par-pid-{i}"))).collect();
    let members =
        pids.iter().enumerate().map(|(i, p)| sh_step(&format!("m{i}"), &step_pid_script(p, "exec sleep 60"))).collect();
    env.submit(&request(Some(id), &env.work, vec![parallel(members, None), sh_step("after", "true")]));
    for p in &pids {
        env.wait_file(p);
    }
    env.wait_state(id, "running");
    let o = env.cli(&["stop", id]);
    assert!(o.status.success(), "{}", describe(&o));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "stopped", "{st}");
    for p in &pids {
        let pid = read_pid(p);
        wait_until(LONG, "parallel member killed", || !process_alive(pid));
    }
    for i in 0..3 {
        assert_eq!(st["steps"][i]["status"], "stopped", "member {i}: {st}");
    }
    assert_ne!(st["steps"][3]["status"], "complete", "the step after a stopped group never runs: {st}");
    env.check_consistency();
}

#[test]
fn output_captures_stderr_and_summary_is_the_tail() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let id = "big-output";
    // ~20 KiB of output, then a known last line; stderr goes to the same log.
    let script = "i=0; while [ $i -lt 400 ]; do echo line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done; echo to-stderr >&2; echo THE-END";
    env.submit(&request(Some(id), &env.work, vec![sh_step("first", "echo from-first"), sh_step("talker", script)]));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete");
    let out = env.output_log(id, 1);
    assert!(out.contains("to-stderr"), "stderr captured in output-1.log");
    assert!(out.contains("line-0-") && out.contains("line-399-"));
    let r = env.result(id).unwrap();
    let summary = r["summary"].as_str().unwrap();
    assert!(summary.len() <= 4096, "summary is at most 4 KiB, got {}", summary.len());
    assert!(summary.len() > 1000, "summary holds the tail, got {} bytes", summary.len());
    assert!(
        summary.trim_end().ends_with("THE-END"),
        "summary ends with the last line: {:?}",
        &summary[summary.len().saturating_sub(80)..]
    );
    assert!(!summary.contains("from-first"), "summary comes from the last step");
    env.check_consistency();
}
