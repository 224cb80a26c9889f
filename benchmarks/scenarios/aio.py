"""Reports from one asyncio process with 64 calls in flight on 64 requests, three ways:

- ``redis.asyncio EVALSHA (raw)``: a bare ``redis.asyncio`` client sending the very EVALSHA
  that ``RequestStore.record_worker_report`` sends (captured from a real call of the sync
  store, see ``capture_report``): the floor of an async store;
- ``AsyncRequestStore.record_worker_report``: ``store.AsyncRequestStore`` over a
  ``redis.asyncio`` client, awaited;
- ``RequestStore.record_worker_report via to_thread``: the sync store driven through
  ``asyncio.to_thread`` (the loop's default executor: min(32, CPUs + 4) threads), what a
  conductor on asyncio does without an async store.

Targets: async >= 0.85x the raw client's ops/s and >= 1.4x the to_thread driver's. Without
``store.AsyncRequestStore`` its row is skipped with the import error; the others still run.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Iterable
from typing import Any

import redis
import redis.asyncio

from benchmarks.harness import (
    AsyncDriver,
    Bench,
    Case,
    Check,
    Row,
    Scenario,
    Spec,
    Worker,
    figure,
)
from benchmarks.harness import ratio_check as ratio
from benchmarks.scenarios import store_ops
from benchmarks.shapes import HOT, HUGE_RANKS, WORKER_GRAPH
from benchmarks.wire import Command, Recorded, recording_client
from store import RequestStore

MODULE = __name__
TASKS = 64
RAW = "redis.asyncio EVALSHA (raw)"
ASYNC = "AsyncRequestStore.record_worker_report"
THREAD = "RequestStore.record_worker_report via to_thread"
TARGET = f"{TASKS} in flight"
MARK = 987_654_321_000  # a rank no other report uses: finds the rank among the arguments

REPORT_SCRIPT = "report"  # store/scripts/report.lua: what record_worker_report runs


def capture_report(store: Any, recorded: Recorded, rid: str) -> tuple[Command, int]:
    """The EVALSHA one ``record_worker_report`` sends for ``rid``, and where its rank is.

    The call is real: it applies one report (rank ``MARK``), which the row's check counts.
    """
    recorded.clear()
    store.record_worker_report(
        rid, HOT, fwd_pass=0, worker_graph_id=WORKER_GRAPH, rank=MARK, num_ranks=HUGE_RANKS
    )
    sent = recorded.commands
    for command in sent:
        name = command[0].upper()
        if name in (b"EVALSHA", b"EVAL") and str(MARK).encode() in command:
            if name == b"EVAL":  # sent whole: the same script by its digest
                digest = hashlib.sha1(command[1], usedforsecurity=False).hexdigest()
                command = [b"EVALSHA", digest.encode(), *command[2:]]
            return command, command.index(str(MARK).encode())
    names = sorted({c[0].decode(errors="replace") for c in sent})
    raise RuntimeError(f"record_worker_report sent no script with its rank (sent {names})")


def _raw(w: Worker) -> AsyncDriver:
    case, targets = w.case, w.case.targets_of(w.index)
    sync, recorded = recording_client(case.url)
    store = RequestStore(sync, namespace=case.namespace)
    captured = [capture_report(store, recorded, rid) for rid in targets]
    sync.close()
    sha = captured[0][0][1].decode()
    w.info["captured"] = len(captured)
    w.info["sha"] = sha
    w.info["keys"] = int(captured[0][0][2])
    w.info["args"] = len(captured[0][0]) - 3 - int(captured[0][0][2])
    w.info["sha_script"] = script_of(sha)
    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(case.url)

    async def call(j: int, k: int) -> str | None:
        command, at = captured[j]
        args: list[Any] = list(command[1:])
        args[at - 1] = store_ops.report_rank(w.case, 0, k, 1)  # this slice's offset
        reply = await client.evalsha(*args)
        return None if reply[0] == b"OK" else f"reply {reply[0]!r}"

    loop.run_until_complete(_all(client.ping() for _ in targets))  # connections made
    return AsyncDriver(loop, call, case.tasks, [client.aclose])


async def _all(calls: Iterable[Awaitable[Any]]) -> None:
    """Await ``calls`` concurrently (inside the loop: futures belong to the running one)."""
    await asyncio.gather(*calls)


def _digest(source: str) -> str:
    return hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


def script_of(sha: str) -> str | None:
    """The name of the store script whose digest is ``sha`` (None: none of them)."""
    try:
        from importlib import resources

        from store import scripts
    except ImportError:
        return None
    for entry in resources.files(scripts.__name__).iterdir():
        name = entry.name.removesuffix(".lua")
        is_script = entry.name.endswith(".lua") and not name.startswith("_")
        if is_script and _digest(scripts.source(name)) == sha:
            return name
    return None


def _async_store(w: Worker) -> AsyncDriver:
    from store import AsyncRequestStore  # type: ignore[attr-defined,unused-ignore]

    case, targets = w.case, w.case.targets_of(w.index)
    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(case.url)
    store = AsyncRequestStore(client, namespace=case.namespace)

    async def call(j: int, k: int) -> str | None:
        args = store_ops.report_args(w.case, 0, targets[j], k, 1)  # this slice's offset
        outcome = await store.record_worker_report(**args)
        return None if outcome.applied else "duplicate"

    # Connected, scripts and topologies cached: each task reads its request once.
    loop.run_until_complete(_all(store.load_record(rid) for rid in targets))
    return AsyncDriver(loop, call, case.tasks, [client.aclose, store.aclose])


def _to_thread(w: Worker) -> AsyncDriver:
    case, targets = w.case, w.case.targets_of(w.index)
    store = store_ops.connect(w)
    loop = asyncio.new_event_loop()

    async def call(j: int, k: int) -> str | None:
        args = store_ops.report_args(w.case, 0, targets[j], k, 1)  # this slice's offset
        outcome = await asyncio.to_thread(store.record_worker_report, **args)
        return None if outcome.applied else "duplicate"

    # The executor starts its threads outside the timing.
    loop.run_until_complete(_all(asyncio.to_thread(time.sleep, 0.002) for _ in targets))
    return AsyncDriver(loop, call, case.tasks, [loop.shutdown_default_executor])


OPS = {RAW: _raw, ASYNC: _async_store, THREAD: _to_thread}


def async_store_missing() -> str | None:
    """Why ``store.AsyncRequestStore`` cannot be used, or None."""
    try:
        from store import AsyncRequestStore  # type: ignore[attr-defined,unused-ignore]  # noqa: F401
    except ImportError as e:
        return f"store.AsyncRequestStore cannot be imported ({type(e).__name__}: {e})"
    return None


def prepare(bench: Bench, case: Case) -> Any:
    store_ops.prepare(bench, case)  # the 64 requests, with KV info of 4 ranks

    def verify(row: Row, c: Case, results: list[dict[str, Any]]) -> None:
        store = bench.store(c.namespace)
        held = sum(
            store.load_partition(rid, HOT).wg_rank_completions.get(WORKER_GRAPH, 0)
            for rid in bench.targets(c)
        )
        captured = row.details.get("info", {}).get("captured", 0)
        what = f"rank count (+{captured} captured)" if captured else "rank count"
        bench.set_verified(row, held == row.details["committed"] + captured, what)

    return verify


def measure(bench: Bench) -> None:
    missing = async_store_missing()
    ops = [RAW, THREAD] if missing else [RAW, ASYNC, THREAD]
    if missing:
        bench.skip(ASYNC, missing)
    bench.log(f"aio ({TASKS} tasks in flight, 1 process)")
    specs = [
        Spec("aio", MODULE, op, 1, "distinct", "", prepare, requests=TASKS, tasks=TASKS)
        for op in ops
    ]
    for row in bench.measure_group(specs, rounds=bench.rounds):
        row.target = TARGET
        if row.operation != RAW:
            row.baseline = f"{RAW}|1|{TARGET}"
        if row.operation == RAW:
            script = row.details.get("info", {}).get("sha_script")
            if script == REPORT_SCRIPT:
                row.note(f"sha = {REPORT_SCRIPT}.lua")
            else:
                row.note(f"sha is NOT {REPORT_SCRIPT}.lua's (it is {script or 'no script'}'s)")


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    by_op = {r.operation: r for r in rows if r.section == "aio"}
    raw, thread, aio = by_op.get(RAW), by_op.get(THREAD), by_op.get(ASYNC)
    targets = (
        ("async store ops/s >= 0.85x raw redis.asyncio EVALSHA", raw, 0.85),
        ("async store ops/s >= 1.4x sync store through asyncio.to_thread", thread, 1.4),
    )
    missing = async_store_missing()
    out = []
    for text, base, limit in targets:
        if missing:
            out.append(Check(text, None, f"skipped: {missing}"))
        else:
            a, b = figure(aio, "ops_per_s"), figure(base, "ops_per_s")
            out.append(ratio(text, a, b, limit, False))
    return out


SCENARIO = Scenario(
    "aio", measure=measure, checks=checks, title=f"Async store ({TASKS} in flight, 1 process)"
)
