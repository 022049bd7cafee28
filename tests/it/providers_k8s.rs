//! The example Kubernetes command provider (docs/examples/runspool-k8s),
//! exercised against a FAKE `kubectl` on PATH that records its arguments and
//! plays a tiny Job controller. This checks the example's protocol handling
//! and the kubectl calls it makes; it is not a test against a real cluster.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Fake kubectl: records each call (arguments separated by " | "), keeps Jobs
/// as directories; a Job succeeds (or, if its name contains "fail", fails) on
/// the second `get -o json`.
const FAKE_KUBECTL: &str = r#"#!/bin/sh
D='@DIR@'
printf '%s\n' "$(printf '%s | ' "$@" | sed 's/ | $//')" >> "$D/calls.log"
verb=$1
case "$verb" in
apply)
    n=$(ls "$D/jobs" | wc -l)
    cat > "$D/applied-$n.json"
    name=$(sed -n 's/.*"metadata":{"name":"\([^"]*\)".*/\1/p' "$D/applied-$n.json")
    mkdir -p "$D/jobs/$name"
    echo "job.batch/$name created"
    ;;
get)
    name=$3
    [ -d "$D/jobs/$name" ] || { echo "Error from server (NotFound): jobs.batch \"$name\" not found" >&2; exit 1; }
    case "$*" in *"--output name"*) echo "job.batch/$name"; exit 0 ;; esac
    c=$(cat "$D/jobs/$name/gets" 2>/dev/null || echo 0); c=$((c + 1)); echo $c > "$D/jobs/$name/gets"
    if [ -e "$D/jobs/$name/hold" ] || [ $c -lt 2 ]; then
        echo '{"status":{"active":1}}'
    else
        case "$name" in
            *fail*) echo '{"status":{"failed":1,"conditions":[{"type":"Failed","status":"True","reason":"BackoffLimitExceeded","message":"Job has reached the specified backoff limit"}]}}' ;;
            *) echo '{"status":{"succeeded":1}}' ;;
        esac
    fi
    ;;
logs)
    echo "pod log line for ${2#job/}"
    echo 'a "quoted" line'
    ;;
delete)
    rm -rf "$D/jobs/$3"
    echo "job.batch \"$3\" deleted"
    ;;
*)
    echo "fake kubectl: unsupported verb $verb" >&2
    exit 1
    ;;
esac
"#;

fn jq_available() -> bool {
    let found =
        || Command::new("sh").arg("-c").arg("command -v jq").output().map(|o| o.status.success()).unwrap_or(false);
    if found() {
        return true;
    }
    if is_root() {
        let _ = Command::new("apt-get")
            .args(["install", "-y", "-q", "jq"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output();
    }
    found()
}

struct K8s {
    env: TestEnv,
    dir: PathBuf,
}

fn setup() -> Option<K8s> {
    if !jq_available() {
        eprintln!("SKIPPED: the example provider docs/examples/runspool-k8s needs jq, which is not installed (apt-get install jq)");
        return None;
    }
    let mut env = TestEnv::new();
    let dir = env.base().join("kube");
    fs::create_dir_all(dir.join("jobs")).unwrap();
    let kubectl = dir.join("kubectl");
    fs::write(&kubectl, FAKE_KUBECTL.replace("@DIR@", dir.to_str().unwrap())).unwrap();
    fs::set_permissions(&kubectl, fs::Permissions::from_mode(0o755)).unwrap();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/runspool-k8s");
    env.write_config(&format!(
        "{DEFAULT_CONFIG}[providers.k8s]\ntype = \"command\"\ncommand = [\"sh\", \"{}\", \"--namespace\", \"jobs\", \"--image\", \"busybox:1.36\"]\ntimeout_ms = 30000\n",
        example.display()
    ));
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    env.start_daemon_env(&[("PATH", path)]);
    Some(K8s { env, dir })
}

impl K8s {
    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.dir.join("calls.log")).unwrap_or_default().lines().map(str::to_string).collect()
    }
}

fn k8s_step(prompt: &str) -> Value {
    json!({"agent": "pod", "externalJob": {"provider": "k8s", "prompt": prompt}})
}

#[test]
fn example_k8s_provider_runs_a_job_through_kubectl() {
    let Some(k) = setup() else { return };
    let env = &k.env;
    let id = "k8s-run-1";
    let prompt = "echo \"hello from a pod\"; uname -a";
    env.submit(&request(
        Some(id),
        &env.work,
        vec![k8s_step(prompt), sh_step("after", "cat \"$RUNSPOOL_PREVIOUS_OUTPUT\"")],
    ));
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st:#}\n{}\n{:?}", env.output_log(id, 0), k.calls());
    let ej = &st["steps"][0]["externalJob"];
    assert_eq!(ej["providerJobId"], "jobs/runspool-k8s-run-1-0");
    // The manifest kubectl received.
    let m: Value = serde_json::from_slice(&fs::read(k.dir.join("applied-0.json")).unwrap()).unwrap();
    assert_eq!(m["kind"], "Job");
    assert_eq!(m["metadata"]["name"], "runspool-k8s-run-1-0");
    assert_eq!(m["metadata"]["namespace"], "jobs");
    assert_eq!(m["metadata"]["annotations"]["runspool/prompt-digest"], sha256_hex(prompt.as_bytes()));
    assert_eq!(m["spec"]["backoffLimit"], 0);
    let c = &m["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "busybox:1.36");
    assert_eq!(c["command"], json!(["sh", "-c", prompt]));
    // The kubectl calls, in order.
    let calls = k.calls();
    assert!(
        calls[0].starts_with("get | job | runspool-k8s-run-1-0 | --namespace | jobs | --output | name"),
        "{calls:?}"
    );
    assert_eq!(calls[1], "apply | --namespace | jobs | --filename | -", "{calls:?}");
    assert!(
        calls.iter().any(|c| c == "get | job | runspool-k8s-run-1-0 | --namespace | jobs | --output | json"),
        "{calls:?}"
    );
    assert!(calls.iter().any(|c| c == "logs | job/runspool-k8s-run-1-0 | --namespace | jobs"), "{calls:?}");
    // The pod log is the step's result, seen by the next step.
    let text = fs::read_to_string(env.run_dir(id).join("external-job-0.result.md")).unwrap();
    assert!(text.contains("pod log line for runspool-k8s-run-1-0") && text.contains("a \"quoted\" line"), "{text}");
    assert!(env.output_log(id, 1).contains("pod log line"), "{}", env.output_log(id, 1));
}

#[test]
fn example_k8s_provider_reports_failures_and_deletes_on_stop() {
    let Some(k) = setup() else { return };
    let env = &k.env;
    env.submit(&request(Some("k8s-fail"), &env.work, vec![k8s_step("exit 1")]));
    let st = env.wait_terminal("k8s-fail");
    assert_eq!(st["state"], "failed");
    let err = st["steps"][0]["error"].as_str().unwrap();
    assert!(
        err.contains("Kubernetes Job jobs/runspool-k8s-fail-0 failed: Job has reached the specified backoff limit"),
        "{err}"
    );
    assert!(err.contains("k8s-backofflimitexceeded"), "{err}");
    // A held job keeps running until the run is stopped: cancel deletes it.
    fs::create_dir_all(k.dir.join("jobs/runspool-k8s-stop-0")).unwrap();
    fs::write(k.dir.join("jobs/runspool-k8s-stop-0/hold"), b"").unwrap();
    env.submit(&request(Some("k8s-stop"), &env.work, vec![k8s_step("sleep 600")]));
    wait_until(LONG, "the job to run", || {
        env.status("k8s-stop").is_some_and(|s| s["steps"][0]["externalJob"]["state"] == "running")
    });
    // The pre-existing Job of that name was adopted, not created again.
    assert_eq!(k.calls().iter().filter(|c| c.starts_with("apply")).count(), 1, "{:?}", k.calls());
    let out = env.cli(&["stop", "k8s-stop"]);
    assert!(out.status.success(), "{}", describe(&out));
    let st = env.wait_terminal("k8s-stop");
    assert_eq!(st["state"], "stopped");
    assert!(k.calls().iter().any(|c| c == "delete | job | runspool-k8s-stop-0 | --namespace | jobs | --wait=false | --ignore-not-found"), "{:?}", k.calls());
    assert!(!k.dir.join("jobs/runspool-k8s-stop-0").exists());
}
