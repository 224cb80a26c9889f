"""The real-Redis guard (``tests/backends.py``): it names the server, refuses foreign data.

Every test here runs on servers of its own, never on ``REDIS_URL``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import backends
from tests.backends import ALLOW_FOREIGN_KEYS, OWN_NAMESPACE, probe_server
from tests.servers import RedisCluster, RedisSentinel, RedisServer, free_port

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    "key",
    [
        b"t-0123456789ab:requests",
        b"t-replicas-0123456789ab:replicas",
        b"t-0123456789ab-other:{r}:meta",
        b"sim-0123abcd:requests",
        b"mstar-bench-4242-abcdef:c1:bare:r1",
        b"mstar-demo:{demo-1}:meta",
    ],
)
def test_the_projects_own_namespaces(key: bytes) -> None:
    assert OWN_NAMESPACE.match(key)


@pytest.mark.parametrize(
    "key",
    [
        b"mstar:requests",  # the default deployment namespace
        b"mstar:{r}:meta",
        b"t-prod:requests",  # no random part: someone named it
        b"sim-prod:requests",
        b"mstar-demo-live:requests",
        b"t-0123456789ab",  # not under the namespace
        b"session:42",
    ],
)
def test_anything_else_is_foreign(key: bytes) -> None:
    assert not OWN_NAMESPACE.match(key)


def test_the_namespace_fixture_makes_own_namespaces(namespace: str) -> None:
    assert OWN_NAMESPACE.match(f"{namespace}:requests".encode())


@pytest.mark.servers
def test_a_standalone_server_is_named(tmp_redis: RedisServer) -> None:
    with tmp_redis.client() as c:
        c.set(f"t-{uuid.uuid4().hex[:12]}:k", b"1")
        c.set(f"t-{uuid.uuid4().hex[:12]}:k", b"2")
        version = c.info("server")["redis_version"]

    found = probe_server(tmp_redis.url)

    assert (found.error, found.mode, found.keys, found.foreign_count) == (None, "standalone", 2, 0)
    assert found.version == version
    assert found.refusal() is None
    assert f"{tmp_redis.url}: Redis {version}, standalone, 2 keys" in found.header()


@pytest.mark.servers
@pytest.mark.cluster
def test_a_cluster_counts_the_keys_of_every_master(tmp_cluster: RedisCluster) -> None:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    keys = [f"{namespace}:k{i}" for i in range(30)]
    with tmp_cluster.client() as c:
        assert len({c.get_node_from_key(k).port for k in keys}) == 3
        for k in keys:
            c.set(k, b"v")

        found = probe_server(tmp_cluster.store_url)
        assert (found.mode, found.keys, found.sampled, found.refusal()) == (
            "cluster with 3 masters", 30, 30, None,
        )  # fmt: skip

        # The fixtures' cleanup reaches every master, across slots.
        assert backends.delete_namespace(c, namespace) == 30
        assert probe_server(tmp_cluster.store_url).keys == 0


@pytest.mark.servers
@pytest.mark.sentinel
def test_a_sentinel_url_names_the_master(tmp_sentinel: RedisSentinel) -> None:
    host, port = tmp_sentinel.sentinels[0]
    found = probe_server(f"redis+sentinel://{host}:{port}/{tmp_sentinel.service_name}")

    master = tmp_sentinel.master
    assert found.error is None
    assert found.mode == f"sentinel master {master.host}:{master.port} (mymaster)"


def test_a_server_that_does_not_answer_is_named_without_its_password() -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there

    found = probe_server(url)

    assert found.error is not None and "does not answer" in found.error
    refusal = found.refusal()
    assert refusal is not None and "redis://***@127.0.0.1" in refusal
    assert "hunter2" not in found.header() + refusal


@pytest.mark.servers
def test_foreign_keys_are_named_and_refused_unless_allowed(
    tmp_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tmp_redis.client() as c:
        c.set("t-0123456789ab:mine", b"1")
        c.set("mstar:requests", b"live")
        c.set("session:42", b"live")
    monkeypatch.delenv(ALLOW_FOREIGN_KEYS, raising=False)

    found = probe_server(tmp_redis.url)

    assert (found.sampled, found.foreign_count) == (3, 2)
    assert sorted(found.foreign) == [b"mstar:requests", b"session:42"]
    refusal = found.refusal()
    assert refusal is not None
    assert "'mstar:requests'" in refusal and f"{ALLOW_FOREIGN_KEYS}=1" in refusal
    assert "refused" in found.header()

    monkeypatch.setenv(ALLOW_FOREIGN_KEYS, "1")
    assert found.refusal() is None
    assert f"allowed by {ALLOW_FOREIGN_KEYS}=1" in found.header()


@pytest.mark.servers
def test_the_sample_is_bounded_on_a_big_server(tmp_redis: RedisServer) -> None:
    n = 10 * backends.SAMPLE_KEYS
    with tmp_redis.client() as c:
        pipe = c.pipeline(transaction=False)
        for i in range(n):
            pipe.set(f"t-0123456789ab:k{i}", b"")
        pipe.execute()

    found = probe_server(tmp_redis.url)

    assert found.keys == n  # DBSIZE, exact
    assert backends.SAMPLE_KEYS <= found.sampled < backends.SAMPLE_KEYS + 1000


def _pytest(url: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run one real test in a child pytest on ``url``; CI and the opt-in as given."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CI", ALLOW_FOREIGN_KEYS)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-W", "error",
         "tests/test_servers.py::test_real_cleanup_keeps_other_namespaces"],
        cwd=ROOT, env={**environ, "REDIS_URL": url, **env},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.servers
def test_the_real_tests_skip_fail_or_run_on_a_server_with_foreign_keys(
    tmp_redis: RedisServer,
) -> None:
    with tmp_redis.client() as c:
        c.set("live:user:1", b"precious")

    local = _pytest(tmp_redis.url)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 skipped" in local.stdout
    assert "'live:user:1'" in local.stdout and f"{ALLOW_FOREIGN_KEYS}=1" in local.stdout
    assert f"real Redis (REDIS_URL): {tmp_redis.url}: Redis " in local.stdout  # the header

    in_ci = _pytest(tmp_redis.url, CI="1")
    assert in_ci.returncode == 1
    assert "1 error" in in_ci.stdout and "CI is set" in in_ci.stdout

    allowed = _pytest(tmp_redis.url, **{ALLOW_FOREIGN_KEYS: "1"})
    assert allowed.returncode == 0, allowed.stdout
    assert "1 passed" in allowed.stdout
    with tmp_redis.client() as c:
        assert c.get("live:user:1") == b"precious"  # never deleted
