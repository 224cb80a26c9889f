"""The store against mstar-ai's own conductor: the same messages, the same request.

Every batch of generated messages goes to an unmodified in-memory ``Conductor``
(``tests.engine.oracle``: no workers, a scripted model) and, through the store's operations,
to the store on fakeredis and on the Redis at ``REDIS_URL``. After each batch the whole
request read back from the store equals the conductor's ``RequestData`` (every field the
store holds, its teardown barrier and its early READS_DONE), and what the store's outcomes
say to send equals what the conductor sent. The store side makes the calls the conductor
makes to its model and to its sharding (the same functions on the store's state), nothing
else of the engine's.

A report naming a worker graph the request does not have goes to the store only: the store
refuses it whole (``UnknownWorkerGraphError``) and nothing it holds changes, where the
engine raises half way through it (docs/conductor.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import types as store_types

if not store_types.engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

import fakeredis
import redis
from mstar.api_server.request_types import APIServerMessage
from mstar.utils.ipc_format import (
    ConductorMessageType,
    InputSignals,
    WorkerMessage,
    WorkerMessageType,
)

from store import RequestStore
from store.conductor import (
    PREPROCESS_WORKER,
    ConductorRequest,
    PassResult,
    TeardownOutcome,
)
from store.conductor.convert import (
    HELD_FIELDS,
    from_request_data,
    request_data_fields,
)
from store.errors import RequestNotFound, UnknownWorkerGraphError
from tests.engine.oracle import (
    Shape,
    choices,
    finishing_messages,
    make_conductor,
    new_request_message,
    next_message,
    quiet_conductor_logs,
    run_loop_once,
    shapes,
)

EXAMPLES = int(os.environ.get("CONDUCTOR_DIFF_EXAMPLES", "300"))
ROUNDS = 400
_ids = itertools.count()


def _redis() -> Any:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    try:
        client.ping()
    except redis.ConnectionError:
        return None
    return client


@pytest.fixture(scope="module", params=["fakeredis", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[RequestStore]:
    namespace = f"diff-{uuid.uuid4().hex[:8]}"
    if request.param == "fakeredis":
        client: Any = fakeredis.FakeRedis()
    else:
        client = _redis()
        if client is None:
            pytest.skip("no Redis at REDIS_URL")
    yield RequestStore(client, namespace=namespace)
    if request.param == "redis":  # only this test's keys: never a flush
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(key)


# -- what was sent, in a form both sides produce ------------------------------------------


def _engine_sends(sent: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for dest, msg in sent:
        if isinstance(msg, APIServerMessage):
            body = msg.body
            if msg.message_type == "request_complete":
                out.append(("complete", body.request_id, body.final_outputs))
            elif msg.message_type == "request_failed":
                out.append(("failed", body.request_id, body.error_message, body.status))
            continue
        assert isinstance(msg, WorkerMessage)
        kind, body = msg.message_type, msg.body
        if kind == WorkerMessageType.NEW_REQUEST:
            continue  # the ingest: the store takes the RequestData it made
        if kind == WorkerMessageType.DRAIN_REQUEST:
            out.append(("drain", dest, body.request_id))
        elif kind == WorkerMessageType.REMOVE_REQUEST:
            out.append(("remove", dest, body.request_id))
        elif kind == WorkerMessageType.UNPERSIST_TENSORS:
            out.append(("unpersist", dest, body.request_id, body.uuid_to_ref_count))
        elif kind == WorkerMessageType.INPUT_SIGNALS:
            out.append(_input_signals(dest, body))
        else:
            raise AssertionError(f"unexpected message {kind}")
    return out


def _input_signals(dest: str, body: InputSignals) -> tuple[Any, ...]:
    info = body.request_info
    if body.producer_done:
        return (
            "producer_done", dest, body.request_id, body.partition_name,
            frozenset(body.producer_done), info.fwd_index, info.graph_walk, info.random_seed,
        )  # fmt: skip
    uuids = sorted(i.uuid for edge in body.inputs for i in edge.tensor_info)
    return (
        "inputs", dest, body.request_id, body.partition_name, info.fwd_index,
        info.random_seed, info.graph_walk, info.step_metadata, info.resource_publish_info,
        info.max_tokens, info.resource_configs, uuids,
    )  # fmt: skip


def _canonical(sends: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Sorted by kind, destination and request (the engine walks sets); within those the
    order sent is kept (a sort is stable)."""
    return sorted(sends, key=lambda s: (s[0], s[1], str(s[2])))


def _teardown_sends(rid: str, outcome: TeardownOutcome) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [("drain", e, rid) for e in outcome.drain]
    out += [("remove", e, rid) for e in outcome.remove]
    if outcome.failure is not None:
        out.append(("failed", rid, *outcome.failure))
    return out


# -- the store driven as the run loop drives the conductor --------------------------------


class StoreSide:
    """One conductor's turn, made of the store's operations."""

    def __init__(self, store: RequestStore, conductor: Any) -> None:
        self.store = store
        self.conductor = conductor  # for its model, its sharding and its worker graph walks
        self.now = time.time()

    def held(self, rid: str) -> ConductorRequest | None:
        try:
            return self.store.load_conductor_request(rid)
        except RequestNotFound:
            return None

    def ingest(self, rid: str, engine_sent: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
        data = self.conductor.requests.get(rid)
        if data is None:  # the engine dropped it: an abort came first
            outcome = self.store.ingest_request(_placeholder(rid))
            assert outcome.aborted
            return [("remove", PREPROCESS_WORKER, rid)]
        record = from_request_data(
            rid, data, self.conductor._all_worker_graph_ids_to_graph_walks,
            early_reads_done=self.conductor._early_reads_done.get(rid, set()),
        )  # fmt: skip
        assert not self.store.ingest_request(record).aborted
        return []

    def turn(self, batch: list[Any], engine_sent: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
        sends: list[tuple[Any, ...]] = []
        done: list[tuple[str, str, bool]] = []
        for message in batch:
            kind, body = message.message_type, message.body
            if kind == ConductorMessageType.NEW_REQUEST:
                sends += self.ingest(body.request_id, engine_sent)
            elif kind == ConductorMessageType.ABORT_REQUEST:
                outcome = self.store.abort_request(body.request_id, now=self.now)
                sends += _teardown_sends(body.request_id, outcome)
            elif kind == ConductorMessageType.FAIL_REQUESTS:
                for rid, error in body.errors.items():
                    outcome = self.store.fail_request(rid, error, now=self.now)
                    sends += _teardown_sends(rid, outcome)
            elif kind == ConductorMessageType.READS_DONE:
                outcome = self.store.reads_done(body.request_id, body.entity_id)
                sends += _teardown_sends(body.request_id, outcome)
            else:
                graphs = self.store.apply_worker_graphs_done(body)
                done += [(body.request_id, p, body.partition_done) for p in graphs.done_partitions]
        completed: list[str] = []
        for rid, partition, from_worker in done:
            request = self.held(rid)
            if request is None or request.teardown is not None:
                continue
            result, inputs = self.model_answer(request, partition)
            outcome = self.store.complete_pass(
                rid, partition, result, partition_done_from_worker=from_worker
            )
            after = self.held(rid)
            assert after is not None
            sends += self.pass_sends(after, partition, outcome, inputs)
            if outcome.request_done:
                completed.append(rid)
        for rid in dict.fromkeys(completed):
            request = self.held(rid)
            if request is None or request.teardown is not None:
                continue
            finish = _finish_time(engine_sent, rid)
            conclusion = self.store.conclude_request(rid, finish_time=finish, now=self.now)
            sends.append(("complete", rid, conclusion.final_outputs))
            sends += [("unpersist", e, rid, u) for e, u in conclusion.unpersist.items()]
            sends += _teardown_sends(rid, conclusion.teardown)
        return sends

    def model_answer(self, request: ConductorRequest, partition: str) -> tuple[PassResult, Any]:
        """What ``_process_done_forward`` asks the model, and how it splits the inputs."""
        pstate = request.partition_states[partition]
        incoming = [
            c for c in request.streaming_connections.values() if c.to_partition == partition
        ]
        fwd = self.conductor.model.forward_pass_args(
            partition, pstate.metadata, request.persist_signals, incoming
        )
        last = fwd.request_done or pstate.num_output_tokens >= request.max_output_tokens
        split: dict[str, list[Any]] = {}
        if not last and fwd.inputs:
            sharding = self.conductor._build_request_sharding_config(
                request.worker_graph_to_workers
            )
            split = self.conductor._split_inputs_to_workers(
                sharding, fwd.inputs, fwd.full_metadata.graph_walk
            )
        sent = [i.uuid for edges in split.values() for edge in edges for i in edge.tensor_info]
        result = PassResult(
            full_metadata=fwd.full_metadata,
            step_metadata=fwd.step_metadata,
            request_done=fwd.request_done,
            sent_tensor_uuids=sent,
            unpersist_tensors=fwd.unpersist_tensors,
        )
        return result, (fwd, split)

    def pass_sends(
        self, request: ConductorRequest, partition: str, outcome: Any, inputs: Any
    ) -> list[tuple[Any, ...]]:
        fwd, split = inputs
        rid = request.request_id
        pstate = request.partition_states[partition]
        sends: list[tuple[Any, ...]] = []
        for consumer in outcome.producer_done:
            cstate = request.partition_states[consumer]
            walks = request.partition_definitions[consumer].graph_walks
            workers = {
                w
                for wg, ws in request.worker_graph_to_workers.items()
                if request.worker_graph_walks[wg] & walks
                for w in ws
            }
            walk, seed = cstate.metadata.graph_walk or "", cstate.random_seed
            done = frozenset({partition})
            sends += [
                ("producer_done", w, rid, consumer, done, cstate.fwd_pass_number, walk, seed)
                for w in workers
            ]
        for worker, edges in split.items():
            sends.append((
                "inputs", worker, rid, partition, outcome.fwd_index, pstate.random_seed,
                fwd.full_metadata.graph_walk, fwd.step_metadata, pstate.resource_publish_info,
                request.max_output_tokens, request.resource_configs,
                sorted(i.uuid for edge in edges for i in edge.tensor_info),
            ))  # fmt: skip
        sends += [("unpersist", e, rid, u) for e, u in outcome.unpersist.items()]
        return sends


def _placeholder(rid: str) -> ConductorRequest:
    from store.types import CurrentForwardConductorMetadata, PartitionState

    state = PartitionState("p", CurrentForwardConductorMetadata(graph_walk="w", is_prefill=True))
    return ConductorRequest(rid, {}, {}, {}, set(), 1, 0, {}, partition_states={"p": state})


def _finish_time(engine_sent: list[tuple[str, Any]], rid: str) -> float:
    for _, msg in engine_sent:
        if (
            isinstance(msg, APIServerMessage)
            and msg.message_type == "request_complete"
            and msg.body.request_id == rid
        ):
            return float(msg.body.conductor_finish_time)
    raise AssertionError(f"the store concluded {rid} where the engine did not")


# -- the comparison ------------------------------------------------------------------------


def _same_request(conductor: Any, side: StoreSide, rid: str) -> None:
    data = conductor.requests.get(rid)
    held = side.held(rid)
    if data is None:
        assert held is None, f"the store still holds {rid}"
        return
    assert held is not None, f"the store lost {rid}"
    engine = {name: getattr(data, name) for name in HELD_FIELDS}
    ours = request_data_fields(held)
    for name in HELD_FIELDS:
        assert ours[name] == engine[name], name
    drain = conductor.draining.get(rid)
    if drain is None:
        assert held.teardown is None
        assert held.early_reads_done == conductor._early_reads_done.get(rid, set())
    else:
        assert held.teardown is not None
        assert held.teardown.expected_acks == drain.expected_acks
        assert held.teardown.participants == drain.participants
        assert held.teardown.failure_error == drain.failure_error
        assert held.teardown.failure_status == drain.failure_status


def _unknown_graph(message: Any) -> bool:
    return (
        message.message_type == ConductorMessageType.WORKER_GRAPHS_DONE
        and "no_such_wg" in message.body.worker_graph_ids
    )


def _turn(conductor: Any, side: StoreSide, batch: list[Any], rids: list[str]) -> None:
    refused = [m for m in batch if _unknown_graph(m)]
    batch = [m for m in batch if not _unknown_graph(m)]
    for message in refused:  # the store alone: refused whole, nothing changed
        rid = message.body.request_id
        before = side.held(rid)
        if before is None or before.teardown is not None:
            continue
        with pytest.raises(UnknownWorkerGraphError) as caught:
            side.store.apply_worker_graphs_done(message.body)
        assert caught.value.request_id == rid and caught.value.field == "worker_graph_ids"
        assert side.held(rid) == before
    if not batch:
        return
    outcome = run_loop_once(conductor, batch)
    assert outcome.error is None, repr(outcome.error)
    ours = side.turn(batch, outcome.sent)
    assert _canonical(ours) == _canonical(_engine_sends(outcome.sent))
    for rid in rids:
        _same_request(conductor, side, rid)


def _pending(conductor: Any, rids: list[str]) -> bool:
    return any(rid in conductor.requests for rid in rids)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(shape=shapes(), data=st.data())
def test_the_store_keeps_what_the_engine_keeps(
    store: RequestStore, shape: Shape, data: st.DataObject
) -> None:
    # The waiting queue (admission) is the conductor's own, not a request's state.
    shape = dataclasses.replace(shape, max_concurrent_requests=None)
    with tempfile.TemporaryDirectory() as tmp, quiet_conductor_logs():
        conductor = make_conductor(shape, tmp)
        side = StoreSide(store, conductor)
        n = next(_ids)
        rids = [f"{n}-a", f"{n}-b"][: data.draw(st.integers(1, 2), label="requests")]
        steps = data.draw(choices(max_size=40), label="choices")
        ingest_at = {rid: data.draw(st.integers(0, len(steps)), label=rid) for rid in rids}
        ingest_at[rids[0]] = 0
        batch: list[Any] = []
        for i, choice in enumerate(steps):
            for rid in rids:
                if ingest_at[rid] == i:
                    _turn(conductor, side, [*batch, new_request_message(shape, rid, choice)], rids)
                    batch = []
            rid = rids[choice % len(rids)]
            batch.append(next_message(conductor, rid, choice >> 1, pending=batch))
            if (choice >> 8) % 3 == 0:
                _turn(conductor, side, batch, rids)
                batch = []
        _turn(conductor, side, batch, rids)
        late = [new_request_message(shape, rid, 7) for rid in rids if ingest_at[rid] >= len(steps)]
        _turn(conductor, side, late, rids)
        for _ in range(ROUNDS):
            if not _pending(conductor, rids):
                break
            for rid in rids:
                messages = finishing_messages(conductor, rid)
                if messages:
                    _turn(conductor, side, messages, rids)
        assert not _pending(conductor, rids), "requests never ended"
        assert store.list_conductor_requests() == [] or all(
            rid not in store.list_conductor_requests() for rid in rids
        )
