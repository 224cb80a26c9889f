"""The crash-free reference run, and how a request's final state is compared with it.

The reference runs the runtime (``store.Replica`` with the simulation's planner) in this
process on a private fakeredis: one replica, every report delivered once and in order, no
kills, no recovery. Since every decision of the model is a function of the seed and the
request, a simulated run whose final states differ from these has lost, doubled or
misordered something; ``doubled`` reads the same from a request's history.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from store.cli.simulate.planner import SimPlanner
from store.errors import ConfigurationError
from store.records import RequestState
from store.runtime import Replica, Timing
from store.store import RequestStore

# Fields that differ between runs by nature: when the request was created and finished.
_VOLATILE_RECORD_FIELDS = ("created_at", "finished_at")


class SimulationError(Exception):
    """The simulation itself could not run to the end (not a mismatch of final states)."""


def canonical(state: RequestState) -> dict[str, Any]:
    """A request's final state as plain data, without what differs between runs by nature."""
    data: dict[str, Any] = msgspec.to_builtins(state, str_keys=True, order="deterministic")
    for name in _VOLATILE_RECORD_FIELDS:
        data["record"].pop(name, None)
    return data


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where two canonical states differ, as ``path: expected X, got Y`` lines."""
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        out = []
        for key in sorted(set(expected) | set(actual), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in actual:
                out.append(f"{where}: missing (expected {expected[key]!r})")
            elif key not in expected:
                out.append(f"{where}: unexpected {actual[key]!r}")
            else:
                out += differences(expected[key], actual[key], where)
        return out
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []


def fakeredis_with_lua() -> Any:
    """The fakeredis module, checked to run Lua (the store's scripts need lupa)."""
    hint = "install `pip install 'fakeredis[lua]'` (or 'mstar-conductor-store[demo]')"
    try:
        import fakeredis
    except ImportError as e:
        raise ConfigurationError(
            f"the simulation runs its reference (and, without --redis-url, its Redis) on "
            f"fakeredis, which is not installed ({e}): {hint}"
        ) from e
    if importlib.util.find_spec("lupa") is None:
        raise ConfigurationError(
            "fakeredis is installed without Lua support (the 'lupa' package is missing), "
            f"and the store runs Lua scripts: {hint}"
        )
    return fakeredis


def reference_run(
    seed: int, request_ids: Sequence[str], timing: Timing | None = None
) -> dict[str, Any]:
    """Every request's canonical final state from a crash-free, duplicate-free run."""
    fakeredis = fakeredis_with_lua()
    client: Any = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    timing = timing or Timing(keep_for=600.0)
    store = RequestStore(client, namespace="reference", lease_ttl=timing.lease_ttl)
    planner = SimPlanner(seed)
    replica = Replica(store, planner=planner, replica_id="reference", timing=timing)
    for rid in request_ids:
        replica.submit(rid, **planner.create(rid))
    states: dict[str, Any] = {}
    while planner.sent:
        for report in planner.reports_for(*planner.sent.pop(0)):
            replica.apply_report(report)
        for rid in planner.finished_ids:
            if rid not in states:
                states[rid] = canonical(store.load_request(rid))
                store.delete_request(rid)
    client.close()
    stuck = sorted(set(request_ids) - set(states))
    if stuck:  # every pass reported once and in order: nothing should wait for recovery
        raise SimulationError(f"the reference run is stuck: {', '.join(stuck)}")
    return states


def doubled(history: Sequence[tuple[Any, Mapping[bytes, bytes]]]) -> list[str]:
    """What a request's history shows applied more than once: a step of one pass, or one
    rank's report of one pass (the store must absorb every repeat)."""
    applied: Counter[str] = Counter()
    for _, entry in history:
        if entry.get(b"outcome") != b"applied":
            continue
        op = entry.get(b"op", b"").decode()
        where = [entry.get(name, b"").decode() for name in (b"partition", b"pass")]
        if op == "step":
            applied["step " + "/".join(where)] += 1
        elif op == "report":
            rank = [entry.get(name, b"").decode() for name in (b"wg", b"rank")]
            applied["report " + "/".join(where + rank)] += 1
    return sorted(f"{what} applied {n} times" for what, n in applied.items() if n > 1)
