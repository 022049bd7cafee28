//! The built-in `slurm` provider against a real single-node Slurm cluster,
//! started by scripts/slurm-dev-cluster.sh in a directory of this test
//! binary's own under the temp dir (one cluster per test binary, stopped and
//! its directory removed at exit). Clients, and the daemons the tests start,
//! find it only through SLURM_CONF. Needs root; skips otherwise.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm-dev-cluster.sh")
}

fn run_script(cmd: &str, dir: &Path) -> Output {
    Command::new("bash").arg(script()).arg(cmd).arg(dir).output().expect("run slurm-dev-cluster.sh")
}

/// A directory for a cluster, not yet created (the script makes it; `down` removes it).
fn fresh_cluster_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(unique(&format!("runspool-slurm-{tag}")))
}

/// The shared cluster's directory, chosen at the first `cluster()` call.
static CLUSTER_DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn cluster_down() {
    if let Some(dir) = CLUSTER_DIR.get() {
        let _ = run_script("down", dir);
    }
}

/// SLURM_CONF of the shared cluster, or None (with a message) when the tests must skip.
fn cluster() -> Option<String> {
    if !is_root() {
        eprintln!(
            "SKIPPED: the Slurm tests start a single-node cluster with scripts/slurm-dev-cluster.sh, which needs root"
        );
        return None;
    }
    static CONF: OnceLock<String> = OnceLock::new();
    Some(
        CONF.get_or_init(|| {
            // The exit hook is registered before `up`, so a half-started cluster is stopped too.
            let dir = CLUSTER_DIR
                .get_or_init(|| {
                    unsafe {
                        libc::atexit(cluster_down);
                    }
                    fresh_cluster_dir("dev")
                })
                .clone();
            let out = run_script("up", &dir);
            assert!(out.status.success(), "slurm-dev-cluster.sh up {} failed:\n{}", dir.display(), describe(&out));
            dir.join("etc/slurm.conf").to_str().unwrap().to_string()
        })
        .clone(),
    )
}

fn slurm_cmd(conf: &str, bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).env("SLURM_CONF", conf).output().unwrap();
    assert!(out.status.success(), "{bin} {args:?}: {}", describe(&out));
    stdout_str(&out)
}

/// (job id, state) of every job Slurm still knows with this name.
fn jobs_named(conf: &str, name: &str) -> Vec<(String, String)> {
    slurm_cmd(conf, "squeue", &["-h", "-t", "all", "--name", name, "-o", "%i|%T"])
        .lines()
        .filter_map(|l| l.split_once('|').map(|(a, b)| (a.to_string(), b.to_string())))
        .collect()
}

const CONFIG: &str = "[providers.slurm]\ntype = \"slurm\"\ntimeout_ms = 60000\n";

fn slurm_env(conf: &str) -> (TestEnv, Vec<(&'static str, String)>) {
    let mut env = TestEnv::new();
    env.write_config(&format!("{DEFAULT_CONFIG}{CONFIG}"));
    let vars = vec![("SLURM_CONF", conf.to_string())];
    env.start_daemon_env(&vars);
    (env, vars)
}

fn slurm_step(prompt: &str, options: Value) -> Value {
    json!({"agent": "hpc", "externalJob": {"provider": "slurm", "prompt": prompt, "options": options}})
}

fn unique_id(prefix: &str) -> String {
    unique(prefix).replace('_', "-")
}

#[test]
fn chain_with_a_slurm_middle_step_completes() {
    let Some(conf) = cluster() else { return };
    let (env, _) = slurm_env(&conf);
    let id = unique_id("slurm-chain");
    let req = request(
        Some(&id),
        &env.work,
        vec![
            sh_step("prepare", "echo prepared"),
            slurm_step(
                "#!/bin/sh\necho slurm-job-output-$SLURM_JOB_ID\necho in=$(pwd)\n",
                json!({"partition": "debug", "cpus": 1, "timeLimit": "00:05:00"}),
            ),
            sh_step("consume", "echo previous=$RUNSPOOL_PREVIOUS_OUTPUT; cat \"$RUNSPOOL_PREVIOUS_OUTPUT\""),
        ],
    );
    env.submit(&req);
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "complete", "{st:#}\n{}", env.output_log(&id, 1));
    let ej = &st["steps"][1]["externalJob"];
    assert_eq!(ej["state"], "completed");
    let job = ej["providerJobId"].as_str().unwrap().to_string();
    let out_file = env.run_dir(&id).join(format!("slurm-{job}.out"));
    assert_eq!(ej["resultArtifactPath"].as_str(), Some(out_file.to_str().unwrap()));
    assert_eq!(st["steps"][1]["outputFile"].as_str(), Some(out_file.to_str().unwrap()));
    // The batch script is kept in the run directory; the job ran in the step's cwd.
    assert!(env.run_dir(&id).join("external-job-1.sbatch").is_file());
    let consume = env.output_log(&id, 2);
    assert!(consume.contains(&format!("slurm-job-output-{job}")), "{consume}");
    assert!(consume.contains(&format!("in={}", env.work.display())), "{consume}");
    wait_until(LONG, "the result file", || env.result(&id).is_some());
    let res = env.result(&id).unwrap();
    assert!(res["summary"].as_str().unwrap().contains(&format!("slurm-job-output-{job}")), "{res}");
    let jobs = jobs_named(&conf, &format!("runspool-{id}-1"));
    assert_eq!(jobs, vec![(job, "COMPLETED".to_string())]);
    env.check_consistency();
}

#[test]
fn failing_slurm_job_names_the_slurm_state() {
    let Some(conf) = cluster() else { return };
    let (env, _) = slurm_env(&conf);
    let id = unique_id("slurm-fail");
    env.submit(&request(Some(&id), &env.work, vec![slurm_step("#!/bin/sh\necho about-to-fail\nexit 3\n", json!({}))]));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(err.contains("state FAILED") && err.contains("exit code 3:0"), "{err}");
    assert_eq!(st["steps"][0]["externalJob"]["failureCode"], "slurm-failed");
    let out = fs::read_to_string(st["steps"][0]["outputFile"].as_str().unwrap()).unwrap();
    assert!(out.contains("about-to-fail"), "{out}");
    env.check_consistency();
}

#[test]
fn stopping_a_run_cancels_its_running_slurm_job() {
    let Some(conf) = cluster() else { return };
    let (env, _) = slurm_env(&conf);
    let id = unique_id("slurm-stop");
    env.submit(&request(Some(&id), &env.work, vec![slurm_step("#!/bin/sh\necho started\nsleep 600\n", json!({}))]));
    wait_until(LONG, "the Slurm job to run", || {
        env.status(&id).is_some_and(|s| s["steps"][0]["externalJob"]["state"] == "running")
    });
    let job = env.status(&id).unwrap()["steps"][0]["externalJob"]["providerJobId"].as_str().unwrap().to_string();
    let out = env.cli(&["stop", &id]);
    assert!(out.status.success(), "{}", describe(&out));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "stopped", "{st:#}");
    assert_eq!(st["steps"][0]["status"], "stopped");
    let name = format!("runspool-{id}-0");
    wait_until(LONG, "the job to end CANCELLED", || {
        jobs_named(&conf, &name) == vec![(job.clone(), "CANCELLED".to_string())]
    });
    env.check_consistency();
}

#[test]
fn unknown_slurm_option_is_refused_without_submitting() {
    let Some(conf) = cluster() else { return };
    let (env, _) = slurm_env(&conf);
    let id = unique_id("slurm-opt");
    env.submit(&request(Some(&id), &env.work, vec![slurm_step("#!/bin/sh\necho x\n", json!({"gpus": 2}))]));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(err.starts_with("invalid-option: ") && err.contains("externalJob.options.gpus"), "{err}");
    assert!(jobs_named(&conf, &format!("runspool-{id}-0")).is_empty());
    // The daemon keeps serving.
    let ok = unique_id("slurm-opt-after");
    env.submit(&request(Some(&ok), &env.work, vec![sh_step("a", "true")]));
    assert_eq!(env.wait_terminal(&ok)["state"], "complete");
}

/// A wrapper `sbatch` on PATH that submits for real, then runs `then`.
fn sbatch_wrapper(env: &TestEnv, then: &str) -> PathBuf {
    let dir = env.base().join("wrap");
    fs::create_dir_all(&dir).unwrap();
    let real =
        String::from_utf8(Command::new("sh").arg("-c").arg("command -v sbatch").output().unwrap().stdout).unwrap();
    let body = format!(
        "#!/bin/sh\nout=$({} \"$@\") || {{ rc=$?; echo \"$out\"; exit $rc; }}\necho \"$out\" > {}/submitted\n{then}\necho \"$out\"\n",
        real.trim(),
        dir.display()
    );
    let p = dir.join("sbatch");
    fs::write(&p, body).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn path_with(dir: &Path) -> String {
    format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default())
}

#[test]
fn daemon_killed_after_sbatch_adopts_the_job_after_restart() {
    let Some(conf) = cluster() else { return };
    let mut env = TestEnv::new();
    env.write_config(&format!("{DEFAULT_CONFIG}{CONFIG}"));
    // The daemon is the wrapper's parent: kill it before the handle can be saved.
    let wrap = sbatch_wrapper(&env, "kill -9 $PPID\nsleep 2");
    env.start_daemon_env(&[("SLURM_CONF", conf.clone()), ("PATH", path_with(&wrap))]);
    let id = unique_id("slurm-kill-daemon");
    env.submit(&request(Some(&id), &env.work, vec![slurm_step("#!/bin/sh\necho adopted-job-ran\n", json!({}))]));
    env.wait_daemon_exit();
    assert!(wrap.join("submitted").exists(), "sbatch ran before the daemon died");
    let claims: Vec<String> = list_names(&env.run_dir(&id).join("external-job-requests"))
        .into_iter()
        .filter(|n| n.ends_with(".claim"))
        .collect();
    assert_eq!(claims.len(), 1);
    let claim = env.run_dir(&id).join("external-job-requests").join(&claims[0]);
    assert!(!claim.join("handle.json").exists(), "the handle must not have been saved");
    // Restart without the wrapper: a second submission would show as a second job.
    env.start_daemon_env(&[("SLURM_CONF", conf.clone())]);
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "complete", "{st:#}");
    let job = st["steps"][0]["externalJob"]["providerJobId"].as_str().unwrap().to_string();
    assert!(claim.join("handle.json").is_file() && claim.join("completed.json").is_file());
    assert_eq!(jobs_named(&conf, &format!("runspool-{id}-0")), vec![(job, "COMPLETED".to_string())]);
    assert!(fs::read_to_string(&env.log_path).unwrap().contains("adopt"), "{}", env.log_tail(40));
    env.check_consistency();
}

#[test]
fn runner_killed_after_sbatch_is_repaired_and_not_resubmitted() {
    let Some(conf) = cluster() else { return };
    let mut env = TestEnv::new();
    env.write_config(&format!("{DEFAULT_CONFIG}{CONFIG}"));
    let id = unique_id("slurm-kill-runner");
    let status = env.run_dir(&id).join("status.json");
    let kill = format!("kill -9 $(grep -m1 '\"pid\"' {} | tr -dc 0-9)\nsleep 1", status.display());
    let wrap = sbatch_wrapper(&env, &kill);
    env.start_daemon_env(&[("SLURM_CONF", conf.clone()), ("PATH", path_with(&wrap))]);
    env.submit(&request(Some(&id), &env.work, vec![slurm_step("#!/bin/sh\nsleep 2\necho orphan-ran\n", json!({}))]));
    let st = env.wait_terminal(&id);
    assert_eq!(st["state"], "failed", "{st:#}");
    assert!(st["error"].as_str().unwrap().contains("exited before recording a result"), "{st:#}");
    // The daemon still finished the start claim; nothing submitted the job again.
    let reqdir = env.run_dir(&id).join("external-job-requests");
    wait_until(LONG, "the start claim to complete", || {
        list_names(&reqdir).iter().any(|n| n.ends_with(".claim") && reqdir.join(n).join("completed.json").exists())
    });
    let jobs = jobs_named(&conf, &format!("runspool-{id}-0"));
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let _ = Command::new("scancel").arg(&jobs[0].0).env("SLURM_CONF", &conf).status();
    env.check_consistency();
}

#[test]
fn providers_command_checks_sinfo() {
    let Some(conf) = cluster() else { return };
    let env = TestEnv::new();
    env.write_config(&format!("{DEFAULT_CONFIG}{CONFIG}"));
    let out = Command::new(BIN)
        .args(["providers", "--config", env.config_path.to_str().unwrap()])
        .env("SLURM_CONF", &conf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let text = stdout_str(&out);
    assert!(text.contains("slurm") && text.contains("sinfo: debug"), "{text}");
    let out = Command::new(BIN)
        .args(["providers", "--config", env.config_path.to_str().unwrap()])
        .env("SLURM_CONF", "/nonexistent/slurm.conf")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout_str(&out);
    assert!(text.contains("FAILED: providers.slurm: sinfo"), "{}", describe(&out));
}

/// A pi-subagents 0.67 `follow-up` is a real Slurm job of its own that runs
/// after its parent: submitted with `--dependency=afterany:<parent>` while
/// the parent is still known to Slurm, under a name of its own.
#[test]
fn follow_up_submits_a_job_that_waits_for_its_parent() {
    let Some(conf) = cluster() else { return };
    let (env, _) = slurm_env(&conf);
    let id = unique_id("slurm-fu");
    let gate = env.work.join("gate");
    let req = request(
        Some(&id),
        &env.work,
        vec![parallel(
            vec![
                slurm_step(
                    &format!("#!/bin/sh\nwhile [ ! -e '{}' ]; do sleep 0.2; done\necho parent-done\n", gate.display()),
                    json!({"partition": "debug", "timeLimit": "00:05:00"}),
                ),
                sh_step("host", &gate_wait(&env.work.join("host-gate"))),
            ],
            None,
        )],
    );
    env.submit(&req);
    wait_until(LONG, "the parent job submitted", || {
        env.status(&id).is_some_and(|s| s["steps"][0]["externalJob"]["providerJobId"].is_string())
    });
    let parent = env.status(&id).unwrap()["steps"][0]["externalJob"]["providerJobId"].as_str().unwrap().to_string();
    let prompt = "#!/bin/sh\necho follow-up-ran\n";
    let body = json!({
        "id": "fu-1", "operation": "follow-up", "provider": "slurm", "createdAt": now_ms(),
        "followUp": {
            "prompt": prompt, "promptDigest": sha256_hex(prompt.as_bytes()), "cwd": env.work.to_str().unwrap(),
            "runId": id, "stepIndex": 0, "agent": "hpc", "options": {"partition": "debug", "timeLimit": "00:05:00"},
            "sourceRunId": id, "sourceStepIndex": 0, "parentProviderJobId": parent,
            "requestId": "resume-1", "requestDigest": "d1"
        }
    });
    let reqdir = env.run_dir(&id).join("external-job-requests");
    fs::create_dir_all(&reqdir).unwrap();
    fs::write(reqdir.join(".fu.tmp"), body.to_string()).unwrap();
    fs::rename(reqdir.join(".fu.tmp"), reqdir.join("fu-1.json")).unwrap();
    let resp = env.run_dir(&id).join("external-job-responses/fu-1.json");
    wait_until(LONG, "the follow-up answered", || resp.exists());
    let r = read_json(&resp).unwrap();
    assert_eq!(r["ok"], json!(true), "{r}");
    let job = r["result"]["providerJobId"].as_str().unwrap().to_string();
    assert_ne!(job, parent);
    let show = slurm_cmd(&conf, "scontrol", &["-o", "show", "job", &job]);
    assert!(show.contains(&format!("afterany:{parent}")), "the follow-up waits for its parent: {show}");
    assert!(show.contains(&format!("JobName=runspool-{id}-0-fu-")), "{show}");
    fs::write(&gate, b"").unwrap();
    wait_until(LONG, "the follow-up job ran after its parent", || {
        fs::read_to_string(env.run_dir(&id).join(format!("slurm-{job}.out"))).is_ok_and(|o| o.contains("follow-up-ran"))
    });
    open_gate(&env.work.join("host-gate"));
    env.wait_terminal(&id);
}

/// The machine-wide files a Slurm/munge set-up would touch: kind, mode, owner,
/// mtime and (for files) a content hash of each, or that it is absent.
fn machine_wide_snapshot() -> Vec<String> {
    ["/etc/slurm", "/etc/slurm/slurm.conf", "/etc/munge", "/etc/munge/munge.key"]
        .iter()
        .map(|p| match fs::symlink_metadata(p) {
            Err(_) => format!("{p}: absent"),
            Ok(m) => {
                let hash = if m.is_file() { sha256_hex(&fs::read(p).unwrap()) } else { "-".to_string() };
                format!(
                    "{p}: {:?} mode {:o} owner {}:{} mtime {}.{} sha256 {hash}",
                    m.file_type(),
                    m.mode(),
                    m.uid(),
                    m.gid(),
                    m.mtime(),
                    m.mtime_nsec()
                )
            }
        })
        .collect()
}

/// The processes in `dir/pids/` (the ones `up` started).
fn recorded_pids(dir: &Path) -> Vec<(String, i64)> {
    list_names(&dir.join("pids"))
        .into_iter()
        .filter_map(|n| {
            let pid = fs::read_to_string(dir.join("pids").join(&n)).ok()?.trim().parse().ok()?;
            Some((n, pid))
        })
        .collect()
}

/// Runs `down` on drop, so a failing assertion does not leave the cluster running.
struct StopCluster(PathBuf);

impl Drop for StopCluster {
    fn drop(&mut self) {
        let _ = run_script("down", &self.0);
    }
}

/// README promises the suite leaves machine-wide settings alone: the cluster
/// the tests start is reachable only through SLURM_CONF, writes nothing in
/// /etc (an admin's slurm.conf and munge key stay as they were, byte for
/// byte), and `down` stops its processes and leaves no directory behind.
#[test]
fn dev_cluster_writes_nothing_in_etc_and_down_removes_its_directory() {
    // The shared cluster first: whatever apt installs on a fresh machine
    // (the one documented machine-wide change) is in place before the snapshot.
    let Some(_) = cluster() else { return };
    let before = machine_wide_snapshot();
    let dir = fresh_cluster_dir("check");
    let _stop = StopCluster(dir.clone());
    let out = run_script("up", &dir);
    assert!(out.status.success(), "slurm-dev-cluster.sh up {} failed:\n{}", dir.display(), describe(&out));
    let conf = dir.join("etc/slurm.conf");
    let dir_s = dir.to_str().unwrap();
    let via_env = Command::new("scontrol").args(["show", "config"]).env("SLURM_CONF", &conf).output().unwrap();
    assert!(
        via_env.status.success() && stdout_str(&via_env).contains(dir_s),
        "scontrol with SLURM_CONF={} does not reach the cluster: {}",
        conf.display(),
        describe(&via_env)
    );
    let plain = Command::new("scontrol").args(["show", "config"]).env_remove("SLURM_CONF").output().unwrap();
    assert!(
        !(plain.status.success() && stdout_str(&plain).contains(dir_s)),
        "scontrol without SLURM_CONF found the test cluster, so its config was installed machine-wide: {}",
        describe(&plain)
    );
    assert_eq!(machine_wide_snapshot(), before, "while the cluster is up");
    let pids = recorded_pids(&dir);
    assert_eq!(pids.len(), 3, "munged, slurmctld and slurmd recorded: {pids:?}");
    let out = run_script("down", &dir);
    assert!(out.status.success(), "slurm-dev-cluster.sh down {} failed:\n{}", dir.display(), describe(&out));
    for (name, pid) in &pids {
        assert!(!process_alive(*pid), "{name} (pid {pid}) still runs after down");
    }
    assert!(!dir.exists(), "down left {} behind: {:?}", dir.display(), list_names(&dir));
    assert_eq!(machine_wide_snapshot(), before, "after the cluster stopped");
}
