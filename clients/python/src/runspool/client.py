"""The runspool client: submit, inspect, wait for, follow and stop runs,
through the files of PROTOCOL.md alone (no socket, no daemon API)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
import uuid
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _fs
from ._fs import FileId, now_ms
from ._status import ACTIVE_STATES, Status
from .errors import NotFound, Rejected, RunspoolError, WaitTimeout

__all__ = ["Client", "Status", "ACTIVE_STATES"]

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_REQUEST_BYTES = 1 << 20
MAX_STATUS_BYTES = 16 << 20
MAX_SMALL_FILE = 64 << 10
MAX_LINE = 1 << 20
ERROR_FILE_SUFFIX = ".error.json"
INTENT_PREFIX = ".withdrawing-"
SOURCE = "runspool-python"


def is_id(s: object, max_len: int) -> bool:
    """The id grammar of PROTOCOL §2.1: `[A-Za-z0-9][A-Za-z0-9._-]{0,max-1}`."""
    return isinstance(s, str) and 0 < len(s) <= max_len and s.isascii() and _ID.match(s) is not None


def _check_run_id(run_id: str) -> None:
    if not is_id(run_id, 255):
        raise ValueError(
            f"{run_id!r} is not a run id: use letters, digits, '.', '_' and '-', starting with a letter or digit"
        )


def default_root() -> str:
    """The root of PROTOCOL §1: $RUNSPOOL_ROOT, $PI_SUBAGENTS_TEMP_ROOT, else
    `<$TMPDIR or /tmp>/pi-subagents-uid-<uid>`."""
    for var in ("RUNSPOOL_ROOT", "PI_SUBAGENTS_TEMP_ROOT"):
        v = os.environ.get(var)
        if v:
            return v
    tmp = os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, f"pi-subagents-uid-{os.getuid()}")


def _rejection_of(data: Mapping[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """(code, message) of a `rejected` status: its `error` is `<code>: <message>`."""
    err = data.get("error")
    if not isinstance(err, str):
        return None, None
    code, sep, message = err.partition(": ")
    if sep and re.fullmatch(r"[a-z][a-z-]*", code):
        return code, message
    return None, err


class Client:
    """A client of the runspool daemon whose root is `root` (default: PROTOCOL
    §1's resolution, see `default_root`). It only reads and writes files
    under the root; a daemon need not be running to submit."""

    def __init__(self, root: Union[str, "os.PathLike[str]", None] = None) -> None:
        self.root = os.path.abspath(os.fspath(root) if root is not None else default_root())
        self.spool = os.path.join(self.root, "spool")
        self.rejected = os.path.join(self.spool, "rejected")
        self.runs = os.path.join(self.root, "async-subagent-runs")
        self.active_index = os.path.join(self.runs, ".active-runs")
        self.terminal_index = os.path.join(self.runs, ".terminal-runs")

    def __repr__(self) -> str:
        return f"Client(root={self.root!r})"

    # ---------------------------------------------------------------- submit

    def submit(
        self,
        argv_or_request: Union[Sequence[str], Mapping[str, Any]],
        *,
        cwd: Union[str, "os.PathLike[str]", None] = None,
        env: Optional[Mapping[str, str]] = None,
        run_id: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        session_id: Optional[str] = None,
        priority: Optional[int] = None,
        agent: Optional[str] = None,
        tool_call_id: Optional[str] = None,
    ) -> str:
        """Publish a launch request in the spool (PROTOCOL §2.1) and return
        its run id. A list of strings is one command step (run in `cwd`,
        default the current directory); a mapping is a whole request body
        (§2.2), to which only `run_id` may be added. The request is named
        `<runId>.json`, as `runspool submit` names it."""
        if isinstance(argv_or_request, Mapping):
            extra = {
                "cwd": cwd, "env": env, "timeout_ms": timeout_ms, "session_id": session_id,
                "priority": priority, "agent": agent, "tool_call_id": tool_call_id,
            }
            given = [k for k, v in extra.items() if v is not None]
            if given:
                raise TypeError(
                    f"submit() of a request body takes no {', '.join(given)}: set those fields in the body itself"
                )
            body: Dict[str, Any] = dict(argv_or_request)
            if "runId" in body:
                if run_id is not None and run_id != body["runId"]:
                    raise ValueError(f"the request has runId {body['runId']!r} but run_id={run_id!r}: drop one")
            else:
                body["runId"] = run_id if run_id is not None else str(uuid.uuid4())
            body.setdefault("version", 1)
        elif isinstance(argv_or_request, (str, bytes)):
            raise TypeError("submit() takes a list of arguments (['make', 'test']) or a request body, not a string")
        else:
            argv = list(argv_or_request)
            if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
                raise ValueError("submit() needs a non-empty list of strings, the command and its arguments")
            step: Dict[str, Any] = {"command": argv}
            if agent is not None:
                step["agent"] = agent
            body = {
                "version": 1,
                "runId": run_id if run_id is not None else str(uuid.uuid4()),
                "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
                "steps": [step],
            }
            if session_id is not None:
                body["sessionId"] = session_id
            if tool_call_id is not None:
                body["toolCallId"] = tool_call_id
            if env:
                body["env"] = {str(k): str(v) for k, v in env.items()}
            if timeout_ms is not None:
                body["timeoutMs"] = int(timeout_ms)
            if priority:
                body["priority"] = int(priority)
        rid = body["runId"]
        if not is_id(rid, 128):
            raise ValueError(
                f"runId {rid!r} is not valid: 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        # runId first, where readers looking for it (runspool status) find it early.
        ordered = {"runId": rid, **{k: v for k, v in body.items() if k != "runId"}}
        data = json.dumps(ordered, indent=2, ensure_ascii=False).encode()
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"the request is {len(data)} bytes; a request may be at most {MAX_REQUEST_BYTES} bytes")
        self._publish(data, rid)
        return str(rid)

    def _check_dir(self, path: str) -> None:
        """A directory the daemon would accept: real, ours, not group/other writable."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            _fs.mkdir_private_all(path)
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise RunspoolError(f"{path} is not a directory (a symlink?); replace it with a real one (mkdir -m 700)")
        if st.st_uid != os.geteuid():
            raise RunspoolError(f"{path} is owned by uid {st.st_uid}, not by you; use a root of your own (RUNSPOOL_ROOT)")
        if st.st_mode & 0o022:
            raise RunspoolError(f"{path} is writable by group or others; run chmod 700 {path}")

    def _publish(self, data: bytes, run_id: str) -> None:
        for d in (self.root, self.spool):
            self._check_dir(d)
        target = os.path.join(self.spool, f"{run_id}.json")
        if os.path.lexists(target):
            raise RunspoolError(f"{target} already exists: a request with run id {run_id!r} is waiting to be claimed")
        tmp = os.path.join(self.spool, f".submit-{uuid.uuid4()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _fs._O_NOFOLLOW | _fs._O_CLOEXEC, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            _fs.rename_noreplace(tmp, target)
        except FileExistsError:
            _unlink_quiet(tmp)
            raise RunspoolError(
                f"{target} already exists: a request with run id {run_id!r} is waiting to be claimed"
            ) from None
        except BaseException:
            _unlink_quiet(tmp)
            raise
        _fs.fsync_dir(self.spool)

    # ---------------------------------------------------------------- status

    def status(self, run_id: str) -> Status:
        """Where run `run_id` is: pending in the spool, claimed, its
        status.json, or its rejection. Raises NotFound when there is none."""
        _check_run_id(run_id)
        deadline = time.monotonic() + 5
        while True:
            s = self._run_status(run_id)
            if s is not None:
                return s
            s = self._pending(run_id)
            if s is not None:
                return s
            # Claimed between the two looks: the claim renamed it into its run.
            s = self._run_status(run_id)
            if s is not None:
                return s
            s = self._rejection(run_id)
            if s is not None:
                return s
            # Moved to rejected/ a moment before its error file is written, or
            # a run directory made a moment before its request is moved in.
            between = os.path.lexists(os.path.join(self.rejected, f"{run_id}.json")) or os.path.lexists(
                os.path.join(self.runs, run_id)
            )
            if not between or time.monotonic() > deadline:
                raise NotFound(
                    run_id,
                    f"no run, pending request or rejection {run_id!r} under {self.root}; "
                    "check the id and the root (RUNSPOOL_ROOT, or Client(root=...))",
                )
            time.sleep(0.01)

    def _open_run_dir(self, run_id: str) -> Optional[int]:
        d = os.path.join(self.runs, run_id)
        try:
            return os.open(d, _fs.DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunspoolError(f"{d} is a symbolic link; a run directory is never followed: remove the link") from e
            raise

    def _run_status(self, run_id: str) -> Optional[Status]:
        d = os.path.join(self.runs, run_id)
        dfd = self._open_run_dir(run_id)
        if dfd is None:
            return None
        try:
            path = os.path.join(d, "status.json")
            raw = _fs.read_regular("status.json", MAX_STATUS_BYTES, dir_fd=dfd, shown=path)
            if raw is None:
                try:
                    st = os.stat("request.json", dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                if stat.S_ISREG(st.st_mode):
                    return Status(run_id, "claimed", os.path.join(d, "request.json"))
                return None
        finally:
            os.close(dfd)
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise RunspoolError(f"{path} is not valid JSON ({e}); it is written atomically, so it was damaged: look at it") from None
        if not isinstance(data, dict):
            raise RunspoolError(f"{path} does not hold a JSON object; look at it")
        if data.get("runId") != run_id:
            raise RunspoolError(
                f"{path} names run {data.get('runId')!r}, not {run_id!r}: a copied or crafted status, not this run's; "
                "remove the directory if it is a copy"
            )
        state = data.get("state")
        state = state if isinstance(state, str) else "unknown"
        code = message = None
        if state == "rejected":
            code, message = _rejection_of(data)
            if code == "withdrawn":
                state = "withdrawn"
        return Status(run_id, state, path, data, code, message)

    def _pending(self, run_id: str) -> Optional[Status]:
        path = os.path.join(self.spool, f"{run_id}.json")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return Status(run_id, "pending", path, {"spoolFile": path, "publishedAt": st.st_mtime_ns // 1_000_000})

    def _error_file(self, stem: str) -> str:
        name = f"{stem}{ERROR_FILE_SUFFIX}"
        if len(name.encode()) > 255:
            name = f"~sha256-{hashlib.sha256(f'{stem}.json'.encode()).hexdigest()}{ERROR_FILE_SUFFIX}"
        return os.path.join(self.rejected, name)

    def _rejection(self, run_id: str) -> Optional[Status]:
        path = self._error_file(run_id)
        raw = _fs.read_regular(path, MAX_SMALL_FILE)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        code = data.get("code") if isinstance(data.get("code"), str) else "unknown"
        message = data.get("message") if isinstance(data.get("message"), str) else "see the error file"
        return Status(run_id, "withdrawn" if code == "withdrawn" else "rejected", path, data, code, message)

    # ---------------------------------------------------------------- wait

    def wait(self, run_id: str, timeout: Optional[float] = None, poll_interval: float = 0.05) -> Status:
        """Wait until run `run_id` ends and return its terminal status
        (`complete`, `failed`, `stopped`, `paused`, ...). Raises Rejected
        when it was rejected or withdrawn, WaitTimeout after `timeout` seconds
        (the run goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            s = self.status(run_id)
            if s.state in ("rejected", "withdrawn"):
                raise Rejected(run_id, s.code or "unknown", s.message or s.error or "", s.path)
            if s.terminal:
                return s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(run_id, float(timeout or 0), s)
                time.sleep(min(poll_interval, left))
            else:
                time.sleep(poll_interval)

    # ---------------------------------------------------------------- follow

    def follow(self, run_id: str, poll_interval: float = 0.05) -> Iterator[str]:
        """The output lines (without their newline) of the run's steps, step
        after step in order, as they are written, until the run ends. Raises
        Rejected when the request was rejected or withdrawn."""
        s = self.status(run_id)
        while s.state in ("pending", "claimed"):
            time.sleep(poll_interval)
            s = self.status(run_id)
        if s.state in ("rejected", "withdrawn"):
            raise Rejected(run_id, s.code or "unknown", s.message or s.error or "", s.path)
        d = os.path.join(self.runs, run_id)
        i = 0
        while True:
            steps = s.steps
            if i >= len(steps):
                if s.terminal:
                    return
                time.sleep(poll_interval)
                s = self.status(run_id)
                continue
            name = f"output-{i}.log"
            path = os.path.join(d, name)
            fd: Optional[int] = None
            offset = 0
            buf = b""
            try:
                while True:
                    step_state = steps[i].get("status") if i < len(steps) else None
                    # Seen ended before the read: the read gets all it wrote.
                    done = s.terminal or step_state not in ("pending", "running")
                    if fd is None:
                        fd = self._open_in_run(run_id, name, path)
                    if fd is not None:
                        while True:
                            chunk = _fs.read_fd(fd, 1 << 20, offset)
                            if not chunk:
                                break
                            offset += len(chunk)
                            buf += chunk
                            *lines, buf = buf.split(b"\n")
                            for line in lines:
                                yield line.decode("utf-8", "replace")
                            while len(buf) >= MAX_LINE:
                                yield buf[:MAX_LINE].decode("utf-8", "replace")
                                buf = buf[MAX_LINE:]
                    if done:
                        if buf:
                            yield buf.decode("utf-8", "replace")
                        break
                    time.sleep(poll_interval)
                    s = self.status(run_id)
                    steps = s.steps
            finally:
                if fd is not None:
                    os.close(fd)
            i += 1

    def _open_in_run(self, run_id: str, name: str, path: str) -> Optional[int]:
        """Open `<run>/<name>` by descriptor, never through a symlink."""
        dfd = self._open_run_dir(run_id)
        if dfd is None:
            return None
        try:
            return _fs.open_regular(name, dir_fd=dfd, shown=path)
        finally:
            os.close(dfd)

    # ---------------------------------------------------------------- stop

    def stop(self, run_id: str, reason: Optional[str] = None) -> str:
        """Stop run `run_id`. A request still pending in the spool is
        withdrawn (it never runs; returns "withdrawn"); a claimed, queued or
        running run gets a stop request in its control inbox (returns
        "requested"); a run that already ended is left alone ("ended")."""
        message = "withdrawn by the runspool Python client before it was claimed" + (f": {reason}" if reason else "")
        deadline = time.monotonic() + 30
        while True:
            s = self.status(run_id)
            if s.state == "pending":
                outcome = self._withdraw(f"{run_id}.json", message)
                if outcome == "withdrawn":
                    return "withdrawn"
                if outcome == "busy":
                    if time.monotonic() > deadline:
                        raise RunspoolError(
                            f"{s.path} stayed locked for 30 s (a writer still at work on it?); nothing was withdrawn: try again"
                        )
                    time.sleep(0.02)
                continue  # gone: the daemon settled it first; look again
            if s.state == "claimed" or s.state in ("queued", "running"):
                self._write_stop_request(run_id, reason)
                return "requested"
            return "ended"

    def _write_stop_request(self, run_id: str, reason: Optional[str]) -> str:
        d = os.path.join(self.runs, run_id)
        dfd = self._open_run_dir(run_id)
        if dfd is None:
            raise NotFound(run_id, f"{d} is gone; nothing to stop")
        fds = [dfd]
        try:
            try:
                st: Optional[os.stat_result] = os.stat("request.json", dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise RunspoolError(
                    f"run {run_id} was launched by another host (pi-subagents), not by runspool; runspool never writes "
                    "into it. Stop it from the host that launched it"
                )
            parent, where = dfd, d
            for sub in ("control", "stop-requests"):
                where = os.path.join(where, sub)
                try:
                    os.mkdir(sub, 0o700, dir_fd=parent)
                except FileExistsError:
                    pass
                try:
                    parent = os.open(sub, _fs.DIR_FLAGS, dir_fd=parent)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise RunspoolError(
                            f"{where} is not a real directory (a symlink?); no stop request is written through it: remove it"
                        ) from e
                    raise
                fds.append(parent)
            ts = now_ms()
            body: Dict[str, Any] = {"type": "stop", "ts": ts, "source": SOURCE}
            if reason is not None:
                body["reason"] = reason
            name = f"{max(ts, 0):013d}-{uuid.uuid4()}.json"
            _fs.write_atomic(name, json.dumps(body).encode(), durable=True, dir_fd=parent)
            return os.path.join(where, name)
        finally:
            for fd in fds:
                os.close(fd)

    def _withdraw(self, name: str, message: str) -> str:
        """Withdraw `spool/<name>` as `runspool stop` does (src/daemon/spool/
        withdraw.rs): under the exclusive flock the daemon's claim takes, check
        it is still the same file, record an intent marker in rejected/, move
        the entry there (code `withdrawn`) and write its error file. Returns
        "withdrawn", "gone" (settled by someone else first) or "busy".

        The `rejected` run directory that runspool's own withdrawal also
        writes is left to the daemon: the intent marker stays until it is
        written, and the daemon finishes it at its next rescan, exactly as
        it finishes the withdrawal of a client cut short after its move."""
        path = os.path.join(self.spool, name)
        try:
            md = os.lstat(path)
        except FileNotFoundError:
            return "gone"
        _check_entry(path, md)
        try:
            fd = os.open(path, _fs.READ_FLAGS)
        except FileNotFoundError:
            return "gone"
        try:
            seen = FileId.of(md)
            if FileId.of(os.fstat(fd)) != seen:
                return "gone"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "busy"
            # Under the lock: a claim that held it before us has moved the entry.
            if not _same_file(path, seen):
                return "gone"
            raw = _fs.read_fd(fd, MAX_REQUEST_BYTES + 1)
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            rid = body.get("runId") if isinstance(body, dict) else None
            run_id = rid if is_id(rid, 128) else None
            for d in (self.rejected, self.runs, self.terminal_index):
                _fs.mkdir_private_all(d)
            intent = os.path.join(self.rejected, f"{INTENT_PREFIX}{seen.ino}-{name}")
            intent_body = {
                "version": 1, "file": name, "message": message, "dev": md.st_dev, "ino": md.st_ino,
                "size": md.st_size, "mtimeNs": str(md.st_mtime_ns), "writtenAt": now_ms(),
            }
            try:
                _fs.write_atomic(intent, json.dumps(intent_body, indent=2).encode(), durable=True)
            except OSError as e:
                raise RunspoolError(
                    f"nothing was withdrawn: cannot record the withdrawal in {intent} ({e}); free some space and try again"
                ) from e
            try:
                entry = self._move_to_rejected(path, name, seen)
            except BaseException:
                if self._find_entry(name, seen) is None:
                    _unlink_quiet(intent)
                raise
            if entry is None:
                _unlink_quiet(intent)
                return "gone"
            err = os.path.join(self.rejected, _error_name(os.path.basename(entry)))
            error_body = {
                "version": 1, "file": os.path.basename(entry), "code": "withdrawn", "message": message,
                "rejectedAt": now_ms(),
            }
            _fs.write_atomic(err, json.dumps(error_body, indent=2, ensure_ascii=False).encode(), durable=True)
            # No run to make (no valid run id, or the id is taken): nothing is left for the daemon.
            if run_id is None or os.path.lexists(os.path.join(self.runs, run_id)):
                _unlink_quiet(intent)
            return "withdrawn"
        finally:
            os.close(fd)

    def _move_to_rejected(self, path: str, name: str, seen: FileId) -> Optional[str]:
        """reject.rs `reject_entry`'s move: to the first free `<base>[-N].json`
        of rejected/. None: the entry moved was not `seen` (replaced
        meanwhile); it is put back in the spool."""
        st = os.lstat(self.rejected)
        if not stat.S_ISDIR(st.st_mode):
            raise RunspoolError(
                f"{self.rejected} is not a real directory (a symlink?); replace it with one (mkdir -m 700)"
            )
        n = 0
        while True:
            entry, err = _rejected_names(self.rejected, name, n)
            if not os.path.lexists(err):
                try:
                    _fs.rename_noreplace(path, entry)
                    break
                except FileExistsError:
                    pass
            n += 1
        if FileId.of(os.lstat(entry)) != seen:
            _republish(entry, self.spool, name)
            return None
        _fs.fsync_dir(self.rejected)
        _fs.fsync_dir(self.spool)
        return entry

    def _find_entry(self, name: str, seen: FileId) -> Optional[str]:
        for n in range(1000):
            p = _rejected_names(self.rejected, name, n)[0]
            try:
                if FileId.of(os.lstat(p)) == seen:
                    return p
            except FileNotFoundError:
                continue
        return None

    # ---------------------------------------------------------------- list

    def list(self, active: bool = False, recent: Optional[int] = None, session: Optional[str] = None) -> List[Status]:
        """Runs from the indexes, as `runspool list`: without arguments the
        active runs (oldest claim first), then the 20 most recently ended;
        `active=True` only the active ones; `recent=N` only the N most
        recently ended. `session` keeps the runs of that session id."""
        if active and recent is not None:
            raise ValueError("list() takes active=True or recent=N, not both")
        out: List[Status] = []
        if recent is None:
            out.extend(self._list_active(session))
        if not active:
            out.extend(self._list_recent(session, 20 if recent is None else recent))
        return out

    def _safe_status(self, run_id: str) -> Optional[Status]:
        try:
            return self._run_status(run_id)
        except RunspoolError as e:
            return Status(run_id, "unreadable", os.path.join(self.runs, run_id), {"statusError": str(e)})

    def _list_active(self, session: Optional[str]) -> List[Status]:
        try:
            names = os.listdir(self.active_index)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if not is_id(n, 255):
                continue
            try:
                if not stat.S_ISREG(os.lstat(os.path.join(self.active_index, n)).st_mode):
                    continue
            except FileNotFoundError:
                continue
            s = self._safe_status(n)
            if s is None or s.state not in ("queued", "running", "unreadable"):
                continue  # a stale marker: the daemon removes it
            if session is not None and s.data.get("sessionId", session) != session:
                continue
            out.append(s)

        def key(s: Status) -> Tuple[int, str]:
            q = s.data.get("queue")
            c = q.get("claimedAt") if isinstance(q, dict) else None
            return (c if isinstance(c, int) else 0, s.run_id)

        return sorted(out, key=key)

    def _list_recent(self, session: Optional[str], limit: int) -> List[Status]:
        if limit <= 0:
            return []
        try:
            sessions = [
                os.path.join(self.terminal_index, e.name)
                for e in os.scandir(self.terminal_index)
                if e.is_dir(follow_symlinks=False)
            ]
        except FileNotFoundError:
            return []
        if session is not None:
            want = os.path.join(self.terminal_index, _seg(session))
            sessions = [s for s in sessions if s == want]
        names: List[Tuple[str, str]] = []
        for d in sessions:
            try:
                names.extend((n, d) for n in os.listdir(d) if not n.startswith(".") and n.endswith(".json"))
            except OSError:
                continue
        names.sort(key=lambda x: x[0], reverse=True)
        out: List[Status] = []
        seen = set()
        for n, d in names:
            if len(out) >= limit:
                break
            try:
                raw = _fs.read_regular(os.path.join(d, n), MAX_SMALL_FILE)
                m = json.loads(raw) if raw is not None else None
            except (RunspoolError, ValueError, OSError):
                continue
            if not isinstance(m, dict) or m.get("version") != 1:
                continue
            rid = m.get("runId")
            # A marker is a hint, never a path: only an id of the grammar is
            # looked up, and the status found must be that run's own.
            if not isinstance(rid, str) or not is_id(rid, 255) or rid in seen:
                continue
            s = self._safe_status(rid)
            if s is None or s.active:
                continue
            if s.state != "unreadable" and (
                s.data.get("sessionId") != m.get("sessionId") or max(s.data.get("endedAt") or 0, 0) != m.get("endedAt")
            ):
                continue
            seen.add(rid)
            out.append(s)
        return out

    # ---------------------------------------------------------------- events

    def events(
        self, since: Optional[int] = None, follow: bool = False, poll_interval: float = 0.1
    ) -> Iterator[Dict[str, Any]]:
        """The events of every run (PROTOCOL §5), each once. `since`: only
        events whose `ts` (ms) is at least that. With `follow`, keeps looking
        for new events (of new runs too) until the caller stops iterating;
        without it, ends after one pass. Only complete lines are read: a line
        being written is read once it is whole."""
        # run id -> (file identity, offset after its last complete line)
        offsets: Dict[str, Tuple[FileId, int]] = {}
        while True:
            batch: List[Dict[str, Any]] = []
            try:
                names = os.listdir(self.runs)
            except FileNotFoundError:
                names = []
            present = set()
            for n in names:
                if n.startswith(".") or not is_id(n, 255):
                    continue
                present.add(n)
                batch.extend(self._new_events(n, offsets, since))
            for gone in set(offsets) - present:
                del offsets[gone]
            batch.sort(key=lambda e: e["ts"] if isinstance(e.get("ts"), int) else 0)
            yield from batch
            if not follow:
                return
            time.sleep(poll_interval)

    def _new_events(
        self, run_id: str, offsets: Dict[str, Tuple[FileId, int]], since: Optional[int]
    ) -> List[Dict[str, Any]]:
        try:
            dfd = self._open_run_dir(run_id)
        except RunspoolError:
            return []
        if dfd is None:
            return []
        try:
            try:
                fd = _fs.open_regular("events.jsonl", dir_fd=dfd)
            except RunspoolError:
                return []
        finally:
            os.close(dfd)
        if fd is None:
            return []
        out: List[Dict[str, Any]] = []
        try:
            fid = FileId.of(os.fstat(fd))
            prev = offsets.get(run_id)
            offset = prev[1] if prev is not None and prev[0] == fid else 0
            while True:
                chunk = _fs.read_fd(fd, 4 << 20, offset)
                end = chunk.rfind(b"\n")
                if end < 0:
                    if len(chunk) >= MAX_LINE * 4:
                        offset += len(chunk)  # a line no writer of runspool's makes: skipped
                        continue
                    break
                for line in chunk[:end].split(b"\n"):
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(ev, dict):
                        continue
                    if since is not None and not (isinstance(ev.get("ts"), int) and ev["ts"] >= since):
                        continue
                    out.append(ev)
                offset += end + 1
            offsets[run_id] = (fid, offset)
        finally:
            os.close(fd)
        return out


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _same_file(path: str, seen: FileId) -> bool:
    try:
        return FileId.of(os.lstat(path)) == seen
    except FileNotFoundError:
        return False


def _check_entry(path: str, md: os.stat_result) -> None:
    """The checks of PROTOCOL §2.3 step 1: only a request the daemon could
    claim is withdrawn; anything else it rejects on its own."""
    if not stat.S_ISREG(md.st_mode):
        raise RunspoolError(f"{path} is not a regular file; the daemon rejects it on its own, nothing to withdraw")
    if md.st_uid != os.geteuid():
        raise RunspoolError(f"{path} is owned by uid {md.st_uid}, not by you; the daemon rejects it on its own")
    if md.st_nlink != 1:
        raise RunspoolError(f"{path} has {md.st_nlink} hard links; the daemon rejects it on its own")
    if md.st_mode & 0o022:
        raise RunspoolError(f"{path} is writable by group or others; the daemon rejects it on its own")
    if md.st_size > MAX_REQUEST_BYTES:
        raise RunspoolError(f"{path} is larger than {MAX_REQUEST_BYTES} bytes; the daemon rejects it on its own")


def _error_name(entry: str) -> str:
    stem = entry[: -len(".json")] if entry.endswith(".json") else entry
    name = f"{stem}{ERROR_FILE_SUFFIX}"
    if len(name.encode()) > 255:
        name = f"~sha256-{hashlib.sha256(entry.encode()).hexdigest()}{ERROR_FILE_SUFFIX}"
    return name


def _rejected_names(rejected: str, name: str, n: int) -> Tuple[str, str]:
    """reject.rs `rejected_names`: `<base>[-N].json` and its error file."""
    if name.endswith(".json"):
        base, ext = name[: -len(".json")], ".json"
    else:
        base, ext = name, ""
    if n:
        base = f"{base}-{n}"
    entry = f"{base}{ext}"
    err = f"{base}{ERROR_FILE_SUFFIX}"
    if len(err.encode()) > 255:
        err = f"~sha256-{hashlib.sha256(entry.encode()).hexdigest()}{ERROR_FILE_SUFFIX}"
    return os.path.join(rejected, entry), os.path.join(rejected, err)


def _republish(src: str, spool: str, name: str) -> None:
    """Put an entry replaced under us back into the spool under a free name."""
    stem = name[: -len(".json")] if name.endswith(".json") else name
    candidates = [name] + [f"{stem}-{k}.json" for k in range(1, 9) if is_id(f"{stem}-{k}", 200)]
    candidates.append(f"r{uuid.uuid4().hex}.json")
    for c in candidates:
        try:
            _fs.rename_noreplace(src, os.path.join(spool, c))
            return
        except FileExistsError:
            continue
    raise RunspoolError(f"no free name in {spool} to put {src} back; move it there by hand")


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.!~*'()")
_RESERVED_NAME = re.compile(r"^(con|prn|aux|nul|com[1-9]|lpt[1-9])(\.|$)", re.IGNORECASE)
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}\Z")


def _seg(v: str, max_len: int = 255) -> str:
    """PROTOCOL §6.3 seg(): an index path segment for `v`."""
    e = "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in v.encode())
    portable = (
        e not in ("", ".", "..")
        and not e.endswith(".")
        and not _RESERVED_NAME.match(e)
        and "%5c" not in e.lower()
        and not _EXTENSION.search(e)
    )
    if len(e) <= max_len and portable:
        return e
    return "~sha256-" + hashlib.sha256(v.encode()).hexdigest()
