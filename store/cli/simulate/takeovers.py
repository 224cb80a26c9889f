"""How soon another replica takes over a step that a killed or drained replica held.

After a SIGKILL the fleet reads which live leases the victim held; a draining replica says
which leases it handed over. Each such step is taken over by another replica's recovery
(``claim_step``), which the request's history records with the server's time: the latency
is from the kill (or the hand-over) to that claim. A SIGKILLed step waits for its lease to
run out (about one lease TTL); a handed-over one for the next recovery look (at most one
recovery interval).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KILL, DRAIN = "kill", "drain"


@dataclass
class Awaited:
    request_id: str
    partition: str
    victim: str
    since: float  # wall clock seconds (the server's history shares the host's clock)
    how: str  # KILL or DRAIN


@dataclass
class Takeovers:
    """Steps awaiting a takeover, and the latencies of those taken over, per kind."""

    awaited: list[Awaited] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {KILL: [], DRAIN: []})

    def expect(self, request_id: str, partition: str, victim: str, since: float, how: str) -> None:
        self.awaited.append(Awaited(request_id, partition, victim, since, how))

    def requests(self) -> set[str]:
        return {a.request_id for a in self.awaited}

    def resolve(
        self, request_id: str, history: Iterable[tuple[Any, Mapping[bytes, bytes]]]
    ) -> None:
        """Settle the steps of ``request_id`` whose takeover ``history`` (its entries since
        the earliest awaited) shows."""
        entries = [(_ms(entry_id) / 1000, entry) for entry_id, entry in history]
        still = []
        for awaited in self.awaited:
            at = None
            if awaited.request_id == request_id:
                at = _claimed(awaited, entries)
            if at is None:
                still.append(awaited)
            else:
                self.latencies[awaited.how].append(max(0.0, at - awaited.since))
        self.awaited = still

    def earliest(self, request_id: str) -> float:
        return min(a.since for a in self.awaited if a.request_id == request_id)


def _claimed(awaited: Awaited, entries: list[tuple[float, Mapping[bytes, bytes]]]) -> float | None:
    for at, entry in entries:
        if (
            at >= awaited.since - 0.001  # the history's ids are whole milliseconds
            and entry.get(b"op") == b"claim"
            and entry.get(b"outcome") == b"applied"
            and entry.get(b"partition") == awaited.partition.encode()
            and entry.get(b"replica") != awaited.victim.encode()
        ):
            return at
    return None


def _ms(entry_id: Any) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0])
