"""Live resharding under load: the requests' slots move between masters while replicas run.

A private 3-master cluster; the runtime drives requests of the simulation's model while a
thread keeps moving the slots of those requests (and of the shared index keys) from master
to master, as `redis-cli --cluster reshard` would: SETSLOT IMPORTING/MIGRATING, MIGRATE the
keys, SETSLOT NODE. The store meets MOVED, ASK and TRYAGAIN (a multi-key script whose keys
are half moved) mid-run; every request must end equal to the crash-free reference.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import reference_run
from tests.runtime_harness import FAST, Harness, assert_matches, pump
from tests.servers import RedisCluster

# exclusive: a MIGRATE of a busy slot (5 s timeout) failed once with the suite's other
# workers on the same 2 cores.
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.exclusive]

SEED = 23
IDS = model.request_ids(12)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(SEED, IDS)


class Resharder:
    """Moves ``slots`` round the cluster's masters, one at a time, until stopped."""

    def __init__(self, cluster: RedisCluster, slots: list[int]) -> None:
        self.cluster = cluster
        self.slots = slots
        self.moves = 0
        self.keys_moved = 0
        self.error: str | None = None  # what failed, and where
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Resharder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        where = "before the first move"
        try:
            for slot in itertools.cycle(self.slots):
                if self._stop.is_set():
                    return
                source = self.cluster.owner_of(slot)
                target = next(
                    n for n in self.cluster.nodes[self.cluster.nodes.index(source) + 1 :]
                    + self.cluster.nodes
                    if n is not source
                )  # fmt: skip
                where = f"moving slot {slot} from :{source.port} to :{target.port}"
                self.keys_moved += self.cluster.migrate_slot(slot, source, target)
                self.moves += 1
        except BaseException as e:  # the test reports it (redis-py's repr hides the message)
            self.error = f"{where}: {type(e).__name__}: {e}"


@pytest.fixture
def cluster_client(tmp_cluster: RedisCluster) -> Iterator[Any]:
    client = tmp_cluster.client()
    try:
        yield client
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_requests_finish_as_the_reference_while_their_slots_move(
    kind: str,
    tmp_cluster: RedisCluster,
    cluster_client: Any,
    namespace: str,
    reference: dict[str, Any],
) -> None:
    harness = Harness(kind, cluster_client, namespace, SimPlanner(SEED), FAST)
    try:
        keys = harness.store.keys
        slots = sorted(
            {cluster_client.keyslot(keys.meta(rid)) for rid in IDS}
            | {cluster_client.keyslot(k) for k in (keys.index, keys.deadlines)}
        )
        for rid in IDS:
            harness.submit(rid)
        with Resharder(tmp_cluster, slots) as resharder:
            pump(harness, IDS, timeout=120)
        assert resharder.error is None, resharder.error
        assert resharder.moves > 0 and resharder.keys_moved > 0
        assert_matches(harness.store, reference, IDS)
        print(
            f"\n{kind}: {len(IDS)} requests finished as the reference while {resharder.moves} "
            f"slot moves carried {resharder.keys_moved} keys"
        )
    finally:
        harness.close()
