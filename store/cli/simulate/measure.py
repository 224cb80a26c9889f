"""What a replica process measures: the latency of the store calls its runtime makes.

The runtime counts what it does itself (``Replica.counts``); the process adds how long
each of the store's calls took, by wrapping the store it hands the runtime, and notices the
steps a draining runtime hands over (a ``release_lease`` with a check time of now), so the
fleet can time how soon another replica takes each.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The store's methods whose latency the summary reports, by the label it prints.
TIMED = {
    "record_worker_report": "report", "record_worker_reports": "report",
    "take_step": "step", "take_steps": "step",
    "claim_step": "claim", "release_lease": "release",
}  # fmt: skip
TIMED_OPERATIONS = ("report", "step", "claim", "release")


@dataclass
class ReplicaStats:
    """Latencies per operation and counters, merged from every replica's flushes."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def add(self, operation: str, seconds: float) -> None:
        self.latencies.setdefault(operation, []).append(seconds)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def merge(self, other: dict[str, Any]) -> None:
        for op, samples in other.get("latencies", {}).items():
            self.latencies.setdefault(op, []).extend(samples)
        for name, n in other.get("counters", {}).items():
            self.count(name, n)

    def take_latencies(self) -> dict[str, list[float]]:
        out, self.latencies = self.latencies, {}
        return out


Handed = Callable[[str, str], Any]


class TimedStore:
    """The store (sync or async) with its calls in ``TIMED`` timed into ``stats``, and
    ``handed(request_id, partition)`` called after each hand-over (awaited if it returns
    an awaitable)."""

    def __init__(self, store: Any, stats: ReplicaStats, handed: Handed) -> None:
        self._store = store
        self._stats = stats
        self._handed = handed

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        label = TIMED.get(name)
        if label is None:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = attr(*args, **kwargs)
            if inspect.isawaitable(result):
                return self._awaited(result, label, started, args, kwargs)
            self._done(label, started, args, kwargs)
            return result

        return call

    async def _awaited(
        self, result: Any, label: str, started: float, args: Any, kwargs: Any
    ) -> Any:
        value = await result
        notice = self._done(label, started, args, kwargs)
        if inspect.isawaitable(notice):
            await notice
        return value

    def _done(self, label: str, started: float, args: Any, kwargs: Any) -> Any:
        self._stats.add(label, time.perf_counter() - started)
        if label == "release" and kwargs.get("check_in") == 0:
            lease = args[0]
            return self._handed(lease.request_id, lease.partition)
        return None
