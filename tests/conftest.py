"""Shared fixtures.

Backends (like fakeredis-py's own conftest): ``client`` runs every test twice,
as ``[fake]`` against an in-process fakeredis server and as ``[real]`` against
``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``; any URL the store takes, a
cluster or sentinel one too, see ``tests/backends.py``).  Select with
``-m fake`` / ``-m real`` or ``-k fake`` / ``-k real``.

The header names the real server.  An unreachable one, or one holding keys
outside test namespaces (unless ``MSTAR_TEST_ALLOW_FOREIGN_KEYS=1``), skips
every ``real`` test, except when the ``CI`` environment variable is set: then
it fails them, so CI cannot silently skip the real backend.  The same rule
applies when ``redis-server`` is missing for the fixtures that start their own
servers.

Clients return bytes (``decode_responses`` stays off); the library relies on it.
The real server is shared: tests only ever delete ``<namespace>:*`` keys.

``run("ls", ...)`` runs the ``mstar-store`` command line in-process on the test's backend.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from store.cli import main as cli
from store.keys import KeySpace
from store.stats import Command, flush_commands
from store.store import RequestStore
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests import backends
from tests.backends import delete_namespace, redis_url_for_tests
from tests.exclusive import share_the_machine  # noqa: F401  (an autouse fixture)
from tests.servers import RedisCluster, RedisSentinel, RedisServer, redis_binaries_available
from tests.stores import Stores, stores_of

# tests import them from here
__all__ = ["delete_namespace", "new_namespace", "redis_url_for_tests"]


def _in_ci() -> bool:
    return bool(os.environ.get("CI"))


def _skip_or_fail(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason} (CI is set, so this is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


# -- the real Redis: named in the header, refused if unsafe ---------------------------------


def pytest_report_header(config: pytest.Config) -> str:
    return backends.probe().header()


@pytest.fixture(scope="session")
def real_redis_error() -> str | None:
    """``None`` if the real tests may use the real Redis, else why not (probed once)."""
    return backends.probe().refusal()


@pytest.fixture(autouse=True)
def _real_redis_is_usable(request: pytest.FixtureRequest) -> None:
    """Every ``real`` test, whatever fixtures it uses, runs only on a usable real Redis."""
    if request.node.get_closest_marker("real") is not None:
        reason = request.getfixturevalue("real_redis_error")
        if reason is not None:
            _skip_or_fail(reason)


def new_namespace() -> str:
    """A fresh key prefix, e.g. ``t-1f2e3d4c5b6a`` (one of ``backends.OWN_NAMESPACE``)."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def namespace() -> str:
    """A fresh key prefix per test, e.g. ``t-1f2e3d4c5b6a``; keys live under ``<ns>:``."""
    return new_namespace()


@pytest.fixture
def fake_server() -> fakeredis.FakeServer:
    """A fresh fakeredis server, shared by every fake client within one test."""
    return fakeredis.FakeServer()


def _real_client(real_redis_error: str | None) -> redis.Redis:
    if real_redis_error is not None:
        _skip_or_fail(real_redis_error)
    return backends.connect()


@pytest.fixture(
    params=[
        pytest.param("fake", marks=pytest.mark.fake, id="fake"),
        pytest.param("real", marks=pytest.mark.real, id="real"),
    ]
)
def client(
    request: pytest.FixtureRequest, namespace: str, real_redis_error: str | None
) -> Iterator[redis.Redis]:
    """A bytes-returning client, once per backend (``fake`` / ``real``)."""
    c: redis.Redis
    if request.param == "fake":
        c = fakeredis.FakeRedis(server=request.getfixturevalue("fake_server"))
    else:
        c = _real_client(real_redis_error)
    try:
        yield c
    finally:
        try:
            delete_namespace(c, namespace)
        finally:
            c.close()


@pytest.fixture
def real_client(namespace: str, real_redis_error: str | None) -> Iterator[redis.Redis]:
    """A client for the real Redis only; cleans ``<namespace>:*`` afterwards."""
    c = _real_client(real_redis_error)
    try:
        yield c
    finally:
        try:
            delete_namespace(c, namespace)
        finally:
            c.close()


def require_binaries() -> None:
    """Skip (fail, in CI) a test that starts servers when the binaries are missing."""
    if not redis_binaries_available():
        _skip_or_fail("redis-server / redis-cli not found on PATH")


@pytest.fixture
def tmp_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    """A private ``redis-server`` on a free port in ``tmp_path``, stopped afterwards.

    Extra server arguments via indirect parametrization::

        @pytest.mark.parametrize("tmp_redis", [("--appendonly", "yes")], indirect=True)
    """
    require_binaries()
    args: tuple[str, ...] = tuple(getattr(request, "param", ()))
    server = RedisServer(tmp_path / "redis", None, *args)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tmp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A private 3-master Redis Cluster, shared by the tests of one module."""
    require_binaries()
    with RedisCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tmp_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    """A private master plus one Sentinel (``mymaster``), shared by one module.

    The master is ``tmp_sentinel.master``; quorum 1, down-after 1 s.
    """
    require_binaries()
    workdir = tmp_path_factory.mktemp("sentinel")
    with (
        RedisServer(workdir / "master") as master,
        RedisSentinel(master, workdir / "sentinel") as sentinel,
    ):
        yield sentinel


@pytest.fixture(params=["sync", "async"])
def make_store(request: pytest.FixtureRequest) -> Iterator[Stores]:
    """Makes stores of one kind per run of the test: ``RequestStore``, or an
    ``AsyncRequestStore`` driven from the test's sync code (see ``tests.stores``)."""
    yield from stores_of(request.param)


@dataclass
class Result:
    code: int
    out: str
    err: str


Run = Callable[..., Result]


@pytest.fixture
def run(
    client: redis.Redis,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> Run:
    """``run("ls")`` runs ``mstar-store ls`` in the test's namespace on the test's backend."""
    if isinstance(client, fakeredis.FakeRedis):
        server = request.getfixturevalue("fake_server")
        monkeypatch.setattr(cli, "make_client", lambda args: fakeredis.FakeRedis(server=server))
        backend: list[str] = []
    else:
        backend = ["--redis-url", redis_url_for_tests()]

    def run(*argv: str) -> Result:
        code = cli.main([*argv, "--namespace", namespace, *backend])
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.fixture
def store(client: redis.Redis, namespace: str) -> RequestStore:
    """A store in the test's namespace on the test's backend."""
    return RequestStore(client, namespace=namespace)


def create_small_request(store: RequestStore, rid: str) -> None:
    """A request of one partition ("llm", worker graph "wg") at pass 0."""
    meta = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
    store.create_request(
        rid, partitions={"llm": PartitionState("llm", meta, current_worker_graph_ids={"wg"})},
        connections={}, max_output_tokens=8, seed=1,
    )  # fmt: skip


def send_flush(
    client: Any,
    keys: KeySpace,
    replica: str,
    totals: dict[str, int],
    flushed: dict[str, int],
    **options: Any,
) -> list[Any]:
    """A replica's heartbeat flush (``store.stats.flush_commands`` with ``options``), sent."""
    return send_commands(client, flush_commands(keys, replica, totals, flushed, **options))


def send_commands(client: Any, commands: list[Command]) -> list[Any]:
    """Send commands built by ``store.stats`` as a replica runtime does: one pipeline."""
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return list(pipe.execute())
