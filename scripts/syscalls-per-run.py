#!/usr/bin/env python3
"""System calls per run, runspool against the bench's reference pipeline
(docs/performance.md, "Where a run's time goes").

For each pipeline: start its daemon on a fresh root under --dir, attach
`strace -f -tt -T` to it once it is ready, drop --n trivial requests
(`/bin/true`) at once, wait until every run is terminal, detach. Every
process and thread of the trace gets a role (daemon, spawn child, runner,
step) from the clone/execve lines, and the script prints, per run:

- the system calls of each role, by name, for both pipelines side by side;
- the runner's phases from its own timestamps (inflated by strace: compare
  the two pipelines, not the absolute times) with their system calls:
  start-up (execve → the step's clone), step (clone → the step reaped),
  finish (reaped → exit).

Usage (the binaries of `cargo build --release` or `--profile profiling`):

    scripts/syscalls-per-run.py --bin target/release --dir /dev/shm/rsp --n 200
    scripts/syscalls-per-run.py ... --keep     # keep roots and traces
"""

import argparse
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"^(\d+)\s+(\d\d):(\d\d):(\d\d\.\d+)\s+(.*)$")
CALL = re.compile(r"^([a-z0-9_]+)\((.*)$")
RESUMED = re.compile(r"^<\.\.\. ([a-z0-9_]+) resumed>(.*)$")
RET = re.compile(r"\)\s+=\s+(-?\d+|\?)")

# Grouped in the tables: name → the calls it sums.
GROUPS = {
    "fsync+fdatasync": ("fsync", "fdatasync"),
    "openat": ("openat", "open", "openat2"),
    "rename": ("rename", "renameat", "renameat2"),
    "write": ("write", "writev", "pwrite64"),
    "read": ("read", "pread64", "readv"),
    "clone/vfork": ("clone", "clone3", "vfork", "fork"),
    "execve": ("execve",),
    "mmap/munmap/mprotect": ("mmap", "munmap", "mprotect", "mremap", "brk"),
    "stat": ("statx", "newfstatat", "fstat", "stat", "lstat", "statfs", "fstatfs"),
    "close": ("close",),
    "getdents64": ("getdents64",),
    "mkdir/unlink": ("mkdir", "mkdirat", "unlink", "unlinkat", "rmdir"),
    "flock/fcntl": ("flock", "fcntl"),
    "inotify": ("inotify_add_watch", "inotify_rm_watch", "inotify_init1"),
    "futex": ("futex",),
    "wait/poll": ("wait4", "waitid", "poll", "ppoll", "epoll_wait", "epoll_pwait", "epoll_pwait2", "select", "pselect6"),
    "signals": ("rt_sigaction", "rt_sigprocmask", "sigaltstack", "rt_sigreturn", "kill", "tgkill"),
    "prctl/rlimit/ids": ("prctl", "prlimit64", "setsid", "setpgid", "getpid", "gettid", "getuid", "geteuid", "getrandom",
                         "sched_getaffinity", "set_tid_address", "set_robust_list", "rseq", "arch_prctl", "uname",
                         "pidfd_open", "pidfd_send_signal", "ioctl", "dup2", "dup3", "pipe2", "socket", "connect",
                         "sendto", "access", "faccessat2", "readlink", "getcwd", "lseek", "clock_nanosleep", "nanosleep"),
}


def ts(h, m, s):
    return int(h) * 3600 + int(m) * 60 + float(s)


def run(pipeline, args, bindir, base):
    root = os.path.join(base, pipeline)
    os.makedirs(root, mode=0o700)
    log = open(root + ".daemon.log", "w")
    if pipeline == "runspool":
        cfg = root + ".toml"
        with open(cfg, "w") as f:
            f.write(f"max_running = {args.max_running}\n[watch]\nstrategy = \"native\"\n")
        d = subprocess.Popen([os.path.join(bindir, "runspool"), "--root", root, "daemon", "--config", cfg],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        ready = os.path.join(root, "runspool", "daemon.json")
        term = os.path.join(root, "async-subagent-runs", ".terminal-runs", "default")
    else:
        d = subprocess.Popen([os.path.join(bindir, "runspool-bench"), "__ref-daemon", root, str(args.max_running)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        ready = os.path.join(root, "ready")
        term = os.path.join(root, "done")
    until = time.time() + 120
    while not os.path.exists(ready):
        if time.time() > until or d.poll() is not None:
            sys.exit(f"{pipeline}: the daemon did not start; see {root}.daemon.log")
        time.sleep(0.02)
    time.sleep(0.5)
    staging = os.path.join(root, "staging")
    os.makedirs(staging)
    ids = [f"sc-{i:06d}" for i in range(args.n)]
    for i in ids:
        with open(os.path.join(staging, i + ".json"), "w") as f:
            f.write('{"version":1,"runId":"%s","cwd":"/","steps":[{"agent":"bench","command":["/bin/true"]}]}' % i)
    trace = root + ".strace"
    st = subprocess.Popen(["strace", "-f", "-qq", "-tt", "-T", "-s", "64", "-o", trace, "-p", str(d.pid)],
                          stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    t0 = time.time()
    for i in ids:
        os.rename(os.path.join(staging, i + ".json"), os.path.join(root, "spool", i + ".json"))
    until = time.time() + 600
    while True:
        n = len([e for e in os.listdir(term) if not e.startswith(".")]) if os.path.isdir(term) else 0
        if n >= args.n:
            break
        if time.time() > until:
            sys.exit(f"{pipeline}: only {n} of {args.n} runs ended")
        time.sleep(0.02)
    secs = time.time() - t0
    time.sleep(0.5)
    st.send_signal(signal.SIGINT)
    st.wait()
    d.terminate()
    d.wait()
    return trace, secs


def role_of_exec(line):
    if "runspool-runner" in line or "__ref-runner" in line or '"runner"' in line:
        return "runner"
    if "/bin/true" in line or '"true"' in line:
        return "step"
    return "other"


def events(trace):
    """Each completed call of the trace: (pid, time, name, arguments and result)."""
    pending = {}  # pid → the unfinished call's arguments
    with open(trace) as f:
        for raw in f:
            m = LINE.match(raw)
            if not m:
                continue
            pid, t, rest = int(m.group(1)), ts(m.group(2), m.group(3), m.group(4)), m.group(5)
            r = RESUMED.match(rest)
            if r:
                yield pid, t, r.group(1), pending.pop(pid, "") + r.group(2)
                continue
            c = CALL.match(rest)
            if not c:
                continue
            if "<unfinished ...>" in c.group(2):
                pending[pid] = c.group(2)  # counted once, when it resumes
                continue
            yield pid, t, c.group(1), c.group(2)


def parse(trace):
    """(role → Counter of calls, runner pid → its phase marks and calls per phase).

    Pass 1 learns who cloned whom (a child may print before its parent's
    clone returns); pass 2 gives each line the role of its process: the
    daemon's own, a spawn child (after the clone, before its execve), or
    what it exec'd (runner, step)."""
    parent, thread = {}, set()
    for pid, _, name, tail in events(trace):
        ret = RET.search(tail)
        if name in ("clone", "clone3", "vfork", "fork") and ret and ret.group(1).isdigit():
            parent[int(ret.group(1))] = pid
            if "CLONE_THREAD" in tail:
                thread.add(int(ret.group(1)))
    role, owner = {}, {}
    calls = collections.defaultdict(collections.Counter)
    runners = {}
    for pid, t, name, tail in events(trace):
        if pid not in role:
            par = parent.get(pid)
            if par is None:
                role[pid] = "daemon"
            elif pid in thread:
                role[pid] = role.get(par, "daemon")
                owner[pid] = owner.get(par, par)
            else:
                role[pid] = "spawn child of " + role.get(par, "daemon")
        who, proc = role[pid], owner.get(pid, pid)
        calls[who][name] += 1
        rp = runners.get(proc) if who == "runner" else None
        if rp is not None:
            phase = "start-up" if "clone" not in rp else ("step" if "reaped" not in rp else "finish")
            rp["calls"][phase][name] += 1
        ret = RET.search(tail)
        if name in ("clone", "clone3", "vfork", "fork") and ret and ret.group(1).isdigit():
            if rp is not None and "CLONE_THREAD" not in tail and "clone" not in rp:
                rp["clone"] = t
        elif name == "execve" and ret and ret.group(1) == "0":
            role[pid] = role_of_exec(tail)
            if role[pid] == "runner":
                runners[pid] = {"exec": t, "calls": collections.defaultdict(collections.Counter)}
        elif name in ("wait4", "waitid") and rp is not None:
            if "clone" in rp and "reaped" not in rp and ret and ret.group(1) not in ("0", "-1", "?"):
                rp["reaped"] = t
        elif name == "exit_group" and rp is not None:
            rp["exit"] = t
    return calls, runners


def group(counter):
    out = collections.OrderedDict()
    seen = set()
    for g, names in GROUPS.items():
        out[g] = sum(counter[n] for n in names)
        seen.update(names)
    out["other"] = sum(v for k, v in counter.items() if k not in seen)
    out["total"] = sum(counter.values())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release", help="directory of runspool, runspool-runner, runspool-bench")
    ap.add_argument("--dir", default="/dev/shm", help="where the temporary roots go (tmpfs or disk)")
    ap.add_argument("--n", type=int, default=200, help="runs per pipeline")
    ap.add_argument("--max-running", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the roots and the traces")
    ap.add_argument("--raw", action="store_true", help="also list every system call by name")
    args = ap.parse_args()
    if not shutil.which("strace"):
        sys.exit("strace is not installed (apt-get install strace)")
    bindir = os.path.abspath(args.bin)
    base = os.path.join(os.path.abspath(args.dir), f"syscalls-per-run-{os.getpid()}")
    os.makedirs(base, mode=0o700)
    results = {}
    for p in ("reference", "runspool"):
        print(f"{p}: {args.n} runs under strace ...", file=sys.stderr)
        trace, secs = run(p, args, bindir, base)
        results[p] = parse(trace) + (secs,)
    n = args.n
    roles = ["daemon", "spawn child of daemon", "runner", "spawn child of runner", "step"]
    print(f"## System calls per run ({n} runs at max_running {args.max_running}, {args.dir})\n")
    for r in roles:
        a, b = group(results["runspool"][0][r]), group(results["reference"][0][r])
        if a["total"] == 0 and b["total"] == 0:
            continue
        print(f"### {r}\n\n| calls per run | runspool | reference |\n|---|---|---|")
        for k in a:
            if a[k] or b[k]:
                print(f"| {k} | {a[k] / n:.1f} | {b[k] / n:.1f} |")
        print()
    allr = {p: group(sum((results[p][0][r] for r in results[p][0]), collections.Counter())) for p in results}
    print("### every process of a run together\n\n| calls per run | runspool | reference |\n|---|---|---|")
    for k in allr["runspool"]:
        print(f"| {k} | {allr['runspool'][k] / n:.1f} | {allr['reference'][k] / n:.1f} |")
    print()
    print("### the runner's phases (median ms under strace; calls per run)\n")
    print("| phase | runspool ms | calls | reference ms | calls |\n|---|---|---|---|---|")
    bounds = {"start-up": ("exec", "clone"), "step": ("clone", "reaped"), "finish": ("reaped", "exit")}
    for phase, (a, b) in bounds.items():
        row = []
        for p in ("runspool", "reference"):
            rs = [r for r in results[p][1].values() if a in r and b in r]
            ms = statistics.median([(r[b] - r[a]) * 1000 for r in rs]) if rs else float("nan")
            cnt = sum(sum(r["calls"][phase].values()) for r in rs) / max(len(rs), 1)
            row += [f"{ms:.2f}", f"{cnt:.1f}"]
        print(f"| {phase} | {' | '.join(row)} |")
    print()
    for p in ("runspool", "reference"):
        print(f"{p}: {n} runs in {results[p][2]:.2f} s under strace", file=sys.stderr)
    if args.raw:
        for p in ("runspool", "reference"):
            print(f"### {p}, every call by name (per run)\n")
            for r, c in sorted(results[p][0].items()):
                top = ", ".join(f"{k} {v / n:.1f}" for k, v in c.most_common())
                print(f"- {r}: {top}")
            print()
            for phase in ("start-up", "step", "finish"):
                agg = collections.Counter()
                rs = list(results[p][1].values())
                for r in rs:
                    agg.update(r["calls"][phase])
                top = ", ".join(f"{k} {v / max(len(rs), 1):.1f}" for k, v in agg.most_common())
                print(f"- runner {phase}: {top}")
            print()
    if args.keep:
        print(f"kept {base}", file=sys.stderr)
    else:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
