"""No key outlives its request, and one clock (the server's) decides leases.

Counts every key of a namespace after finish, late writes, expiry, reap and delete; and
runs two replicas whose own clocks are more than a lease TTL apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import redis

import store.ops.core
import store.ops.lifecycle
from store import Step
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
    StreamingConnectionState,
)
from tests.stores import Stores

MD = CurrentForwardConductorMetadata("decode", False)
CONN = "llm->codec"


def namespace_keys(client: redis.Redis, namespace: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{namespace}:*"))


def create(store: Any, rid: str) -> None:
    store.create_request(
        rid,
        partitions={
            "llm": PartitionState("llm", MD, current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", MD, current_worker_graph_ids={"wg-c"}),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "e")},
        max_output_tokens=100,
        check_in=30.0,
    )


def one_pass(store: Any, rid: str, replica: str = "a") -> Any:
    """Both ranks of llm report pass 0 with their KV shards; the step is taken."""
    for rank in (0, 1):
        kv = PublishedKVInfo({rank: {"llm": KVSequenceInfo(1, None, [rank])}}, 2)
        outcome = store.record_worker_report(
            rid, "llm", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=2,
            new_tokens=1 if rank == 0 else 0, replica_id=replica, published={"kv": kv},
        )  # fmt: skip
    assert outcome.lease is not None
    store.take_step(outcome.lease, Step(MD, ("wg",)), check_in=30.0)
    return outcome


def request_keys_of(client: redis.Redis, namespace: str, rid: str) -> list[bytes]:
    return [k for k in namespace_keys(client, namespace) if f"{{{rid}}}".encode() in k]


@pytest.mark.slow
def test_no_key_outlives_a_finished_request(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    create(store, "kept")
    one_pass(store, "kept")
    # Long enough that a loaded machine (CI runs the suite on 2 workers) reaches the SCAN
    # below before the first keys expire.
    store.finish_request("kept", keep_for=3.0)
    # Late writes after the finish create keys that did not exist yet (the dedupe set, a
    # history stream made anew): they expire with the request.
    client.delete(store.keys.ops("kept"), store.keys.history("kept"))
    store.add_tokens("kept", CONN, 1, op_id="late")
    store.record_worker_report("kept", "codec", fwd_pass=0, worker_graph_id="wg-c", rank=0,
                               num_ranks=1)  # fmt: skip
    held = request_keys_of(client, namespace, "kept")
    assert store.keys.ops("kept").encode() in held
    assert store.keys.history("kept").encode() in held
    assert all(0 < client.pttl(k) <= 3000 for k in held), {k: client.pttl(k) for k in held}

    deadline = time.monotonic() + 7
    while request_keys_of(client, namespace, "kept") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert request_keys_of(client, namespace, "kept") == []
    # The index still lists it, marked finished, until reap drops both entries.
    assert store.list_requests() == ["kept"]
    assert client.zscore(store.keys.finished, "kept") is not None
    assert store.reap(max_age=3600) == ["kept"]
    assert namespace_keys(client, namespace) == []


def test_delete_and_reap_leave_no_key(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    for rid in ("gone", "old"):
        create(store, rid)
        one_pass(store, rid)
    assert store.delete_request("gone")
    assert request_keys_of(client, namespace, "gone") == []
    assert store.reap(max_age=0) == ["old"]
    assert namespace_keys(client, namespace) == []


# -- one clock ------------------------------------------------------------------------------


@contextmanager
def clock_off_by(seconds: float) -> Iterator[None]:
    """The caller's own clock (every ``time.time`` the operations read) runs off by
    ``seconds``; the server's clock is untouched."""
    skewed = mock.Mock(wraps=time)
    skewed.time = lambda: time.time() + seconds
    modules = (store.ops.core, store.ops.lifecycle)
    patches = [mock.patch.object(m, "time", skewed) for m in modules]
    for patch in patches:
        patch.start()
    try:
        yield
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.real
def test_replicas_whose_clocks_disagree_agree_on_leases(
    real_client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    ttl = 0.5
    store = make_store(real_client, namespace=namespace, lease_ttl=ttl)
    create(store, "skew")
    with clock_off_by(-10 * ttl):  # A's clock runs behind: it would keep dead leases
        outcome = store.record_worker_report(
            "skew", "codec", fwd_pass=0, worker_graph_id="wg-c", rank=0, num_ranks=1,
            replica_id="a",
        )  # fmt: skip
    assert outcome.lease is not None
    with clock_off_by(+10 * ttl):  # B's runs ahead: it would claim live ones
        assert store.claim_step("skew", "codec", "b") is None  # not claimed early
    time.sleep(ttl * 1.5)  # by the server's clock, A's lease has lapsed
    with clock_off_by(-10 * ttl):
        claimed = store.claim_step("skew", "codec", "b")
    assert claimed is not None and claimed.holder == "b"  # not held late
    assert claimed.token > outcome.lease.token
