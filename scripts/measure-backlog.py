#!/usr/bin/env python3
"""The daemon's memory under a backlog (issue 23 item 3).

A real daemon (max_running 8) on a temporary root; N requests (one step,
`true`) dropped into its spool at once; /proc/<pid>/status sampled until
every run has ended, then for a few seconds more. Reports the peak
(VmHWM), the RSS at the largest queue, and the RSS once drained.

    cargo build --release --bin runspool --bin runspool-runner
    python3 scripts/measure-backlog.py [--bin target/release/runspool] [--requests 20000]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def proc_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/runspool")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--after", type=float, default=10.0, help="seconds sampled once drained")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    binp = os.path.abspath(a.bin)
    base = tempfile.mkdtemp(prefix="backlog-")
    root = os.path.join(base, "root")
    os.makedirs(root, mode=0o700)
    cfg = os.path.join(base, "config.toml")
    with open(cfg, "w") as f:
        f.write("max_running = 8\n")
    log = open(os.path.join(base, "daemon.log"), "w")
    env = dict(os.environ, RUNSPOOL_LOG="warn", XDG_CONFIG_HOME=os.path.join(base, "xdg"))
    env.pop("RUNSPOOL_ROOT", None)
    d = subprocess.Popen([binp, "daemon", "--root", root, "--config", cfg], env=env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    spool = os.path.join(root, "spool")
    daemon_json = os.path.join(root, "runspool", "daemon.json")
    try:
        deadline = time.time() + 30
        while not os.path.exists(daemon_json):
            if time.time() > deadline or d.poll() is not None:
                sys.exit("the daemon did not start; see " + log.name)
            time.sleep(0.05)
        time.sleep(1)
        idle = proc_kib(d.pid, "VmRSS")
        t0 = time.time()
        for i in range(a.requests):
            rid = f"bl-{i:06d}"
            body = json.dumps({"version": 1, "runId": rid, "cwd": base,
                               "steps": [{"agent": "a", "command": ["true"]}]})
            tmp = os.path.join(spool, f".{rid}.tmp")
            with open(tmp, "w") as f:
                f.write(body)
            os.rename(tmp, os.path.join(spool, f"{rid}.json"))
        dropped = time.time() - t0
        term = os.path.join(root, "async-subagent-runs", ".terminal-runs")
        peak_queued, rss_at_peak_queue, last = 0, 0, 0
        while True:
            time.sleep(1)
            rss = proc_kib(d.pid, "VmRSS")
            try:
                with open(daemon_json) as f:
                    runs = json.load(f).get("runs", {})
            except (OSError, ValueError):
                runs = {}
            q = runs.get("queued", 0)
            if q >= peak_queued:
                peak_queued, rss_at_peak_queue = q, rss
            ended = sum(len(fs) for _, _, fs in os.walk(term))
            if time.time() - last >= 10:
                last = time.time()
                print(f"  t={time.time() - t0:5.0f}s queued={q} running={runs.get('running', 0)} "
                      f"ended={ended} rss={rss / 1024:.1f}MiB hwm={proc_kib(d.pid, 'VmHWM') / 1024:.1f}MiB",
                      flush=True)
            left = [n for n in os.listdir(spool) if n.endswith(".json")]
            if ended >= a.requests and not left and q == 0 and runs.get("running", 1) == 0:
                break
            if d.poll() is not None:
                sys.exit("the daemon died; see " + log.name)
        drained_at = time.time() - t0
        time.sleep(a.after)
        after = proc_kib(d.pid, "VmRSS")
        hwm = proc_kib(d.pid, "VmHWM")
        print(f"requests: {a.requests} (dropped in {dropped:.1f}s), drained after {drained_at:.0f}s")
        print(f"RSS idle before: {idle / 1024:.1f} MiB")
        print(f"peak RSS (VmHWM): {hwm / 1024:.1f} MiB")
        print(f"RSS at the largest queue ({peak_queued}): {rss_at_peak_queue / 1024:.1f} MiB")
        print(f"RSS {a.after:.0f}s after drained: {after / 1024:.1f} MiB")
    finally:
        d.terminate()
        d.wait()
        if a.keep:
            print("kept", base)
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
