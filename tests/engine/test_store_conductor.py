"""mstar-ai's ``Conductor`` on the store (``store.integrations.mstar``) against the engine's
own, in one process: the same batches of messages, the same messages sent, and the store
holding exactly what the engine holds; then a takeover between two turns, after which the
successor carries every request on as if nothing happened.

The conductors have no workers or sockets (``tests.engine.oracle``); the store is
fakeredis. The test with real processes, SIGKILL and SIGSTOP is ``test_kill.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import types as store_types

if not store_types.engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

import dataclasses

import fakeredis

from store import RequestStore
from store.conductor.convert import HELD_FIELDS
from store.errors import RequestNotFound
from store.integrations.mstar import StoreConductor
from tests.engine.oracle import (
    PartitionShape,
    ScriptedModel,
    Shape,
    StageShape,
    WalkShape,
    choices,
    finishing_messages,
    make_conductor,
    new_request_message,
    next_message,
    quiet_conductor_logs,
    run_loop_once,
    shapes,
    unlaunched,
    write_config,
)
from tests.engine.test_conductor_diff import _canonical, _engine_sends

ROUNDS = 300
CLOCKS = ("conductor_ingest_time", "conductor_finish_time")


def _store_conductor(shape: Shape, tmp: Path, store: RequestStore, attach: bool) -> Any:
    config = write_config(shape, tmp)
    with unlaunched():
        return StoreConductor(
            ScriptedModel(shape), str(config), store=store, deployment="d1", attach=attach,
            launch=False, socket_path_prefix=str(tmp / "sockets"), stall_timeout=3600.0,
        )  # fmt: skip


def _turn(engine: Any, ours: Any, batch: list[Any]) -> None:
    """One batch to both: the store-backed one sends at the end of the turn, after its
    commit (or, after a turn the engine's loop left by an exception, at the next one)."""
    expected = run_loop_once(engine, batch)
    first = run_loop_once(ours, batch)
    late = run_loop_once(ours, [])
    assert (expected.error is None) == (first.error is None)
    if first.error is None:
        assert late.sent == []
    sent = first.sent + late.sent
    assert _canonical(_engine_sends(sent)) == _canonical(_engine_sends(expected.sent))


def _same_requests(engine: Any, ours: Any, store: RequestStore, rids: list[str]) -> None:
    assert set(ours.requests) == set(engine.requests)
    assert set(ours.draining) == set(engine.draining)
    for rid in rids:
        data = engine.requests.get(rid)
        try:
            held = store.load_conductor_request(rid)
        except RequestNotFound:
            held = None
        assert (held is None) == (data is None), rid
        if data is None or held is None:
            continue
        for name in HELD_FIELDS:
            assert getattr(held, name) == getattr(ours.requests[rid], name), (rid, name)
            if name not in CLOCKS:  # each conductor stamps its own
                assert getattr(held, name) == getattr(data, name), (rid, name)
        assert (held.teardown is None) == (rid not in engine.draining)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(shape=shapes(), data=st.data())
def test_the_store_backed_conductor_is_the_engine_and_takes_over(
    shape: Shape, data: st.DataObject
) -> None:
    shape = dataclasses.replace(shape, max_concurrent_requests=None)
    store = RequestStore(fakeredis.FakeRedis(), namespace="integration")
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        engine = make_conductor(shape, Path(tmp) / "engine")
        ours = _store_conductor(shape, Path(tmp) / "ours", store, attach=False)
        rids = ["a", "b"][: data.draw(st.integers(1, 2), label="requests")]
        steps = data.draw(choices(max_size=30), label="choices")
        crash_at = data.draw(st.integers(0, len(steps) + ROUNDS), label="takeover at")
        _turn(engine, ours, [new_request_message(shape, rid, 5) for rid in rids])
        turns = 0
        batches = [[next_message(engine, rids[c % len(rids)], c >> 1)] for c in steps]
        for batch in batches:
            batch = [
                m for m in batch if "no_such_wg" not in getattr(m.body, "worker_graph_ids", ())
            ]
            _turn(engine, ours, batch)
            turns += 1
            if turns == crash_at:  # between two turns: the predecessor is gone, nothing lost
                ours = _store_conductor(shape, Path(tmp) / "ours", store, attach=True)
            _same_requests(engine, ours, store, rids)
        for _ in range(ROUNDS):
            if not any(rid in engine.requests for rid in rids):
                break
            for rid in rids:
                messages = finishing_messages(engine, rid)
                if messages:
                    _turn(engine, ours, messages)
                    turns += 1
                    if turns == crash_at:
                        ours = _store_conductor(shape, Path(tmp) / "ours", store, attach=True)
                    _same_requests(engine, ours, store, rids)
        assert not engine.requests and not ours.requests
        run_loop_once(ours, [])
        assert store.list_conductor_requests() == []


def test_a_turn_whose_state_was_not_stored_sends_nothing_until_it_is(tmp_path: Path) -> None:
    """The store is away for a turn: its messages wait (none leaves before its state is
    stored), no new message is taken, and the next turn sends them once."""
    from store.errors import StoreConnectionError

    stage = StageShape(("default_s0n0",), (0, 1))
    walk = WalkShape("default_prefill", (0,))
    shape = Shape(partitions=(PartitionShape("default", (stage,), (walk,), passes=2),))
    store = RequestStore(fakeredis.FakeRedis(), namespace="away")
    with quiet_conductor_logs():
        ours = _store_conductor(shape, tmp_path, store, attach=False)
        engine = make_conductor(shape, tmp_path / "engine")
        request = new_request_message(shape, "a", 1)
        expected = run_loop_once(engine, [request])
        away = StoreConnectionError("away")
        with (
            mock.patch.object(store, "save_conductor_request", side_effect=away),
            mock.patch.object(store, "save_conductor_requests", side_effect=away),
        ):
            held_back = run_loop_once(ours, [request])
            again = run_loop_once(ours, [request])  # not taken while the store is away
        assert held_back.sent == [] and again.sent == []
        assert store.list_conductor_requests() == []
        ours.communicator.inner.inbox.clear()
        flushed = run_loop_once(ours, [])
    assert _canonical(_engine_sends(flushed.sent)) == _canonical(_engine_sends(expected.sent))
    assert store.list_conductor_requests() == ["a"]


def test_a_deployment_attaches_only_its_own_requests(tmp_path: Path) -> None:
    """Two deployments, one store: attaching one takes over its requests and never the
    other's (whose workers hold their caches), and each stays fenced to its own."""
    stage = StageShape(("default_s0n0",), (0,))
    walk = WalkShape("default_prefill", (0,))
    shape = Shape(partitions=(PartitionShape("default", (stage,), (walk,), passes=3),))
    store = RequestStore(fakeredis.FakeRedis(), namespace="fleet")
    config = write_config(shape, tmp_path)

    def conductor(deployment: str, attach: bool) -> Any:
        with unlaunched():
            return StoreConductor(
                ScriptedModel(shape), str(config), store=store, deployment=deployment,
                attach=attach, launch=False, socket_path_prefix=str(tmp_path / deployment),
            )  # fmt: skip

    with quiet_conductor_logs():
        east, west = conductor("east", False), conductor("west", False)
        run_loop_once(east, [new_request_message(shape, "e-1", 1)])
        run_loop_once(west, [new_request_message(shape, "w-1", 2)])
        run_loop_once(west, [new_request_message(shape, "w-2", 3)])
        held = {rid: store.load_conductor_request(rid).owner for rid in ("e-1", "w-1", "w-2")}
        assert held == {"e-1": "east", "w-1": "west", "w-2": "west"}
        successor = conductor("west", True)
        assert set(successor.requests) == {"w-1", "w-2"}
        assert set(east.requests) == {"e-1"}  # east drives its own on, untouched
        run_loop_once(east, finishing_messages(east, "e-1"))
        assert store.load_conductor_request("e-1").partition_states == (
            east.requests["e-1"].partition_states
        )
