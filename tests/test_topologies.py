"""The store on Redis Cluster and Sentinel, and on a server whose connections die under it.

Every test starts its own servers (``tests/servers.py``); the cluster and the sentinel are
shared by the tests of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from store import (
    Codec,
    KindRegistry,
    Reconnect,
    RequestNotFound,
    RequestStore,
    StoreConnectionError,
)
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
)
from tests.servers import RedisCluster, RedisSentinel, RedisServer
from tests.stores import Stores


def _metadata(walk: str = "decode") -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(graph_walk=walk, is_prefill=False)


def _create(store: RequestStore, rid: str) -> None:
    store.create_request(
        rid,
        partitions={
            "llm": PartitionState("llm", _metadata(), current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", _metadata()),
        },
        connections={"llm->codec": StreamingConnectionState("llm", "codec", "tokens")},
        max_output_tokens=16,
    )


def _kv(rank: int, seq_len: int) -> PublishedKVInfo:
    shard = KVSequenceInfo(seq_len=seq_len, latest_kv_transfer_info=None, page_indices=[rank])
    return PublishedKVInfo(info={rank: {"main": shard}}, world_size=2)


def _lifecycle(store: RequestStore, rid: str) -> None:
    """Create, report, merge, advance, load and delete one request, checking each step."""
    _create(store, rid)
    assert store.request_exists(rid)
    for rank in (0, 1):
        outcome = store.record_worker_report(
            rid,
            "llm",
            fwd_pass=0,
            worker_graph_id="wg",
            rank=rank,
            num_ranks=2,
            new_tokens=3 if rank == 0 else 0,
        )
        assert outcome.applied
        assert outcome.pass_complete == (rank == 1)
    for rank in (0, 1):
        store.merge_publish_info(rid, "llm", {"kv": _kv(rank, 10 + rank)})
    merged = store.merge_publish_info(rid, "llm", {"pos": PublishedPositionInfo({"llm": 7})})
    assert merged == {"pos": PublishedPositionInfo({"llm": 7})}
    assert store.advance_partition(rid, "llm", from_pass=0, metadata=_metadata("next")) == 1

    state = store.load_request(rid)
    llm = state.partitions["llm"]
    assert llm.fwd_pass_number == 1
    assert llm.metadata == _metadata("next")
    assert llm.num_output_tokens == 3
    assert llm.resource_publish_info == {
        "kv": PublishedKVInfo(info={0: _kv(0, 10).info[0], 1: _kv(1, 11).info[1]}, world_size=2),
        "pos": PublishedPositionInfo({"llm": 7}),
    }
    assert state.connections["llm->codec"].token_count == 3

    assert store.delete_request(rid)
    assert not store.request_exists(rid)
    with pytest.raises(RequestNotFound):
        store.load_request(rid)


# -- Redis Cluster ---------------------------------------------------------------------------


def _owner(client: ClusterClient, store: RequestStore, rid: str) -> str:
    """The node the store's own client maps the request to (an async store has its own)."""
    own = getattr(store, "_store", None)
    initialized = own is not None and own.client.nodes_manager.slots_cache
    mapper = own.client if initialized else client
    return str(mapper.get_node_from_key(store.keys.meta(rid)).name)


@pytest.mark.cluster
def test_lifecycle_on_requests_spread_over_cluster_nodes(
    tmp_cluster: RedisCluster, namespace: str, make_store: Stores
) -> None:
    client = tmp_cluster.client()
    try:
        store = make_store(client, namespace=namespace)
        rids = [f"req-{i}" for i in range(6)]
        assert len({_owner(client, store, rid) for rid in rids}) > 1
        for rid in rids:
            _lifecycle(store, rid)

        # The index lives in a slot of its own, apart from every request's keys.
        for rid in rids:
            _create(store, rid)
        assert client.keyslot(store.keys.index) not in {
            client.keyslot(store.keys.meta(rid)) for rid in rids
        }
        assert store.list_requests() == rids
        assert all(store.delete_request(rid) for rid in rids)
        assert store.list_requests() == []
    finally:
        client.close()


@pytest.mark.cluster
def test_store_from_a_cluster_url(
    tmp_cluster: RedisCluster, namespace: str, make_store: Stores
) -> None:
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in tmp_cluster.ports)
    store = make_store.from_url(url, namespace=namespace)
    assert isinstance(store.client, ClusterClient)
    _lifecycle(store, "from-url")
    assert store.list_requests() == []


@dataclass
class CountInfo(PublishedInfo):
    """A user kind: merged in Python, so by the optimistic transaction."""

    count: int = 0

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, CountInfo)
        self.count = max(self.count, other.count)


def _registry() -> KindRegistry:
    registry = KindRegistry()
    registry.register(PublishedPositionInfo, "position")
    registry.register(CountInfo, "count")
    return registry


@pytest.mark.cluster
def test_merges_follow_a_moved_slot(
    tmp_cluster: RedisCluster, namespace: str, make_store: Stores
) -> None:
    client = tmp_cluster.client()
    try:
        store = make_store(client, namespace=namespace, codec=Codec(_registry()))
        rid = "moving"
        _create(store, rid)
        store.merge_publish_info(rid, "llm", {"pos": PublishedPositionInfo({"llm": 1})})
        slot = client.keyslot(store.keys.meta(rid))
        owner = _owner(client, store, rid)
        source = next(n for n in tmp_cluster.nodes if f"{n.host}:{n.port}" == owner)
        target = next(n for n in tmp_cluster.nodes if n is not source)
        assert tmp_cluster.migrate_slot(slot, source, target) >= 4

        # The client still maps the slot to the old owner: the server-side merge meets MOVED,
        # the slot map is refreshed and it runs again on the new owner.
        merged = store.merge_publish_info(rid, "llm", {"pos": PublishedPositionInfo({"llm": 5})})
        assert merged == {"pos": PublishedPositionInfo({"llm": 5})}
        assert _owner(client, store, rid) == f"{target.host}:{target.port}"
        with target.client() as c:
            assert c.exists(store.keys.meta(rid))

        # Back to the first owner: the optimistic transaction's first try meets MOVED and
        # the second commits there.
        assert tmp_cluster.migrate_slot(slot, target, source) >= 4
        before = store.stats.attempts
        assert store.merge_publish_info(rid, "llm", {"n": CountInfo(3)}) == {"n": CountInfo(3)}
        assert store.stats.attempts - before == 2
        assert _owner(client, store, rid) == f"{source.host}:{source.port}"

        outcome = store.record_worker_report(
            rid, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, new_tokens=2
        )
        assert outcome.pass_complete
        assert store.advance_partition(rid, "llm", from_pass=0, metadata=_metadata()) == 1
        state = store.load_request(rid)
        assert state.partitions["llm"].resource_publish_info == {
            "pos": PublishedPositionInfo({"llm": 5}),
            "n": CountInfo(3),
        }
        assert state.connections["llm->codec"].token_count == 2
        assert store.delete_request(rid)
    finally:
        client.close()


# -- Sentinel --------------------------------------------------------------------------------


@pytest.mark.sentinel
def test_lifecycle_through_sentinel(
    tmp_sentinel: RedisSentinel, namespace: str, make_store: Stores
) -> None:
    url = f"redis+sentinel://{tmp_sentinel.host}:{tmp_sentinel.port}/{tmp_sentinel.service_name}"
    store = make_store.from_url(url, namespace=namespace)
    _create(store, "watched")
    with tmp_sentinel.master.client() as master:
        assert master.exists(store.keys.meta("watched"))
    store.delete_request("watched")
    _lifecycle(store, "watched")


# -- connections that die ----------------------------------------------------------------


@pytest.fixture
def admin(tmp_redis: RedisServer) -> Iterator[redis.Redis]:
    with tmp_redis.client() as c:
        yield c


def _kill_clients(admin: redis.Redis) -> int:
    """Close every normal connection but the admin's own; how many were closed."""
    return int(admin.client_kill_filter(_type="normal", skipme=True))


@pytest.mark.servers
@pytest.mark.timeout(60)  # a hang, not a slow answer, is the failure here
@pytest.mark.parametrize("tmp_redis", [("--appendonly", "yes")], indirect=True)
def test_store_survives_killed_connections_and_a_restart(
    tmp_redis: RedisServer, admin: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store.from_url(tmp_redis.url, namespace=namespace, reconnect=BRIEF)
    try:
        rid = "survivor"
        _create(store, rid)
        killed = 0
        for i in range(1, 11):
            store.merge_publish_info(rid, "llm", {"pos": PublishedPositionInfo({"llm": i})})
            killed += _kill_clients(admin)
            store.add_tokens(rid, "llm->codec", i)
            killed += _kill_clients(admin)
        assert killed >= 20  # every kill found the store's connection
        state = store.load_request(rid)
        assert state.partitions["llm"].resource_publish_info == {
            "pos": PublishedPositionInfo({"llm": 10})
        }
        assert state.connections["llm->codec"].token_count == sum(range(1, 11))

        tmp_redis.stop()
        position = {"pos": PublishedPositionInfo({"llm": 11})}
        with pytest.raises(StoreConnectionError):
            store.merge_publish_info(rid, "llm", position)
        with pytest.raises(StoreConnectionError):
            store.add_tokens(rid, "llm->codec", 1)
        with pytest.raises(StoreConnectionError):
            store.load_request(rid)

        tmp_redis.restart()  # the AOF brings the request back; the script cache is empty
        assert store.merge_publish_info(rid, "llm", position) == position
        assert store.add_tokens(rid, "llm->codec", 1) == sum(range(1, 11)) + 1
        assert store.load_partition(rid, "llm").resource_publish_info == position
    finally:
        store.client.close()


BRIEF = Reconnect(give_up_after=0.5)  # the server is down on purpose: say so soon
