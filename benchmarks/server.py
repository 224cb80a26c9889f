"""What the Redis server spent on a row: ``INFO commandstats`` and ``INFO cpu``, per call.

``ServerStats`` wraps a row's driver: it reads both sections right before and right after
each timed slice (outside the timing) and adds the differences to the worker's counters,
which the harness sums over slices into ``Row.details["counters"]``:
``usec:<command>`` and ``calls:<command>`` per command name, ``cpu_us`` the server
process's ``used_cpu_sys + used_cpu_user``.

Two figures per call come out of them (``per_call``):

- ``cmdstat_us``: the time the server spent executing the commands the client sent. A
  command a script calls (or a MULTI..EXEC runs) is counted under its own name *and* inside
  the EVALSHA (or EXEC) that called it, so summing every name counts it twice. Only the
  names the client sent itself count (``top_level``: learned from the wire, see
  benchmarks.wire); a name sent both itself and from inside scripts (a ZADD, say) counts
  the share of its calls the client sent, at its average cost per call (``top_level_usec``).
- ``cpu_us``: the whole process: also reading and writing the sockets, which for small
  commands costs more than executing them, and its timer (``hz``), and the two INFO calls
  themselves (tens of µs per slice, over thousands of calls). On a server shared with
  other clients (``--redis-url``) both figures include their work, so they are only
  reported, never checked, there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.workers import Driver, Samples, Worker

Snapshot = dict[str, int]


def snapshot(client: Any) -> Snapshot:
    """The server's counters now, flattened (see the module docstring)."""
    info = client.info("cpu", "commandstats")
    return parse_info(info)


def parse_info(info: Mapping[str, Any]) -> Snapshot:
    out: Snapshot = {
        "cpu_us": round((float(info["used_cpu_sys"]) + float(info["used_cpu_user"])) * 1e6)
    }
    for key, stat in info.items():
        if key.startswith("cmdstat_") and isinstance(stat, Mapping):
            name = key.removeprefix("cmdstat_").lower()
            out[f"calls:{name}"] = int(stat["calls"])
            out[f"usec:{name}"] = int(stat["usec"])
    return out


def difference(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after - before``, for every counter that moved (a command first seen counts from 0)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def top_level_usec(counters: Mapping[str, int], sent: Mapping[str, float]) -> float:
    """µs the server spent on the commands the client sent: ``sent`` is how many of each
    name it sent (over the same window as ``counters``); see the module docstring."""
    total = 0.0
    for name, count in sent.items():
        calls, usec = counters.get(f"calls:{name}", 0), counters.get(f"usec:{name}", 0)
        if calls:
            total += usec * min(1.0, count / calls)
    return total


def per_call(
    counters: Mapping[str, int], sent_per_call: Mapping[str, float], calls: int
) -> dict[str, float]:
    """Server time per call: ``cmdstat_us`` (commands sent) and ``cpu_us`` (the process)."""
    sent = {name: n * calls for name, n in sent_per_call.items()}
    return {
        "cmdstat_us": top_level_usec(counters, sent) / calls,
        "cpu_us": counters.get("cpu_us", 0) / calls,
    }


class ServerStats(Driver):
    """``inner``, with the server's counters read around each slice (``client``: any
    connection to the same server, used outside the timing)."""

    def __init__(self, inner: Driver, client: Any, worker: Worker) -> None:
        self.inner, self.client, self.worker = inner, client, worker

    def run(self, duration: float, start_at: float) -> Samples:
        before = snapshot(self.client)
        samples = self.inner.run(duration, start_at)
        moved = difference(before, snapshot(self.client))
        self.worker.counters.update(moved)
        return samples

    def close(self) -> None:
        self.inner.close()
