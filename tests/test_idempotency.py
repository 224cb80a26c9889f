"""Operations sent twice (a resend after a lost reply, a redelivered report) apply once.

What the module docstring of store/store.py promises: create, add_tokens, advance and merge
are guarded by an op id; a report by its (pass, worker graph, rank); raising a count and
replacing fields are idempotent by nature. ``SumInfo`` merges by adding, so a merge applied
twice would show.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from store import Codec, RequestExistsError, RequestStore
from store.io import sync as transaction
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)
from tests.servers import RedisServer
from tests.strategies import SumInfo, user_registry

MD = CurrentForwardConductorMetadata("walk", True)
NEXT = CurrentForwardConductorMetadata("next", False)
CONN = "llm->codec"
RID = "r1"


def make_store(client: redis.Redis, namespace: str) -> RequestStore:
    return RequestStore(client, namespace=namespace, codec=Codec(user_registry()))


@pytest.fixture
def store(client: redis.Redis, namespace: str) -> RequestStore:
    return make_store(client, namespace)


def create(store: RequestStore, op_id: str | None = None) -> None:
    store.create_request(
        RID,
        partitions={
            "llm": PartitionState(
                "llm",
                MD,
                current_worker_graph_ids={"wg"},
                resource_publish_info={"sum": SumInfo(10)},
            ),
            "codec": PartitionState("codec", MD, current_worker_graph_ids={"wg-c"}),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "e")},
        max_output_tokens=10,
        op_id=op_id,
    )


def test_resent_create_is_recognised(store: RequestStore) -> None:
    create(store, op_id="create-1")
    store.update_partition(RID, "llm", num_output_tokens=4)
    create(store, op_id="create-1")  # the same create again: succeeds, overwrites nothing
    assert store.load_partition(RID, "llm").num_output_tokens == 4
    assert store.list_requests() == [RID]
    with pytest.raises(RequestExistsError):
        create(store, op_id="create-2")
    with pytest.raises(RequestExistsError):
        create(store)  # no op id: a fresh one, so not a resend


def test_add_tokens_with_one_op_id_adds_once(store: RequestStore) -> None:
    create(store)
    assert store.add_tokens(RID, CONN, 5, op_id="t1") == 5
    assert store.add_tokens(RID, CONN, 5, op_id="t1") == 5
    assert store.add_tokens(RID, CONN, 2, op_id="t2") == 7
    assert store.add_tokens(RID, CONN, 2) == 9  # without op ids every call counts
    assert store.add_tokens(RID, CONN, 2) == 11
    assert store.load_connection(RID, CONN).token_count == 11


def test_advance_with_one_op_id_advances_once(store: RequestStore) -> None:
    create(store)
    assert store.advance_partition(RID, "llm", from_pass=0, metadata=NEXT, op_id="a1") == 1
    # The resend names the pass it left; it is recognised, not reported stale.
    assert store.advance_partition(RID, "llm", from_pass=0, metadata=NEXT, op_id="a1") == 1
    llm = store.load_partition(RID, "llm")
    assert (llm.fwd_pass_number, llm.random_seed) == (1, 1)
    assert store.advance_partition(RID, "llm", from_pass=1, metadata=NEXT, op_id="a2") == 2


def test_merge_with_one_op_id_merges_once(store: RequestStore) -> None:
    create(store)
    first = store.merge_publish_info(RID, "llm", {"sum": SumInfo(5)}, op_id="m1")
    second = store.merge_publish_info(RID, "llm", {"sum": SumInfo(5)}, op_id="m1")
    assert first == second == {"sum": SumInfo(15)}
    assert store.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(15)}
    store.merge_publish_info(RID, "llm", {"sum": SumInfo(1)}, op_id="m2")
    store.merge_publish_info(RID, "llm", {"sum": SumInfo(1)})
    assert store.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(17)}


def test_op_ids_of_different_operations_do_not_meet(store: RequestStore) -> None:
    create(store)
    store.add_tokens(RID, CONN, 1, op_id="same")
    store.merge_publish_info(RID, "llm", {"sum": SumInfo(1)}, op_id="same")
    store.advance_partition(RID, "llm", from_pass=0, metadata=NEXT, op_id="same")
    assert store.load_connection(RID, CONN).token_count == 1
    llm = store.load_partition(RID, "llm")
    assert llm.resource_publish_info == {"sum": SumInfo(11)}
    assert llm.fwd_pass_number == 1


def test_op_ids_are_per_request(store: RequestStore) -> None:
    create(store)
    store.create_request(
        "r2",
        partitions={"llm": PartitionState("llm", MD), "codec": PartitionState("codec", MD)},
        connections={CONN: StreamingConnectionState("llm", "codec", "e")},
        max_output_tokens=1,
    )
    store.add_tokens(RID, CONN, 3, op_id="t")
    assert store.add_tokens("r2", CONN, 3, op_id="t") == 3


def test_redelivered_reports_count_once(store: RequestStore) -> None:
    create(store)
    for _ in range(2):
        store.record_worker_report(
            RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1,
            new_tokens=4, output_names=["out"],
        )  # fmt: skip
        store.record_worker_report(
            RID, "codec", fwd_pass=0, worker_graph_id="wg-c", rank=0, num_ranks=1,
            consumed={CONN: 4},
        )  # fmt: skip
    llm = store.load_partition(RID, "llm")
    assert (llm.num_output_tokens, llm.curr_forward_outputs) == (4, ["out"])
    assert llm.wg_rank_completions == {"wg": 1}
    conn = store.load_connection(RID, CONN)
    assert (conn.token_count, conn.consumed_count) == (4, 4)


def test_writes_idempotent_by_nature(store: RequestStore) -> None:
    create(store)
    for _ in range(2):
        assert store.raise_consumed_count(RID, CONN, 3) == 3
        store.update_partition(
            RID, "llm", curr_forward_outputs=["a"], wg_rank_completions={"wg": 1}, is_done=True
        )
        store.set_producer_done(RID, CONN)
        store.set_final_output(RID, "text", "hi")
    llm = store.load_partition(RID, "llm")
    assert (llm.curr_forward_outputs, llm.wg_rank_completions, llm.is_done) == (
        ["a"],
        {"wg": 1},
        True,
    )
    conn = store.load_connection(RID, CONN)
    assert (conn.consumed_count, conn.producer_done) == (3, True)
    assert store.load_record(RID).final_outputs == {"text": "hi"}


def test_delete_twice(store: RequestStore) -> None:
    create(store)
    assert store.delete_request(RID) is True
    assert store.delete_request(RID) is False


# -- a reply lost on the wire ------------------------------------------------------------------


@pytest.fixture
def server_client(tmp_redis: RedisServer) -> Iterator[redis.Redis]:
    client = tmp_redis.client()
    yield client
    client.close()


def drop_the_exec_connection(
    monkeypatch: pytest.MonkeyPatch, *, committed: bool
) -> list[Sequence[Any]]:
    """Make the first MULTI..EXEC round trip lose its connection; returns what was dropped.

    With ``committed``, the commands reach Redis and run, and the connection drops before
    the caller sees a reply (the replies are read here so that EXEC surely ran before the
    retry; the caller never gets them, which is what a lost reply is). Without, the
    connection drops before anything is sent.
    """
    real = transaction.round_trip
    dropped: list[Sequence[Any]] = []

    def lossy(conn: Any, commands: Sequence[Any]) -> list[Any]:
        if commands[0] == ("MULTI",) and not dropped:
            dropped.append(commands)
            if committed:
                conn.send_packed_command(conn.pack_commands(commands))
                for _ in commands:
                    with contextlib.suppress(redis.ResponseError):
                        conn.read_response()
            raise redis.ConnectionError("connection lost while EXEC was in flight")
        return real(conn, commands)

    monkeypatch.setattr(transaction, "round_trip", lossy)
    return dropped


@pytest.mark.servers
def test_merge_after_a_lost_exec_reply_counts_once(
    server_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(server_client, namespace)
    create(store)
    dropped = drop_the_exec_connection(monkeypatch, committed=True)
    merged = store.merge_publish_info(RID, "llm", {"sum": SumInfo(5)}, op_id="m1")
    assert len(dropped) == 1
    assert (store.stats.transactions, store.stats.attempts) == (1, 2)  # it did retry
    assert merged == {"sum": SumInfo(15)}
    assert store.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(15)}


@pytest.mark.servers
def test_merge_after_a_connection_lost_before_exec_applies_once(
    server_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(server_client, namespace)
    create(store)
    dropped = drop_the_exec_connection(monkeypatch, committed=False)
    merged = store.merge_publish_info(RID, "llm", {"sum": SumInfo(5)}, op_id="m1")
    assert len(dropped) == 1
    assert store.stats.attempts == 2
    assert merged == {"sum": SumInfo(15)}
    assert store.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(15)}
