"""``check_server()`` and ``mstar-store doctor``: eviction, persistence, mode, scripts, ACL,
namespace; the warning a store opened on an evicting server logs; the replica's refusal.

The shared server is fit (noeviction); servers with other settings are private ones
(``tmp_redis``), so a test may set them as it likes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import pytest
import redis

from store import AsyncReplica, AsyncRequestStore, EvictingServerError, Replica, RequestStore
from store.cli import main as cli
from store.health import Finding, worst
from tests.conftest import Run, create_small_request
from tests.runtime_planner import TwoRankPlanner
from tests.servers import RedisCluster, RedisSentinel, RedisServer
from tests.stores import Stores

EVICTING = ("--maxmemory-policy", "allkeys-lru", "--maxmemory", "64mb")


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def doctor(url: str, namespace: str, capsys: pytest.CaptureFixture[str], *more: str) -> Any:
    code = cli.main(["doctor", "--redis-url", url, "--namespace", namespace, *more])
    out, err = capsys.readouterr()
    return code, out, err


# -- on the test backends (fakeredis, and the shared server) ---------------------------------


def test_check_server_on_the_test_backend(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    create_small_request(store, "r-1")

    findings = store.check_server()

    found = by_check(findings)
    assert {"server", "eviction", "persistence", "scripts", "acl", "namespace"} <= set(found)
    assert worst(findings) != "fatal", findings
    assert found["scripts"].level == "ok"
    assert found["acl"].level == "ok"
    assert f"{namespace!r}: 1 requests, 0 steps due, 0 live replicas" in found["namespace"].message
    assert all("\n" not in f.message for f in findings)


def test_doctor_prints_a_line_per_check_and_exits_0(run: Run, client: redis.Redis) -> None:
    result = run("doctor")

    assert result.code == 0, result.out + result.err
    lines = result.out.splitlines()
    checks = list(dict.fromkeys(line.split()[1] for line in lines))  # per master on a cluster
    assert [c for c in checks if c != "cluster"] == [
        "server", "eviction", "persistence", "scripts", "acl", "namespace",
    ]  # fmt: skip
    assert all(line.split()[0] in ("ok", "warning") for line in lines)


def test_doctor_json(run: Run, namespace: str) -> None:
    result = run("doctor", "--json")

    data = json.loads(result.out)
    assert result.code == 0
    assert data["namespace"] == namespace
    assert data["worst"] in ("ok", "warning")
    assert {f["check"] for f in data["findings"]} >= {"eviction", "acl", "namespace"}


@pytest.mark.fake
def test_on_fakeredis_what_cannot_be_read_is_a_warning(
    fake_server: Any, namespace: str, make_store: Stores
) -> None:
    import fakeredis

    store = make_store(fakeredis.FakeRedis(server=fake_server), namespace=namespace)

    found = by_check(store.check_server())

    assert found["eviction"].level == "warning"  # fakeredis has no CONFIG and no INFO
    assert "cannot read maxmemory-policy" in found["eviction"].message
    assert found["acl"].message.startswith("user default may run every command")


@pytest.mark.real
def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = doctor("redis://127.0.0.1:1/0", "t-nowhere", capsys)

    assert code == 1
    assert out == ""
    assert err.startswith("error: Redis unreachable") and err.count("\n") == 1


# -- private servers: eviction, persistence -------------------------------------------------


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [EVICTING], indirect=True)
def test_an_evicting_server_is_fatal(
    tmp_redis: RedisServer, namespace: str, make_store: Stores,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    with tmp_redis.client() as client:
        store = make_store(client, namespace=namespace)
        findings = store.check_server()
        eviction = by_check(findings)["eviction"]
        assert eviction.level == "fatal"
        assert "maxmemory-policy is allkeys-lru" in eviction.message
        assert "CONFIG SET maxmemory-policy noeviction" in eviction.message
        assert [f.level for f in store.check_eviction()] == ["fatal"]

    code, out, _ = doctor(tmp_redis.url, namespace, capsys)
    assert code == 1
    assert any(line.startswith("fatal   eviction") for line in out.splitlines())


@pytest.mark.servers
@pytest.mark.parametrize(
    "tmp_redis", [(*EVICTING, "--rename-command", "CONFIG", "")], indirect=True
)
def test_without_config_the_policy_is_read_from_info(
    tmp_redis: RedisServer, namespace: str
) -> None:
    with tmp_redis.client() as client:
        found = by_check(RequestStore(client, namespace=namespace).check_server())
    assert found["eviction"].level == "fatal"
    assert "allkeys-lru" in found["eviction"].message
    assert "appendonly no" in found["persistence"].message  # INFO's aof_enabled


@pytest.mark.servers
@pytest.mark.parametrize(
    ("tmp_redis", "level", "says"),
    [
        (("--appendonly", "yes", "--appendfsync", "everysec"), "ok", "appendfsync everysec"),
        (("--appendonly", "yes", "--appendfsync", "always"), "ok", "loses nothing acknowledged"),
        (("--appendonly", "no", "--save", "900 1"), "warning", "since the last RDB snapshot"),
    ],
    indirect=["tmp_redis"],
    ids=["aof-everysec", "aof-always", "no-aof"],
)
def test_persistence(
    tmp_redis: RedisServer, namespace: str, make_store: Stores, level: str, says: str
) -> None:
    with tmp_redis.client() as client:
        found = by_check(make_store(client, namespace=namespace).check_server())
    assert found["persistence"].level == level
    assert says in found["persistence"].message
    assert found["eviction"].level == "ok"
    assert found["server"].message.endswith("standalone")


# -- the warning at open, and the replica's refusal ----------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("store")
    ]  # fmt: skip


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [EVICTING], indirect=True)
def test_a_store_from_url_warns_once_of_an_evicting_server(
    tmp_redis: RedisServer, namespace: str, make_store: Stores,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="store")
    store = make_store.from_url(tmp_redis.url, namespace=namespace)

    for rid in ("r-1", "r-2"):
        create_small_request(store, rid)
    assert store.list_requests() == ["r-1", "r-2"]

    (warning,) = _warnings(caplog)
    assert "maxmemory-policy is allkeys-lru" in warning
    assert f"{tmp_redis.host}:{tmp_redis.port}" in warning


@pytest.mark.real
def test_a_store_on_a_fit_server_logs_nothing(
    real_client: redis.Redis, namespace: str, make_store: Stores,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    from tests.conftest import redis_url_for_tests

    caplog.set_level(logging.WARNING, logger="store")
    store = make_store.from_url(redis_url_for_tests(), namespace=namespace)
    create_small_request(store, "r-1")
    assert _warnings(caplog) == []


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [EVICTING], indirect=True)
def test_a_replica_refuses_to_run_on_an_evicting_server(
    tmp_redis: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    with RequestStore.from_url(tmp_redis.url, namespace=namespace) as store:
        stop = threading.Event()
        with pytest.raises(EvictingServerError, match=r"allkeys-lru.*allow_eviction=True"):
            Replica(store, planner=TwoRankPlanner(1)).run(stop)

        caplog.set_level(logging.WARNING, logger="store")
        allowed = Replica(store, planner=TwoRankPlanner(1), allow_eviction=True)
        stop.set()  # run checks, warns, then sees stop and returns
        allowed.run(stop)
        assert any("allow_eviction=True" in m for m in _warnings(caplog))


@pytest.mark.servers
@pytest.mark.parametrize("tmp_redis", [EVICTING], indirect=True)
async def test_an_async_replica_refuses_to_run_on_an_evicting_server(
    tmp_redis: RedisServer, namespace: str
) -> None:
    async with AsyncRequestStore.from_url(tmp_redis.url, namespace=namespace) as store:
        stop = asyncio.Event()
        with pytest.raises(EvictingServerError) as refused:
            await AsyncReplica(store, planner=TwoRankPlanner(1)).run(stop)
        assert "allkeys-lru" in refused.value.policies[0]
        stop.set()
        await AsyncReplica(store, planner=TwoRankPlanner(1), allow_eviction=True).run(stop)


# -- a cluster and a Sentinel: every master, and the mode --------------------------------------


@pytest.mark.servers
@pytest.mark.cluster
def test_on_a_cluster_every_master_is_checked(
    tmp_cluster: RedisCluster, namespace: str, make_store: Stores
) -> None:
    store = make_store.from_url(tmp_cluster.store_url, namespace=namespace)

    findings = store.check_server()

    assert worst(findings) != "fatal", findings
    (cluster,) = [f for f in findings if f.check == "cluster"]
    assert cluster.message == "all 16384 slots served by 3 masters"
    masters = {f"127.0.0.1:{port}" for port in tmp_cluster.ports}
    for check in ("server", "eviction", "persistence", "scripts"):
        found = [f for f in findings if f.check == check]
        assert {f.message.split(":")[0] + ":" + f.message.split(":")[1] for f in found} <= masters
        assert len(found) == 3, (check, found)
    assert all("Redis Cluster" in f.message for f in findings if f.check == "server")
    assert [f.level for f in store.check_eviction()] == ["ok"] * 3


@pytest.mark.servers
@pytest.mark.sentinel
def test_through_sentinel_the_master_is_named_as_such(
    tmp_sentinel: RedisSentinel, namespace: str, make_store: Stores
) -> None:
    url = f"redis+sentinel://{tmp_sentinel.host}:{tmp_sentinel.port}/{tmp_sentinel.service_name}"
    store = make_store.from_url(url, namespace=namespace)

    found = by_check(store.check_server())

    assert found["server"].message.endswith("Sentinel-managed master")
    assert worst(list(found.values())) != "fatal"
