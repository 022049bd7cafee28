//! Every crash point, enumerated (issue 18; docs/crash-points.md).
//!
//! tests/it/chaos.rs kills the daemon at random moments; this test kills it at
//! each of its filesystem-changing calls in turn. A fixed workload (claims of
//! valid and invalid requests, a chain, a parallel group, a withdrawal, a stop,
//! an interrupt, a runner killed and repaired, `rm`, `clean`, retention and
//! completion hooks) runs once to count the calls the daemon makes, then once
//! per crash point N with the daemon SIGKILLed on entry to its Nth call; the
//! daemon is started again without the crash, everything settles, and the
//! on-disk invariants are checked. The runner role does the same to every
//! runner (each at its own Nth call) while the daemon is left alone.
//!
//! The mechanism is tests/crash_points/crashpoint.c, an LD_PRELOAD shim built
//! here with `cc`: it numbers the calls of one process (all threads) through
//! glibc's entry points, so it sees every mutation the binary makes, whichever
//! module makes it, without a line of the product changed. strace's
//! `inject=...:when=N` was the other candidate, but it counts per syscall and
//! per thread (not one sequence per process) and ptrace slows every call.
//!
//! `cargo test --test it crash_points::` runs an evenly spread sample of the
//! points, as many as fit in about two minutes per role; the full enumeration is
//! `RUNSPOOL_CRASH_ALL=1 cargo test --release --test it crash_points:: -- --nocapture`.
//! `RUNSPOOL_CRASH_POINTS=3,17` runs just those points (to replay a finding),
//! `RUNSPOOL_CRASH_STRIDE=k` every k-th; `RUNSPOOL_CRASH_KEEP_TRACE=FILE`
//! keeps the counting run's list of calls (FILE.daemon, FILE.runner).

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Which process is killed at its Nth call.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Daemon,
    Runner,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Daemon => "daemon",
            Role::Runner => "runner",
        }
    }
}

/// Time the sampled (CI) enumeration of one role may take, roughly.
const SAMPLE_BUDGET: Duration = Duration::from_secs(120);

const CONFIG_BASE: &str = "max_running = 8\nretention_days = 30\n[watch]\nrescan_interval_s = 1\n";

/// The shim, built once per test binary into cargo's scratch directory.
fn shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/crash_points/crashpoint.c");
        // Built under a name of this process, then renamed over the shared
        // one: a concurrent test binary never loads a half-written library.
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("crashpoint.so");
        let tmp = out.with_extension(format!("so.{}", std::process::id()));
        let o = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
            .arg(&tmp)
            .arg(&src)
            .arg("-ldl")
            .output()
            .unwrap_or_else(|e| panic!("cannot run `cc` to build {}: {e}; install a C compiler (gcc)", src.display()));
        assert!(o.status.success(), "building {} failed:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
        fs::rename(&tmp, &out).unwrap_or_else(|e| panic!("rename {} to {}: {e}", tmp.display(), out.display()));
        out
    })
}

// ---------------------------------------------------------------- workload

/// A step that records its start (run id and flat index) in the shared log,
/// then runs `rest`.
fn logged_step(work: &Path, id: &str, index: usize, rest: &str) -> Value {
    let log = work.join("steps.log");
    sh_step(&format!("a{index}"), &format!("echo '{id} {index}' >> '{}'; {rest}", log.display()))
}

fn gate(work: &Path) -> PathBuf {
    work.join("never-opened")
}

/// What a request ends as when nothing is killed.
#[derive(Clone, Debug)]
enum Want {
    /// A run: state, exit code, the flat step indexes that start.
    Run(&'static str, i64, Vec<usize>),
    /// A run that the workload removes (`rm`, `clean`) once it has ended.
    Removed(Vec<usize>),
    /// A rejection with this code, and whether a `rejected` run of this id exists.
    Rejected(&'static str, Option<&'static str>),
}

struct Req {
    name: &'static str,
    /// Run id (for runs; the rejected run's id for rejections that make one).
    id: &'static str,
    bytes: Vec<u8>,
    mode: u32,
    old_mtime: bool,
    want: Want,
}

fn req(name: &'static str, id: &'static str, body: &Value, want: Want) -> Req {
    Req { name, id, bytes: serde_json::to_vec_pretty(body).unwrap(), mode: 0o600, old_mtime: false, want }
}

/// The batch dropped at once after the withdrawal; `dup` comes later.
fn batch(work: &Path) -> Vec<Req> {
    let r = |id: &str, steps: Vec<Value>| request(Some(id), work, steps);
    let g = gate(work);
    let wait = gate_wait(&g);
    let mut v = vec![
        req(
            "s-ok",
            "s-ok",
            &r("s-ok", vec![logged_step(work, "s-ok", 0, "exit 0")]),
            Want::Run("complete", 0, vec![0]),
        ),
        req(
            "s-fail",
            "s-fail",
            &r("s-fail", vec![logged_step(work, "s-fail", 0, "exit 3")]),
            Want::Run("failed", 3, vec![0]),
        ),
        req(
            "chain-ok",
            "chain-ok",
            &r("chain-ok", (0..3).map(|i| logged_step(work, "chain-ok", i, "exit 0")).collect()),
            Want::Run("complete", 0, vec![0, 1, 2]),
        ),
        req(
            "chain-fail",
            "chain-fail",
            &r(
                "chain-fail",
                (0..3).map(|i| logged_step(work, "chain-fail", i, if i == 1 { "exit 5" } else { "exit 0" })).collect(),
            ),
            Want::Run("failed", 5, vec![0, 1]),
        ),
        req(
            "par-ok",
            "par-ok",
            &r("par-ok", vec![parallel((0..2).map(|i| logged_step(work, "par-ok", i, "exit 0")).collect(), None)]),
            Want::Run("complete", 0, vec![0, 1]),
        ),
        req(
            "l-stop",
            "l-stop",
            &r("l-stop", vec![logged_step(work, "l-stop", 0, &wait)]),
            Want::Run("stopped", 1, vec![0]),
        ),
        req(
            "k-kill",
            "k-kill",
            &r("k-kill", vec![logged_step(work, "k-kill", 0, &wait)]),
            Want::Run("failed", 1, vec![0]),
        ),
        req("i-int", "i-int", &r("i-int", vec![logged_step(work, "i-int", 0, &wait)]), Want::Removed(vec![0])),
        req("r-rm", "r-rm", &r("r-rm", vec![logged_step(work, "r-rm", 0, "exit 0")]), Want::Removed(vec![0])),
    ];
    // Invalid requests, one per kind of check.
    let mut bad_field = r("bad-field", vec![logged_step(work, "bad-field", 0, "exit 0")]);
    bad_field["tiemoutMs"] = json!(1000);
    v.push(req("bad-field", "bad-field", &bad_field, Want::Rejected("invalid-field", Some("bad-field"))));
    let mut no_cwd = r("no-cwd", vec![logged_step(work, "no-cwd", 0, "exit 0")]);
    no_cwd["cwd"] = json!("/nonexistent/crash-points");
    v.push(req("no-cwd", "no-cwd", &no_cwd, Want::Rejected("cwd-missing", Some("no-cwd"))));
    let mut json = req("bad-json", "", &json!(null), Want::Rejected("invalid-json", None));
    json.bytes = br#"{"version":1,"runId":"bad-json","steps":["#.to_vec();
    json.old_mtime = true;
    v.push(json);
    let mut perm = req(
        "bad-perm",
        "",
        &r("bad-perm", vec![logged_step(work, "bad-perm", 0, "exit 0")]),
        Want::Rejected("bad-permissions", None),
    );
    perm.mode = 0o622;
    v.push(perm);
    v.push(req(
        "bad name",
        "",
        &r("bad-name", vec![logged_step(work, "bad-name", 0, "exit 0")]),
        Want::Rejected("bad-name", None),
    ));
    v
}

fn withdrawn(work: &Path) -> Req {
    let body = request(Some("w-drawn"), work, vec![logged_step(work, "w-drawn", 0, "exit 0")]);
    req("w-drawn", "w-drawn", &body, Want::Rejected("withdrawn", Some("w-drawn")))
}

fn duplicate(work: &Path) -> Req {
    let body = request(Some("s-ok"), work, vec![logged_step(work, "dup", 0, "exit 0")]);
    req("dup", "", &body, Want::Rejected("duplicate-run-id", None))
}

fn drop_req(env: &TestEnv, r: &Req) {
    let tmp = env.spool().join(format!(".crash-{}", unique("req")));
    write_file_mode(&tmp, &r.bytes, r.mode);
    if r.old_mtime {
        set_mtime_ago(&tmp, 60);
    }
    fs::rename(&tmp, env.spool().join(format!("{}.json", r.name))).unwrap();
}

// ---------------------------------------------------------------- one point

/// One run of the workload with the crash at `at` (0: count only).
struct Point {
    role: Role,
    at: u64,
    trace: PathBuf,
    /// Whether the armed daemon died (daemon role) and was started again.
    crashed: bool,
    problems: Vec<String>,
}

impl Point {
    fn armed_env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), shim().display().to_string()),
            ("RUNSPOOL_CRASH_ROLE".into(), self.role.name().into()),
            ("RUNSPOOL_CRASH_AT".into(), self.at.to_string()),
            ("RUNSPOOL_CRASH_TRACE".into(), self.trace.display().to_string()),
        ]
    }

    /// Start the daemon with the shim; true once ready, false if it died first.
    fn start_armed(&mut self, env: &mut TestEnv) -> bool {
        env.extra_env = self.armed_env();
        env.start_daemon_nowait();
        let pid = env.daemon_pid().unwrap();
        let ready = poll_until(LONG, || {
            read_json(&env.daemon_json()).is_some_and(|d| d["pid"].as_i64() == Some(pid)) || !self.armed_alive(env)
        });
        if !ready {
            self.problems.push(format!("the armed daemon was not ready after {LONG:?}"));
        }
        self.armed_alive(env)
    }

    /// Is the armed daemon still running? When it has died, note it and start
    /// a clean one (the daemon role's crash; for the runner role, a violation).
    fn armed_alive(&mut self, env: &mut TestEnv) -> bool {
        if env.child.is_none() {
            return false;
        }
        match env.daemon_exited() {
            None => true,
            Some(st) => {
                if self.role == Role::Runner || self.at == 0 {
                    self.problems.push(format!("the daemon exited ({st:?}) without being killed by the shim"));
                }
                self.crashed = true;
                env.extra_env.clear();
                env.start_daemon();
                false
            }
        }
    }

    /// Wait until `cond`, starting the daemon again if the crash takes it down.
    fn wait(&mut self, env: &mut TestEnv, what: &str, mut cond: impl FnMut(&TestEnv) -> bool) -> bool {
        let deadline = Instant::now() + LONG;
        loop {
            if cond(env) {
                return true;
            }
            self.armed_alive(env);
            if Instant::now() > deadline {
                self.problems.push(format!("liveness: {what} did not happen within {LONG:?}"));
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The kill line of the shim's trace: which call the process died on.
    fn kills(&self) -> Vec<String> {
        fs::read_to_string(&self.trace)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("kill "))
            .map(str::to_string)
            .collect()
    }
}

fn started(env: &TestEnv, id: &str) -> bool {
    step_lines(env).iter().any(|(r, _)| r == id)
}

fn terminal(env: &TestEnv, id: &str) -> bool {
    env.state(id).is_some_and(|s| is_terminal_state(&s))
}

fn step_lines(env: &TestEnv) -> Vec<(String, usize)> {
    fs::read_to_string(env.work.join("steps.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (id, i) = l.split_once(' ')?;
            Some((id.to_string(), i.parse().ok()?))
        })
        .collect()
}

fn hook_lines(env: &TestEnv) -> Vec<String> {
    fs::read_to_string(env.work.join("hooks.log")).unwrap_or_default().lines().map(str::to_string).collect()
}

/// The runner of `id`, when its status names a live runspool runner for it.
fn runner_pid(env: &TestEnv, id: &str) -> Option<i64> {
    let st = env.status(id)?;
    let pid = st["runner"]["pid"].as_i64().or(st["pid"].as_i64())?;
    let cmd = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let needle = env.run_dir(id);
    let needle = needle.to_str()?.as_bytes();
    (process_alive(pid) && cmd.windows(needle.len()).any(|w| w == needle)).then_some(pid)
}

/// Run `args` (`rm`, `clean`) until the run `id` is gone: both leave a run
/// alone while its runner still holds its lock (finishing its last writes).
fn remove_when_done(p: &mut Point, env: &mut TestEnv, args: &[&str], id: &str) {
    let mut last = None;
    p.wait(env, &format!("`runspool {}` removes {id}", args.join(" ")), |e| {
        if !e.run_dir(id).exists() {
            return true;
        }
        // Tried as soon as the run may have ended: a removal racing the
        // daemon's publication of the run must win cleanly.
        last = Some(e.cli(args));
        !e.run_dir(id).exists()
    });
    if env.run_dir(id).exists() {
        if let Some(o) = last {
            p.problems.push(format!("`runspool {}` last said: {}", args.join(" "), describe(&o)));
        }
    }
}

fn run_point(role: Role, at: u64) -> Point {
    let mut env = TestEnv::with_config(CONFIG_BASE);
    let w = env.work.display().to_string();
    env.write_config(&format!(
        "{CONFIG_BASE}[hooks]\non_complete = [\"sh\", \"-c\", \"echo \\\"$RUNSPOOL_RUN_ID\\\" >> '{w}/hooks.log'\"]\n\
         on_failure = [\"sh\", \"-c\", \"echo \\\"$RUNSPOOL_RUN_ID\\\" >> '{w}/hooks.log'\"]\n"
    ));
    // Outside the root's temporary directory, which goes with `env`.
    let trace = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{}.trace", unique(role.name())));
    let mut p = Point { role, at, trace, crashed: false, problems: vec![] };
    let work = env.work.clone();

    // Before the daemon: an expired run for retention, a paused queue and a
    // request to withdraw while the queue is paused.
    let day = 86_400_000i64;
    env.fabricate_terminal_run("old-done", "default", now_ms() - 40 * day, "complete");
    env.fabricate_result("old-done");
    let o = env.cli(&["pause", "--reason", "crash points"]);
    assert!(o.status.success(), "runspool pause: {}", describe(&o));
    let w_req = withdrawn(&work);
    drop_req(&env, &w_req);

    p.start_armed(&mut env);
    let o = env.cli(&["stop", "w-drawn", "--reason", "crash points"]);
    if !o.status.success() {
        p.problems
            .push(format!("`runspool stop w-drawn` of a pending request in a paused queue failed: {}", describe(&o)));
    }
    let o = env.cli(&["resume"]);
    assert!(o.status.success(), "runspool resume: {}", describe(&o));

    let mut reqs = batch(&work);
    for r in &reqs {
        drop_req(&env, r);
    }
    // A duplicate of a run id that exists by then.
    if p.wait(&mut env, "s-ok ends", |e| terminal(e, "s-ok")) {
        let d = duplicate(&work);
        drop_req(&env, &d);
        reqs.push(d);
    }
    reqs.push(w_req);

    // A stop of a running run.
    if p.wait(&mut env, "l-stop starts its step", |e| started(e, "l-stop") || terminal(e, "l-stop")) {
        env.cli(&["stop", "l-stop", "--reason", "crash points"]);
    }
    // A runner killed under its run: the daemon repairs the run.
    if p.wait(&mut env, "k-kill starts its step", |e| started(e, "k-kill") || terminal(e, "k-kill")) {
        let mut pid = None;
        p.wait(&mut env, "k-kill's runner is known", |e| {
            pid = runner_pid(e, "k-kill");
            pid.is_some() || terminal(e, "k-kill")
        });
        if let Some(pid) = pid {
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
    // An interrupt, then `clean --state paused`.
    if p.wait(&mut env, "i-int starts its step", |e| started(e, "i-int") || terminal(e, "i-int")) {
        env.cli(&["stop", "--interrupt", "i-int"]);
        if p.wait(&mut env, "i-int ends", |e| terminal(e, "i-int")) && env.state("i-int").as_deref() == Some("paused") {
            remove_when_done(&mut p, &mut env, &["clean", "--state", "paused"], "i-int");
        }
    }
    // `rm` of a finished run.
    if p.wait(&mut env, "r-rm ends", |e| terminal(e, "r-rm")) {
        remove_when_done(&mut p, &mut env, &["rm", "r-rm"], "r-rm");
    }

    // Restart without the shim: the recovery path on whatever the workload
    // (and the crash) left, then let everything settle.
    p.armed_alive(&mut env);
    env.extra_env.clear();
    env.restart();
    settle_and_check(&env, &reqs, &mut p);
    if !p.problems.is_empty() && std::env::var("RUNSPOOL_TEST_KEEP").is_ok() {
        let keep = env.tmp.path().to_path_buf();
        std::mem::forget(std::mem::replace(&mut env.tmp, tempfile::tempdir().unwrap()));
        p.problems.push(format!("kept the root under {}", keep.display()));
    }
    p
}

// ---------------------------------------------------------------- invariants

fn settle_and_check(env: &TestEnv, reqs: &[Req], p: &mut Point) {
    let runs: Vec<&Req> = reqs.iter().filter(|r| matches!(r.want, Want::Run(..))).collect();
    let hooks_dirs = [env.root.join("runspool/hooks-pending"), env.root.join("runspool/hooks-running")];
    let settled = poll_until(LONG, || {
        env.pending_spool().is_empty()
            && env.active_markers().is_empty()
            && runs.iter().all(|r| terminal(env, r.id) && env.result_path(r.id).exists())
            && hooks_dirs.iter().all(|d| list_names(d).iter().all(|n| n.starts_with('.')))
    });
    if !settled {
        p.problems.push(format!(
            "did not settle within {LONG:?}: spool {:?}, active {:?}, hooks owed {:?}, runs {:?}",
            env.pending_spool(),
            env.active_markers(),
            hooks_dirs.iter().map(|d| list_names(d)).collect::<Vec<_>>(),
            runs.iter().map(|r| format!("{}={:?}", r.id, env.state(r.id))).collect::<Vec<_>>()
        ));
    }
    // The indexes and results follow the statuses: give them a moment.
    let mut errors = vec![];
    poll_until(Duration::from_secs(10), || {
        errors = consistency_errors(env);
        errors.is_empty()
    });
    // A run removed by rm/clean is never published again (the publication
    // runs under the run's status lock, only while its status exists).
    p.problems.extend(errors);

    // A repair is its status (the error names the dead runner) and its
    // event; an event lost with a daemon killed between the two is written
    // at the next start (supervisor/repair.rs `ensure_repaired_event`).
    let repaired = |id: &str| {
        env.event_types(id).iter().any(|t| t == "subagent.run.repaired_stale")
            && env.status(id).is_some_and(|s| {
                s["error"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("runner process ") && e.contains("exited before recording"))
            })
    };
    let lines = step_lines(env);
    let mut seen: BTreeMap<(String, usize), usize> = BTreeMap::new();
    for l in &lines {
        *seen.entry(l.clone()).or_default() += 1;
    }
    for ((id, i), n) in &seen {
        if *n > 1 {
            p.problems.push(format!("step {i} of {id} started {n} times"));
        }
    }
    let ran = |id: &str| -> BTreeSet<usize> { lines.iter().filter(|(r, _)| r == id).map(|(_, i)| *i).collect() };

    // Each request is exactly one of: a run, a rejected entry, withdrawn
    // (a rejected entry too); and it is the expected one.
    let rejected: Vec<String> = list_names(&env.rejected()).into_iter().filter(|n| !n.starts_with('.')).collect();
    let mut claimed_dirs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for id in env.run_ids() {
        let rq = env.run_dir(&id).join("request.json");
        if let Ok(b) = fs::read(&rq) {
            claimed_dirs.insert(id, b);
        }
    }
    for r in reqs {
        let as_runs: Vec<&String> = claimed_dirs.iter().filter(|(_, b)| **b == r.bytes).map(|(id, _)| id).collect();
        let entries: Vec<&String> = rejected
            .iter()
            .filter(|n| {
                !n.ends_with(".error.json") && rejected_entry_of(n, r.name) && env.rejected().join(n.as_str()).is_file()
            })
            .filter(|n| fs::read(env.rejected().join(n.as_str())).ok().as_deref() == Some(r.bytes.as_slice()))
            .collect();
        let what = format!("request {}.json", r.name);
        match &r.want {
            Want::Run(state, code, steps) => {
                if as_runs.len() != 1 || !entries.is_empty() {
                    p.problems.push(format!("{what} became runs {as_runs:?} and rejected entries {entries:?}"));
                    continue;
                }
                if as_runs[0] != r.id {
                    p.problems.push(format!("{what} became run {} (want {})", as_runs[0], r.id));
                }
                let st = env.status(r.id).unwrap_or(Value::Null);
                let exact = st["state"] == *state && st["exitCode"] == *code;
                let want_steps: BTreeSet<usize> = steps.iter().copied().collect();
                // The runner role (and the workload's own kill of k-kill's runner)
                // may end a run `failed` by repair, after fewer steps.
                let may_repair = role_may_kill_runners(p.role) || r.id == "k-kill";
                if r.id == "k-kill" || (!exact && may_repair) {
                    if (st["state"] != "failed" || !repaired(r.id)) && !exact {
                        p.problems.push(format!(
                            "run {}: state {} exitCode {} error {}, want {state} {code} or failed by repair",
                            r.id, st["state"], st["exitCode"], st["error"]
                        ));
                    }
                    if !ran(r.id).is_subset(&want_steps) {
                        p.problems.push(format!(
                            "run {}: steps {:?} started, want a subset of {want_steps:?}",
                            r.id,
                            ran(r.id)
                        ));
                    }
                } else if !exact {
                    p.problems.push(format!(
                        "run {}: state {} exitCode {} error {}, want {state} {code}",
                        r.id, st["state"], st["exitCode"], st["error"]
                    ));
                } else if !may_repair && ran(r.id) != want_steps {
                    p.problems.push(format!("run {}: steps {:?} started, want {want_steps:?}", r.id, ran(r.id)));
                }
            }
            Want::Removed(steps) => {
                let want_steps: BTreeSet<usize> = steps.iter().copied().collect();
                if !entries.is_empty() || as_runs.len() > 1 {
                    p.problems.push(format!("{what} became runs {as_runs:?} and rejected entries {entries:?}"));
                }
                // `clean --state paused` leaves an i-int that a runner kill ended `failed`.
                let kept_failed = role_may_kill_runners(p.role)
                    && env.status(r.id).is_some_and(|s| s["state"] == "failed" && repaired(r.id));
                if !kept_failed {
                    if env.run_dir(r.id).exists() || env.result_path(r.id).exists() {
                        p.problems.push(format!("run {} was removed but its directory or result is still there", r.id));
                    }
                    if env.terminal_markers().iter().any(|(_, _, c)| c["runId"] == r.id) {
                        p.problems.push(format!("run {} was removed but its terminal marker is still there", r.id));
                    }
                }
                if !ran(r.id).is_subset(&want_steps) {
                    p.problems.push(format!(
                        "run {}: steps {:?} started, want a subset of {want_steps:?}",
                        r.id,
                        ran(r.id)
                    ));
                }
            }
            Want::Rejected(code, run) => {
                if !as_runs.is_empty() || entries.len() != 1 {
                    p.problems.push(format!("{what} became runs {as_runs:?} and rejected entries {entries:?}"));
                    continue;
                }
                let err_name = format!("{}.error.json", entries[0].strip_suffix(".json").unwrap());
                match read_json(&env.rejected().join(&err_name)) {
                    None => p.problems.push(format!("{what}: rejected without a parsable {err_name}")),
                    Some(e) if e["code"] != *code => {
                        p.problems.push(format!("{what}: rejected with code {} want {code}", e["code"]))
                    }
                    _ => {}
                }
                if let Some(id) = run {
                    if env.state(id).as_deref() != Some("rejected") {
                        p.problems.push(format!("{what}: run {id} is {:?}, want rejected", env.state(id)));
                    }
                }
                if !ran(r.id).is_empty() && !r.id.is_empty() {
                    p.problems.push(format!("{what} was rejected but its steps started"));
                }
            }
        }
    }
    // Nothing else: no run directory, rejected entry or step of a request not written.
    let known: BTreeSet<&str> = reqs.iter().map(|r| r.id).filter(|i| !i.is_empty()).collect();
    for id in env.run_ids() {
        if !known.contains(id.as_str()) {
            p.problems.push(format!("unexpected run directory {id}"));
        }
    }
    for n in &rejected {
        let base = n.strip_suffix(".error.json").or(n.strip_suffix(".json")).unwrap_or(n);
        if !reqs.iter().any(|r| rejected_entry_of(&format!("{base}.json"), r.name)) {
            p.problems.push(format!("unexpected entry rejected/{n}"));
        }
    }
    for (id, _) in seen.keys() {
        if !known.contains(id.as_str()) || id == "w-drawn" {
            p.problems.push(format!("steps of {id} started, which never was a run"));
        }
    }
    // Retention removed the expired run, and no removal was left half done.
    if env.run_dir("old-done").exists() || env.result_path("old-done").exists() {
        p.problems.push("retention: the 40-day-old run old-done or its result is still there".into());
    }
    for n in list_names(&env.runs()) {
        if n.starts_with(".deleting-run-") || n.starts_with(".runspool-deleting-") || n.starts_with(".runspool-staging")
        {
            p.problems.push(format!("leftover {n} in the runs root"));
        }
    }
    // Hooks: at most once per run, and every run that ended has its record.
    let hooks = hook_lines(env);
    let mut fired: BTreeMap<&str, usize> = BTreeMap::new();
    for h in &hooks {
        *fired.entry(h.as_str()).or_default() += 1;
    }
    for (id, n) in &fired {
        if *n > 1 {
            p.problems.push(format!("hook of {id} fired {n} times"));
        }
    }
    for r in &runs {
        let s = env.state(r.id).unwrap_or_default();
        if is_terminal_state(&s) && !env.run_dir(r.id).join("hook.json").exists() {
            p.problems.push(format!("run {} ended {s} and has no hook.json", r.id));
        }
    }
}

fn role_may_kill_runners(role: Role) -> bool {
    role == Role::Runner
}

/// Is `entry` (a name in rejected/) the rejected copy of the request `name`
/// (`<name>.json`, or `<name>-<k>.json` when that was taken)?
fn rejected_entry_of(entry: &str, name: &str) -> bool {
    let Some(stem) = entry.strip_suffix(".json") else { return false };
    stem == name || stem.strip_prefix(name).and_then(|t| t.strip_prefix('-')).is_some_and(|k| k.parse::<u32>().is_ok())
}

// ---------------------------------------------------------------- driver

/// How many calls the role makes over one workload (the most of any one
/// process of that role), and a sample line per call for the report.
fn count(role: Role) -> (u64, Point) {
    let p = run_point(role, 0);
    let text = fs::read_to_string(&p.trace).unwrap_or_default();
    let _ = fs::remove_file(&p.trace);
    let mut per_pid: BTreeMap<String, u64> = BTreeMap::new();
    let mut per_call: BTreeMap<String, u64> = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with("count ")) {
        let mut f = l.split(' ').skip(1);
        *per_pid.entry(f.next().unwrap_or("").to_string()).or_default() += 1;
        *per_call.entry(f.nth(1).unwrap_or("").to_string()).or_default() += 1;
    }
    report(&format!("crash points ({}): calls by kind over {} processes: {per_call:?}", role.name(), per_pid.len()));
    if let Ok(keep) = std::env::var("RUNSPOOL_CRASH_KEEP_TRACE") {
        let _ = fs::write(format!("{keep}.{}", role.name()), &text);
    }
    (per_pid.values().copied().max().unwrap_or(0), p)
}

fn enumerate(role: Role) {
    let started_at = Instant::now();
    let (total, baseline) = count(role);
    assert!(
        baseline.problems.is_empty(),
        "the workload fails with no crash at all:\n  {}",
        baseline.problems.join("\n  ")
    );
    assert!(total > 0, "the shim counted no call of the {} (is LD_PRELOAD honoured?)", role.name());
    let one = started_at.elapsed();
    // Counts vary a little from run to run (timers, rescans): a margin past
    // the counted end covers points that only a slower run reaches.
    let end = total + total / 10 + 1;
    // Every point, in an order that spreads any prefix evenly over 1..=end
    // (1, then the middle, then the quarters, ...): a run cut short by the
    // time budget has still sampled the whole workload.
    let all = std::env::var("RUNSPOOL_CRASH_ALL").is_ok();
    let points: Vec<u64> = if let Ok(list) = std::env::var("RUNSPOOL_CRASH_POINTS") {
        list.split(',').filter_map(|s| s.trim().parse().ok()).collect()
    } else {
        let stride = std::env::var("RUNSPOOL_CRASH_STRIDE")
            .map(|k| k.parse::<u64>().expect("RUNSPOOL_CRASH_STRIDE is a whole number"))
            .unwrap_or(1)
            .max(1);
        spread((1..=end).filter(|n| (n - 1) % stride == 0).collect())
    };
    let budget = (!all && std::env::var("RUNSPOOL_CRASH_POINTS").is_err()).then_some(SAMPLE_BUDGET);
    report(&format!(
        "crash points ({}): {total} calls counted in one workload ({one:?}); {} points of 1..={end} to run{}",
        role.name(),
        points.len(),
        budget.map(|b| format!(", for at most {b:?} (RUNSPOOL_CRASH_ALL=1 runs them all)")).unwrap_or_default()
    ));
    let mut violations = vec![];
    let mut crashed = 0;
    let mut ran = 0;
    for &n in &points {
        if budget.is_some_and(|b| started_at.elapsed() > b) {
            break;
        }
        ran += 1;
        let p = run_point(role, n);
        let kills = p.kills();
        let _ = fs::remove_file(&p.trace);
        if !kills.is_empty() {
            crashed += 1;
        }
        if !p.problems.is_empty() {
            let at = if kills.is_empty() { "no call reached".to_string() } else { kills.join("; ") };
            report(&format!("crash point {} N={n} ({at}): {} problems", role.name(), p.problems.len()));
            violations.push(format!("N={n} killed at {at}:\n    {}", p.problems.join("\n    ")));
        }
    }
    report(&format!(
        "crash points ({}): {ran} of {} points run, {crashed} of them killed a process, {} with violations, in {:?}",
        role.name(),
        points.len(),
        violations.len(),
        started_at.elapsed()
    ));
    assert!(
        violations.is_empty(),
        "{} crash points broke an invariant:\n  {}",
        violations.len(),
        violations.join("\n  ")
    );
}

/// `v` reordered so that every prefix is spread evenly over it: by the
/// bit-reversed index (van der Corput order).
fn spread(v: Vec<u64>) -> Vec<u64> {
    let bits = usize::BITS - v.len().max(1).leading_zeros();
    let mut keyed: Vec<(usize, u64)> =
        v.iter().enumerate().map(|(i, n)| (i.reverse_bits() >> (usize::BITS - bits), *n)).collect();
    keyed.sort();
    keyed.into_iter().map(|(_, n)| n).collect()
}

#[test]
fn spread_orders_a_prefix_evenly() {
    assert_eq!(spread((1..=8).collect()), vec![1, 5, 3, 7, 2, 6, 4, 8]);
    let v = spread((1..=555).collect());
    let mut sorted = v.clone();
    sorted.sort();
    assert_eq!(sorted, (1..=555).collect::<Vec<u64>>(), "every point once");
    let mut head: Vec<u64> = v[..16].to_vec();
    head.sort();
    assert!(head.windows(2).all(|w| w[1] - w[0] <= 64), "the first 16 cover 1..=555 evenly: {head:?}");
}

#[test]
fn every_daemon_crash_point_recovers() {
    enumerate(Role::Daemon);
}

#[test]
fn every_runner_crash_point_is_repaired() {
    enumerate(Role::Runner);
}

/// Found by the enumeration: a daemon killed while writing a hook record
/// left its temp in `runspool/hooks-running/` for ever, since the start-up
/// sweep of temps did not look there.
#[test]
fn temps_of_a_killed_daemon_in_its_own_directories_are_swept_at_start() {
    let mut env = TestEnv::new();
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let temps: Vec<PathBuf> = ["hooks-pending", "hooks-running", "recent-cache"]
        .iter()
        .map(|d| {
            let dir = env.root.join("runspool").join(d);
            mkdir_0700(&dir);
            let t = dir.join(format!(".some-run.{dead}.{}.0badc0de.tmp", now_ms()));
            write_file_mode(&t, b"{", 0o600);
            t
        })
        .collect();
    env.start_daemon();
    for t in &temps {
        wait_until(LONG, &format!("{} removed at start", t.display()), || !t.exists());
    }
    env.check_consistency();
}

/// Found by the enumeration: a request under a bad name whose body carries a
/// run id is refused without a run (its body is never read), but a daemon
/// started soon after used to create a `rejected` run for it while finishing
/// cut-short rejections, so the outcome depended on a restart.
#[test]
fn a_bad_name_never_gets_a_rejected_run_not_even_after_a_restart() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let body = request(Some("bn-run"), &env.work, vec![cmd_step("a", &["true"])]);
    env.drop_request("bad name", &body);
    assert_eq!(env.wait_rejection("bad name")["code"], "bad-name");
    assert_eq!(env.state("bn-run"), None, "a bad name is refused before its body is read");
    env.restart();
    let later = request(Some("after-restart"), &env.work, vec![cmd_step("a", &["true"])]);
    env.submit(&later);
    env.wait_terminal("after-restart");
    assert_eq!(env.state("bn-run"), None, "the restart made a run of the refused request");
    env.check_consistency();
}

/// Found by the enumeration: a daemon killed between writing a run's
/// hook.json under a temp name and renaming it into place left
/// `.hook.json.<pid>.tmp` for good (a name the sweep of temps did not know).
#[test]
fn a_daemon_killed_while_creating_hook_json_leaves_no_temp() {
    let mut env = TestEnv::new();
    let w = env.work.display().to_string();
    env.write_config(&format!(
        "{DEFAULT_CONFIG}[hooks]\non_complete = [\"sh\", \"-c\", \"echo \\\"$RUNSPOOL_RUN_ID\\\" >> '{w}/hooks.log'\"]\n"
    ));
    let trace = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{}.trace", unique("hook-temp")));
    env.extra_env = vec![
        ("LD_PRELOAD".into(), shim().display().to_string()),
        ("RUNSPOOL_CRASH_ROLE".into(), "daemon".into()),
        ("RUNSPOOL_CRASH_AT".into(), "1".into()),
        ("RUNSPOOL_CRASH_MATCH".into(), "renameat2:.hook.json.".into()),
        ("RUNSPOOL_CRASH_TRACE".into(), trace.display().to_string()),
    ];
    env.start_daemon();
    env.submit(&request(Some("hooked"), &env.work, vec![cmd_step("a", &["true"])]));
    env.wait_terminal("hooked");
    env.wait_daemon_exit();
    let kill = fs::read_to_string(&trace).unwrap_or_default();
    let _ = fs::remove_file(&trace);
    assert!(kill.contains("renameat2") && kill.contains("hooked"), "killed elsewhere: {kill}");
    env.extra_env.clear();
    env.start_daemon();
    env.check_consistency();
    // The restarted daemon fires the owed hook on a turn of its loop, which
    // may come after the root is already consistent (a loaded machine).
    let record = env.run_dir("hooked").join("hook.json");
    wait_until(LONG, "hook.json created by the restarted daemon", || record.exists());
}

/// Found by the enumeration (runner role): a runner killed while publishing
/// its terminal marker stays a zombie while nobody reaps it (its daemon was
/// killed too), and the start-up sweep took the zombie for a live writer and
/// kept its temp for good.
#[test]
fn a_temp_of_a_zombie_writer_is_swept_at_start() {
    let mut env = TestEnv::new();
    let mut zombie = Command::new("true").spawn().unwrap();
    let pid = zombie.id();
    wait_until(LONG, "the child to exit unreaped", || {
        fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
    });
    let sdir = env.terminal_dir().join("default");
    mkdir_0700(&sdir);
    let temp = sdir.join(format!(".0000000000000001-gone.json.{pid}.{}.0badc0de.tmp", now_ms()));
    write_file_mode(&temp, b"{", 0o600);
    env.start_daemon();
    wait_until(LONG, &format!("{} removed at start", temp.display()), || !temp.exists());
    zombie.wait().unwrap();
    env.check_consistency();
}
