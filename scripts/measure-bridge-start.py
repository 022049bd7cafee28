#!/usr/bin/env python3
"""Bridge start latency (issue 23 item 4): from the runner's external-job
start request to the provider's `start`, over N runs, one at a time.

A real daemon on a temporary root, a `command` provider written in sh whose
`start` stamps the clock (ms) into a file, and N runs of one external step
(prompt `true`). For each run: latency = the provider's stamp - the request's
`createdAt` (written by the runner just before the request file; kept in the
claim's request.json). Also reported: submit -> terminal, end to end.

    cargo build --bin runspool --bin runspool-runner
    python3 scripts/measure-bridge-start.py [--bin target/debug/runspool] [--runs 20]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ENGINE = r"""#!/bin/sh
E='@DIR@'
op=$1
input=$(cat)
case "$op" in
start)
    t=$(date +%s%3N)
    id=$(printf '%s' "$input" | sed -n 's/.*"runId":"\([^"]*\)".*/\1/p')
    echo "$t $id" >> "$E/starts.log"
    echo '{"providerJobId":"j-'$t'","state":"queued"}'
    ;;
status|reattach)
    id=$(printf '%s' "$input" | sed -n 's/.*"providerJobId":"\([^"]*\)".*/\1/p')
    echo '{"providerJobId":"'$id'","state":"completed"}'
    ;;
result)
    id=$(printf '%s' "$input" | sed -n 's/.*"providerJobId":"\([^"]*\)".*/\1/p')
    echo '{"providerJobId":"'$id'","state":"completed","output":""}'
    ;;
*)
    echo '{"code":"unknown-operation","message":"no"}'; exit 2 ;;
esac
"""


def now_ms():
    return time.time_ns() // 1_000_000


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/runspool")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    binp = os.path.abspath(a.bin)
    base = tempfile.mkdtemp(prefix="bridge-start-")
    root, eng = os.path.join(base, "root"), os.path.join(base, "engine")
    os.makedirs(eng)
    os.makedirs(root, mode=0o700)
    exe = os.path.join(eng, "engine.sh")
    with open(exe, "w") as f:
        f.write(ENGINE.replace("@DIR@", eng))
    os.chmod(exe, 0o755)
    cfg = os.path.join(base, "config.toml")
    with open(cfg, "w") as f:
        f.write(
            'max_running = 4\n[providers.engine]\ntype = "command"\n'
            f'command = ["{exe}"]\ntimeout_ms = 30000\n'
        )
    log = open(os.path.join(base, "daemon.log"), "w")
    env = dict(os.environ, RUNSPOOL_LOG="info", XDG_CONFIG_HOME=os.path.join(base, "xdg"))
    env.pop("RUNSPOOL_ROOT", None)
    d = subprocess.Popen([binp, "daemon", "--root", root, "--config", cfg], env=env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    spool = os.path.join(root, "spool")
    runs = os.path.join(root, "async-subagent-runs")
    try:
        deadline = time.time() + 30
        while not os.path.exists(os.path.join(root, "runspool", "daemon.json")):
            if time.time() > deadline or d.poll() is not None:
                sys.exit("the daemon did not start; see " + log.name)
            time.sleep(0.05)
        time.sleep(0.5)
        lat, e2e = [], []
        for i in range(a.runs):
            rid = f"bs-{i:03d}"
            req = {"version": 1, "runId": rid, "cwd": base, "timeoutMs": 60000,
                   "steps": [{"agent": "a", "externalJob": {"provider": "engine", "prompt": "true", "options": {}}}]}
            tmp = os.path.join(spool, f".{rid}.tmp")
            with open(tmp, "w") as f:
                json.dump(req, f)
            t0 = now_ms()
            os.rename(tmp, os.path.join(spool, f"{rid}.json"))
            st = os.path.join(runs, rid, "status.json")
            deadline = time.time() + 60
            while True:
                try:
                    with open(st) as f:
                        s = json.load(f)
                    if s.get("state") not in ("queued", "running"):
                        break
                except (OSError, ValueError):
                    pass
                if time.time() > deadline:
                    sys.exit(f"{rid} did not end; see {base}")
                time.sleep(0.01)
            if s["state"] != "complete":
                sys.exit(f"{rid} ended {s['state']}; see {base}")
            e2e.append(now_ms() - t0)
        starts = {}
        with open(os.path.join(eng, "starts.log")) as f:
            for line in f:
                t, rq = line.split()
                starts[rq] = int(t)
        for i in range(a.runs):
            reqdir = os.path.join(runs, f"bs-{i:03d}", "external-job-requests")
            claim = [n for n in os.listdir(reqdir) if n.endswith(".claim")][0]
            with open(os.path.join(reqdir, claim, "request.json")) as f:
                r = json.load(f)
            lat.append(starts[f"bs-{i:03d}"] - r["createdAt"])
        print(f"runs: {a.runs}")
        print("request -> provider start (ms): p50 %d  p90 %d  max %d  min %d"
              % (statistics.median(lat), pct(lat, 90), max(lat), min(lat)))
        print("submit -> terminal (ms):        p50 %d  p90 %d  max %d"
              % (statistics.median(e2e), pct(e2e, 90), max(e2e)))
    finally:
        d.terminate()
        d.wait()
        if a.keep:
            print("kept", base)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
