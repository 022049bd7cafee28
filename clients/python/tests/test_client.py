"""The Python client against a real daemon: what a user sees."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from conftest import Daemon
from runspool import ACTIVE_STATES, Client, NotFound, Rejected, RunspoolError, WaitTimeout, default_root

BURST = 500
ROUNDS = 200


@pytest.mark.parametrize("strategy", ["native", "poll"])
def test_submit_then_at_once_status_follow_wait_stop_under_a_burst(
    make_daemon: Callable[..., Daemon], strategy: str
) -> None:
    """Each round submits two runs and at once asks for the first's status,
    stops the second (withdrawn while pending, or stopped once claimed),
    follows the first's output and waits for both, while another thread
    submits a burst of 500 requests: no call fails, every output is whole,
    every run ends as its client was told."""
    d = make_daemon(strategy)
    c = d.client
    assert d.daemon_json()["watch"]["strategy"] == strategy
    burst_ids: List[str] = []
    burst_errors: List[BaseException] = []

    def burst() -> None:
        try:
            for k in range(BURST):
                burst_ids.append(c.submit(["true"], session_id="burst"))
        except BaseException as e:  # noqa: BLE001 (reported below)
            burst_errors.append(e)

    t = threading.Thread(target=burst)
    t.start()
    outcomes: Counter = Counter()
    withdrawn: List[str] = []
    try:
        for k in range(ROUNDS):
            a = c.submit(["sh", "-c", f"echo out-{k}; echo second-{k}"])
            assert c.status(a).state in ACTIVE_STATES | {"complete"}
            b = c.submit(["sleep", "60"])
            # At once, or a few ms later: the stop meets the request pending, mid-claim or queued.
            time.sleep((k % 4) * 0.005)
            how = c.stop(b, reason=f"round {k}")
            assert how in ("withdrawn", "requested"), how
            assert list(c.follow(a)) == [f"out-{k}", f"second-{k}"]
            s = c.wait(a, timeout=60)
            assert (s.state, s.exit_code) == ("complete", 0)
            if how == "withdrawn":
                with pytest.raises(Rejected) as e:
                    c.wait(b, timeout=60)
                assert e.value.code == "withdrawn"
                assert c.status(b).state == "withdrawn"
                withdrawn.append(b)
            else:
                sb = c.wait(b, timeout=60)
                assert sb.state == "stopped", sb
            outcomes[how] += 1
    finally:
        t.join()
    assert burst_errors == []
    assert len(burst_ids) == BURST
    for rid in burst_ids:
        assert c.wait(rid, timeout=120).state == "complete"
    # Nothing left behind in the spool: every request became a run or a withdrawal.
    assert [n for n in os.listdir(c.spool) if not n.startswith(".") and n != "rejected"] == []
    # The daemon finishes each withdrawal (its `rejected` run, then the intent
    # marker goes) at its next rescan; none of them ever ran.
    deadline = time.monotonic() + 60
    while any(n.startswith(".withdrawing-") for n in os.listdir(c.rejected)):
        assert time.monotonic() < deadline, d.log_tail()
        time.sleep(0.1)
    for rid in withdrawn:
        raw = json.loads(Path(c.runs, rid, "status.json").read_text())
        assert raw["state"] == "rejected" and raw["error"].startswith("withdrawn: "), raw
        assert not Path(c.runs, rid, "output-0.log").exists()
        assert c.status(rid).state == "withdrawn"
    print(f"{strategy}: stop outcomes {dict(outcomes)}")


def test_a_rejected_request_raises_rejected_with_its_code(daemon: Daemon, tmp_path: Path) -> None:
    c = daemon.client
    bad = c.submit({"version": 1, "cwd": str(tmp_path), "steps": [{"command": ["true"]}], "colour": "blue"})
    with pytest.raises(Rejected) as e:
        c.wait(bad, timeout=60)
    assert e.value.code == "invalid-field"
    assert "colour" in e.value.message
    s = c.status(bad)
    assert (s.state, s.code) == ("rejected", "invalid-field")

    gone = c.submit(["true"], cwd=tmp_path / "no-such-dir")
    with pytest.raises(Rejected) as e:
        c.wait(gone, timeout=60)
    assert e.value.code == "cwd-missing"
    with pytest.raises(Rejected):
        list(c.follow(gone))


def test_wait_timeout_raises_and_the_run_goes_on(daemon: Daemon) -> None:
    c = daemon.client
    rid = c.submit(["sleep", "30"])
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as e:
        c.wait(rid, timeout=0.5)
    assert time.monotonic() - started >= 0.5
    assert isinstance(e.value, TimeoutError)
    assert e.value.status is not None and e.value.status.state in ACTIVE_STATES
    assert c.status(rid).active
    _stop_and_wait(c, rid)


def test_failed_and_chained_runs(daemon: Daemon, tmp_path: Path) -> None:
    c = daemon.client
    fail = c.submit(["sh", "-c", "echo before; exit 3"])
    s = c.wait(fail, timeout=60)
    assert (s.state, s.exit_code) == ("failed", 3)
    chain = c.submit(
        {
            "version": 1,
            "cwd": str(tmp_path),
            "steps": [
                {"command": ["sh", "-c", "echo one; printf 'no newline'"]},
                {"parallel": [{"command": ["echo", "two"]}, {"command": ["echo", "three"]}]},
            ],
        }
    )
    assert list(c.follow(chain)) == ["one", "no newline", "two", "three"]
    assert c.wait(chain).state == "complete"
    with pytest.raises(NotFound):
        c.status("no-such-run")


def test_withdrawal_while_pending_is_finished_by_the_daemon(make_daemon: Callable[..., Daemon]) -> None:
    """With no daemon, a request stays pending; stop withdraws it the way
    `runspool stop` does. The daemon, started afterwards, never runs it and
    makes its `rejected` run, and the client keeps calling it withdrawn."""
    d = make_daemon(start=False)
    c = d.client
    rid = c.submit(["sh", "-c", "echo ran > ran.txt"], cwd=d.base)
    assert c.status(rid).state == "pending"
    assert c.stop(rid, reason="changed my mind") == "withdrawn"
    s = c.status(rid)
    assert (s.state, s.code) == ("withdrawn", "withdrawn")
    assert "changed my mind" in (s.message or "")
    err = json.loads(Path(c.rejected, f"{rid}.error.json").read_text())
    assert (err["code"], err["file"]) == ("withdrawn", f"{rid}.json")
    assert not Path(c.spool, f"{rid}.json").exists()
    assert c.stop(rid) == "ended"
    d.start()
    deadline = time.monotonic() + 60
    while not Path(c.runs, rid, "status.json").exists() or any(
        n.startswith(".withdrawing-") for n in os.listdir(c.rejected)
    ):
        assert time.monotonic() < deadline, d.log_tail()
        time.sleep(0.05)
    raw = json.loads(Path(c.runs, rid, "status.json").read_text())
    assert raw["state"] == "rejected" and raw["error"].startswith("withdrawn: ")
    assert c.status(rid).state == "withdrawn"
    with pytest.raises(Rejected) as e:
        c.wait(rid, timeout=10)
    assert e.value.code == "withdrawn"
    time.sleep(0.5)
    assert not (d.base / "ran.txt").exists()


def test_events_each_exactly_once_across_runs_starting_and_ending(daemon: Daemon, tmp_path: Path) -> None:
    """A follower started before the runs sees every line of every run's
    events.jsonl exactly once, in file order, including runs that start while
    it follows and a line that was half written when it first looked."""
    c = daemon.client
    seen: List[Dict[str, Any]] = []
    done = threading.Event()
    failure: List[BaseException] = []

    def follow() -> None:
        try:
            for ev in c.events(follow=True, poll_interval=0.02):
                seen.append(ev)
                if done.is_set() and ev.get("runId") == "sentinel":
                    return
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    ids = []
    for k in range(40):
        argv = [["true"], ["sh", "-c", "exit 2"], ["sh", "-c", "echo a; echo b"]][k % 3]
        ids.append(c.submit(argv))
    sleeper = c.submit(["sleep", "30"])
    # Another host's run, its event line written in two halves.
    foreign = Path(c.runs, "foreign-run")
    foreign.mkdir(mode=0o700)
    with open(foreign / "events.jsonl", "ab") as f:
        f.write(b'{"type":"custom.half","ts":1,"runId":"foreign-run"')
        f.flush()
        time.sleep(0.3)
        f.write(b',"n":1}\n')
    for rid in ids:
        c.wait(rid, timeout=120)
    _stop_and_wait(c, sleeper)
    done.set()
    c.wait(c.submit(["true"], run_id="sentinel"), timeout=60)
    t.join(timeout=60)
    assert not t.is_alive() and failure == []

    def from_files() -> Dict[str, List[Dict[str, Any]]]:
        out = {}
        for n in os.listdir(c.runs):
            p = Path(c.runs, n, "events.jsonl")
            if not n.startswith(".") and p.exists():
                out[n] = [json.loads(line) for line in p.read_text().splitlines()]
        return out

    by_run: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for ev in seen:
        by_run[ev["runId"]].append(ev)
    files = from_files()
    for rid in ids + [sleeper, "foreign-run"]:
        assert by_run[rid] == files[rid], rid
    assert [e["type"] for e in by_run["foreign-run"]] == ["custom.half"]
    # One pass sees the same, and `since` keeps only the newer ones.
    once = list(c.events())
    assert Counter(json.dumps(e, sort_keys=True) for e in once) == Counter(
        json.dumps(e, sort_keys=True) for evs in files.values() for e in evs
    )
    cut = sorted(e["ts"] for e in once)[len(once) // 2]
    assert all(e["ts"] >= cut for e in c.events(since=cut))
    assert len(list(c.events(since=cut))) == sum(1 for e in once if e["ts"] >= cut)


def _stop_and_wait(c: Client, rid: str) -> None:
    """Stop `rid`: withdrawn while pending, else stopped."""
    if c.stop(rid) == "withdrawn":
        with pytest.raises(Rejected):
            c.wait(rid, timeout=60)
    else:
        assert c.wait(rid, timeout=60).state == "stopped"


def test_list_active_and_recent(daemon: Daemon) -> None:
    c = daemon.client
    ended = [c.submit(["true"], session_id="listing") for _ in range(6)]
    for rid in ended:
        c.wait(rid, timeout=60)
    running = c.submit(["sleep", "30"], session_id="listing")
    deadline = time.monotonic() + 60
    while c.status(running).state != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    active = c.list(active=True)
    assert [s.run_id for s in active] == [running]
    recent = c.list(recent=4)
    assert len(recent) == 4 and all(s.state == "complete" for s in recent)
    assert {s.run_id for s in recent} <= set(ended)
    assert [s.data["endedAt"] for s in recent] == sorted((s.data["endedAt"] for s in recent), reverse=True)
    everything = c.list(session="listing")
    assert everything[0].run_id == running and {s.run_id for s in everything[1:]} == set(ended)
    assert c.stop(running) == "requested"
    assert c.wait(running, timeout=60).state == "stopped"


def test_hostile_files_neither_block_nor_are_followed(daemon: Daemon, tmp_path: Path) -> None:
    """A FIFO or a symlink where the client reads is reported with its path,
    never waited on or followed."""
    c = daemon.client
    fifo_run = Path(c.runs, "fifo-run")
    fifo_run.mkdir(mode=0o700)
    os.mkfifo(fifo_run / "status.json", 0o600)
    os.mkfifo(fifo_run / "events.jsonl", 0o600)
    link_run = Path(c.runs, "link-run")
    link_run.mkdir(mode=0o700)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"runId": "link-run", "state": "complete"}))
    os.symlink(secret, link_run / "status.json")
    with pytest.raises(RunspoolError, match=r"fifo-run/status.json is not a regular file"):
        c.status("fifo-run")
    with pytest.raises(RunspoolError, match=r"link-run/status.json is a symbolic link"):
        c.status("link-run")
    assert [e for e in c.events() if e.get("runId") in ("fifo-run", "link-run")] == []
    copy = Path(c.runs, "copy-run")
    copy.mkdir(mode=0o700)
    (copy / "status.json").write_text(json.dumps({"runId": "other", "state": "complete"}))
    with pytest.raises(RunspoolError, match="names run 'other'"):
        c.status("copy-run")
    with pytest.raises(ValueError):
        c.status("../escape")


def test_root_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ("RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT", "TMPDIR"):
        monkeypatch.delenv(v, raising=False)
    assert default_root() == f"/tmp/pi-subagents-uid-{os.getuid()}"
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    assert Client().root == f"/var/tmp/pi-subagents-uid-{os.getuid()}"
    monkeypatch.setenv("PI_SUBAGENTS_TEMP_ROOT", "/srv/pi")
    assert Client().root == "/srv/pi"
    monkeypatch.setenv("RUNSPOOL_ROOT", "/srv/rs")
    assert Client().root == "/srv/rs"
    assert Client("/elsewhere").root == "/elsewhere"
