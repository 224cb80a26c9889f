"""A Redis that stops answering (SIGSTOP) for longer than the socket timeout, then resumes.

While it is paused every call must fail with ``StoreConnectionError`` within the store's
``Reconnect`` bound (never hang); once it resumes (SIGCONT) the same store, with the same
pool, must work again, and a write that timed out, resent with its op id, must count once:
Redis reads the timed-out command from its socket when it wakes, and may run it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from store import Reconnect, StoreConnectionError
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)
from tests.servers import RedisServer
from tests.stores import Stores

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]

RID = "paused"
CONN = "llm->codec"
MD = CurrentForwardConductorMetadata("decode", False)
SOCKET_TIMEOUT = 0.3
PATIENCE = Reconnect(first_pause=0.05, max_pause=0.2, give_up_after=1.0)
# A call tries for PATIENCE.give_up_after, plus the try under way then (a connect and a
# read, each up to SOCKET_TIMEOUT): anything well past that is a hang.
BOUND = PATIENCE.give_up_after + 4 * SOCKET_TIMEOUT + 5.0


def create(store: Any) -> None:
    store.create_request(
        RID,
        partitions={
            "llm": PartitionState("llm", MD, current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", MD),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "tokens")},
        max_output_tokens=64,
    )


def timed_failure(call: Any) -> float:
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as failed:
        call()
    elapsed = time.monotonic() - started
    assert failed.value.request_id in (RID, None)
    return elapsed


def test_a_paused_redis_gives_typed_errors_in_bounded_time_then_the_pool_heals(
    tmp_redis: RedisServer, namespace: str, make_store: Stores
) -> None:
    store = make_store.from_url(
        tmp_redis.url, namespace=namespace, reconnect=PATIENCE,
        socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
    )  # fmt: skip
    direct = tmp_redis.client()
    ops = f"{namespace}:{{{RID}}}:ops"
    create(store)
    assert store.add_tokens(RID, CONN, 5, op_id="before") == 5

    tmp_redis.pause()
    try:
        took = {
            "add_tokens": timed_failure(lambda: store.add_tokens(RID, CONN, 3, op_id="during")),
            "load_request": timed_failure(lambda: store.load_request(RID)),
            "list_requests": timed_failure(store.list_requests),
        }
    finally:
        tmp_redis.resume()
    print(f"\n[{make_store.kind}] paused Redis: StoreConnectionError after", ", ".join(
        f"{name} {seconds:.2f} s" for name, seconds in took.items()
    ))  # fmt: skip
    assert all(seconds < BOUND for seconds in took.values()), took

    # The write that timed out may have run when Redis woke: its op id tells.
    ran_on_wake = direct.zscore(ops, "tokens:during") is not None
    print(f"[{make_store.kind}] the timed-out add_tokens ran when Redis resumed: {ran_on_wake}")
    assert store.add_tokens(RID, CONN, 3, op_id="during") == 8  # resent: counted once
    assert store.add_tokens(RID, CONN, 1) == 9
    state = store.load_request(RID)
    assert state.connections[CONN].token_count == 9
    assert store.list_requests() == [RID]
    direct.close()
