"""The status of a run as the client reports it (its own module, so that
the exceptions can carry one without importing the client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional

__all__ = ["ACTIVE_STATES", "Status"]

#: States in which a run (or request) has not ended yet. `pending`: waiting in
#: the spool; `claimed`: its run directory holds request.json, status.json
#: follows; `queued` and `running` are the status.json states of §4. Every
#: other state is terminal.
ACTIVE_STATES = frozenset({"pending", "claimed", "queued", "running"})


@dataclass(frozen=True)
class Status:
    """What is known of a run. `state` is one of:

    - `pending`: the request waits in the spool (`path` is its file);
    - `claimed`: the daemon moved it into its run directory, status.json follows;
    - a status.json state (`queued`, `running`, `complete`, `failed`,
      `paused`, `stopped`, or what another host writes);
    - `rejected` or `withdrawn`: refused by the daemon, or withdrawn before it
      was claimed, with its `code` and `message`.

    `data` is the file read (status.json, or the rejection's error file).
    """

    run_id: str
    state: str
    path: str
    data: Mapping[str, Any] = field(default_factory=dict)
    code: Optional[str] = None
    message: Optional[str] = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def terminal(self) -> bool:
        return not self.active

    @property
    def exit_code(self) -> Optional[int]:
        v = self.data.get("exitCode")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def error(self) -> Optional[str]:
        v = self.data.get("error")
        return v if isinstance(v, str) else self.message

    @property
    def steps(self) -> List[Mapping[str, Any]]:
        v = self.data.get("steps")
        return [s for s in v if isinstance(s, dict)] if isinstance(v, list) else []
