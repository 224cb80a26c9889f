"""Several processes against one Redis: how the concurrency tests start them."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

PROCESS_TIMEOUT = 120.0


def run_workers(target: Callable[..., None], n: int, *args: Any) -> list[dict[str, Any]]:
    """Start ``n`` processes ``target(index, barrier, results, *args)``; their result dicts.

    A barrier makes them start their operations together, so they really contend.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([target.__module__])
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, barrier, results, *args)) for i in range(n)]
    for proc in procs:
        proc.start()
    try:
        out = [results.get(timeout=PROCESS_TIMEOUT) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failures = [r["traceback"] for r in out if "traceback" in r]
    assert not failures, "\n".join(failures)
    return sorted(out, key=lambda r: r["worker"])
