"""A request held as mstar-ai's ``Conductor`` keeps it (``store.conductor``), through the
store's operations: round trip, the engine's rules (small and exact), idempotency per op
id, the request-level lease, version conflicts between two clients, bad input, damaged
hash fields and the hash's expiry. Every test runs on fakeredis and on the real Redis.

Bugs found while writing these are tested at the end of the file.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from store import RequestStore
from store.conductor import (
    PREPROCESS_WORKER,
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    IngestOutcome,
    PassOutcome,
    PassResult,
    Teardown,
    TeardownOutcome,
    WorkerGraphsDone,
    rules,
)
from store.conductor.layout import RECENT_OPS
from store.errors import (
    CorruptRecordError,
    EncodeError,
    FencedError,
    PartitionNotFound,
    RequestExistsError,
    RequestNotFound,
    SchemaVersionError,
    StoreError,
    UnknownWorkerGraphError,
    ValidationError,
)
from store.ops.conductor import CompletePass, Conclude, GraphsDone, Step
from store.records import Lease
from store.types import (
    CurrentForwardConductorMetadata,
    KVReqConfig,
    NestedLoopIndices,
    PartitionDefinition,
    PartitionState,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
    TensorPointerInfo,
)
from tests.stores import Stores

RID = "cr-1"
WORKERS = {"wgA": ["worker_0", "worker_1"], "wgB": ["worker_2"], "wgC": ["worker_3"]}
PARTICIPANTS = ("api_server_preprocess_worker", "worker_0", "worker_1", "worker_2", "worker_3")


def md(walk: str, **kwargs: Any) -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(walk, walk == "prefill", ["text"], ["text"], kwargs)


def tpi(uuid: str, entity: str = "worker_0") -> TensorPointerInfo:
    return TensorPointerInfo([2, 3], "float16", 12, 4096, [3, 1], uuid, "sess", entity)


def nli(i: int) -> NestedLoopIndices:
    return NestedLoopIndices(["outer", "inner"], {"outer": i, "inner": i + 1}, i)


def make_request(rid: str = RID, *, max_output_tokens: int = 100) -> ConductorRequest:
    """Three partitions: p0 (llm, wgA on two workers) streams "text" into p1 (wgB), p1
    streams "audio" into p2 (wgC); two persisted tensors, u1 sent twice, u2 once."""
    return ConductorRequest(
        request_id=rid,
        persist_signals={"x": [tpi("u1", "worker_0")], "y": [tpi("u2", "worker_1")]},
        persist_signal_ref_cnt={"u1": 2, "u2": 1},
        worker_graph_to_workers={wg: list(ws) for wg, ws in WORKERS.items()},
        all_worker_graph_ids=set(WORKERS),
        max_output_tokens=max_output_tokens,
        random_seed=1234,
        resource_configs={
            "sampling": SamplingReqConfig(temperature=0.5, top_k=7),
            "kv": KVReqConfig(["a"], {"node": ["b"]}, {("node", "walk"): ["c"]}),
        },
        partition_states={
            "p0": PartitionState(
                "p0", md("w0"), random_seed=1234, current_worker_graph_ids={"wgA"}
            ),
            "p1": PartitionState(
                "p1", md("w1"), random_seed=1234, current_worker_graph_ids={"wgB"}
            ),
            "p2": PartitionState(
                "p2", md("w2"), random_seed=1234, current_worker_graph_ids={"wgC"}
            ),
        },
        partition_definitions={
            "p0": PartitionDefinition("p0", {"w0", "both"}, "w0"),
            "p1": PartitionDefinition("p1", {"w1"}, producer_partitions=["p0"]),
            "p2": PartitionDefinition("p2", {"w2"}, producer_partitions=["p1"]),
        },
        streaming_connections={
            "p0->p1": StreamingConnectionState("p0", "p1", "text"),
            "p1->p2": StreamingConnectionState("p1", "p2", "audio"),
        },
        worker_graph_walks={"wgA": {"w0", "both"}, "wgB": {"w1", "both"}, "wgC": {"w2"}},
        conductor_ingest_time=1.5,
    )


def wgd(
    wgs: list[str], rank0: bool = True, partition: str = "p0", rid: str = RID, **kw: Any
) -> WorkerGraphsDone:
    return WorkerGraphsDone(rid, wgs, rank0, partition_name=partition, **kw)


def raw(client: Any, store: Any, rid: str = RID) -> dict[bytes, bytes]:
    return client.hgetall(store.keys.conductor(rid))  # type: ignore[no-any-return]


def fresh(client: Any, namespace: str, **options: Any) -> RequestStore:
    """Another client of the same server: a store object with a cache of its own."""
    return RequestStore(client, namespace=namespace, **options)


@pytest.fixture
def held(store: RequestStore) -> RequestStore:
    """``store`` holding ``make_request()``."""
    assert store.ingest_request(make_request(), op_id="ingest") == IngestOutcome()
    return store


# -- 1. round trip ---------------------------------------------------------------------


def rich_request(rid: str) -> ConductorRequest:
    request = make_request(rid)
    p0 = request.partition_states["p0"]
    p0.wg_rank_completions = {"wgA": 1}
    p0.num_output_tokens = 5
    p0.curr_forward_outputs = ["o1"]
    p0.resource_publish_info = {"pos": PublishedPositionInfo({"a": 3})}
    p0.fwd_pass_number = 4
    request.streaming_connections["p0->p1"].token_count = 9
    request.streaming_connections["p0->p1"].consumed_count = 2
    request.final_outputs = {"text": nli(1), "audio": nli(2)}
    request.teardown = Teardown(
        {PREPROCESS_WORKER}, {PREPROCESS_WORKER, "worker_0"}, "boom", 503, 9.5
    )
    request.early_reads_done = {"worker_3"}
    request.conductor_finish_time = 2.5
    request.concluded = True
    return request


def test_round_trip_equals_and_keeps_classes(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    request = rich_request(RID)
    assert store.ingest_request(copy.deepcopy(request), op_id="i") == IngestOutcome()
    for reader in (store, make_store(client, namespace=namespace)):  # cached and cold
        back = reader.load_conductor_request(RID)
        assert back == request
        assert type(back.resource_configs["sampling"]) is SamplingReqConfig
        assert type(back.resource_configs["kv"]) is KVReqConfig
        assert back.resource_configs["kv"].needed_labels_per_node_walk == {("node", "walk"): ["c"]}
        assert type(back.persist_signals["x"][0]) is TensorPointerInfo
        assert type(back.final_outputs["text"]) is NestedLoopIndices
        assert type(back.teardown) is Teardown
        assert (
            type(back.partition_states["p0"].resource_publish_info["pos"]) is PublishedPositionInfo
        )
        assert list(back.partition_states) == ["p0", "p1", "p2"]  # the engine's order
        assert list(back.streaming_connections) == ["p0->p1", "p1->p2"]
    assert store.list_conductor_requests() == [RID]


# -- 2. the rules, small and exact ---------------------------------------------------------


def test_rank0_absorbs_other_ranks_only_count_and_persist(held: RequestStore) -> None:
    first = held.apply_worker_graphs_done(
        wgd(
            ["wgA"],
            new_token_counts={"text": 3, "other": 2},
            resource_publish_info={"pos": PublishedPositionInfo({"a": 1})},
            stream_tokens_consumed={"text": 7, "audio": 4},
            output_signal_names=["o1"],
            persist_signals={"x2": [tpi("u3")]},
            output_loop_indices={"text": nli(1)},
        ),
        op_id="m0",
    )
    assert first == GraphsDoneOutcome()  # wgA has two workers: one report is not enough
    second = held.apply_worker_graphs_done(
        wgd(
            ["wgA"],
            rank0=False,
            new_token_counts={"text": 100},
            resource_publish_info={"other": PublishedPositionInfo({"b": 1})},
            stream_tokens_consumed={"audio": 99},
            output_signal_names=["o2"],
            persist_signals={"x2": [tpi("u4", "worker_1")]},
        ),
        op_id="m1",
    )
    assert second == GraphsDoneOutcome(done_partitions=("p0",))
    got = held.load_conductor_request(RID)
    p0 = got.partition_states["p0"]
    assert p0.num_output_tokens == 5  # rank 0's counts of every edge, once
    assert p0.curr_forward_outputs == ["o1"]
    assert p0.resource_publish_info == {"pos": PublishedPositionInfo({"a": 1})}
    assert p0.wg_rank_completions == {"wgA": 2}
    assert p0.completed_worker_graph_ids == {"wgA"}
    conns = got.streaming_connections
    assert conns["p0->p1"].token_count == 3  # p0's own "text" edge
    assert conns["p1->p2"].token_count == 0  # "audio" is not produced by p0
    assert conns["p0->p1"].consumed_count == 0  # produced by the reporter: not consumed
    assert conns["p1->p2"].consumed_count == 4  # rank 0's, not rank 1's 99
    assert [i.uuid for i in got.persist_signals["x2"]] == ["u3", "u4"]  # every rank's
    assert got.final_outputs == {"text": nli(1)}
    assert got.partition_states["p1"] == make_request().partition_states["p1"]


def test_stream_consumed_is_a_max(held: RequestStore) -> None:
    for i, consumed in enumerate((10, 4, 12, 0)):
        held.apply_worker_graphs_done(
            wgd(["wgB"], partition="p1", stream_tokens_consumed={"text": consumed}), op_id=f"m{i}"
        )
        held.apply_worker_graphs_done(
            wgd(["wgB"], partition="p1", rank0=False, stream_tokens_consumed={"text": 50}),
            op_id=f"r{i}",
        )
    conns = held.load_conductor_request(RID).streaming_connections
    assert conns["p0->p1"].consumed_count == 12
    assert conns["p1->p2"].consumed_count == 0  # p1 produces "audio"; "text" named anyway


def test_several_worker_graphs_per_message(
    client: redis.Redis, namespace: str, store: RequestStore
) -> None:
    request = make_request()
    request.partition_states["p0"].current_worker_graph_ids = {"wgA", "wgB"}
    store.ingest_request(request)
    assert store.apply_worker_graphs_done(wgd(["wgA", "wgB"]), op_id="m0") == GraphsDoneOutcome()
    p0 = store.load_conductor_request(RID).partition_states["p0"]
    assert p0.completed_worker_graph_ids == {"wgB"}
    assert p0.wg_rank_completions == {"wgA": 1, "wgB": 1}
    done = store.apply_worker_graphs_done(wgd(["wgA"], rank0=False), op_id="m1")
    assert done.done_partitions == ("p0",)
    p0 = fresh(client, namespace).load_conductor_request(RID).partition_states["p0"]
    assert p0.completed_worker_graph_ids == {"wgA", "wgB"}


def test_unknown_partition_is_ignored_but_final_outputs_are_taken(held: RequestStore) -> None:
    before = held.load_conductor_request(RID)
    outcome = held.apply_worker_graphs_done(
        wgd(
            ["wgA"],
            partition="nope",
            new_token_counts={"text": 5},
            persist_signals={"z": [tpi("u9")]},
            output_loop_indices={"text": nli(3)},
        ),
        op_id="m0",
    )
    assert outcome == GraphsDoneOutcome(ignored="unknown partition")
    after = held.load_conductor_request(RID)
    assert after.final_outputs == {"text": nli(3)}
    after.final_outputs = {}
    assert after == before


@pytest.mark.parametrize("wgs", [["wgZ"], ["wgA", "wgZ"]], ids=["alone", "after-a-known-one"])
def test_unknown_worker_graph_changes_nothing(
    client: redis.Redis, held: RequestStore, wgs: list[str]
) -> None:
    before = raw(client, held)
    message = wgd(
        wgs,
        new_token_counts={"text": 5},
        persist_signals={"z": [tpi("u9")]},
        output_loop_indices={"text": nli(3)},
    )
    with pytest.raises(UnknownWorkerGraphError) as refused:
        held.apply_worker_graphs_done(message, op_id="m0")
    assert refused.value.request_id == RID
    assert refused.value.field == "worker_graph_ids"
    assert raw(client, held) == before


def test_complete_pass_metadata_references_and_next_worker_graphs(held: RequestStore) -> None:
    held.apply_worker_graphs_done(wgd(["wgA"], new_token_counts={"text": 3}), op_id="m0")
    held.apply_worker_graphs_done(wgd(["wgA"], rank0=False), op_id="m1")
    full = md("both", a=1)
    outcome = held.complete_pass(
        RID,
        "p0",
        PassResult(full, {"b": 2}, sent_tensor_uuids=["u1", "u1", "u9"]),
        op_id="c0",
    )
    assert outcome == PassOutcome(
        "p0", 0, next_worker_graph_ids=frozenset({"wgA", "wgB"}), unpersist={}
    )
    assert full.kwargs == {"a": 1}  # the caller's metadata is not changed
    got = held.load_conductor_request(RID)
    p0 = got.partition_states["p0"]
    assert p0.metadata == md("both", a=1, b=2)
    assert p0.fwd_pass_number == 1
    assert p0.current_worker_graph_ids == {"wgA", "wgB"}
    assert p0.wg_rank_completions == {} and p0.completed_worker_graph_ids == set()
    assert p0.num_output_tokens == 3 and not p0.is_done
    assert got.persist_signal_ref_cnt == {"u1": 4, "u2": 1, "u9": 1}
    assert not any(c.producer_done for c in got.streaming_connections.values())


def test_max_output_tokens_forces_the_last_pass(store: RequestStore) -> None:
    store.ingest_request(make_request(max_output_tokens=5))
    store.apply_worker_graphs_done(wgd(["wgA"], new_token_counts={"text": 5}), op_id="m0")
    outcome = store.complete_pass(
        RID, "p0", PassResult(md("w0"), sent_tensor_uuids=["u1"]), op_id="c0"
    )
    assert outcome.forced_by_max_tokens and outcome.partition_done
    assert outcome.producer_done == ("p1",)
    assert not outcome.request_done  # p1 and p2 are not done
    assert outcome.fwd_index == 0
    got = store.load_conductor_request(RID)
    assert got.persist_signal_ref_cnt == {"u1": 2, "u2": 1}  # the last pass sends nothing
    assert got.streaming_connections["p0->p1"].producer_done
    assert not got.streaming_connections["p1->p2"].producer_done
    assert got.partition_states["p0"].is_done


def test_unpersist_per_source_entity(held: RequestStore) -> None:
    unpersist = [tpi("u1", "worker_0"), tpi("u1", "worker_0"), tpi("u7", "worker_2")]
    outcome = held.complete_pass(
        RID, "p0", PassResult(md("w0"), unpersist_tensors=unpersist), op_id="c0"
    )
    # the duplicate is skipped; worker_2's tensor was never sent, yet it gets a message
    assert outcome.unpersist == {"worker_0": {"u1": 2}, "worker_2": {}}
    got = held.load_conductor_request(RID)
    assert got.persist_signal_ref_cnt == {"u2": 1}
    assert got.persist_signals == {"x": [], "y": [tpi("u2", "worker_1")]}


def test_partition_done_from_worker_needs_an_incoming_connection(held: RequestStore) -> None:
    first = held.complete_pass(
        RID, "p0", PassResult(md("w0")), partition_done_from_worker=True, op_id="c0"
    )
    assert not first.partition_done  # p0 has no producer
    second = held.complete_pass(
        RID, "p1", PassResult(md("w1")), partition_done_from_worker=True, op_id="c1"
    )
    assert second.partition_done and second.producer_done == ()
    got = held.load_conductor_request(RID)
    assert not got.partition_states["p0"].is_done
    assert got.partition_states["p1"].is_done


def finish_every_partition(store: RequestStore) -> None:
    for i, name in enumerate(("p0", "p1", "p2")):
        done = store.complete_pass(
            RID, name, PassResult(md("w"), request_done=True), op_id=f"done-{i}"
        )
    assert done.request_done


def test_conclude_unpersists_everything_and_waits_for_the_preprocess_worker(
    held: RequestStore,
) -> None:
    held.apply_worker_graphs_done(wgd(["wgA"], output_loop_indices={"text": nli(1)}), op_id="m")
    finish_every_partition(held)
    conclusion = held.conclude_request(RID, finish_time=9.0, now=100.0, drain_ttl=10.0, op_id="k")
    assert conclusion == Conclusion(
        final_outputs={"text": nli(1)},
        conductor_ingest_time=1.5,
        conductor_finish_time=9.0,
        unpersist={"worker_0": {"u1": 2}, "worker_1": {"u2": 1}},
        teardown=TeardownOutcome(),
    )
    got = held.load_conductor_request(RID)
    assert got.teardown == Teardown({PREPROCESS_WORKER}, set(PARTICIPANTS), None, 500, 110.0)
    assert got.concluded and got.persist_signal_ref_cnt == {}
    assert held.reads_done(RID, "worker_0", op_id="r0") == TeardownOutcome()
    last = held.reads_done(RID, PREPROCESS_WORKER, op_id="r1")
    assert last == TeardownOutcome(remove=PARTICIPANTS)
    with pytest.raises(RequestNotFound):
        held.load_conductor_request(RID)
    assert held.list_conductor_requests() == []


def test_reads_done_before_the_barrier_counts_when_it_is_registered(held: RequestStore) -> None:
    early = held.reads_done(RID, PREPROCESS_WORKER, op_id="r0")
    assert early == TeardownOutcome(ignored="no barrier yet")
    assert held.load_conductor_request(RID).early_reads_done == {PREPROCESS_WORKER}
    conclusion = held.conclude_request(RID, finish_time=9.0, now=100.0, op_id="k")
    assert conclusion.teardown == TeardownOutcome(remove=PARTICIPANTS)
    with pytest.raises(RequestNotFound):
        held.load_conductor_request(RID)


def test_reads_done_before_the_request_is_kept_for_it(store: RequestStore) -> None:
    assert store.reads_done(RID, "worker_2").ignored == "no barrier yet"
    store.ingest_request(make_request())
    assert store.load_conductor_request(RID).early_reads_done == {"worker_2"}
    outcome = store.abort_request(RID, now=0.0)
    assert outcome.drain == PARTICIPANTS and outcome.remove == ()
    teardown = store.load_conductor_request(RID).teardown
    assert teardown is not None
    assert teardown.expected_acks == set(PARTICIPANTS) - {"worker_2"}


@pytest.mark.parametrize("error", [None, "worker died"], ids=["abort", "fail"])
def test_abort_and_fail_drain_every_participant(held: RequestStore, error: str | None) -> None:
    if error is None:
        outcome = held.abort_request(RID, now=100.0, drain_ttl=5.0, op_id="t")
    else:
        outcome = held.fail_request(RID, error, now=100.0, drain_ttl=5.0, op_id="t")
    assert outcome == TeardownOutcome(drain=PARTICIPANTS)
    got = held.load_conductor_request(RID)
    assert got.teardown == Teardown(set(PARTICIPANTS), set(PARTICIPANTS), error, 500, 105.0)
    # while draining: a second abort or fail, a pass and a late report are ignored
    assert held.abort_request(RID, now=101.0).ignored == "draining"
    assert held.fail_request(RID, "again", now=101.0).ignored == "draining"
    assert held.complete_pass(RID, "p0", PassResult(md("w0"))).ignored == "draining"
    assert held.apply_worker_graphs_done(wgd(["wgA"])).ignored == "draining"
    for entity in PARTICIPANTS[:-1]:
        assert held.reads_done(RID, entity) == TeardownOutcome()
    last = held.reads_done(RID, PARTICIPANTS[-1])
    failure = None if error is None else (error, 500)
    assert last == TeardownOutcome(remove=PARTICIPANTS, failure=failure)
    # after teardown: late messages are ignored, and nothing comes back
    assert held.apply_worker_graphs_done(wgd(["wgA"])).ignored is not None
    assert held.reads_done(RID, "worker_0").ignored == "torn down"
    assert held.abort_request(RID, now=102.0).ignored == "torn down"
    with pytest.raises(RequestNotFound):
        held.load_conductor_request(RID)


def test_expire_teardown_before_and_after_the_deadline(held: RequestStore) -> None:
    held.abort_request(RID, now=100.0, drain_ttl=10.0)
    assert held.expire_teardown(RID, now=109.9) == TeardownOutcome(ignored="not due")
    assert held.load_conductor_request(RID).teardown is not None
    assert held.expire_teardown(RID, now=110.0) == TeardownOutcome(remove=PARTICIPANTS)
    with pytest.raises(RequestNotFound):
        held.load_conductor_request(RID)
    assert held.expire_teardown(RID, now=200.0).ignored == "unknown request"


def test_expire_without_a_barrier_is_not_due(held: RequestStore) -> None:
    assert held.expire_teardown(RID, now=1e12) == TeardownOutcome(ignored="not due")
    assert held.load_conductor_request(RID) == make_request()


def test_abort_before_ingest_wins(client: redis.Redis, store: RequestStore) -> None:
    assert store.abort_request(RID, now=0.0).ignored == "unknown request"
    assert store.ingest_request(make_request()) == IngestOutcome(aborted=True)
    with pytest.raises(RequestNotFound):
        store.load_conductor_request(RID)
    assert store.list_conductor_requests() == []
    assert raw(client, store)[b"state"] == b"gone"
    assert b"head" not in raw(client, store)


def test_fail_on_an_unknown_request_is_ignored(client: redis.Redis, store: RequestStore) -> None:
    assert store.fail_request(RID, "x", now=0.0) == TeardownOutcome(ignored="unknown request")
    assert not client.exists(store.keys.conductor(RID))
    assert store.ingest_request(make_request()) == IngestOutcome()


def test_conclude_twice_is_ignored(held: RequestStore) -> None:
    """As the engine's run loop skips a request in teardown: the barrier stays as it was."""
    held.conclude_request(RID, finish_time=1.0, now=0.0)
    before = held.load_conductor_request(RID)
    again = held.conclude_request(RID, finish_time=2.0, now=0.0)
    assert again.teardown.ignored == "draining"
    assert held.load_conductor_request(RID) == before


def test_steps_in_one_write_equal_the_rules_in_order(
    client: redis.Redis, held: RequestStore
) -> None:
    steps: list[Step] = [
        GraphsDone(wgd(["wgA"], new_token_counts={"text": 2})),
        GraphsDone(wgd(["wgA"], rank0=False)),
        CompletePass("p0", PassResult(md("w0"), request_done=True)),
        GraphsDone(wgd(["wgB"], partition="p1")),
        CompletePass("p1", PassResult(md("w1"), request_done=True)),
        GraphsDone(wgd(["wgC"], partition="p2")),
        CompletePass("p2", PassResult(md("w2"), request_done=True)),
        Conclude(9.0, 200.0),
    ]
    expected = make_request()
    outcomes: list[Any] = []
    for step in steps:
        if isinstance(step, GraphsDone):
            outcomes.append(rules.apply_worker_graphs_done(expected, copy.deepcopy(step.message)))
        elif isinstance(step, CompletePass):
            outcomes.append(rules.complete_pass(expected, step.partition, step.result))
        else:
            assert isinstance(step, Conclude)
            outcomes.append(rules.conclude(expected, step.finish_time, step.deadline))
    version = int(raw(client, held)[b"ver"])
    assert held.apply_conductor_steps(RID, steps, op_id="s") == outcomes
    assert outcomes[-1].teardown == TeardownOutcome()  # waits for the preprocess worker
    assert int(raw(client, held)[b"ver"]) == version + 1  # one write
    assert held.load_conductor_request(RID) == expected


def test_steps_on_an_unknown_request(client: redis.Redis, store: RequestStore) -> None:
    assert store.apply_conductor_steps(RID, []) == []
    with pytest.raises(RequestNotFound):
        store.apply_conductor_steps(RID, [Conclude(1.0, 2.0)])


# -- 3. idempotency --------------------------------------------------------------------


def _draining(store: RequestStore) -> None:
    store.abort_request(RID, now=100.0, drain_ttl=10.0, op_id="setup-abort")


OPS: list[tuple[str, Callable[[RequestStore], None] | None, Callable[[Any, str], Any]]] = [
    ("ingest", None, lambda s, o: s.ingest_request(make_request(), op_id=o)),
    (
        "graphs_done",
        lambda s: None,
        lambda s, o: s.apply_worker_graphs_done(
            wgd(["wgA"], new_token_counts={"text": 2}, persist_signals={"z": [tpi("u5")]}),
            op_id=o,
        ),
    ),
    (
        "complete_pass",
        lambda s: None,
        lambda s, o: s.complete_pass(
            RID,
            "p0",
            PassResult(md("w0"), sent_tensor_uuids=["u1"], unpersist_tensors=[tpi("u2", "w")]),
            op_id=o,
        ),
    ),
    (
        "conclude",
        lambda s: None,
        lambda s, o: s.conclude_request(RID, finish_time=1.0, now=0.0, op_id=o),
    ),
    (
        "steps",
        lambda s: None,
        lambda s, o: s.apply_conductor_steps(
            RID,
            [
                GraphsDone(wgd(["wgA"], new_token_counts={"text": 1})),
                GraphsDone(wgd(["wgA"], rank0=False)),
            ],
            op_id=o,
        ),
    ),
    ("abort", lambda s: None, lambda s, o: s.abort_request(RID, now=0.0, op_id=o)),
    ("fail", lambda s: None, lambda s, o: s.fail_request(RID, "boom", now=0.0, op_id=o)),
    ("reads_done", lambda s: None, lambda s, o: s.reads_done(RID, "worker_0", op_id=o)),
    ("reads_done_early", None, lambda s, o: s.reads_done(RID, "worker_0", op_id=o)),
    ("abort_early", None, lambda s, o: s.abort_request(RID, now=0.0, op_id=o)),
    ("expire", _draining, lambda s, o: s.expire_teardown(RID, now=200.0, op_id=o)),
]


@pytest.mark.parametrize(("name", "setup", "op"), OPS, ids=[o[0] for o in OPS])
def test_an_op_id_applies_once(
    client: redis.Redis,
    namespace: str,
    store: RequestStore,
    name: str,
    setup: Callable[[RequestStore], None] | None,
    op: Callable[[Any, str], Any],
) -> None:
    if setup is not None:
        store.ingest_request(make_request(), op_id="setup-ingest")
        setup(store)
    first = op(store, "op-1")
    after_first = raw(client, store)
    assert op(store, "op-1") == first  # retried from the cache
    assert raw(client, store) == after_first
    # another client writes in between; the retry still returns the first outcome
    other = fresh(client, namespace)
    other.reads_done(RID, "bystander", op_id="between")
    after_other = raw(client, store)
    assert after_other != after_first
    assert op(store, "op-1") == first  # the stale cache is refused, the op found done
    assert op(other, "op-1") == first
    assert raw(client, store) == after_other
    # a lost reply: the client forgot what it wrote, and sends the op again
    store._core.conductor_records.drop(RID)
    assert op(store, "op-1") == first
    assert raw(client, store) == after_other


def test_a_retry_by_a_client_whose_cache_predates_the_op(
    client: redis.Redis, namespace: str, held: RequestStore
) -> None:
    other = fresh(client, namespace)
    other.reads_done(RID, "bystander", op_id="warm")  # other caches this version
    message = wgd(["wgA"], new_token_counts={"text": 2})
    first = held.apply_worker_graphs_done(message, op_id="moved")
    after = raw(client, held)
    assert other.apply_worker_graphs_done(message, op_id="moved") == first
    assert raw(client, held) == after
    assert other.load_conductor_request(RID).partition_states["p0"].num_output_tokens == 2


def test_a_lost_reply_is_applied_once(client: redis.Redis, held: RequestStore) -> None:
    message = wgd(["wgA"], new_token_counts={"text": 2}, persist_signals={"z": [tpi("u5")]})
    first = held.apply_worker_graphs_done(message, op_id="lost")
    held._core.conductor_records.drop(RID)
    assert held.apply_worker_graphs_done(message, op_id="lost") == first
    got = held.load_conductor_request(RID)
    assert got.partition_states["p0"].num_output_tokens == 2
    assert got.partition_states["p0"].wg_rank_completions == {"wgA": 1}
    assert got.persist_signals["z"] == [tpi("u5")]


def test_only_the_latest_op_ids_are_remembered(client: redis.Redis, held: RequestStore) -> None:
    """``RECENT_OPS``: a retry of an op id older than the latest ones is applied again."""
    message = wgd(["wgA"], new_token_counts={"text": 2})
    held.apply_worker_graphs_done(message, op_id="oldest")
    for i in range(300):
        held.reads_done(RID, f"e{i % 3}", op_id=f"later-{i}")
    kept = raw(client, held)
    first_kept = 300 - RECENT_OPS
    assert b"o:oldest" not in kept and f"o:later-{first_kept - 1}".encode() not in kept
    assert f"o:later-{first_kept}".encode() in kept
    assert sum(name.startswith(b"o:") for name in kept) == RECENT_OPS
    held.reads_done(RID, "e0", op_id="later-299")  # a recent one is still applied once
    assert raw(client, held) == kept
    held.apply_worker_graphs_done(message, op_id="oldest")  # forgotten: applied twice
    p0 = held.load_conductor_request(RID).partition_states["p0"]
    assert p0.num_output_tokens == 4
    assert p0.wg_rank_completions == {"wgA": 2}


# -- 4. fencing --------------------------------------------------------------------------


def test_request_lease_fences_writes(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    store.ingest_request(make_request())
    a = store.claim_conductor_request(RID, "a", ttl=0.2)
    assert isinstance(a, Lease) and a.holder == "a" and a.partition == "*"
    assert store.claim_conductor_request(RID, "b", ttl=30) is None
    assert store.apply_worker_graphs_done(wgd(["wgA"]), lease=a, op_id="w-a") == GraphsDoneOutcome()
    time.sleep(0.3)
    b = store.claim_conductor_request(RID, "b", ttl=30)
    assert isinstance(b, Lease) and b.token > a.token
    before = raw(client, store)
    writes: list[Callable[[Lease | None], Any]] = [
        lambda f: store.apply_worker_graphs_done(wgd(["wgA"]), lease=f),
        lambda f: store.complete_pass(RID, "p0", PassResult(md("w0")), lease=f),
        lambda f: store.abort_request(RID, now=0.0, lease=f),
        lambda f: store.reads_done(RID, "worker_0", lease=f),
    ]
    for write in writes:
        for fence in (a, None):
            with pytest.raises(FencedError) as refused:
                write(fence)
            assert refused.value.request_id == RID
    assert raw(client, store) == before
    outcome = store.apply_worker_graphs_done(wgd(["wgA"], rank0=False), lease=b, op_id="w-b")
    assert outcome.done_partitions == ("p0",)
    assert store.load_conductor_request(RID).partition_states["p0"].wg_rank_completions == {
        "wgA": 2
    }


# -- 5. version conflicts between two clients -------------------------------------------


def test_two_clients_interleaved_both_apply(client: redis.Redis, namespace: str) -> None:
    one, two = fresh(client, namespace), fresh(client, namespace)
    messages = [
        wgd(["wgA"], new_token_counts={"text": 1}, persist_signals={"s": [tpi("a")]}),
        wgd(["wgA"], rank0=False, persist_signals={"s": [tpi("b")]}),
        wgd(["wgB"], partition="p1", new_token_counts={"audio": 4}),
        wgd(["wgC"], partition="p2", stream_tokens_consumed={"audio": 3}),
    ]
    expected = make_request()
    one.ingest_request(make_request())
    for i, message in enumerate(messages):  # one, two, one (stale cache), two (stale cache)
        writer = one if i % 2 == 0 else two
        writer.apply_worker_graphs_done(message, op_id=f"m{i}")
        rules.apply_worker_graphs_done(expected, copy.deepcopy(message))
    one.complete_pass(RID, "p0", PassResult(md("both"), sent_tensor_uuids=["a"]), op_id="c")
    rules.complete_pass(expected, "p0", PassResult(md("both"), sent_tensor_uuids=["a"]))
    for reader in (one, two, fresh(client, namespace)):
        assert reader.load_conductor_request(RID) == expected


# -- 7. bad input -------------------------------------------------------------------------


BAD_MESSAGES = [
    ("new_token_counts", {"new_token_counts": {"e": -1}}),
    ("new_token_counts", {"new_token_counts": {"e": True}}),
    ("new_token_counts", {"new_token_counts": {1: 1}}),
    ("stream_tokens_consumed", {"stream_tokens_consumed": {"e": 1.5}}),
    ("is_first_tp_rank", {"is_first_tp_rank": "yes"}),
    ("worker_graph_ids", {"worker_graph_ids": [1]}),
    ("worker_graph_ids", {"worker_graph_ids": "wgA"}),
    ("partition_name", {"partition_name": None}),
    ("persist_signals", {"persist_signals": []}),
    ("output_signal_names", {"output_signal_names": "o1"}),
    ("request_id", {"request_id": "other"}),
]


@pytest.mark.parametrize(
    ("field", "change"), BAD_MESSAGES, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_MESSAGES)]
)
def test_a_wrong_message_field_is_refused_naming_it(
    client: redis.Redis, held: RequestStore, field: str, change: dict[str, Any]
) -> None:
    message = wgd(["wgA"], new_token_counts={"text": 1})
    for name, value in change.items():
        setattr(message, name, value)
    before = raw(client, held)
    if field != "request_id":  # (a message about another request goes to that one)
        with pytest.raises(ValidationError) as refused:
            held.apply_worker_graphs_done(message)
        assert (refused.value.request_id, refused.value.field) == (RID, field)
    with pytest.raises(ValidationError) as refused:  # among good steps: none applied
        held.apply_conductor_steps(RID, [GraphsDone(wgd(["wgA"])), GraphsDone(message)])
    assert (refused.value.request_id, refused.value.field) == (RID, field)
    assert raw(client, held) == before


@pytest.mark.parametrize("rid", ["", "a{b}", "has space", "x" * 5000, 7], ids=repr)
def test_a_wrong_request_id_is_refused(
    client: redis.Redis, namespace: str, store: RequestStore, rid: Any
) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: store.load_conductor_request(rid),
        lambda: store.abort_request(rid, now=0.0),
        lambda: store.reads_done(rid, "worker_0"),
        lambda: store.complete_pass(rid, "p0", PassResult(md("w0"))),
        lambda: store.claim_conductor_request(rid, "a"),
        lambda: store.ingest_request(make_request(rid)),
        lambda: store.apply_worker_graphs_done(wgd(["wgA"], rid=rid)),
    ]
    for call in calls:
        with pytest.raises(ValidationError):
            call()
    assert list(client.scan_iter(match=f"{namespace}:*")) == []


def test_other_wrong_arguments_are_refused(client: redis.Redis, held: RequestStore) -> None:
    before = raw(client, held)
    calls: list[tuple[Callable[[], Any], str | None]] = [
        (lambda: held.reads_done(RID, ""), "entity"),
        (lambda: held.fail_request(RID, 500, now=0.0), "error"),  # type: ignore[arg-type]
        (lambda: held.claim_conductor_request(RID, ""), "holder"),
        (lambda: held.claim_conductor_request(RID, "a", ttl=0), "ttl"),
        (lambda: held.abort_request(RID, now=0.0, op_id="x" * 201), None),
        (lambda: held.apply_worker_graphs_done("not a message"), "request_id"),
    ]
    for call, field in calls:
        with pytest.raises(ValidationError) as refused:
            call()
        if field is not None:
            assert refused.value.field == field
    bad = make_request()
    bad.worker_graph_to_workers["wgA"] = []
    with pytest.raises(ValidationError):
        held.ingest_request(bad)
    with pytest.raises(PartitionNotFound) as missing:
        held.complete_pass(RID, "nope", PassResult(md("w0")))
    assert (missing.value.request_id, missing.value.field) == (RID, "partition")
    assert raw(client, held) == before


def test_ingest_twice_is_refused(held: RequestStore) -> None:
    with pytest.raises(RequestExistsError):
        held.ingest_request(make_request(), op_id="another")
    assert held.ingest_request(make_request(), op_id="ingest") == IngestOutcome()  # a retry


DAMAGE = [
    ("head", b"\xc1garbage", CorruptRecordError),
    ("head", b"\x93\x01\x02\x03", CorruptRecordError),
    ("p:p0", b"\xffnot msgpack", CorruptRecordError),
    ("c:p0->p1", b"\x00\x01", CorruptRecordError),
    ("order", b"\xc1", CorruptRecordError),
    ("order", b"\x92\x91\xa5ghost\x90", CorruptRecordError),  # names a partition not held
    ("ver", b"abc", CorruptRecordError),
    ("ver", b"-1", CorruptRecordError),
    ("_f", b"2", SchemaVersionError),
    ("_f", b"x", CorruptRecordError),
]


@pytest.mark.parametrize(
    ("field", "value", "error"), DAMAGE, ids=[f"{d[0]}-{i}" for i, d in enumerate(DAMAGE)]
)
def test_a_damaged_field_is_named(
    client: redis.Redis,
    namespace: str,
    held: RequestStore,
    field: str,
    value: bytes,
    error: type[Exception],
) -> None:
    key = held.keys.conductor(RID)
    client.hset(key, field, value)
    named = "p:ghost" if b"ghost" in value else field
    store = fresh(client, namespace)
    calls: list[Callable[[], Any]] = [
        lambda: store.load_conductor_request(RID),
        lambda: store.apply_worker_graphs_done(wgd(["wgA"])),
        lambda: store.abort_request(RID, now=0.0),
        lambda: held.reads_done(RID, "worker_0"),  # its cache is stale: it reads
    ]
    held._core.conductor_records.drop(RID)
    for call in calls:
        with pytest.raises(error) as refused:
            call()
        assert refused.value.key == key  # type: ignore[attr-defined]
        if error is not SchemaVersionError:
            assert refused.value.field == named  # type: ignore[attr-defined]


@pytest.mark.parametrize(("fields", "named"), [({"nops": b"x"}, "nops"), ({"nops": b""}, "nops")])
def test_a_damaged_op_list_refuses_every_write_whole(
    client: redis.Redis, held: RequestStore, fields: dict[str, bytes], named: str
) -> None:
    key = held.keys.conductor(RID)
    client.hset(key, mapping=fields)
    before = raw(client, held)
    with pytest.raises(CorruptRecordError) as refused:
        held.apply_worker_graphs_done(wgd(["wgA"]))
    assert (refused.value.key, refused.value.field) == (key, named)
    assert raw(client, held) == before


def test_damaged_early_record_and_wrong_key_type(
    client: redis.Redis, namespace: str, store: RequestStore
) -> None:
    key = store.keys.conductor(RID)
    client.hset(key, mapping={"ver": b"1", "_f": b"1", "early": b"\xc1"})
    for call in (lambda: store.ingest_request(make_request()), lambda: store.reads_done(RID, "w")):
        with pytest.raises(CorruptRecordError) as refused:
            call()
        assert (refused.value.key, refused.value.field) == (key, "early")
    client.delete(key)
    client.set(key, b"a string")
    with pytest.raises(StoreError) as wrong:
        store.load_conductor_request(RID)
    assert wrong.value.key == key


# -- 8. the hash expires --------------------------------------------------------------------


def test_a_torn_down_request_keeps_only_its_results_for_a_while(
    client: redis.Redis, namespace: str
) -> None:
    store = fresh(client, namespace, dedupe_window=60.0)
    store.ingest_request(make_request())
    key = store.keys.conductor(RID)
    assert client.pttl(key) == -1  # a held request does not expire
    store.abort_request(RID, now=0.0, drain_ttl=1.0)
    assert client.pttl(key) == -1
    store.expire_teardown(RID, now=5.0, op_id="expire")
    left = raw(client, store)
    assert left[b"state"] == b"gone"
    assert {n for n in left if not n.startswith(b"o:")} == {
        b"state",
        b"ver",
        b"_f",
        b"ops",
        b"nops",
    }
    assert b"o:expire" in left
    assert 0 < client.pttl(key) <= 60_000
    assert store.expire_teardown(RID, now=5.0, op_id="expire").remove == PARTICIPANTS


def test_an_early_record_expires_within_drain_ttl(client: redis.Redis, store: RequestStore) -> None:
    key = store.keys.conductor(RID)
    store.abort_request(RID, now=0.0, drain_ttl=5.0)
    assert 0 < client.pttl(key) <= 5_000
    store.reads_done(RID, "worker_0", drain_ttl=3.0)
    assert 0 < client.pttl(key) <= 3_000
    other = "cr-2"
    store.reads_done(other, "worker_0", drain_ttl=2.0)
    assert 0 < client.pttl(store.keys.conductor(other)) <= 2_000
    store.ingest_request(make_request(other))  # held now: it no longer expires
    assert client.pttl(store.keys.conductor(other)) == -1


# -- found while writing these (each failed before its fix) -------------------------


def test_bug_mixed_steps_retry_returns_each_steps_outcome(held: RequestStore) -> None:
    steps: list[Step] = [
        GraphsDone(wgd(["wgA"])),
        GraphsDone(wgd(["wgA"], rank0=False)),
        CompletePass("p0", PassResult(md("w0"))),
    ]
    first = held.apply_conductor_steps(RID, steps, op_id="mixed")
    assert isinstance(first[2], PassOutcome)
    held._core.conductor_records.drop(RID)  # a lost reply
    assert held.apply_conductor_steps(RID, steps, op_id="mixed") == first


def test_bug_a_report_for_an_unknown_request_does_not_tombstone_it(store: RequestStore) -> None:
    outcome = store.apply_worker_graphs_done(wgd(["wgA"]), op_id="stray")
    assert outcome.ignored == "unknown request"
    assert store.ingest_request(make_request()) == IngestOutcome()


def test_bug_a_report_before_the_request_keeps_its_early_reads_done(store: RequestStore) -> None:
    store.reads_done(RID, PREPROCESS_WORKER)
    store.apply_worker_graphs_done(wgd(["wgA"]))
    store.ingest_request(make_request())
    assert store.load_conductor_request(RID).early_reads_done == {PREPROCESS_WORKER}


def test_bug_ingest_of_a_non_request_is_a_validation_error(store: RequestStore) -> None:
    with pytest.raises(ValidationError):
        store.ingest_request("not a request")  # type: ignore[arg-type]


BAD_NESTED: list[tuple[str, Callable[[Any], Any]]] = [
    (
        "output_loop_indices",
        lambda s: s.apply_worker_graphs_done(wgd(["wgA"], output_loop_indices={"o": "x"})),
    ),
    (
        "output_loop_indices-key",
        lambda s: s.apply_worker_graphs_done(wgd(["wgA"], output_loop_indices={1: nli(1)})),
    ),
    (
        "output_signal_names",
        lambda s: s.apply_worker_graphs_done(wgd(["wgA"], output_signal_names=[1])),
    ),
    (
        "persist_signals-key",
        lambda s: s.apply_worker_graphs_done(wgd(["wgA"], persist_signals={1: []})),
    ),
    (
        "persist_signals-value",
        lambda s: s.apply_worker_graphs_done(wgd(["wgA"], persist_signals={"z": ["x"]})),
    ),
    (
        "resource_publish_info-key",
        lambda s: s.apply_worker_graphs_done(
            wgd(["wgA"], resource_publish_info={1: PublishedPositionInfo({"a": 1})})
        ),
    ),
    (
        "sent_tensor_uuids",
        lambda s: s.complete_pass(RID, "p0", PassResult(md("w0"), sent_tensor_uuids=[1])),  # type: ignore[list-item]
    ),
    (
        "unpersist_tensors",
        lambda s: s.complete_pass(RID, "p0", PassResult(md("w0"), unpersist_tensors=["x"])),  # type: ignore[list-item]
    ),
]


@pytest.mark.parametrize(("name", "call"), BAD_NESTED, ids=[b[0] for b in BAD_NESTED])
def test_bug_wrong_nested_values_are_refused_and_nothing_is_written(
    client: redis.Redis, held: RequestStore, name: str, call: Callable[[Any], Any]
) -> None:
    before = raw(client, held)
    try:
        with pytest.raises(ValidationError):
            call(held)
    finally:
        assert raw(client, held) == before
        held.load_conductor_request(RID)


def test_bug_conclude_does_not_replace_a_draining_barrier(held: RequestStore) -> None:
    held.fail_request(RID, "worker died", now=100.0)
    held.conclude_request(RID, finish_time=5.0, now=100.0)
    teardown = held.load_conductor_request(RID).teardown
    assert teardown is not None
    assert teardown.expected_acks == set(PARTICIPANTS)
    assert teardown.failure_error == "worker died"


def test_a_pass_result_that_cannot_be_stored_is_refused_before_any_read(
    held: RequestStore,
) -> None:
    with pytest.raises(ValidationError) as refused:
        held.complete_pass(RID, "p0", PassResult(md("w0"), {"k": object()}))
    assert (refused.value.request_id, refused.value.field) == (RID, "result")


def test_an_encode_error_names_the_real_key(store: RequestStore) -> None:
    request = make_request()
    request.partition_states["p0"].metadata.kwargs["k"] = object()
    with pytest.raises(EncodeError) as refused:
        store.ingest_request(request)
    assert refused.value.key == store.keys.conductor(RID)


# -- the request's history -----------------------------------------------------------------


def test_every_write_and_every_fenced_one_is_in_the_history(
    client: redis.Redis, store: RequestStore
) -> None:
    store.ingest_request(make_request())
    lease = store.claim_conductor_request(RID, "a", ttl=30)
    assert lease is not None
    steps: list[Step] = [GraphsDone(wgd(["wgA"])), GraphsDone(wgd(["wgA"], rank0=False))]
    store.apply_conductor_steps(RID, steps, lease=lease)
    newer = store.claim_conductor_request(RID, "a", ttl=30)
    assert newer is not None and newer.token > lease.token
    with pytest.raises(FencedError):
        store.reads_done(RID, "worker_0", lease=lease)
    entries = client.xrange(store.keys.history(RID))
    seen = [(e[b"op"], e[b"outcome"]) for _, e in entries]
    assert seen == [
        (b"ingest", b"applied"),
        (b"graphs done x2", b"applied"),
        (b"reads done worker_0", b"fenced"),
    ]
