//! Chaos: 500 requests of mixed validity dropped at once while the daemon is
//! SIGKILLed and restarted at random moments. Every valid request must become
//! exactly one run with the right outcome, every invalid one exactly one
//! rejected entry with the right code, and the root must end up consistent.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
enum Expect {
    /// A run: (runId if given, state, exitCode)
    Run(Option<String>, &'static str, i64),
    /// A rejection with this code; `run_dir` = whether a `rejected` run dir must exist.
    Reject(&'static str, Option<String>, bool),
}

struct Spec {
    name: String,
    bytes: Vec<u8>,
    mode: u32,
    old_mtime: bool,
    expect: Expect,
}

fn code_step(agent: &str, code: i64) -> Value {
    sh_step(agent, &format!("exit {code}"))
}

fn pick_code(rng: &mut Rng) -> i64 {
    [0, 0, 0, 1, 2, 3, 7, 42][rng.below(8) as usize]
}

fn build_specs(env: &TestEnv, rng: &mut Rng, n: usize) -> Vec<Spec> {
    let w = env.work.clone();
    let mut specs = vec![];
    for i in 0..n {
        let name = format!("c-{i:03}");
        let id = format!("chaos-{i:03}");
        let tag = format!("chaos-agent-{i}");
        let roll = rng.below(100);
        let mut mode = 0o600;
        let mut old_mtime = false;
        let (body, expect): (Vec<u8>, Expect) = if roll < 25 {
            let c = pick_code(rng);
            let r = request(Some(&id), &w, vec![code_step(&tag, c)]);
            (
                serde_json::to_vec(&r).unwrap(),
                Expect::Run(Some(id.clone()), if c == 0 { "complete" } else { "failed" }, c),
            )
        } else if roll < 45 {
            let k = rng.range(2, 3) as usize;
            let codes: Vec<i64> = (0..k).map(|_| if rng.below(3) == 0 { pick_code(rng) } else { 0 }).collect();
            let steps = codes.iter().enumerate().map(|(j, c)| code_step(&format!("{tag}-{j}"), *c)).collect();
            let r = request(Some(&id), &w, steps);
            let first_fail = codes.iter().copied().find(|c| *c != 0);
            let e = match first_fail {
                None => Expect::Run(Some(id.clone()), "complete", 0),
                Some(c) => Expect::Run(Some(id.clone()), "failed", c),
            };
            (serde_json::to_vec(&r).unwrap(), e)
        } else if roll < 60 {
            let k = rng.range(2, 3) as usize;
            let bad = if rng.below(2) == 0 { Some(rng.below(k as u64) as usize) } else { None };
            let code = rng.range(1, 9) as i64;
            let members =
                (0..k).map(|j| code_step(&format!("{tag}-{j}"), if Some(j) == bad { code } else { 0 })).collect();
            let conc = if rng.below(2) == 0 { Some(1 + rng.below(2) as u32) } else { None };
            let r = request(Some(&id), &w, vec![parallel(members, conc)]);
            let e = match bad {
                None => Expect::Run(Some(id.clone()), "complete", 0),
                Some(_) => Expect::Run(Some(id.clone()), "failed", code),
            };
            (serde_json::to_vec(&r).unwrap(), e)
        } else if roll < 68 {
            let c = pick_code(rng);
            let r = request(None, &w, vec![code_step(&tag, c)]);
            (serde_json::to_vec(&r).unwrap(), Expect::Run(None, if c == 0 { "complete" } else { "failed" }, c))
        } else if roll < 76 {
            old_mtime = true;
            (
                format!("{{\"version\":1,\"runId\":\"{id}\",\"steps\":[").into_bytes(),
                Expect::Reject(RejectionCode::InvalidJson.as_str(), None, false),
            )
        } else if roll < 82 {
            let mut r = request(Some(&id), &w, vec![code_step(&tag, 0)]);
            r["version"] = json!(3);
            (
                serde_json::to_vec(&r).unwrap(),
                Expect::Reject(RejectionCode::UnsupportedVersion.as_str(), Some(id.clone()), false),
            )
        } else if roll < 88 {
            let mut r = request(Some(&id), &w, vec![code_step(&tag, 0)]);
            r["tiemoutMs"] = json!(1000);
            (
                serde_json::to_vec(&r).unwrap(),
                Expect::Reject(RejectionCode::InvalidField.as_str(), Some(id.clone()), true),
            )
        } else if roll < 92 {
            let mut r = request(Some(&id), &w, vec![code_step(&tag, 0)]);
            r["cwd"] = json!(format!("/nonexistent/chaos-{i}"));
            (
                serde_json::to_vec(&r).unwrap(),
                Expect::Reject(RejectionCode::CwdMissing.as_str(), Some(id.clone()), true),
            )
        } else if roll < 95 {
            mode = 0o622;
            let r = request(Some(&id), &w, vec![code_step(&tag, 0)]);
            (serde_json::to_vec(&r).unwrap(), Expect::Reject(RejectionCode::BadPermissions.as_str(), None, false))
        } else if roll < 97 {
            let r = request(Some(&id), &w, vec![code_step(&tag, 0)]);
            let bytes = serde_json::to_vec(&r).unwrap();
            specs.push(Spec {
                name: format!("bad name {i:03}"),
                bytes,
                mode,
                old_mtime,
                expect: Expect::Reject(RejectionCode::BadName.as_str(), None, false),
            });
            continue;
        } else {
            let r = request(Some("chaos-pre"), &w, vec![code_step(&tag, 0)]);
            (serde_json::to_vec(&r).unwrap(), Expect::Reject(RejectionCode::DuplicateRunId.as_str(), None, false))
        };
        specs.push(Spec { name, bytes: body, mode, old_mtime, expect });
    }
    specs
}

fn write_spec(spool: &Path, s: &Spec, k: usize) {
    let tmp = spool.join(format!(".chaos-tmp-{k}"));
    write_file_mode(&tmp, &s.bytes, s.mode);
    if s.old_mtime {
        set_mtime_ago(&tmp, 60);
    }
    fs::rename(&tmp, spool.join(format!("{}.json", s.name))).unwrap();
}

#[test]
fn chaos_500_requests_with_daemon_kills() {
    let mut env = TestEnv::with_config("max_running = 8\nretention_days = 30\n[watch]\nrescan_interval_s = 5\n");
    env.start_daemon();
    // A pre-existing run for the duplicate-run-id requests.
    let (_, pre_bytes) = env.submit(&request(Some("chaos-pre"), &env.work, vec![sh_step("pre", "exit 0")]));
    let pre = env.wait_terminal("chaos-pre");

    let mut rng = Rng::new(0x5eed_c0ffee_u64);
    let specs = build_specs(&env, &mut rng, 500);
    let n_valid = specs.iter().filter(|s| matches!(s.expect, Expect::Run(..))).count();
    let n_invalid = specs.len() - n_valid;
    eprintln!("chaos: {} valid, {} invalid requests", n_valid, n_invalid);

    // Drop everything from a writer thread while the main thread kills and restarts the daemon.
    let spool = env.spool();
    let payload: Vec<(String, Vec<u8>, u32, bool)> =
        specs.iter().map(|s| (s.name.clone(), s.bytes.clone(), s.mode, s.old_mtime)).collect();
    let writer = std::thread::spawn(move || {
        for (k, (name, bytes, mode, old)) in payload.iter().enumerate() {
            let s = Spec {
                name: name.clone(),
                bytes: bytes.clone(),
                mode: *mode,
                old_mtime: *old,
                expect: Expect::Run(None, "", 0),
            };
            write_spec(&spool, &s, k);
        }
    });
    let chaos_start = Instant::now();
    let mut kills = 0;
    // At least 12 kills; keep killing (up to 40) while there is work in flight, so the
    // kills land in claims, rejections, launches and terminal writes.
    while kills < 12 || (kills < 40 && (!env.pending_spool().is_empty() || !env.active_markers().is_empty())) {
        std::thread::sleep(Duration::from_millis(rng.range(50, 700)));
        env.kill9();
        kills += 1;
        std::thread::sleep(Duration::from_millis(rng.range(0, 300)));
        env.start_daemon();
    }
    writer.join().unwrap();
    eprintln!("chaos: {} kills in {:?}", kills, chaos_start.elapsed());

    // Let it settle.
    let valid_ids: Vec<String> = specs
        .iter()
        .filter_map(|s| match &s.expect {
            Expect::Run(Some(id), ..) => Some(id.clone()),
            _ => None,
        })
        .collect();
    let invalid_names: Vec<String> =
        specs.iter().filter(|s| matches!(s.expect, Expect::Reject(..))).map(|s| s.name.clone()).collect();
    let settle = Instant::now();
    let settled = poll_until(Duration::from_secs(150), || {
        env.pending_spool().is_empty()
            && env.active_markers().is_empty()
            && valid_ids.iter().all(|id| env.state(id).map(|s| is_terminal_state(&s)).unwrap_or(false))
            && invalid_names.iter().all(|n| env.rejected().join(format!("{n}.error.json")).exists())
    });
    if !settled {
        let not_done: Vec<String> = valid_ids
            .iter()
            .filter(|id| !env.state(id).map(|s| is_terminal_state(&s)).unwrap_or(false))
            .take(20)
            .map(|id| format!("{}={:?}", id, env.state(id)))
            .collect();
        let odd_dirs: Vec<String> = env
            .run_ids()
            .iter()
            .filter(|id| !env.state(id).map(|s| is_terminal_state(&s)).unwrap_or(false))
            .take(20)
            .map(|id| format!("{}: state {:?}, files {:?}", id, env.state(id), list_names(&env.run_dir(id))))
            .collect();
        panic!(
            "chaos did not settle in 150 s: spool {:?}, active {:?}, unfinished {:?}, non-terminal run dirs {:?}\n{}",
            env.pending_spool().iter().take(20).collect::<Vec<_>>(),
            env.active_markers().iter().take(20).collect::<Vec<_>>(),
            not_done,
            odd_dirs,
            env.log_tail(80)
        );
    }
    eprintln!("chaos: settled after {:?}", settle.elapsed());

    let mut problems: Vec<String> = vec![];

    // Rejections: exactly the invalid names, each once, with the right code.
    let rejected_names: BTreeSet<String> = list_names(&env.rejected())
        .into_iter()
        .filter(|n| !n.ends_with(".error.json") && !n.starts_with('.'))
        .collect();
    let want_rejected: BTreeSet<String> =
        specs.iter().filter(|s| matches!(s.expect, Expect::Reject(..))).map(|s| format!("{}.json", s.name)).collect();
    for extra in rejected_names.difference(&want_rejected) {
        problems.push(format!("unexpected rejected entry {extra}"));
    }
    for missing in want_rejected.difference(&rejected_names) {
        problems.push(format!("invalid request {missing} was not rejected"));
    }
    for s in &specs {
        if let Expect::Reject(code, id, must_run_dir) = &s.expect {
            match read_json(&env.rejected().join(format!("{}.error.json", s.name))) {
                None => problems.push(format!("{}: no error.json", s.name)),
                Some(e) => {
                    if e["code"].as_str() != Some(code) {
                        problems.push(format!("{}: code {} want {}", s.name, e["code"], code));
                    }
                    if e["file"].as_str() != Some(format!("{}.json", s.name).as_str()) {
                        problems.push(format!("{}: file {}", s.name, e["file"]));
                    }
                }
            }
            let entry = env.rejected().join(format!("{}.json", s.name));
            if entry.is_file() && file_bytes(&entry) != s.bytes {
                problems.push(format!("{}: rejected entry differs from what was written", s.name));
            }
            if let Some(id) = id {
                match env.state(id) {
                    Some(st) if st != "rejected" => problems.push(format!("{}: run {} in state {}", s.name, id, st)),
                    None if *must_run_dir => problems.push(format!("{}: no rejected run dir {}", s.name, id)),
                    _ => {}
                }
            }
        }
    }

    // Runs: every valid body is exactly one run with the right outcome.
    let mut by_bytes: HashMap<Vec<u8>, usize> = HashMap::new();
    for (k, s) in specs.iter().enumerate() {
        if matches!(s.expect, Expect::Run(..)) {
            by_bytes.insert(s.bytes.clone(), k);
        }
    }
    let mut found: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for id in env.run_ids() {
        let st = env.status(&id).unwrap_or(Value::Null);
        if st["state"] == "rejected" || id == "chaos-pre" {
            continue;
        }
        let rq = env.run_dir(&id).join("request.json");
        if !rq.is_file() {
            // a run dir without request.json is reported by the consistency check
            continue;
        }
        let bytes = file_bytes(&rq);
        match by_bytes.get(&bytes) {
            None => problems.push(format!("run {id} has a request.json matching no valid request")),
            Some(k) => found.entry(*k).or_default().push(id.clone()),
        }
        if env.event_types(&id).iter().any(|t| t == "subagent.run.repaired_stale") {
            problems.push(format!("run {id} was repaired as stale although no runner died"));
        }
    }
    for (k, s) in specs.iter().enumerate() {
        if let Expect::Run(rid, state, code) = &s.expect {
            let ids = found.get(&k).cloned().unwrap_or_default();
            if ids.len() != 1 {
                problems.push(format!("{} became {} runs: {:?}", s.name, ids.len(), ids));
                continue;
            }
            let id = &ids[0];
            if let Some(r) = rid {
                if r != id {
                    problems.push(format!("{}: run id {} want {}", s.name, id, r));
                }
            }
            let st = env.status(id).unwrap();
            if st["state"].as_str() != Some(state) || st["exitCode"].as_i64() != Some(*code) {
                problems.push(format!(
                    "{} (run {}): state {} exitCode {}, want {} {}; error {}",
                    s.name, id, st["state"], st["exitCode"], state, code, st["error"]
                ));
            }
        }
    }

    // The pre-existing run was not disturbed by the duplicates.
    assert_eq!(file_bytes(&env.run_dir("chaos-pre").join("request.json")), pre_bytes);
    let pre2 = env.status("chaos-pre").unwrap();
    if pre2["endedAt"] != pre["endedAt"] || pre2["state"] != pre["state"] {
        problems.push(format!("chaos-pre changed: {} -> {}", pre, pre2));
    }

    // Give the daemon's periodic rescan (5 s) a few rounds to tidy up, then judge the root.
    let mut cons = vec![];
    poll_until(Duration::from_secs(20), || {
        cons = consistency_errors(&env);
        cons.is_empty()
    });
    problems.extend(cons);
    if !problems.is_empty() {
        panic!(
            "chaos found {} problems:\n  {}\n{}",
            problems.len(),
            problems.iter().take(60).cloned().collect::<Vec<_>>().join("\n  "),
            env.log_tail(60)
        );
    }
}
