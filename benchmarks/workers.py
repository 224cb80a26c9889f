"""The worker side of the harness: cases, drivers, the spawned processes and their pool.

A ``Case`` names a scenario module and one of its ``OPS``; a pool process opens it once
(connects, warms up), then runs it slice after slice and sends back every latency, after a
start barrier shared by all processes of the row.

Imports nothing of the project at module level, nor does ``benchmarks.bench`` (which a
spawned process imports as its main module): a worker of another tree (``--legacy``) puts
that tree first on ``sys.path`` before anything imports ``store`` or ``mstar``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import sys
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Case:
    """One row as a worker sees it: which operation, how many processes, on what."""

    module: str  # the scenario module whose OPS holds ``op``
    op: str
    procs: int
    target: str  # "one", "distinct", "hot" or "random"
    url: str = ""
    namespace: str = ""
    duration: float = 2.0
    rid: str = ""  # the shared target, or the prefix of per-process / held targets
    held: int = 0  # scale rows: how many requests "<rid>-held-<i>" to pick from
    offset: int = 0  # grows from slice to slice: report ranks and positions never repeat
    requests: int = 1  # distinct targets per process (an async row: one per task in flight)
    tasks: int = 1  # calls in flight per process (async rows)
    tree: str = ""  # which pool runs it: "" the current tree, else a name in Bench.pools
    create: bool = False  # the worker creates its targets (the parent cannot: another tree)

    def targets_of(self, index: int) -> list[str]:
        if self.target in ("one", "hot"):
            return [self.rid]
        if self.requests > 1:
            first = index * self.requests
            return [f"{self.rid}-{first + j}" for j in range(self.requests)]
        return [f"{self.rid}-{index}"]

    def rid_for(self, index: int) -> str:
        return self.targets_of(index)[0]

    def opened_key(self) -> tuple[Any, ...]:
        return (self.module, self.op, self.procs, self.target, self.namespace, self.rid, self.held)


@dataclass
class Worker:
    """What one process holds while running one case."""

    case: Case
    index: int
    client: Any = None
    store: Any = None
    counters: Counter[str] = field(default_factory=Counter)
    last_step: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # facts for the row's details
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        if self.client is not None:
            self.client.close()


Op = Callable[[int], str | None]  # op(k) runs the k-th call; returns an outcome, None = ok
Samples = tuple["array[int]", Counter[str], float]  # latencies (ns), outcomes, seconds


class Driver:
    """Runs a case's calls for one slice. Sync operations use ``LoopDriver``; a scenario with
    its own way of calling (an asyncio loop with calls in flight) brings a subclass."""

    def run(self, duration: float, start_at: float) -> Samples:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the driver holds (a loop, async clients)."""


class LoopDriver(Driver):
    """One call after the other, timed one by one."""

    def __init__(self, op: Op) -> None:
        self.op = op

    def run(self, duration: float, start_at: float) -> Samples:
        latencies: array[int] = array("q")
        outcomes: Counter[str] = Counter()
        wait_until(start_at)
        clock, op = time.perf_counter_ns, self.op
        began = clock()
        deadline = began + int(duration * 1e9)
        k = 0
        end = began
        while end < deadline:
            start = clock()
            outcome = op(k)
            end = clock()
            latencies.append(end - start)
            if outcome is not None:
                outcomes[outcome] += 1
            k += 1
        return latencies, outcomes, (end - began) / 1e9


class AsyncDriver(Driver):
    """``tasks`` coroutines in flight on one asyncio loop, each timing its own calls.

    ``call(j, k)`` is task j's k-th call. The loop lives as long as the driver, so clients
    bound to it (redis.asyncio) stay connected from slice to slice.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        call: Callable[[int, int], Awaitable[str | None]],
        tasks: int,
        closers: Sequence[Callable[[], Awaitable[Any]]] = (),
    ) -> None:
        self.loop, self.call, self.tasks, self.closers = loop, call, tasks, list(closers)

    def run(self, duration: float, start_at: float) -> Samples:
        wait_until(start_at)
        return self.loop.run_until_complete(self._slice(duration))

    async def _slice(self, duration: float) -> Samples:
        latencies: array[int] = array("q")
        outcomes: Counter[str] = Counter()
        clock, call = time.perf_counter_ns, self.call
        began = clock()
        deadline = began + int(duration * 1e9)

        async def task(j: int) -> None:
            k = 0
            while clock() < deadline:
                start = clock()
                outcome = await call(j, k)
                latencies.append(clock() - start)
                if outcome is not None:
                    outcomes[outcome] += 1
                k += 1

        await asyncio.gather(*(task(j) for j in range(self.tasks)))
        return latencies, outcomes, (clock() - began) / 1e9

    def close(self) -> None:
        try:
            for close in reversed(self.closers):
                self.loop.run_until_complete(close())
        finally:
            self.loop.close()


Factory = Callable[[Worker], Op | Driver]


def wait_until(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


def _merge_counts(stats: Any) -> tuple[int, int]:
    """(merges committed, tries spent): a server-side merge commits in its one try."""
    if stats is None:
        return 0, 0
    server = getattr(stats, "server_merges", 0)
    return stats.transactions + server, stats.attempts + server


def run_prelude(prelude: str) -> None:
    """Call ``"module:function"``: what a pool sets up before anything imports the store."""
    module, _, name = prelude.partition(":")
    getattr(importlib.import_module(module), name)()


def worker_main(conn: Any, index: int, path_first: str | None, prelude: str | None = None) -> None:
    """A pool process: run each slice it is sent, after the start signal, and send back samples.

    What a case opened (connection, store, the operation's state) is kept for its later
    slices, so a slice pays neither for connecting nor for warming up. The process CPU time
    of each slice goes back with it (``cpu``: the timed loop and its clock reads, as spent
    by this process alone).
    """
    early = sorted(m for m in ("store", "mstar") if m in sys.modules)
    if early and (path_first is not None or prelude is not None):
        conn.send(("up", f"{early} imported before the pool's setup"))
        return
    if path_first is not None:
        sys.path.insert(0, path_first)
    if prelude is not None:
        try:
            run_prelude(prelude)
        except Exception as e:
            conn.send(("up", f"prelude {prelude}: {type(e).__name__}: {e}"))
            return
    conn.send(("up", None))
    opened: dict[tuple[Any, ...], tuple[Worker, Driver]] = {}
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            case = Case(**message)
            try:
                if case.opened_key() not in opened:
                    w = Worker(case, index)
                    factory: Factory = importlib.import_module(case.module).OPS[case.op]
                    runner = factory(w)
                    driver = runner if isinstance(runner, Driver) else LoopDriver(runner)
                    opened[case.opened_key()] = (w, driver)
                w, driver = opened[case.opened_key()]
                w.case, w.counters = case, Counter()
                stats = getattr(w.store, "stats", None)
                before = _merge_counts(stats)
                conn.send(("ready", None))
                start_at = conn.recv()
                if start_at is None:  # another process failed to set up: no run
                    conn.send(("aborted", None))
                    continue
                cpu = time.process_time()
                latencies, outcomes, elapsed = driver.run(case.duration, start_at)
                cpu = time.process_time() - cpu
                after = _merge_counts(stats)
                result = {
                    "latencies": latencies.tobytes(),
                    "outcomes": dict(outcomes),
                    "elapsed": elapsed,
                    "cpu": cpu,
                    "counters": dict(w.counters),
                    "transactions": after[0] - before[0],
                    "attempts": after[1] - before[1],
                    "last_step": w.last_step,
                    "index": index,
                    "info": w.info,
                    "store_from": getattr(sys.modules.get("store"), "__file__", None),
                }
                conn.send(("done", result))
            except Exception as e:  # reported to the parent, which stops the run
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        for w, driver in opened.values():
            driver.close()
            w.close()


class Pool:
    """Spawned processes kept for the whole run, so no row pays for starting Python.

    ``path_first``: a source tree put first on the workers' ``sys.path``, so they import
    that tree's ``store`` and ``mstar`` instead of the current ones. ``prelude``:
    ``"module:function"`` each worker calls first, before anything imports the store (to
    hide an optional package, or set global providers).
    """

    def __init__(
        self, size: int, path_first: Path | None = None, prelude: str | None = None
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        first = None if path_first is None else str(path_first)
        for index in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, index, first, prelude), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        # Started and imported: no later row shares the CPUs with that.
        problems = [problem for _, problem in (pipe.recv() for pipe in self.pipes) if problem]
        if problems:
            self.close()
            raise RuntimeError(f"a pool process could not start: {problems[0]}")

    def run(self, case: Case) -> list[dict[str, Any]]:
        pipes = self.pipes[: case.procs]
        for pipe in pipes:
            pipe.send(asdict(case))
        # The start barrier: every process connected and warmed up, then all start at once.
        ready = [pipe.recv() for pipe in pipes]
        failed = [payload for kind, payload in ready if kind != "ready"]
        start_at = None if failed else time.time() + 0.02 + 0.002 * case.procs
        for pipe, (kind, _) in zip(pipes, ready, strict=True):
            if kind == "ready":
                pipe.send(start_at)
        done = [
            pipe.recv() for pipe, (kind, _) in zip(pipes, ready, strict=True) if kind == "ready"
        ]
        failed += [payload for kind, payload in done if kind == "error"]
        if failed:
            raise RuntimeError(f"{case.op} ({case.procs} procs, {case.target}): {failed[0]}")
        return [payload for _, payload in done]

    def close(self, timeout: float = 5.0) -> None:
        """Ask every process to stop; stop those that do not within ``timeout`` seconds
        (after an interrupted row, a process may be blocked sending its samples)."""
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):  # that process is gone
                pipe.send(None)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
