"""A writer process for the crash tests: its own store from a URL, acknowledged writes counted.

Each writer owns one request and, round after round, adds one token (``add_tokens``,
guarded by its op id) and merges ``SumInfo(1)`` (an optimistic merge, guarded by its op id;
``SumInfo`` adds, so a double merge shows). A round is acknowledged, in ``acked``, once both
calls returned. A round whose call failed (Redis down longer than the store's patience) is
sent again with the same op ids, as a conductor redelivers an operation: so the final state
must be exactly ``acked`` rounds, unless Redis lost acknowledged writes.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from store import AsyncRequestStore, Codec, Reconnect, RequestStore, StoreConnectionError
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)
from tests.strategies import SumInfo, user_registry

CONN = "llm->codec"
PATIENCE = Reconnect(give_up_after=2.0)  # shorter than a restart may take: redeliveries too


def request_id(writer: int) -> str:
    return f"writer-{writer}"


def partitions() -> dict[str, PartitionState]:
    md = CurrentForwardConductorMetadata("decode", False)
    return {
        "llm": PartitionState("llm", md, resource_publish_info={"sum": SumInfo(0)}),
        "codec": PartitionState("codec", md),
    }


def create(store: RequestStore, writer: int) -> None:
    store.create_request(
        request_id(writer),
        partitions=partitions(),
        connections={CONN: StreamingConnectionState("llm", "codec", "tokens")},
        max_output_tokens=1 << 20,
    )


def run(kind: str, url: str, namespace: str, writer: int, acked: Any, retried: Any,
        stop: Any) -> None:  # fmt: skip
    """Write rounds until ``stop`` is set (``acked`` / ``retried``: shared counters)."""
    options: dict[str, Any] = {"namespace": namespace, "codec": Codec(user_registry()),
                               "reconnect": PATIENCE}  # fmt: skip
    if kind == "sync":
        _run_sync(RequestStore.from_url(url, **options), writer, acked, retried, stop)
    else:
        asyncio.run(_run_async(AsyncRequestStore.from_url(url, **options), writer, acked,
                               retried, stop))  # fmt: skip


def _run_sync(store: RequestStore, writer: int, acked: Any, retried: Any, stop: Any) -> None:
    rid = request_id(writer)
    with store:
        for n in itertools.count():
            if stop.is_set():
                return
            while True:
                try:
                    store.add_tokens(rid, CONN, 1, op_id=f"t{n}")
                    store.merge_publish_info(rid, "llm", {"sum": SumInfo(1)}, op_id=f"m{n}",
                                             returning=False)  # fmt: skip
                    break
                except StoreConnectionError:
                    retried.value += 1
            acked.value = n + 1


async def _run_async(
    store: AsyncRequestStore, writer: int, acked: Any, retried: Any, stop: Any
) -> None:
    rid = request_id(writer)
    async with store:
        for n in itertools.count():
            if stop.is_set():
                return
            while True:
                try:
                    await store.add_tokens(rid, CONN, 1, op_id=f"t{n}")
                    await store.merge_publish_info(
                        rid, "llm", {"sum": SumInfo(1)}, op_id=f"m{n}", returning=False
                    )
                    break
                except StoreConnectionError:
                    retried.value += 1
            acked.value = n + 1
