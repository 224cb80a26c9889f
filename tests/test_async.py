"""What only the asyncio store has: cancelled tasks, many tasks on one store, ``async with``.

The contract itself (every method, every error) runs over both stores in the other modules
(the ``make_store`` fixture); these tests drive ``AsyncRequestStore`` natively.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from store import AsyncReplicaRegistry, AsyncRequestStore, RequestNotFound, StalePassError
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
)
from tests.servers import RedisServer
from tests.stores import async_twin

MD = CurrentForwardConductorMetadata("decode", False)
CONN = "llm->codec"


@pytest.fixture
async def astore(client: redis.Redis, namespace: str) -> AsyncIterator[AsyncRequestStore]:
    async with AsyncRequestStore(async_twin(client), namespace=namespace) as store:
        yield store


async def create(store: AsyncRequestStore, rid: str) -> None:
    await store.create_request(
        rid,
        partitions={
            "llm": PartitionState("llm", MD, current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", MD),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "e")},
        max_output_tokens=10_000,
    )


def kv(rank: int, pass_: int) -> PublishedKVInfo:
    shard = KVSequenceInfo(
        seq_len=pass_ + 1, latest_kv_transfer_info=None, page_indices=list(range(pass_ + 1))
    )
    return PublishedKVInfo(info={rank: {f"p{pass_}": shard}}, world_size=2)


async def one_pass(store: AsyncRequestStore, rid: str, fwd_pass: int) -> None:
    """Merge both ranks' KV infos and positions, report both ranks, advance."""
    for rank in (0, 1):
        await store.merge_publish_info(
            rid, "llm", {"kv": kv(rank, fwd_pass), "pos": PublishedPositionInfo({"llm": fwd_pass})}
        )
        await store.record_worker_report(
            rid, "llm", fwd_pass=fwd_pass, worker_graph_id="wg", rank=rank, num_ranks=2,
            new_tokens=3 if rank == 0 else 0, output_names=["t"] if rank == 0 else [],
        )  # fmt: skip
    await store.add_tokens(rid, CONN, 1, op_id=f"{rid}:{fwd_pass}")
    await store.advance_partition(
        rid, "llm", from_pass=fwd_pass, metadata=MD, worker_graph_ids=["wg"]
    )


async def drive(store: AsyncRequestStore, rid: str) -> None:
    """Run passes from wherever the request stands (a cancelled pass is taken up again)."""
    while True:
        await asyncio.sleep(0)  # fakeredis answers without suspending: let the loop run
        state = await store.load_partition(rid, "llm")
        try:
            await one_pass(store, rid, state.fwd_pass_number)
        except StalePassError:
            continue


async def test_cancelled_tasks_leave_nothing_half_written_and_the_pool_sound(
    astore: AsyncRequestStore,
) -> None:
    rng = random.Random(3)
    rids = [f"cancel-{i}" for i in range(8)]
    for rid in rids:
        await create(astore, rid)
    cancelled = 0
    for _ in range(60):
        rid = rng.choice(rids)
        task = asyncio.create_task(drive(astore, rid))
        await asyncio.sleep(rng.uniform(0, 0.004))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled += 1
    assert cancelled == 60

    for rid in rids:
        state = await astore.load_request(rid)
        llm = state.partitions["llm"]
        # A report changes the partition and its outgoing connection in one script; each
        # completed pass added one more token with add_tokens.
        passes = llm.fwd_pass_number
        tokens = state.connections[CONN].token_count
        assert llm.num_output_tokens % 3 == 0
        reported_passes = llm.num_output_tokens // 3
        assert passes <= reported_passes <= passes + 1
        assert tokens - llm.num_output_tokens in (passes, passes + 1)  # add_tokens per pass
        assert len(llm.curr_forward_outputs) == int(reported_passes > passes)
        kv_info = llm.resource_publish_info.get("kv")
        if kv_info is not None:  # every merged shard whole, never a part of one
            assert isinstance(kv_info, PublishedKVInfo)
            for labels in kv_info.info.values():
                for label, shard in labels.items():
                    assert shard.page_indices == list(range(int(label[1:]) + 1))

    # Every connection left in the pool answers its own calls in order.
    async def next_pass(rid: str) -> None:
        await one_pass(astore, rid, (await astore.load_partition(rid, "llm")).fwd_pass_number)

    await asyncio.gather(*(next_pass(rid) for rid in rids))
    # None is lost: those out of redis-py's pool are the store's idle ones, each connected.
    pool = getattr(astore.client, "connection_pool", None)  # a cluster has one per node
    if hasattr(pool, "_in_use_connections"):
        idle = astore._executor.idle_connections()
        assert pool._in_use_connections == set(idle)
        assert all(conn.is_connected for conn in idle)


async def test_many_tasks_on_one_store_lose_nothing(astore: AsyncRequestStore) -> None:
    await create(astore, "busy")
    await asyncio.gather(
        *(astore.add_tokens("busy", CONN, i, op_id=f"t{i}") for i in range(1, 201)),
        *(astore.raise_consumed_count("busy", CONN, i) for i in range(1, 201)),
    )
    conn = await astore.load_connection("busy", CONN)
    assert conn.token_count == sum(range(1, 201))
    assert conn.consumed_count == 200


async def test_errors_are_the_sync_store_errors(astore: AsyncRequestStore) -> None:
    with pytest.raises(RequestNotFound) as info:
        await astore.load_request("missing")
    assert info.value.request_id == "missing"


async def test_async_replica_registry(client: redis.Redis, namespace: str) -> None:
    twin = async_twin(client)
    registry = AsyncReplicaRegistry(twin, namespace=namespace)
    await registry.heartbeat("a", now=100.0)
    await registry.heartbeat("b", now=200.0)
    assert await registry.last_beats() == {"b": 200.0, "a": 100.0}
    assert await registry.live(within=50, now=220.0) == ["b"]
    assert await registry.prune(older_than=50, now=220.0) == 1
    await registry.forget("b")
    assert await registry.last_beats() == {}
    await twin.aclose()


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [("--unixsocket", "redis.sock")], indirect=True)
async def test_from_url_over_a_unix_socket(tmp_redis: RedisServer, namespace: str) -> None:
    socket = Path(tmp_redis.workdir) / "redis.sock"
    async with AsyncRequestStore.from_url(f"unix://{socket}", namespace=namespace) as store:
        await create(store, "unix")
        assert await store.list_requests() == ["unix"]
        assert await store.delete_request("unix")


@pytest.mark.fake
def test_the_connection_methods_the_executor_writes_through_are_there() -> None:
    """store.io.aio writes through redis-py's unbounded ``_send_packed_command`` (its own
    bound covers the whole exchange, see ``_bounded``); a redis-py that drops or renames it
    must fail here, not in production. (tests/faults/test_pause.py checks the bound.)"""
    import inspect

    from redis.asyncio.connection import AbstractConnection

    send = AbstractConnection._send_packed_command
    assert inspect.iscoroutinefunction(send)
    assert list(inspect.signature(send).parameters) == ["self", "command"]
    assert isinstance(AbstractConnection.__dict__.get("is_connected"), property)
