"""The test fixtures themselves work (backends, cleanup, private servers)."""

from __future__ import annotations

import uuid

import fakeredis
import pytest
import redis
import redis.cluster

from tests.conftest import delete_namespace
from tests.servers import RedisCluster, RedisSentinel, RedisServer, cluster_state, no_retry


def test_client_set_get_in_namespace(client: redis.Redis, namespace: str) -> None:
    client.set(f"{namespace}:a", b"1")
    client.hset(f"{namespace}:h", mapping={"f": "v"})
    assert client.get(f"{namespace}:a") == b"1"  # bytes: decode_responses is off
    assert client.hgetall(f"{namespace}:h") == {b"f": b"v"}
    assert sorted(client.scan_iter(match=f"{namespace}:*")) == [
        f"{namespace}:a".encode(),
        f"{namespace}:h".encode(),
    ]


def test_namespaces_are_unique(namespace: str) -> None:
    assert namespace.startswith("t-")
    assert len(namespace) == 14


@pytest.mark.fake
def test_fake_clients_share_one_server_per_test(
    fake_server: fakeredis.FakeServer, namespace: str
) -> None:
    with (
        fakeredis.FakeRedis(server=fake_server) as a,
        fakeredis.FakeRedis(server=fake_server) as b,
    ):
        a.set(f"{namespace}:k", b"v")
        assert b.get(f"{namespace}:k") == b"v"


@pytest.mark.fake
def test_fake_cleanup_only_touches_namespace(fake_server: fakeredis.FakeServer) -> None:
    with fakeredis.FakeRedis(server=fake_server) as c:
        c.set("ns1:a", 1)
        c.set("ns1:b", 2)
        c.set("ns10:a", 3)  # shares the prefix string, not the namespace
        c.set("other", 4)
        assert delete_namespace(c, "ns1") == 2
        assert sorted(c.keys()) == [b"ns10:a", b"other"]


@pytest.mark.real
def test_real_cleanup_keeps_other_namespaces(real_client: redis.Redis, namespace: str) -> None:
    other = f"t-other-{uuid.uuid4().hex[:12]}"
    try:
        real_client.set(f"{other}:survivor", b"x")
        real_client.set(f"{namespace}:doomed", b"y")
        # Same cleanup the fixtures run after each test.
        assert delete_namespace(real_client, namespace) == 1
        assert real_client.exists(f"{namespace}:doomed") == 0
        assert real_client.get(f"{other}:survivor") == b"x"
    finally:
        real_client.delete(f"{other}:survivor")


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [("--appendonly", "yes")], indirect=True)
def test_tmp_redis_kill_restart_keeps_aof_data(tmp_redis: RedisServer) -> None:
    url = tmp_redis.url
    with tmp_redis.client() as c:
        assert c.config_get("appendonly") == {"appendonly": "yes"}
        c.set("durable", b"1")
    tmp_redis.kill()
    assert not tmp_redis.running
    tmp_redis.restart()
    assert tmp_redis.url == url  # same port
    with redis.Redis.from_url(url) as c:
        assert c.get("durable") == b"1"


@pytest.mark.servers
def test_tmp_redis_pause_resume(tmp_redis: RedisServer) -> None:
    with tmp_redis.client(socket_timeout=0.3, retry=no_retry()) as c:
        assert c.ping()
        tmp_redis.pause()
        try:
            with pytest.raises(redis.TimeoutError):
                c.ping()
        finally:
            tmp_redis.resume()
    with tmp_redis.client() as c:
        assert c.ping()
        assert c.config_get("appendonly") == {"appendonly": "no"}


@pytest.mark.servers
@pytest.mark.cluster
def test_tmp_cluster(tmp_cluster: RedisCluster) -> None:
    for node in tmp_cluster.nodes:
        with node.client() as c:
            assert cluster_state(c) == "ok"
    assert tmp_cluster.url == f"redis://127.0.0.1:{tmp_cluster.ports[0]}"
    keys = [f"k{i}" for i in range(30)]
    with redis.cluster.RedisCluster.from_url(tmp_cluster.url) as rc:
        slots = {rc.keyslot(k) for k in keys}
        owners = {rc.get_node_from_key(k).port for k in keys}
        assert len(slots) > 1
        assert len(owners) == 3  # keys spread over all masters
        for k in keys:
            rc.set(k, k)
        assert [rc.get(k) for k in keys] == [k.encode() for k in keys]
        rc.delete(*keys)


@pytest.mark.servers
@pytest.mark.sentinel
def test_tmp_sentinel_resolves_master(tmp_sentinel: RedisSentinel) -> None:
    sentinel = redis.sentinel.Sentinel(tmp_sentinel.sentinels, socket_timeout=5)
    try:
        addr = sentinel.discover_master(tmp_sentinel.service_name)
        assert addr == (tmp_sentinel.master.host, tmp_sentinel.master.port)
        master = sentinel.master_for(tmp_sentinel.service_name, socket_timeout=5)
        try:
            master.set("via-sentinel", b"1")
            assert master.get("via-sentinel") == b"1"
            master.delete("via-sentinel")
        finally:
            master.close()
    finally:
        for s in sentinel.sentinels:
            s.close()
