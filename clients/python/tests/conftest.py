"""A real runspool daemon per test, on a temporary root.

The binary: $RUNSPOOL_BIN, else target/debug/runspool of this repository
(`cargo build` makes it). The fixture stops only what it started: the runs
still active under its root (through stop requests) and its daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

from runspool import Client

REPO = Path(__file__).resolve().parents[3]


def runspool_bin() -> str:
    b = os.environ.get("RUNSPOOL_BIN") or str(REPO / "target" / "debug" / "runspool")
    if not os.access(b, os.X_OK):
        pytest.fail(f"no runspool binary at {b}: run `cargo build` in {REPO}, or set RUNSPOOL_BIN")
    return b


class Daemon:
    def __init__(self, base: Path, strategy: str, extra_config: str) -> None:
        self.base = base
        self.root = base / "root"
        self.config = base / "config.toml"
        self.log = base / "daemon.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        poll = "poll_interval_ms = 50\n" if strategy == "poll" else ""
        self.config.write_text(
            "max_running = 8\nretention_days = 0\n"
            f"{extra_config}"
            f"[watch]\nstrategy = \"{strategy}\"\n{poll}rescan_interval_s = 2\n"
        )
        self.client = Client(self.root)

    def start(self) -> None:
        assert self.proc is None
        env = {k: v for k, v in os.environ.items() if k not in ("RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT")}
        env.setdefault("RUNSPOOL_LOG", "info")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [runspool_bin(), "daemon", "--root", str(self.root), "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                d = json.loads((self.root / "runspool" / "daemon.json").read_text())
                if d.get("pid") == self.proc.pid:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        pytest.fail(f"the daemon did not report itself in daemon.json within 60 s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def daemon_json(self) -> dict:
        return json.loads((self.root / "runspool" / "daemon.json").read_text())

    def stop(self) -> None:
        if self.proc is None:
            return
        # Runs still going are stopped the protocol's way, by this test's daemon.
        try:
            active = [s.run_id for s in self.client.list(active=True)]
            for rid in active:
                self.client.stop(rid, reason="test teardown")
            for rid in active:
                try:
                    self.client.wait(rid, timeout=30)
                except Exception:
                    pass
        except Exception:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: List[Daemon] = []

    def make(strategy: str = "native", start: bool = True, extra_config: str = "") -> Daemon:
        base = tmp_path / f"d{len(made)}"
        base.mkdir(mode=0o700)
        d = Daemon(base, strategy, extra_config)
        made.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in made:
        d.stop()


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    return make_daemon()
