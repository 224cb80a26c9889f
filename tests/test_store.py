"""The store contract, run against every backend (``client``: fakeredis and real Redis)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from store import (
    Codec,
    ConnectionNotFound,
    FencedError,
    PartitionNotFound,
    RequestExistsError,
    RequestNotFound,
    RequestStore,
    StalePassError,
    Step,
    UnknownWorkerGraphError,
    ValidationError,
)
from store import scripts as script_files
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionDefinition,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests import strategies as s
from tests.stores import Stores
from tests.strategies import STORE_SETTINGS, BeamConfig, ScoreInfo, user_registry

LLM_TO_CODEC = "llm->codec"
PREFILL = CurrentForwardConductorMetadata("prefill", True, ["text"], ["text"], {"temp": 0.5})
DECODE = CurrentForwardConductorMetadata("decode", False, ["text"], ["audio"])


@pytest.fixture
def store(client: redis.Redis, namespace: str, make_store: Stores) -> RequestStore:
    return make_store(client, namespace=namespace, codec=Codec(user_registry()))  # type: ignore[no-any-return]


def namespace_keys(client: redis.Redis, namespace: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{namespace}:*"))


def create_two_partitions(
    store: RequestStore, rid: str = "r1", configs: dict[str, object] | None = None
) -> None:
    """The README's example request: partitions llm (TP-2) and codec, streaming llm->codec."""
    store.create_request(
        rid,
        partitions={
            "llm": PartitionState("llm", PREFILL, current_worker_graph_ids={"wg-llm"}),
            "codec": PartitionState("codec", PREFILL, current_worker_graph_ids={"wg-codec"}),
        },
        connections={LLM_TO_CODEC: StreamingConnectionState("llm", "codec", "tokens")},
        max_output_tokens=64,
        seed=7,
        resource_configs=configs or {"sampler": SamplingReqConfig(temperature=0.2, _seed=7)},
        partition_definitions={
            "llm": PartitionDefinition("llm", {"prefill", "decode"}, "prefill"),
            "codec": PartitionDefinition("codec", {"prefill"}, "prefill", ["llm"]),
        },
    )


def kv(rank: int, label: str, seq_len: int, world_size: int = 2) -> PublishedKVInfo:
    return PublishedKVInfo(
        {rank: {label: KVSequenceInfo(seq_len, {"block": rank}, [rank, seq_len])}}, world_size
    )


# -- the lifecycle of one request -----------------------------------------------------------


def test_full_lifecycle(store: RequestStore, client: redis.Redis, namespace: str) -> None:
    create_two_partitions(store)
    assert store.list_requests() == ["r1"]
    assert store.request_exists("r1")

    # Pass 0 of llm: two tensor-parallel ranks report; only the second completes the pass.
    first = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=0, num_ranks=2,
        new_tokens=3, output_names=["text"],
    )  # fmt: skip
    assert (first.applied, first.rank_completions, first.pass_complete) == (True, 1, False)
    assert not first.worker_graph_complete
    second = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=1, num_ranks=2
    )
    assert (second.applied, second.rank_completions) == (True, 2)
    assert second.worker_graph_complete and second.pass_complete
    again = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=1, num_ranks=2
    )
    # A resent copy of the completing report says what the first delivery did.
    assert (again.applied, again.rank_completions, again.pass_complete) == (False, 2, True)

    llm = store.load_partition("r1", "llm")
    assert llm.num_output_tokens == 3
    assert llm.wg_rank_completions == {"wg-llm": 2}
    assert llm.completed_worker_graph_ids == {"wg-llm"}
    assert llm.curr_forward_outputs == ["text"]
    assert store.load_connection("r1", LLM_TO_CODEC).token_count == 3

    # Both ranks publish their KV shard; the merge keeps both.
    store.merge_publish_info("r1", "llm", {"kv": kv(0, "main", 4)})
    merged = store.merge_publish_info(
        "r1", "llm", {"kv": kv(1, "main", 4), "pos": PublishedPositionInfo({"main": 4})}
    )
    expected_kv = PublishedKVInfo(
        {
            0: {"main": KVSequenceInfo(4, {"block": 0}, [0, 4])},
            1: {"main": KVSequenceInfo(4, {"block": 1}, [1, 4])},
        },
        world_size=2,
    )
    assert merged == {"kv": expected_kv, "pos": PublishedPositionInfo({"main": 4})}
    assert store.load_partition("r1", "llm").resource_publish_info == merged

    # The codec consumes what llm produced.
    codec_report = store.record_worker_report(
        "r1", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=0, num_ranks=1,
        consumed={LLM_TO_CODEC: 3},
    )  # fmt: skip
    assert codec_report.pass_complete
    assert store.load_connection("r1", LLM_TO_CODEC).consumed_count == 3

    # llm moves to its next pass: per-pass state resets, counters go up, published info stays.
    assert (
        store.advance_partition(
            "r1", "llm", from_pass=0, metadata=DECODE, worker_graph_ids=["wg-llm"]
        )
        == 1
    )
    llm = store.load_partition("r1", "llm")
    assert llm.fwd_pass_number == 1
    assert llm.random_seed == 1
    assert llm.metadata == DECODE
    assert llm.current_worker_graph_ids == {"wg-llm"}
    assert llm.completed_worker_graph_ids == set()
    assert llm.wg_rank_completions == {}
    assert llm.curr_forward_outputs == []
    assert llm.num_output_tokens == 3
    assert llm.resource_publish_info == merged
    assert not llm.is_done

    # The reports of pass 0 do not count in pass 1: rank 1 reports anew.
    fresh = store.record_worker_report(
        "r1", "llm", fwd_pass=1, worker_graph_id="wg-llm", rank=1, num_ranks=2
    )
    assert (fresh.applied, fresh.rank_completions) == (True, 1)

    # llm finishes: is_done, and its outgoing connection learns the producer is done.
    assert store.advance_partition("r1", "llm", from_pass=1, metadata=DECODE, done=True) == 2
    assert store.load_partition("r1", "llm").is_done
    assert store.load_connection("r1", LLM_TO_CODEC).producer_done
    store.advance_partition("r1", "codec", from_pass=0, metadata=DECODE, done=True)

    state = store.load_request("r1")
    assert all(p.is_done for p in state.partitions.values())
    assert state.record.max_output_tokens == 64
    assert state.record.seed == 7
    assert state.record.partitions == ["llm", "codec"]
    assert state.record.connections == [LLM_TO_CODEC]
    assert state.record.resource_configs == {"sampler": SamplingReqConfig(temperature=0.2, _seed=7)}
    assert state.record.partition_definitions["codec"].producer_partitions == ["llm"]
    assert state.connections[LLM_TO_CODEC].token_count == 3

    assert store.delete_request("r1") is True
    assert namespace_keys(client, namespace) == []
    assert store.list_requests() == []
    assert not store.request_exists("r1")
    assert store.delete_request("r1") is False


def test_single_partition_request_without_connections(store: RequestStore) -> None:
    state = PartitionState("default", PREFILL, current_worker_graph_ids={"wg"})
    store.create_request("solo", partitions={"default": state}, max_output_tokens=1)
    loaded = store.load_request("solo")
    assert loaded.record.connections == []
    assert loaded.connections == {}
    assert loaded.partitions == {"default": state}


def test_list_requests_oldest_first(store: RequestStore) -> None:
    for rid in ("b", "a", "c"):
        create_two_partitions(store, rid)
    assert store.list_requests() == ["b", "a", "c"]
    store.delete_request("a")
    assert store.list_requests() == ["b", "c"]


def test_namespaces_do_not_see_each_other(store: RequestStore, client: redis.Redis) -> None:
    create_two_partitions(store)
    other = RequestStore(client, namespace=store.keys.namespace + "-other")
    assert other.list_requests() == []
    with pytest.raises(RequestNotFound):
        other.load_request("r1")


# -- round trips through the store ------------------------------------------------------------

_ids = itertools.count()


def fresh_id() -> str:
    return f"prop-{next(_ids)}"


@STORE_SETTINGS
@given(data=st.data())
def test_partitions_roundtrip_through_the_store(store: RequestStore, data: st.DataObject) -> None:
    names = data.draw(st.lists(s.names, min_size=1, max_size=3, unique=True), label="names")
    partitions = {
        n: data.draw(s.partition_states(st.just(n), s.user_infos), label=n) for n in names
    }
    connections = {
        f"{a}->{b}": data.draw(s.connection_states(st.just(a), st.just(b)))
        for a, b in itertools.pairwise(names)
    }
    configs = data.draw(st.dictionaries(s.labels, s.user_configs, max_size=3), label="configs")
    definitions = data.draw(
        st.dictionaries(s.names, s.partition_definitions, max_size=2), label="definitions"
    )
    rid = fresh_id()
    store.create_request(
        rid,
        partitions=partitions,
        connections=connections,
        max_output_tokens=data.draw(s.lua_counts),
        seed=data.draw(s.int64),
        resource_configs=configs,
        partition_definitions=definitions,
    )
    try:
        for name, state in partitions.items():
            assert store.load_partition(rid, name) == state
        for name, conn in connections.items():
            assert store.load_connection(rid, name) == conn
        loaded = store.load_request(rid)
        assert loaded.partitions == partitions
        assert list(loaded.partitions) == names
        assert loaded.connections == connections
        assert loaded.record.resource_configs == configs
        assert loaded.record.partition_definitions == definitions
        for label, info in partitions[names[0]].resource_publish_info.items():
            assert type(loaded.partitions[names[0]].resource_publish_info[label]) is type(info)
    finally:
        store.delete_request(rid)


@STORE_SETTINGS
@given(infos=st.dictionaries(s.labels, s.user_infos, min_size=1, max_size=3))
def test_merge_into_empty_stores_exactly(store: RequestStore, infos: dict) -> None:  # type: ignore[type-arg]
    rid = fresh_id()
    store.create_request(rid, partitions={"p": PartitionState("p", PREFILL)}, max_output_tokens=1)
    try:
        assert store.merge_publish_info(rid, "p", infos) == infos
        assert store.load_partition(rid, "p").resource_publish_info == infos
    finally:
        store.delete_request(rid)


@STORE_SETTINGS
@given(value=s.json_like)
def test_final_output_roundtrip(store: RequestStore, value: object) -> None:
    rid = fresh_id()
    store.create_request(rid, partitions={"p": PartitionState("p", PREFILL)}, max_output_tokens=1)
    try:
        store.set_final_output(rid, "answer", value)
        assert store.load_record(rid).final_outputs == {"answer": value}
    finally:
        store.delete_request(rid)


def test_merge_uses_each_kinds_update(store: RequestStore) -> None:
    create_two_partitions(store)
    store.merge_publish_info("r1", "llm", {"pos": PublishedPositionInfo({"a": 5, "b": 1})})
    store.merge_publish_info("r1", "llm", {"s": ScoreInfo({"x": 1.0}, {"t1"})})
    merged = store.merge_publish_info(
        "r1",
        "llm",
        {"pos": PublishedPositionInfo({"a": 2, "b": 9}), "s": ScoreInfo({"y": 2.0}, {"t2"})},
    )
    assert merged == {
        "pos": PublishedPositionInfo({"a": 5, "b": 9}),
        "s": ScoreInfo({"x": 1.0, "y": 2.0}, {"t1", "t2"}),
    }
    assert store.load_partition("r1", "llm").resource_publish_info == merged
    assert store.load_partition("r1", "codec").resource_publish_info == {}


def test_merge_of_another_kind_under_a_label_is_refused(store: RequestStore) -> None:
    create_two_partitions(store)
    store.merge_publish_info("r1", "llm", {"x": PublishedPositionInfo({"a": 1})})
    with pytest.raises(ValidationError, match="cannot merge") as info:
        store.merge_publish_info("r1", "llm", {"x": kv(0, "a", 1)})
    assert (info.value.request_id, info.value.field) == ("r1", "x")
    assert store.load_partition("r1", "llm").resource_publish_info == {
        "x": PublishedPositionInfo({"a": 1})
    }


def test_merge_nothing_is_a_no_op(store: RequestStore) -> None:
    create_two_partitions(store)
    assert store.merge_publish_info("r1", "llm", {}) == {}


# -- create, load and delete errors -----------------------------------------------------------


def test_create_schedules_recovery_on_a_server_without_the_scripts(
    store: RequestStore, client: redis.Redis
) -> None:
    # The hint goes out beside the create, before any script ran: on a server that lacks
    # them (fresh, restarted, its cache flushed) it is loaded, not lost with the first pass.
    # Each fake test has a fresh server; the shared real one is not flushed under others.
    if isinstance(client, fakeredis.FakeRedis):
        hint = hashlib.sha1(script_files.source("hint").encode()).hexdigest()
        assert client.script_exists(hint) == [False]
    store.create_request(
        "r1", partitions={"llm": PartitionState("llm", PREFILL, current_worker_graph_ids={"wg"})},
        connections={}, max_output_tokens=8, check_in=30.0,
    )  # fmt: skip
    (server_now, _), score = client.time(), client.zscore(store.keys.deadlines, "r1 llm")
    assert score is not None and 0 < score - server_now <= 30.0 + 1


def test_create_of_an_existing_id_is_refused(store: RequestStore) -> None:
    create_two_partitions(store)
    store.update_partition("r1", "llm", num_output_tokens=5)
    with pytest.raises(RequestExistsError, match="held already") as info:
        create_two_partitions(store)
    assert info.value.request_id == "r1"
    assert "(request 'r1')" in str(info.value)
    assert store.load_partition("r1", "llm").num_output_tokens == 5  # not overwritten


@pytest.mark.parametrize(
    "load",
    [
        lambda rs: rs.load_request("missing"),
        lambda rs: rs.load_record("missing"),
        lambda rs: rs.load_partition("missing", "llm"),
        lambda rs: rs.load_connection("missing", LLM_TO_CODEC),
        lambda rs: rs.update_partition("missing", "llm", is_done=True),
        lambda rs: rs.add_tokens("missing", LLM_TO_CODEC, 1),
        lambda rs: rs.raise_consumed_count("missing", LLM_TO_CODEC, 1),
        lambda rs: rs.set_producer_done("missing", LLM_TO_CODEC),
        lambda rs: rs.set_final_output("missing", "out", 1),
        lambda rs: rs.merge_publish_info("missing", "llm", {"p": PublishedPositionInfo()}),
        lambda rs: rs.advance_partition("missing", "llm", from_pass=0, metadata=PREFILL),
        lambda rs: rs.record_worker_report(
            "missing", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1
        ),
    ],
    ids=[
        "load_request",
        "load_record",
        "load_partition",
        "load_connection",
        "update_partition",
        "add_tokens",
        "raise_consumed_count",
        "set_producer_done",
        "set_final_output",
        "merge_publish_info",
        "advance_partition",
        "record_worker_report",
    ],
)
def test_missing_request(
    store: RequestStore, client: redis.Redis, namespace: str, load: Callable[[RequestStore], Any]
) -> None:
    with pytest.raises(RequestNotFound) as info:
        load(store)
    assert info.value.request_id == "missing"
    assert "request 'missing'" in str(info.value)
    assert namespace_keys(client, namespace) == []  # nothing was written


def test_missing_partition(store: RequestStore) -> None:
    create_two_partitions(store)
    with pytest.raises(PartitionNotFound, match="no partition 'tts'") as info:
        store.load_partition("r1", "tts")
    assert info.value.request_id == "r1"
    assert "request 'r1'" in str(info.value)
    with pytest.raises(PartitionNotFound) as info:
        store.update_partition("r1", "tts", is_done=True)
    assert info.value.request_id == "r1"
    with pytest.raises(PartitionNotFound) as info:
        store.merge_publish_info("r1", "tts", {"p": PublishedPositionInfo()})
    assert info.value.request_id == "r1"


def test_missing_connection(store: RequestStore) -> None:
    create_two_partitions(store)
    with pytest.raises(ConnectionNotFound, match="no connection 'codec->llm'") as info:
        store.load_connection("r1", "codec->llm")
    assert info.value.request_id == "r1"
    assert "request 'r1'" in str(info.value)
    with pytest.raises(ConnectionNotFound) as info:
        store.add_tokens("r1", "codec->llm", 1)
    assert info.value.request_id == "r1"


# -- field writes -----------------------------------------------------------------------------


def test_update_partition_replaces_collections_wholly(store: RequestStore) -> None:
    create_two_partitions(store)
    store.update_partition(
        "r1",
        "llm",
        completed_worker_graph_ids={"a", "b"},
        wg_rank_completions={"a": 2, "b": 1},
        curr_forward_outputs=["x", "y", "z"],
    )
    store.update_partition(
        "r1",
        "llm",
        completed_worker_graph_ids={"c"},
        wg_rank_completions={"c": 4},
        curr_forward_outputs=["w"],
        num_output_tokens=9,
        metadata=DECODE,
    )
    llm = store.load_partition("r1", "llm")
    assert llm.completed_worker_graph_ids == {"c"}
    assert llm.wg_rank_completions == {"c": 4}
    assert llm.curr_forward_outputs == ["w"]
    assert llm.num_output_tokens == 9
    assert llm.metadata == DECODE
    assert llm.current_worker_graph_ids == {"wg-llm"}  # untouched
    store.update_partition("r1", "llm", completed_worker_graph_ids=set(), curr_forward_outputs=[])
    llm = store.load_partition("r1", "llm")
    assert llm.completed_worker_graph_ids == set()
    assert llm.curr_forward_outputs == []


def test_update_partition_refuses_publish_info(store: RequestStore) -> None:
    # Published info only changes by merging (``partition_name`` cannot even be passed: it
    # is the method's own parameter).
    create_two_partitions(store)
    with pytest.raises(
        ValidationError, match="resource_publish_info is changed with merge_publish_info"
    ) as info:
        store.update_partition("r1", "llm", resource_publish_info={})
    assert (info.value.request_id, info.value.field) == ("r1", "resource_publish_info")


def test_raise_consumed_count_never_lowers(store: RequestStore) -> None:
    create_two_partitions(store)
    assert store.raise_consumed_count("r1", LLM_TO_CODEC, 5) == 5
    assert store.raise_consumed_count("r1", LLM_TO_CODEC, 3) == 5
    assert store.raise_consumed_count("r1", LLM_TO_CODEC, 8) == 8
    assert store.load_connection("r1", LLM_TO_CODEC).consumed_count == 8


def test_add_tokens_adds(store: RequestStore) -> None:
    create_two_partitions(store)
    assert store.add_tokens("r1", LLM_TO_CODEC, 2) == 2
    assert store.add_tokens("r1", LLM_TO_CODEC, 5) == 7
    assert store.load_connection("r1", LLM_TO_CODEC).token_count == 7


def test_set_producer_done(store: RequestStore) -> None:
    create_two_partitions(store)
    store.set_producer_done("r1", LLM_TO_CODEC)
    assert store.load_connection("r1", LLM_TO_CODEC).producer_done


def test_final_outputs_accumulate(store: RequestStore) -> None:
    create_two_partitions(store)
    store.set_final_output("r1", "text", "hello")
    store.set_final_output("r1", "audio", [1, 2])
    store.set_final_output("r1", "text", "bye")
    assert store.load_record("r1").final_outputs == {"text": "bye", "audio": [1, 2]}


# -- the forward-pass guards -------------------------------------------------------------------


def test_stale_report_changes_nothing(store: RequestStore) -> None:
    create_two_partitions(store)
    store.advance_partition("r1", "llm", from_pass=0, metadata=DECODE, worker_graph_ids=["wg-llm"])
    with pytest.raises(StalePassError, match="forward pass 0 is not current") as info:
        store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=0, num_ranks=1, new_tokens=4
        )
    assert (info.value.expected, info.value.current) == (0, 1)
    assert info.value.request_id == "r1"
    assert info.value.key == store.keys.partition("r1", "llm")
    llm = store.load_partition("r1", "llm")
    assert (llm.num_output_tokens, llm.wg_rank_completions) == (0, {})
    assert store.load_connection("r1", LLM_TO_CODEC).token_count == 0


def test_stale_advance_changes_nothing(store: RequestStore) -> None:
    create_two_partitions(store)
    store.advance_partition("r1", "llm", from_pass=0, metadata=DECODE)
    with pytest.raises(StalePassError) as info:
        store.advance_partition("r1", "llm", from_pass=0, metadata=PREFILL, done=True)
    assert (info.value.expected, info.value.current) == (0, 1)
    assert "(request 'r1'" in str(info.value)
    llm = store.load_partition("r1", "llm")
    assert (llm.fwd_pass_number, llm.metadata, llm.is_done) == (1, DECODE, False)
    with pytest.raises(StalePassError) as info:
        store.advance_partition("r1", "llm", from_pass=5, metadata=PREFILL)
    assert (info.value.expected, info.value.current) == (5, 1)


def test_report_of_an_unknown_worker_graph(store: RequestStore) -> None:
    create_two_partitions(store)
    with pytest.raises(UnknownWorkerGraphError, match="'wg-other' is not in the current") as info:
        store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-other", rank=0, num_ranks=1
        )
    assert info.value.request_id == "r1"
    assert info.value.field == "current_worker_graph_ids"
    assert store.load_partition("r1", "llm").wg_rank_completions == {}


def test_duplicate_report_counts_once(store: RequestStore) -> None:
    create_two_partitions(store)
    outcomes = [
        store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=0, num_ranks=2,
            new_tokens=2, output_names=["t"], consumed={},
        )
        for _ in range(3)
    ]  # fmt: skip
    assert [o.applied for o in outcomes] == [True, False, False]
    assert [o.rank_completions for o in outcomes] == [1, 1, 1]
    llm = store.load_partition("r1", "llm")
    assert llm.num_output_tokens == 2
    assert llm.curr_forward_outputs == ["t"]
    assert store.load_connection("r1", LLM_TO_CODEC).token_count == 2


def test_a_resent_report_that_took_its_step_says_so_with_the_fence(
    store: RequestStore,
) -> None:
    # rank 1 completes pass 0 and takes the decode step in the same call; its reply is lost
    # and it is sent again: the duplicate names the new pass and the ended lease's token,
    # which still fences what follows the step (here, finishing the request).
    create_two_partitions(store)

    def report(rank: int, fwd_pass: int = 0) -> Any:
        return store.record_worker_report(
            "r1", "codec", fwd_pass=fwd_pass, worker_graph_id="wg-codec", rank=rank,
            num_ranks=2, replica_id="a", then_step=Step(DECODE, ("wg-codec",)), check_in=30.0,
        )  # fmt: skip

    report(0)
    first, again = report(1), report(1)
    assert (first.applied, first.pass_complete, first.stepped_to) == (True, True, 1)
    assert (again.applied, again.pass_complete, again.stepped_to) == (False, True, 1)
    assert first.lease is not None and again.lease is not None
    assert again.lease.token == first.lease.token and again.partition is None
    store.finish_request("r1", fence=again.lease, keep_for=60.0)
    assert store.load_record("r1").finished_at


def test_a_step_taken_in_the_report_returns_the_consumers_as_it_left_them(
    store: RequestStore,
) -> None:
    """llm streams to codec: the report that completes llm's pass and takes its step, asked
    for its consumers, comes back with codec's partition as it stands right after the step
    (its infos left out), the same as reading it; a report that took no step, a resend, or
    one not asked has none; a partition that streams nowhere has none to give."""
    create_two_partitions(store)
    store.merge_publish_info("r1", "codec", {"pos": PublishedPositionInfo({"a": 3})})
    store.record_worker_report(
        "r1", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=0, num_ranks=1,
    )  # fmt: skip
    step = Step(DECODE, ("wg-llm",))

    def report(rank: int) -> Any:
        return store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=rank, num_ranks=2,
            new_tokens=2 if rank == 0 else 0, replica_id="a", then_step=step, check_in=30.0,
            consumers=True,
        )  # fmt: skip

    first = report(0)
    assert first.stepped_to is None and first.consumers is None
    done = report(1)
    assert done.stepped_to == 1
    assert done.consumers is not None and list(done.consumers) == ["codec"]
    read = store.load_partition("r1", "codec")
    assert read.resource_publish_info  # the consumer has infos: they are not sent back
    expected = PartitionState(**{**read.__dict__, "resource_publish_info": {}})
    assert done.consumers["codec"] == expected
    assert done.consumers["codec"].wg_rank_completions == {"wg-codec": 1}
    assert report(1).consumers is None  # the resend says what the step did, not this
    # codec streams nowhere: its own in-report step has no consumers to give back
    create_two_partitions(store, "r2")
    took = store.record_worker_report(
        "r2", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=0, num_ranks=1,
        replica_id="a", then_step=Step(DECODE, ("wg-codec",)), check_in=30.0, consumers=True,
    )  # fmt: skip
    assert took.stepped_to == 1 and took.consumers == {}
    # not asked for: not read
    create_two_partitions(store, "r3")
    for rank in (0, 1):
        plain = store.record_worker_report(
            "r3", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=rank, num_ranks=2,
            replica_id="a", then_step=step, check_in=30.0,
        )  # fmt: skip
    assert plain.stepped_to == 1 and plain.consumers is None


def test_a_last_step_taken_in_the_report_marks_the_partitions_streams_done(
    store: RequestStore,
) -> None:
    """llm's completing report (rank 1: no tokens of its own) takes a done step: llm is done
    and its stream to codec says its producer is done, as ``take_step`` would leave them."""
    create_two_partitions(store)
    for rank in (0, 1):
        outcome = store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=rank, num_ranks=2,
            replica_id="a", then_step=Step(DECODE, (), done=True), check_in=None,
        )  # fmt: skip
    assert outcome.stepped_to == 1
    assert store.load_partition("r1", "llm").is_done
    assert store.load_connection("r1", LLM_TO_CODEC).producer_done


def test_the_fencing_token_a_step_in_the_report_raises_stays_exact_past_lua_digits(
    store: RequestStore, client: redis.Redis
) -> None:
    """The in-report step counts the token up in Lua while Lua counts exactly (13 digits)
    and leaves it to HINCRBY beyond: either way the lease carries the stored token + 1."""
    create_two_partitions(store)
    step = Step(DECODE, ("wg-codec",))
    lease_key = store.keys.lease("r1")
    for fwd_pass, held in enumerate((9_999_999_999_998, 9_999_999_999_999, 10**15 + 7)):
        client.hset(lease_key, "token", held)
        outcome = store.record_worker_report(
            "r1", "codec", fwd_pass=fwd_pass, worker_graph_id="wg-codec", rank=0,
            num_ranks=1, replica_id="a", then_step=step, check_in=30.0,
        )  # fmt: skip
        assert outcome.stepped_to == fwd_pass + 1
        assert outcome.lease is not None and outcome.lease.token == held + 1
        assert int(client.hget(lease_key, "token")) == held + 1
        assert int(client.hget(lease_key, "token[codec]")) == held + 1


def test_a_report_resent_after_later_steps_is_stale(store: RequestStore) -> None:
    create_two_partitions(store)
    step = Step(DECODE, ("wg-codec",))
    for fwd_pass in (0, 1):  # pass 0 stepped in-report, then pass 1 too
        for rank in (0, 1):
            store.record_worker_report(
                "r1", "codec", fwd_pass=fwd_pass, worker_graph_id="wg-codec", rank=rank,
                num_ranks=2, replica_id="a", then_step=step, check_in=30.0,
            )  # fmt: skip
    with pytest.raises(StalePassError):
        store.record_worker_report(
            "r1", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=1, num_ranks=2,
            replica_id="a", then_step=step, check_in=30.0,
        )  # fmt: skip


def test_a_refused_finish_leaves_the_request_where_recovery_and_reap_find_it(
    store: RequestStore, client: redis.Redis
) -> None:
    # Replica "a" holds the lease on codec's next step; an unfenced finish (a zombie's, or a
    # tool's) is refused, and must neither mark the request finished for reap nor take its
    # partitions out of the recovery index.
    create_two_partitions(store)
    store.schedule_check("r1", "llm", 30.0)
    for rank in (0, 1):
        store.record_worker_report(
            "r1", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=rank, num_ranks=2,
            replica_id="a",
        )  # fmt: skip
    with pytest.raises(FencedError):
        store.finish_request("r1", keep_for=60.0)
    assert client.zscore(store.keys.finished, "r1") is None
    assert client.zscore(store.keys.deadlines, "r1 llm") is not None
    assert not store.load_record("r1").finished_at
    store.finish_request("r1", keep_for=60.0, fence=store.claim_step("r1", "llm", "b"))
    assert client.zscore(store.keys.finished, "r1") is not None
    assert client.zscore(store.keys.deadlines, "r1 llm") is None


def test_pass_completes_once_across_worker_graphs(store: RequestStore) -> None:
    create_two_partitions(store)
    store.advance_partition(
        "r1", "llm", from_pass=0, metadata=DECODE, worker_graph_ids=["wg-a", "wg-b"]
    )
    reports = [("wg-a", 0), ("wg-b", 0), ("wg-a", 1), ("wg-b", 1), ("wg-b", 1)]
    outcomes = [
        store.record_worker_report(
            "r1", "llm", fwd_pass=1, worker_graph_id=wg, rank=rank, num_ranks=2
        )
        for wg, rank in reports
    ]
    assert [o.applied and o.pass_complete for o in outcomes] == [False, False, False, True, False]
    # The resent completing report is a duplicate that says the first one completed it.
    assert (outcomes[4].applied, outcomes[4].pass_complete) == (False, True)


def test_consumed_must_name_an_incoming_connection(store: RequestStore) -> None:
    create_two_partitions(store)
    with pytest.raises(ValidationError, match="not incoming connections of 'llm'") as info:
        store.record_worker_report(
            "r1", "llm", fwd_pass=0, worker_graph_id="wg-llm", rank=0, num_ranks=1,
            consumed={LLM_TO_CODEC: 1},
        )  # fmt: skip
    assert info.value.request_id == "r1"


def test_a_second_store_sees_the_first_ones_writes(
    store: RequestStore, client: redis.Redis, namespace: str
) -> None:
    create_two_partitions(store)
    other = RequestStore(client, namespace=namespace, codec=Codec(user_registry()))
    other.record_worker_report(
        "r1", "codec", fwd_pass=0, worker_graph_id="wg-codec", rank=0, num_ranks=1,
        consumed={LLM_TO_CODEC: 2},
    )  # fmt: skip
    assert store.load_connection("r1", LLM_TO_CODEC).consumed_count == 2
    store.delete_request("r1")
    create_two_partitions(store)  # the same id, created again
    assert other.load_connection("r1", LLM_TO_CODEC).consumed_count == 0


def test_user_config_kind_roundtrips(store: RequestStore) -> None:
    create_two_partitions(store, configs={"beam": BeamConfig(4, {3: 0.5})})
    assert store.load_record("r1").resource_configs == {"beam": BeamConfig(4, {3: 0.5})}


@pytest.mark.parametrize(
    ("seed", "fwd_pass", "done", "check_in"),
    [
        (7, 0, False, 30.0),
        (7, 0, True, None),
        (2**62, 10**15, False, 30.0),  # beyond what the script counts itself: HINCRBY's
        (-(2**63), 3, False, 30.0),
    ],
)
def test_a_step_taken_in_the_report_leaves_what_report_then_take_step_leaves(
    store: RequestStore,
    client: redis.Redis,
    seed: int,
    fwd_pass: int,
    done: bool,
    check_in: float | None,
) -> None:
    """The completing report that takes the step writes the partition and lease hash in one
    go; the stored result must be the two calls' (but the field that recognises its resend)."""
    step = Step(DECODE, ("wg-llm",), done=done)
    stored = []
    for rid, in_report in (("a", True), ("b", False)):
        store.create_request(
            rid,
            partitions={
                "llm": PartitionState(
                    "llm", PREFILL, fwd_pass_number=fwd_pass, random_seed=seed,
                    current_worker_graph_ids={"wg-llm", "wg-aux"},
                ),
                "codec": PartitionState("codec", PREFILL, current_worker_graph_ids={"wg-codec"}),
            },
            connections={LLM_TO_CODEC: StreamingConnectionState("llm", "codec", "tokens")},
            max_output_tokens=64,
        )  # fmt: skip
        store.record_worker_report(  # an output of the pass, which the step clears
            rid, "llm", fwd_pass=fwd_pass, worker_graph_id="wg-aux", rank=0, num_ranks=1,
            new_tokens=1, output_names=["aux"],
        )  # fmt: skip
        for rank in (1, 0):  # rank 0 (tokens, outputs) completes the pass
            outcome = store.record_worker_report(
                rid, "llm", fwd_pass=fwd_pass, worker_graph_id="wg-llm", rank=rank, num_ranks=2,
                new_tokens=5 - 5 * rank, output_names=["out"] * (1 - rank),
                published={"kv": kv(rank, "x", 9)},
                replica_id="r", then_step=step if in_report else None, check_in=check_in,
            )  # fmt: skip
        assert outcome.lease is not None
        if in_report:
            assert outcome.stepped_to == fwd_pass + 1
        else:
            assert store.take_step(outcome.lease, step, check_in=check_in) == fwd_pass + 1
        lease = {k: v for k, v in client.hgetall(store.keys.lease(rid)).items()}
        lease.pop(b"stepped_by[llm]", None)
        for field in (b"sent[llm]", b"check[llm]"):  # times: each call's own
            assert (lease.pop(field, None) is None) == (field == b"check[llm]" and done)
        stored.append(
            (store.load_request(rid).partitions, store.load_request(rid).connections, lease)
        )
    assert stored[0] == stored[1]
    llm = stored[0][0]["llm"]
    assert (llm.fwd_pass_number, llm.random_seed, llm.num_output_tokens) == (
        fwd_pass + 1,
        seed + 1,
        6,
    )
    assert stored[0][1][LLM_TO_CODEC].producer_done == done
