"""The crash-free reference run, and how a request's final state is compared with it.

The reference runs the same ``Replica`` code in this process on a private fakeredis: one
replica, every report delivered once and in order, no kills. Since every decision of the
model is a function of the seed and the request, a simulated run whose final states differ
from these has lost, doubled or misordered something.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from store.cli.simulate import model
from store.cli.simulate.replica import Replica, SimKeys, Timing, decode_dispatch, ingest
from store.errors import ConfigurationError
from store.records import RequestState
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


def reference_run(seed: int, request_ids: Sequence[str], timing: Timing) -> dict[str, Any]:
    """Every request's canonical final state from a crash-free, duplicate-free run."""
    fakeredis = fakeredis_with_lua()
    client: Any = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    store = RequestStore(client, namespace="reference", lease_ttl=timing.lease_ttl)
    keys = SimKeys("reference")
    replica = Replica(store, replica_id="reference", seed=seed, timing=timing, keys=keys)
    specs = [model.spec(seed, rid) for rid in request_ids]
    for spec in specs:
        ingest(store, keys, spec, timing.pass_deadline)
    states: dict[str, Any] = {}
    # Recovery is never needed without crashes; allow some, bounded, rather than hang.
    recoveries_left = 10 + 3 * sum(spec.passes for spec in specs)
    while len(states) < len(specs):
        raw = client.lpop(keys.dispatch)
        if raw is not None:
            rid, partition, fwd_pass = decode_dispatch(raw)
            for report in model.reports(replica.spec(rid), partition, fwd_pass):
                replica.handle(report)
            continue
        while (done := client.lpop(keys.finished)) is not None:
            rid = done.decode()
            if rid not in states:
                states[rid] = canonical(store.load_request(rid))
                store.delete_request(rid)
        if len(states) < len(specs):
            recoveries_left -= 1
            if recoveries_left < 0:
                stuck = sorted(set(request_ids) - set(states))
                raise SimulationError(f"the reference run is stuck: {', '.join(stuck)}")
            replica.recover()
    client.close()
    return states
