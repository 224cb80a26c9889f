"""The oracle's self-test: the engine's conductor, driven by generated messages, stays sane.

Whatever the store is compared against must itself behave: requests end (complete, fail or
are aborted, then torn down once their readers drained), a client hears of each request once,
ref counts only count what is still persisted, and the only exceptions the run loop swallows
are the ones the generator provoked on purpose (an unknown worker graph id).
"""

from __future__ import annotations

import inspect
import tempfile
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from store import types as store_types

if not store_types.engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

from mstar.api_server.request_types import APIServerMessage
from mstar.conductor.conductor import Conductor
from mstar.utils.ipc_format import (
    ConductorMessage,
    ConductorMessageType,
    RemoveRequest,
    UnpersistTensors,
    WorkerGraphsDone,
    WorkerMessage,
)

from mstar.graph.base import TensorPointerInfo
from mstar.graph.loop_indices import NestedLoopIndices
from tests.engine import oracle
from tests.engine.oracle import (
    PREPROCESS_WORKER,
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
)

ROUNDS = 400  # batches allowed to drive every request to its end


def _provoked(batch: list[Any]) -> bool:
    return any(
        m.message_type == ConductorMessageType.WORKER_GRAPHS_DONE
        and "no_such_wg" in m.body.worker_graph_ids
        for m in batch
    )


class Sanity:
    """Checks made on what the conductor sent and holds after every batch."""

    def __init__(self) -> None:
        self.completed: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.removed: dict[str, set[str]] = {}
        self.errors: list[Exception] = []

    def after(self, conductor: Any, batch: list[Any], outcome: Any) -> None:
        if outcome.error is not None:
            assert _provoked(batch), repr(outcome.error)
            assert isinstance(outcome.error, KeyError), repr(outcome.error)
            event("the loop swallowed a KeyError")
            self.errors.append(outcome.error)
        for dest, msg in outcome.sent:
            if isinstance(msg, APIServerMessage):
                assert dest == "api_server"
                if msg.message_type == "request_complete":
                    self.completed[msg.body.request_id] += 1
                elif msg.message_type == "request_failed":
                    self.failed[msg.body.request_id] += 1
            elif isinstance(msg, WorkerMessage):
                if isinstance(msg.body, UnpersistTensors):
                    assert all(n >= 1 for n in msg.body.uuid_to_ref_count.values())
                if isinstance(msg.body, RemoveRequest):
                    self.removed.setdefault(msg.body.request_id, set()).add(dest)
        for rid in set(self.completed) | set(self.failed):
            assert self.completed[rid] + self.failed[rid] == 1, rid
        for rid, data in conductor.requests.items():
            held = {info.uuid for infos in data.persist_signals.values() for info in infos}
            for uuid, count in data.persist_signal_ref_cnt.items():
                assert count >= 1, (rid, uuid, count)
                assert uuid in held, (rid, uuid)
            for ps in data.partition_states.values():
                assert ps.current_worker_graph_ids <= data.all_worker_graph_ids
                for wg, n in ps.wg_rank_completions.items():
                    assert n >= 1, (rid, wg)
        for rid, drain in conductor.draining.items():
            assert rid in conductor.requests
            assert drain.expected_acks <= drain.participants


def _run(conductor: Any, batch: list[Any], sanity: Sanity) -> None:
    outcome = run_loop_once(conductor, batch)
    sanity.after(conductor, batch, outcome)


def _pending(conductor: Any, rids: list[str]) -> bool:
    queued = {body.request_id for body in conductor.waiting_queue}
    return any(
        rid in conductor.requests or rid in conductor.draining or rid in queued for rid in rids
    )


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(shape=shapes(), data=st.data())
def test_generated_runs_end_sanely(shape: Shape, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = make_conductor(shape, tmp)
        rids = ["r0", "r1"][: data.draw(st.sampled_from([2, 1]), label="requests")]
        steps = data.draw(choices(max_size=40), label="choices")
        ingest_at = {
            rid: data.draw(st.integers(0, len(steps)), label=f"ingest {rid}") for rid in rids
        }
        ingest_at[rids[0]] = 0
        sanity = Sanity()

        if shape.max_concurrent_requests == 1 and len(rids) == 2:
            event("two requests, one slot")
        batch: list[Any] = []
        for i, choice in enumerate(steps):
            for rid in rids:
                if ingest_at[rid] == i:
                    batch.append(new_request_message(shape, rid, choice))
            rid = rids[choice % len(rids)]
            batch.append(next_message(conductor, rid, choice >> 1, pending=batch))
            if (choice >> 40) % 3 == 0 or (choice >> 8) % 3 == 0:
                _run(conductor, batch, sanity)
                batch = []
        batch += [
            new_request_message(shape, rid, 7) for rid in rids if ingest_at[rid] >= len(steps)
        ]
        _run(conductor, batch, sanity)

        for _ in range(ROUNDS):
            if not _pending(conductor, rids):
                break
            for rid in rids:
                msgs = finishing_messages(conductor, rid)
                if msgs:
                    _run(conductor, msgs, sanity)
        assert not _pending(conductor, rids), "requests never ended"

        for rid in rids:
            if sanity.completed[rid] or sanity.failed[rid]:
                assert PREPROCESS_WORKER in sanity.removed[rid]
            ending = (
                "completed"
                if sanity.completed[rid]
                else "failed"
                if sanity.failed[rid]
                else ("aborted" if rid in sanity.removed else "dropped before ingest")
            )
            event(f"a request {ending}")
        assert not conductor.draining
        assert not conductor.waiting_queue


@settings(max_examples=30, deadline=None)
@given(shape=shapes(), choice=st.integers(0, 2**32 - 1))
def test_the_model_decides_by_its_arguments_alone(shape: Shape, choice: int) -> None:
    """Equal arguments give equal ForwardPassArgs, and the arguments are left untouched."""
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = make_conductor(shape, tmp)
        run_loop_once(conductor, [new_request_message(shape, "r0", choice)])
        data = conductor.requests["r0"]
        model: ScriptedModel = conductor.model
        for name, ps in data.partition_states.items():
            conns = data.get_incoming_connections(name)
            before = repr((ps.metadata, data.persist_signals, conns))
            a = model.forward_pass_args(name, ps.metadata, data.persist_signals, conns)
            b = model.forward_pass_args(name, ps.metadata, data.persist_signals, conns)
            assert a == b
            assert repr((ps.metadata, data.persist_signals, conns)) == before


@settings(max_examples=10, deadline=None)
@given(shape=shapes())
def test_construction_is_quick(shape: Shape) -> None:
    """A conductor per example is affordable (no workers, no sockets)."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        conductor = make_conductor(shape, tmp)
        elapsed = time.perf_counter() - start
    assert conductor.communicator.sent == []
    assert elapsed < 1.0, elapsed


def test_the_loop_copy_matches_the_engine() -> None:
    """run_loop_once's body is Conductor.run()'s loop line for line (nvtx and sleep aside)."""

    def lines(text: str) -> list[str]:
        return [ln.strip() for ln in text.splitlines() if ln.strip()]

    engine = inspect.getsource(Conductor.run)
    engine = engine[engine.index("try:") : engine.index("except Exception:")]
    engine_lines = [
        ln
        for ln in lines(engine)
        if "nvtx" not in ln and not ln.startswith(("range_push", "range_pop"))
    ]
    ours = inspect.getsource(oracle.run_loop_once)
    ours = ours[ours.index("# fmt: off") + len("# fmt: off") : ours.index("except Exception")]
    our_lines = [ln.replace("conductor_module.logger", "logger") for ln in lines(ours)]
    assert our_lines == engine_lines


TP2 = Shape(
    partitions=(
        PartitionShape(
            name="p0",
            stages=(StageShape(nodes=("p0_s0n0",), ranks=(0, 1)),),
            walks=(WalkShape("p0_prefill", (0,)), WalkShape("p0_decode", (0,))),
            passes=3,
        ),
    ),
)


def _report(wgs: list[str], first: bool, **fields: Any) -> ConductorMessage:
    body = WorkerGraphsDone(
        request_id="r0", worker_graph_ids=wgs, is_first_tp_rank=first, partition_name="p0"
    )
    for name, value in fields.items():
        setattr(body, name, value)
    return ConductorMessage(ConductorMessageType.WORKER_GRAPHS_DONE, body)


def _tp2_conductor(tmp: str) -> Any:
    conductor = make_conductor(TP2, tmp)
    out = run_loop_once(conductor, [new_request_message(TP2, "r0", 0)])
    assert out.error is None
    return conductor


def test_an_unknown_worker_graph_raises_after_half_applying_and_drops_the_batch() -> None:
    """The KeyError comes after the report's tokens and persist signals were taken and the
    known graphs counted; the loop swallows it, and the pass completed earlier in the same
    batch is never processed: only a later report moves the partition on."""
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = _tp2_conductor(tmp)
        ps = conductor.requests["r0"].partition_states["p0"]
        wg = "p0_prefill#0"
        info = TensorPointerInfo([3], "bfloat16", 6, 0, [1], "u1", "h:w", "worker_0")
        out = run_loop_once(
            conductor,
            [
                _report([wg], True),
                _report([wg], False),
                _report(
                    ["no_such_wg"],
                    True,
                    new_token_counts={"text": 2},
                    persist_signals={"x": [info]},
                ),
            ],
        )
        assert isinstance(out.error, KeyError)
        assert ps.fwd_pass_number == 0 and ps.completed_worker_graph_ids == {wg}
        assert ps.num_output_tokens == 2
        assert conductor.requests["r0"].persist_signals["x"][0].uuid == "u1"
        out = run_loop_once(conductor, [_report([wg], False)])  # a third report for a TP-2 graph
        assert out.error is None and ps.fwd_pass_number == 1


def test_an_unknown_partition_still_records_final_outputs() -> None:
    """final_outputs is updated before the partition is looked up, from any rank."""
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = _tp2_conductor(tmp)
        msg = _report(
            ["p0_prefill#0"], False, output_loop_indices={"o": NestedLoopIndices([], {}, 4)}
        )
        msg.body.partition_name = "nope"
        out = run_loop_once(conductor, [msg])
        assert out.error is None
        data = conductor.requests["r0"]
        assert data.final_outputs["o"].wg_fwd_pass_idx == 4
        assert data.partition_states["p0"].wg_rank_completions == {}


def test_untracked_persist_signals_get_an_empty_unpersist_and_stay() -> None:
    """A persisted tensor never sent to a worker has no ref count: unpersisting it sends its
    producer an UnpersistTensors with an empty map, and leaves it in persist_signals."""
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = _tp2_conductor(tmp)
        data = conductor.requests["r0"]
        info = TensorPointerInfo([3], "bfloat16", 6, 0, [1], "u9", "h:w", "worker_1")
        conductor._un_persist_tensors("r0", [])  # nothing: no message
        before = len(conductor.communicator.sent)
        data.persist_signals["y"] = [info]
        conductor._un_persist_tensors("r0", [info])
        (dest, msg), *rest = conductor.communicator.sent[before:]
        assert not rest and dest == "worker_1"
        assert isinstance(msg.body, UnpersistTensors) and msg.body.uuid_to_ref_count == {}
        assert data.persist_signals["y"] == [info]
