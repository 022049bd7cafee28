"""The exceptions of the runspool client."""

from __future__ import annotations

from typing import Optional

from ._status import Status


class RunspoolError(Exception):
    """Something under the runspool root is not as the protocol says; the
    message names the path and the fix."""


class NotFound(RunspoolError):
    """No run, pending request or rejection of that id under the root."""

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(message)
        self.run_id = run_id


class Rejected(RunspoolError):
    """The request was refused by the daemon (`code` is the rejection code of
    PROTOCOL §2.3, for example `invalid-field`), or withdrawn (`withdrawn`)
    before it was claimed. `path` is the file that says so."""

    def __init__(self, run_id: str, code: str, message: str, path: str) -> None:
        super().__init__(f"run {run_id} was {'withdrawn' if code == 'withdrawn' else 'rejected'} ({code}): {message} (see {path})")
        self.run_id = run_id
        self.code = code
        self.message = message
        self.path = path


class WaitTimeout(RunspoolError, TimeoutError):
    """`wait` gave up; the run goes on. `status` is the last one seen."""

    def __init__(self, run_id: str, timeout: float, status: "Optional[Status]") -> None:
        state = status.state if status is not None else "unknown"
        super().__init__(
            f"run {run_id} did not end within {timeout:g} s (still {state}); it goes on: wait again, or stop it"
        )
        self.run_id = run_id
        self.timeout = timeout
        self.status = status
