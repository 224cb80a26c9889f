"""Replicated durability on a Redis Cluster: each write waits on its own shard's replica.

The store sends a write and its ``WAIT`` in one write on the connection to the master
that holds the request's slot (redis-py's ``RedisCluster`` would send a bare ``WAIT`` to
every primary and add their counts up, which says nothing about the shard written). A
private cluster of three masters with a replica each: steps on requests of every shard
succeed; with one shard's replica stopped (SIGSTOP), steps there raise
``ReplicationTimeoutError`` (applied on the master) while steps on the other shards go on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from store import ReplicationTimeoutError, RequestStore
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.conftest import require_binaries
from tests.servers import RedisCluster

pytestmark = [pytest.mark.servers, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]

MD = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
NAMESPACE = "dur"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_binaries()
    with RedisCluster(tmp_path_factory.mktemp("replicated"), replicas=1) as cluster:
        yield cluster


def one_request_per_shard(cluster: RedisCluster) -> dict[int, str]:
    """A request id for each master's port."""
    found: dict[int, str] = {}
    for i in range(10_000):
        rid = f"r{i}"
        port = cluster.owner_of(key_slot(f"{NAMESPACE}:{{{rid}}}:meta".encode())).port
        found.setdefault(port, rid)
        if len(found) == cluster.masters:
            return found
    raise AssertionError("could not place a request on every shard")


def step(store: RequestStore, rid: str, p: int) -> None:
    store.record_worker_report(rid, "llm", fwd_pass=p, worker_graph_id="wg", rank=0, num_ranks=1)
    store.advance_partition(rid, "llm", from_pass=p, metadata=MD, worker_graph_ids=["wg"],
                            op_id=f"adv{p}")  # fmt: skip


def test_each_write_waits_for_its_own_shards_replica(cluster: RedisCluster) -> None:
    store = RequestStore.from_url(
        f"{cluster.store_url}?durability=replicated&replicas=1&wait_ms=300", namespace=NAMESPACE
    )
    requests = one_request_per_shard(cluster)
    state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
    for rid in requests.values():
        store.create_request(rid, partitions={"llm": state}, connections={}, max_output_tokens=8)
        step(store, rid, 0)
    lagging_master, lagging = next(iter(requests.items()))
    (replica_port,) = cluster.replicas_of(lagging_master)
    replica = cluster.node(replica_port)
    replica.pause()
    try:
        with pytest.raises(ReplicationTimeoutError) as raised:
            step(store, lagging, 1)
        assert (raised.value.acknowledged, raised.value.wanted) == (0, 1)
        assert raised.value.request_id == lagging
        for rid in requests.values():
            if rid != lagging:
                step(store, rid, 1)  # the other shards' replicas acknowledge
    finally:
        replica.resume()
    # The report was applied on the master: once the replica is back, the step goes on.
    step(store, lagging, 1)
    for rid in requests.values():
        assert store.load_partition(rid, "llm").fwd_pass_number == 2
    store.close()
