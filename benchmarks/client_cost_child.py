"""One workload of ``benchmarks.client_cost``, run under callgrind: ``WHAT UNITS URL``.

Run by path with ``PYTHONPATH`` set to the tree being measured, so that its own ``store``
and ``benchmarks`` are imported (a worktree of another revision, or this one). Sets up,
runs one unit outside the count's difference (connected, scripts loaded, topologies
cached), then ``UNITS`` more, and removes its keys.
"""

from __future__ import annotations

import gc
import os
import sys

# This file's folder (unless -P kept it out): its modules are benchmarks.*, from the tree.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

Unit = Callable[[int], None]


def _pings(client: Any, n: int) -> Unit:
    def unit(_: int) -> None:
        for _ in range(n):
            client.ping()

    return unit


def _pass(store: Any, then_step: bool) -> Unit:
    from benchmarks.scenarios.fastpath import current_pass
    from benchmarks.shapes import pass_request

    pass_request().create(store, "r0")
    run = current_pass(then_step=then_step)

    def unit(p: int) -> None:
        failed = run(store, "r0", p)
        if failed:
            raise RuntimeError(f"pass {p}: {failed}")

    return unit


def _passes(store: Any, batched: bool) -> Unit:
    from benchmarks.scenarios.batch import BATCH, Passes
    from benchmarks.shapes import pass_request

    rids = [f"r{i}" for i in range(BATCH)]
    for rid in rids:
        pass_request().create(store, rid)
    passes, counters = Passes(batched), Counter[str]()

    def unit(p: int) -> None:
        failed = passes.run(store, rids, p, counters)
        if failed:
            raise RuntimeError(f"pass {p}: {failed}")

    return unit


def _runtime(client: Any, namespace: str, url: str) -> Unit:
    """One pass of each of 64 requests through ``AsyncReplica.apply_report`` (the runtime
    scenario's decode loop, its step predicted), the requests' tasks gathered on one loop."""
    import asyncio

    from benchmarks.scenarios.batch import BATCH, reports_of
    from benchmarks.scenarios.runtime import REPLICA, _planner
    from benchmarks.shapes import PASS_RANKS, pass_request, rank_kv
    from store import AsyncRequestStore, RequestStore
    from store.runtime import AsyncReplica, ReportStatus

    rids = [f"r{i}" for i in range(BATCH)]
    setup = RequestStore(client, namespace=namespace)
    for rid in rids:
        pass_request().create(setup, rid)
    loop = asyncio.new_event_loop()
    aclient = redis.asyncio.Redis.from_url(url)
    replica = AsyncReplica(
        AsyncRequestStore(aclient, namespace=namespace), planner=_planner(), replica_id=REPLICA
    )
    kv = [rank_kv(rank) for rank in range(PASS_RANKS)]

    async def one(rid: str, p: int) -> None:
        for rank in range(PASS_RANKS):
            result = await replica.apply_report(reports_of([rid], p, rank, kv[rank])[0])
            last = rank == PASS_RANKS - 1  # completes the pass and takes the step
            if getattr(result, "status", None) is not ReportStatus.APPLIED or (
                last and not result.drove
            ):
                raise RuntimeError(f"{rid} pass {p} rank {rank}: {result}")

    async def unit_async(p: int) -> None:
        await asyncio.gather(*(one(rid, p) for rid in rids))

    def unit(p: int) -> None:
        loop.run_until_complete(unit_async(p))

    return unit


def _codec(pickled: bool) -> Unit:
    """Encode and decode the codec scenario's partition: this tree's codec, or pickle."""
    import pickle

    from benchmarks.shapes import codec_partition
    from store import Codec
    from store.types import PartitionState

    state, codec = codec_partition(), Codec()

    def unit(_: int) -> None:
        if pickled:
            pickle.loads(pickle.dumps(state))
        else:
            codec.decode(codec.encode(state), PartitionState)

    return unit


def main(what: str, units: int, url: str) -> None:
    from store import RequestStore

    client = redis.Redis.from_url(url)
    namespace = f"client-cost-{uuid.uuid4().hex[:8]}"
    # "<workload>_no_history": the same workload with history off (what prices history).
    no_history = what.endswith("_no_history")
    what = what.removesuffix("_no_history")
    store = (
        RequestStore(client, namespace=namespace, history_cap=0)
        if no_history
        else RequestStore(client, namespace=namespace)
    )
    try:
        unit = {
            "ping2": lambda: _pings(client, 2),
            "ping3": lambda: _pings(client, 3),
            "in_report": lambda: _pass(store, then_step=True),
            "take_step": lambda: _pass(store, then_step=False),
            "batched": lambda: _passes(store, batched=True),
            "singles": lambda: _passes(store, batched=False),
            "runtime": lambda: _runtime(client, namespace, url),
            "codec": lambda: _codec(pickled=False),
            "pickle": lambda: _codec(pickled=True),
        }[what]()
        unit(0)  # warm: connected, scripts loaded, topologies cached
        # What the start left (imports, the store's tables) is not the pass's: out of the
        # collector's way, so a full collection landing in one run does not count for it.
        gc.collect()
        gc.freeze()
        for p in range(1, units + 1):
            unit(p)
    finally:
        for key in client.scan_iter(f"{namespace}:*", count=1000):
            client.delete(key)
        client.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
