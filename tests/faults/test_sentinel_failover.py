"""A Sentinel promotes the replica while replicas run: the store follows it, nothing is lost.

A private master with one replica and one Sentinel (quorum 1, down-after 1 s). The runtime
drives requests of the simulation's model through a ``redis+sentinel://`` store; part way
through, the master is SIGKILLed. Calls pause until Sentinel has promoted the replica (the
store's reconnect policy rides through it, the Sentinel pool asks for the new master), and
every request must end equal to the crash-free reference. Writes acknowledged by the old
master but not yet replicated are lost by Redis itself; the runtime redoes what they held
(a pass whose report vanished is sent again), which the equality checks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from store import Reconnect
from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import reference_run
from store.io.connect import async_client_from_url, client_from_url
from tests.conftest import require_binaries
from tests.runtime_harness import FAST, Harness, assert_matches, run_killing
from tests.servers import RedisSentinel, RedisServer

pytestmark = [pytest.mark.sentinel, pytest.mark.slow]

SEED = 29
IDS = model.request_ids(8)
KILL_AT = 12  # deliveries before the master is killed
PATIENCE = Reconnect(give_up_after=30.0)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(SEED, IDS)


class Pair:
    """A master, its replica and a Sentinel watching them, in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.master = RedisServer(workdir / "master")
        self.master.start()
        self.replica = RedisServer(
            workdir / "replica", None, "--replicaof", self.master.host, str(self.master.port)
        )
        self.replica.start()
        self._wait(lambda: self._role(self.replica) == "up", "the replica did not sync")
        self.sentinel = RedisSentinel(self.master, workdir / "sentinel").start()
        self._wait(self._replica_known, "the Sentinel did not find the replica")

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.sentinel.host}:{self.sentinel.port}/mymaster"

    def _role(self, server: RedisServer) -> str | None:
        with server.client(socket_timeout=1) as c:
            return c.info("replication").get("master_link_status")  # type: ignore[no-any-return]

    def _replica_known(self) -> bool:
        with redis.Redis(self.sentinel.host, self.sentinel.port, socket_timeout=1) as c:
            return bool(c.execute_command("SENTINEL", "REPLICAS", "mymaster"))

    def promoted(self) -> bool:
        with self.replica.client(socket_timeout=1) as c:
            return c.info("replication").get("role") == "master"  # type: ignore[no-any-return]

    @staticmethod
    def _wait(ready: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(0.05)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    require_binaries()
    servers = Pair(tmp_path)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_requests_finish_as_the_reference_across_a_sentinel_failover(
    kind: str, pair: Pair, namespace: str, reference: dict[str, Any]
) -> None:
    client = client_from_url(pair.url)
    async_client = async_client_from_url(pair.url) if kind == "async" else None
    harness = Harness(
        kind, client, namespace, SimPlanner(SEED), FAST, async_client=async_client,
        store_options={"reconnect": PATIENCE},
    )  # fmt: skip
    try:
        killed_at = run_killing(harness, IDS, KILL_AT, pair.master.kill, timeout=120)
        assert pair.promoted()
        assert_matches(harness.store, reference, IDS)
        print(
            f"\n{kind}: master killed after {KILL_AT} deliveries; {len(IDS)} requests finished "
            f"as the reference {time.monotonic() - killed_at:.1f} s later on the promoted replica"
        )
    finally:
        harness.close()
        client.close()
