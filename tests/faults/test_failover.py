"""A cluster master SIGKILLed under load: the store heals once its replica is promoted.

A private cluster of three masters, each with a replica, fails a master over one second
after it stops answering (``cluster-node-timeout 1000``). Requests live on the master that
is killed and on the others; a load of guarded writes (tokens, a server-side merge, an
optimistic merge) runs over all of them while the master dies. Calls may fail meanwhile,
with ``StoreConnectionError`` only (a failed round is resent with its op ids, as a conductor
redelivers); once the replica is promoted every call must succeed again, with no restart of
the store, and each request must hold what its acknowledged rounds imply: nothing twice,
and nothing lost but what Redis may lose (writes the old master acknowledged before they
reached the replica), which is printed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.crc import key_slot

from store import Codec, Reconnect, StoreConnectionError
from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import reference_run
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    PublishedPositionInfo,
    StreamingConnectionState,
)
from tests.conftest import require_binaries
from tests.runtime_harness import FAST, Harness, assert_matches, run_killing
from tests.servers import RedisCluster
from tests.stores import Stores
from tests.strategies import SumInfo, user_registry

pytestmark = [pytest.mark.servers, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

CONN = "llm->codec"
MD = CurrentForwardConductorMetadata("decode", False)
ON_VICTIM, ELSEWHERE = 4, 2  # requests on the master that is killed, and on the others
ROUNDS_BEFORE = 10  # acknowledged rounds per request before the kill
HEALTHY_ROUNDS = 20  # rounds in a row over every request, without an error, after promotion
HEAL_WITHIN = 30.0  # seconds after the promotion
# Short, so that calls during the failover fail (typed) and later calls must heal by
# themselves; the default patience (5 s) rides a failover of this cluster out instead.
PATIENCE = Reconnect(first_pause=0.05, max_pause=0.25, give_up_after=0.5)


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_binaries()
    workdir = tmp_path_factory.mktemp("failover")
    with RedisCluster(workdir, replicas=1, node_timeout_ms=1000) as cluster:
        yield cluster


@pytest.fixture
def cluster(module_cluster: RedisCluster) -> Iterator[RedisCluster]:
    """The module's cluster, whole again after the test: a killed node is restarted and
    rejoins as the replica of the node promoted in its place (cheaper than a new cluster)."""
    yield module_cluster
    for node in module_cluster.nodes:
        if not node.running:
            node.restart()
    module_cluster.wait_ready()


def owner_port(cluster: RedisCluster, key: str) -> int:
    """The port of the master that serves ``key``'s slot now."""
    return cluster.owner_of(key_slot(key.encode())).port


def pick_requests(cluster: RedisCluster, namespace: str, victim: int) -> tuple[list[str], ...]:
    on_victim: list[str] = []
    elsewhere: list[str] = []
    for i in range(10_000):
        rid = f"r{i}"
        port = owner_port(cluster, f"{namespace}:{{{rid}}}:meta")
        group = on_victim if port == victim else elsewhere
        if len(group) < (ON_VICTIM if port == victim else ELSEWHERE):
            group.append(rid)
        if len(on_victim) == ON_VICTIM and len(elsewhere) == ELSEWHERE:
            return on_victim, elsewhere
    raise AssertionError("could not place the requests")


@dataclass
class Load:
    """Rounds of guarded writes over some requests, and what happened to each call."""

    store: Any
    rids: list[str]
    acked: dict[str, int] = field(default_factory=dict)
    errors: list[tuple[float, str]] = field(default_factory=list)
    successes: list[float] = field(default_factory=list)

    def create(self) -> None:
        for rid in self.rids:
            self.store.create_request(
                rid,
                partitions={
                    "llm": PartitionState("llm", MD, resource_publish_info={"sum": SumInfo(0)}),
                    "codec": PartitionState("codec", MD),
                },
                connections={CONN: StreamingConnectionState("llm", "codec", "tokens")},
                max_output_tokens=1 << 20,
            )
            self.acked[rid] = 0

    def round(self) -> bool:
        """One round over every request; False if a call failed (its round is resent)."""
        ok = True
        for rid in self.rids:
            n = self.acked[rid]
            try:
                self.store.add_tokens(rid, CONN, 1, op_id=f"t{n}")
                self.store.merge_publish_info(
                    rid, "llm", {"pos": PublishedPositionInfo({"n": n + 1})}, op_id=f"p{n}",
                    returning=False,
                )  # fmt: skip
                self.store.merge_publish_info(
                    rid, "llm", {"sum": SumInfo(1)}, op_id=f"m{n}", returning=False
                )
            except StoreConnectionError as e:
                self.errors.append((time.monotonic(), str(e)))
                ok = False
                continue
            self.acked[rid] = n + 1
            self.successes.append(time.monotonic())
        return ok


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_store_heals_after_a_master_fails_over(
    kind: str, cluster: RedisCluster, namespace: str
) -> None:
    stores = Stores(kind)
    try:
        _failover(stores, cluster, namespace)
    finally:
        stores.close()


def _failover(stores: Stores, cluster: RedisCluster, namespace: str) -> None:
    store = stores.from_url(
        cluster.store_url, namespace=namespace, codec=Codec(user_registry()), reconnect=PATIENCE
    )
    victim = owner_port(cluster, f"{namespace}:{{probe}}:meta")
    (heir,) = cluster.replicas_of(victim)
    on_victim, elsewhere = pick_requests(cluster, namespace, victim)
    load = Load(store, on_victim + elsewhere)
    load.create()
    # Replication is asynchronous: on a loaded machine the replica may lag the master by
    # more than the whole run before the kill. The requests must exist on both; what the
    # rounds after this wrote may be lost, and the test measures how much.
    cluster.wait_replicated(victim)
    while min(load.acked.values()) < ROUNDS_BEFORE:
        assert load.round()
    at_kill = dict(load.acked)

    promoted: list[float] = []
    cluster.node(victim).kill()
    killed = time.monotonic()
    watcher = threading.Thread(target=lambda: promoted.append(cluster.wait_promoted(heir)))
    watcher.start()
    healthy = 0
    while healthy < HEALTHY_ROUNDS:
        healthy = healthy + 1 if load.round() and promoted else 0
        if promoted and time.monotonic() > promoted[0] + HEAL_WITHIN:
            last = load.errors[-1][1] if load.errors else "none"
            pytest.fail(
                f"no {HEALTHY_ROUNDS} clean rounds within {HEAL_WITHIN:g} s of the promotion: "
                f"{len(load.errors)} errors since the kill, the last: {last}"
            )
        if not watcher.is_alive() and not promoted:
            pytest.fail("the replica was not promoted")
    watcher.join()

    failed_after = [at for at, _ in load.errors if at > promoted[0]]
    first_ok = min((at for at in load.successes if at > killed), default=float("nan"))
    healed_at = max([at for at, _ in load.errors], default=killed)
    assert all(message.startswith(("Redis unreachable", "Redis kept refusing"))
               for _, message in load.errors), load.errors[:3]  # fmt: skip

    lost: dict[str, tuple[int, int, int]] = {}
    for rid in load.rids:
        state = store.load_request(rid)
        acked = load.acked[rid]
        tokens = state.connections[CONN].token_count
        infos = state.partitions["llm"].resource_publish_info
        pos = infos["pos"]
        total = infos["sum"]
        assert isinstance(pos, PublishedPositionInfo) and isinstance(total, SumInfo)
        assert tokens <= acked and pos.counters["n"] <= acked and total.total <= acked
        lost[rid] = (acked - tokens, acked - pos.counters["n"], acked - total.total)
    print(
        f"\n[{stores.kind}] master {victim} killed; replica {heir} promoted after "
        f"{promoted[0] - killed:.2f} s; first call to succeed after the kill "
        f"{first_ok - killed:.2f} s, last to fail {healed_at - killed:.2f} s after it "
        f"({len(load.errors)} failed calls, {len(failed_after)} after the promotion); "
        f"rounds acknowledged {at_kill} at the kill, {load.acked} at the end; "
        f"acknowledged but lost (tokens, position, sum) on the killed master's requests: "
        f"{ {rid: lost[rid] for rid in on_victim} }"
    )
    for rid in elsewhere:  # their masters never failed: nothing may be missing
        assert lost[rid] == (0, 0, 0)
    for rid in load.rids:  # the whole lifecycle works again
        assert store.delete_request(rid) is True
        assert not store.request_exists(rid)


# -- under the replica runtime's load ---------------------------------------------------------

SIM_SEED = 31
SIM_IDS = model.request_ids(8)
SIM_KILL_AT = 12  # deliveries before the master is killed
SIM_PATIENCE = Reconnect(give_up_after=30.0)  # the runtime rides the failover out


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(SIM_SEED, SIM_IDS)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_requests_finish_as_the_reference_across_a_master_failover(
    kind: str, cluster: RedisCluster, namespace: str, reference: dict[str, Any]
) -> None:
    """The runtime drives the simulation's requests; part way through, the master that holds
    the recovery index (and some of the requests) is SIGKILLed. Once its replica is
    promoted every request must end equal to the crash-free reference: what the old master
    acknowledged but had not replicated, the runtime redoes."""
    client = cluster.client()
    harness = Harness(
        kind, client, namespace, SimPlanner(SIM_SEED), FAST,
        store_options={"reconnect": SIM_PATIENCE},
    )  # fmt: skip
    victim = owner_port(cluster, harness.store.keys.deadlines)
    (heir,) = cluster.replicas_of(victim)
    on_victim = [r for r in SIM_IDS if owner_port(cluster, harness.store.keys.meta(r)) == victim]

    def kill() -> None:
        # Replication is asynchronous, and the victim's replica may still be syncing after
        # an earlier test's failover: a request it never received is lost whole, which no
        # store can recover (seen: 2 of 8). What is written after this may be lost; the
        # runtime redoes it.
        cluster.wait_replicated(victim)
        cluster.node(victim).kill()

    try:
        killed_at = run_killing(harness, SIM_IDS, SIM_KILL_AT, kill, timeout=150)
        cluster.wait_promoted(heir)  # it was: the requests on the victim's slots finished
        assert_matches(harness.store, reference, SIM_IDS)
        print(
            f"\n{kind}: master {victim} (recovery index, {len(on_victim)} of {len(SIM_IDS)} "
            f"requests) killed after {SIM_KILL_AT} deliveries; replica {heir} promoted; every "
            f"request finished as the reference {time.monotonic() - killed_at:.1f} s after the "
            f"kill"
        )
    finally:
        harness.close()
        client.close()
