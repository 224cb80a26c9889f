"""The recovery index never comes later than the check time the lease hash holds: a driver
that dies is looked at once its step is due, whichever call was refused, resent or lost.

On one server the scripts write both at once, so the entry equals the check time; on a
cluster (the real tests' cluster pass) the store keeps it at or before it.
"""

from __future__ import annotations

import time

import pytest
import redis
from redis.cluster import RedisCluster

from store import FencedError, Lease, RequestStore, Step
from store.types import CurrentForwardConductorMetadata, PartitionState

META = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
TTL = 0.3


@pytest.fixture
def store(client: redis.Redis, namespace: str) -> RequestStore:
    return RequestStore(client, namespace=namespace, lease_ttl=TTL)


def create(store: RequestStore, check_in: float | None, op_id: str | None = None) -> None:
    store.create_request(
        "r1", partitions={"llm": PartitionState("llm", META, current_worker_graph_ids={"wg"})},
        connections={}, max_output_tokens=8, check_in=check_in, op_id=op_id,
    )  # fmt: skip


def claim(store: RequestStore, replica: str) -> Lease:
    """``replica`` claims r1's step, which must be granted."""
    lease = store.claim_step("r1", "llm", replica)
    assert lease is not None
    return lease


def entry(store: RequestStore, client: redis.Redis) -> float | None:
    return client.zscore(store.keys.deadlines, "r1 llm")


def check_time(store: RequestStore, client: redis.Redis) -> float | None:
    held = client.hget(store.keys.lease("r1"), "check[llm]")
    return None if held is None else float(held)


def assert_on_time(store: RequestStore, client: redis.Redis) -> None:
    """The entry is there and not later than the check time (on one server: equal)."""
    hint, check = entry(store, client), check_time(store, client)
    assert check is not None and hint is not None, (hint, check)
    if isinstance(client, RedisCluster):
        assert hint <= check
    else:
        assert hint == check


def lapse(store: RequestStore) -> None:
    time.sleep(TTL + 0.05)


def test_a_zombies_refused_release_leaves_the_drivers_entry(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    zombie = claim(store, "a")
    lapse(store)
    driver = claim(store, "b")
    assert driver.token > zombie.token
    with pytest.raises(FencedError):
        store.release_lease(zombie, check_in=None)  # "the partition is done", says the zombie
    assert_on_time(store, client)
    with pytest.raises(FencedError):
        store.take_step(zombie, Step(META, ("wg",)), check_in=60.0)
    assert_on_time(store, client)
    assert entry(store, client) <= driver.expires_at + 1e-3  # type: ignore[operator]


def test_the_holders_reclaim_keeps_the_entry_at_its_lease(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    first = store.claim_step("r1", "llm", "a")
    time.sleep(0.1)
    again = store.claim_step("r1", "llm", "a")  # the first reply was lost
    assert first is not None and again is not None and again.token == first.token
    assert_on_time(store, client)


def test_a_shorter_renewal_brings_the_entry_forward(client: redis.Redis, namespace: str) -> None:
    store = RequestStore(client, namespace=namespace, lease_ttl=60.0)
    create(store, check_in=0.0)
    lease = claim(store, "a")
    renewed = store.renew_lease(lease, ttl=1.0)
    assert_on_time(store, client)
    assert entry(store, client) <= renewed.expires_at + 1e-3  # type: ignore[operator]


def test_a_resent_create_leaves_the_entry(store: RequestStore, client: redis.Redis) -> None:
    create(store, check_in=0.2, op_id="create-1")
    create(store, check_in=60.0, op_id="create-1")  # its reply was lost: recognised
    assert_on_time(store, client)


def test_the_lease_a_report_grants_has_an_entry(store: RequestStore, client: redis.Redis) -> None:
    create(store, check_in=None)  # recovery was told not to look yet
    assert entry(store, client) is None
    outcome = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, replica_id="a"
    )
    assert outcome.lease is not None
    assert_on_time(store, client)
    lapse(store)  # its holder died: recovery finds the step
    assert ("r1", "llm") in store.due_steps()


def test_a_step_that_finishes_the_partition_takes_it_out(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    lease = claim(store, "a")
    store.take_step(lease, Step(META, done=True), check_in=None)
    assert entry(store, client) is None and check_time(store, client) is None


def test_a_report_that_completes_nothing_makes_no_entry(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=None)
    outcome = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=2, replica_id="a"
    )
    assert not outcome.pass_complete and outcome.lease is None
    assert entry(store, client) is None  # nothing for recovery to look at


def test_a_resent_step_keeps_the_entry_of_the_lease_after_it(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    first = claim(store, "a")
    store.take_step(first, Step(META, ("wg",)), check_in=None)  # done, says the step
    claim(store, "b")  # e.g. an operator asks for a look
    store.take_step(first, Step(META, ("wg",)), check_in=None)  # resent: recognised
    assert_on_time(store, client)  # still at the second lease, which nobody ended


def test_a_claim_on_a_finished_request_takes_its_check_time_out(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    lease = claim(store, "a")
    store.finish_request("r1", fence=lease, keep_for=60.0)
    store.take_step(lease, Step(META, ("wg",)), check_in=60.0)  # late: it sets a check time
    assert check_time(store, client) is not None
    assert store.claim_step("r1", "llm", "b") is None  # finished: nothing to recover
    assert entry(store, client) is None and check_time(store, client) is None
    assert ("r1", "llm") not in store.due_steps()


def test_a_late_completing_report_on_a_finished_request_gets_no_lease(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store, check_in=0.0)
    store.finish_request("r1", keep_for=60.0)
    outcome = store.record_worker_report(
        "r1", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, replica_id="a",
        then_step=Step(META, ("wg",)), check_in=60.0,
    )  # fmt: skip
    assert outcome.applied and outcome.pass_complete  # counted, as any report
    assert outcome.lease is None and outcome.stepped_to is None  # nobody drives it on
    assert store.leases("r1") == {}
    assert entry(store, client) is None and check_time(store, client) is None
