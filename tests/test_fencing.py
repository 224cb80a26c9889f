"""Every write a driving replica relies on is fenced store-side (the README's list).

A zombie replica (its lease lapsed, another replica claimed the step and holds a live
lease) tries each write twice: with its own superseded lease as the fence, and without a
fence. Both are refused with ``FencedError`` and change nothing; the live holder's fenced
write goes through. Only ``force_delete_request``, the operator's form, ignores leases.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from store import FencedError, RequestNotFound, RequestStore, Step
from store.records import Lease
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)
from tests.stores import Stores

RID = "fenced-1"
CONN = "llm->codec"
META = CurrentForwardConductorMetadata("decode", False, ["text"], ["text"])
TTL = 0.3
# (name, write(store, fence)): the README's list of fenced writes, under the fence given.
Write = Callable[[Any, "Lease | None"], Any]
WRITES: list[tuple[str, Write]] = [
    ("update_partition", lambda s, f: s.update_partition(RID, "llm", fence=f, is_done=True)),
    ("set_producer_done", lambda s, f: s.set_producer_done(RID, CONN, fence=f)),
    ("set_final_output", lambda s, f: s.set_final_output(RID, "text", [1], fence=f)),
    (
        "advance_partition",
        lambda s, f: s.advance_partition(RID, "llm", from_pass=0, metadata=META, fence=f),
    ),
    ("finish_request(keep_for)", lambda s, f: s.finish_request(RID, keep_for=60, fence=f)),
    ("finish_request(delete)", lambda s, f: s.finish_request(RID, fence=f)),
    ("delete_request", lambda s, f: s.delete_request(RID, fence=f)),
]
# Writes that exist only with a lease: the zombie's own lease is their fence.
LEASE_WRITES: list[tuple[str, Callable[[Any, Lease], Any]]] = [
    ("take_step", lambda s, f: s.take_step(f, Step(META, ("wg",)))),
    ("release_lease", lambda s, f: s.release_lease(f)),
    ("renew_lease", lambda s, f: s.renew_lease(f)),
]


def create(store: Any) -> None:
    store.create_request(
        RID,
        partitions={
            "llm": PartitionState("llm", META, current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", META, current_worker_graph_ids={"wg"}),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "text")},
        max_output_tokens=8,
    )


def zombie_and_driver(store: Any) -> tuple[Lease, Lease]:
    """Replica a's lease on llm lapses; replica b claims llm and holds it live."""
    create(store)
    zombie = store.claim_step(RID, "llm", "a")
    assert zombie is not None
    time.sleep(TTL + 0.05)
    driver = store.claim_step(RID, "llm", "b")
    assert driver is not None and driver.token > zombie.token
    store.renew_lease(driver, 30.0)  # live for the rest of the test
    return zombie, driver


def snapshot(client: redis.Redis, namespace: str) -> dict[bytes, Any]:
    """Every key of the namespace but the history stream (a refusal is recorded there)."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter(match=f"{namespace}:*")):
        kind = client.type(key)
        if kind == b"hash":
            out[key] = client.hgetall(key)
        elif kind == b"zset":
            out[key] = client.zrange(key, 0, -1)
    return out


@pytest.fixture
def store(client: redis.Redis, namespace: str, make_store: Stores) -> Any:
    return make_store(client, namespace=namespace, lease_ttl=TTL)


@pytest.mark.parametrize("fenced", [True, False], ids=["stale-fence", "unfenced"])
@pytest.mark.parametrize(("name", "write"), WRITES, ids=[w[0] for w in WRITES])
def test_a_lapsed_replica_cannot_write_under_a_live_lease(
    store: Any,
    client: redis.Redis,
    namespace: str,
    name: str,
    write: Write,
    fenced: bool,
) -> None:
    zombie, driver = zombie_and_driver(store)
    before = snapshot(client, namespace)
    with pytest.raises(FencedError) as refused:
        write(store, zombie if fenced else None)
    assert refused.value.request_id == RID
    assert snapshot(client, namespace) == before
    write(store, driver)  # the live driver's write goes through
    if name in ("finish_request(delete)", "delete_request"):
        with pytest.raises(RequestNotFound):
            store.load_record(RID)


@pytest.mark.parametrize(("name", "write"), LEASE_WRITES, ids=[w[0] for w in LEASE_WRITES])
def test_a_lapsed_lease_writes_nothing(
    store: Any, client: redis.Redis, namespace: str, name: str, write: Callable[[Any, Lease], Any]
) -> None:
    zombie, _ = zombie_and_driver(store)
    before = snapshot(client, namespace)
    with pytest.raises(FencedError):
        write(store, zombie)
    assert snapshot(client, namespace) == before
    assert store.leases(RID)["llm"].holder == "b"


def test_the_operator_deletes_whatever_the_leases_say(store: Any) -> None:
    zombie_and_driver(store)
    assert store.force_delete_request(RID) is True
    with pytest.raises(RequestNotFound):
        store.load_record(RID)


def test_reap_leaves_a_request_that_is_driven(store: Any) -> None:
    zombie_and_driver(store)
    assert store.reap(max_age=0) == []
    assert store.load_record(RID).request_id == RID


def test_set_producer_done_is_fenced_by_the_producer_partition(store: Any) -> None:
    """A live lease on the consumer does not fence the producer's write; the producer's
    lease does, and only that lease passes it."""
    create(store)
    consumer = store.claim_step(RID, "codec", "c")
    assert consumer is not None
    store.set_producer_done(RID, CONN)  # unfenced: no live lease on llm
    assert store.load_connection(RID, CONN).producer_done
    with pytest.raises(FencedError):
        store.set_producer_done(RID, CONN, fence=consumer)  # codec's lease is not llm's


def test_unfenced_writes_work_when_no_lease_is_live(store: RequestStore) -> None:
    create(store)
    store.set_producer_done(RID, CONN)
    assert store.delete_request(RID) is True
    assert store.delete_request(RID) is False
