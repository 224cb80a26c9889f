"""A replica of either kind behind one blocking interface, and in-process workers.

``Harness("sync" | "async", client, namespace, planner, timing)`` builds a ``Replica`` on a
``RequestStore`` or an ``AsyncReplica`` on an ``AsyncRequestStore`` (with an
``AsyncPlanner`` around the given planner, on an event loop in a thread of its own) and
exposes the same blocking methods for both, so the contract tests are written once.
``pump`` plays the workers: it answers every pass the planner sent with the model's
reports until the requests finish, running recovery when nothing is left to answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from store import (
    AsyncReplica,
    AsyncRequestStore,
    Replica,
    Report,
    ReportStatus,
    RequestStore,
    Step,
    Timing,
)
from store.cli.simulate.planner import AsyncSimPlanner as SimulationAsyncPlanner
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import canonical, differences
from store.errors import StoreError
from store.runtime.decisions import ReportResult
from store.types import PartitionState
from tests.stores import LoopThread, async_twin

FAST = Timing(
    lease_ttl=0.5, pass_deadline=0.2, max_pass_deadline=1.0, recovery_interval=0.02,
    heartbeat=0.2, keep_for=60.0, drain_timeout=1.0, retry_pause=0.05, max_retry_pause=0.5,
)  # fmt: skip


class AsyncSimPlanner(SimulationAsyncPlanner):
    """The simulation's async planner, with ``next_step`` in a thread (so that a test's
    planner may block without stopping the loop) and a yield before each dispatch."""

    async def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        return await asyncio.to_thread(self.planner.next_step, request_id, partition, state)

    async def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Step) -> None:
        await asyncio.sleep(0)
        await super().dispatch(request_id, partition, fwd_pass, step)


class Harness:
    """One replica of ``kind`` with blocking methods (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        client: Any,
        namespace: str,
        planner: SimPlanner,
        timing: Timing = FAST,
        *,
        replica_id: str = "replica-1",
        failpoints: Callable[[str], Any] | None = None,
        loop: LoopThread | None = None,
        store_options: Mapping[str, Any] | None = None,
        async_client: Any = None,
    ) -> None:
        self.kind = kind
        self.planner = planner
        self.statuses: Counter[ReportStatus] = Counter()
        self.timing = timing
        options = {"namespace": namespace, "lease_ttl": timing.lease_ttl, **(store_options or {})}
        self.store = RequestStore(client, **options)  # the sync view, for the test's reads
        self._loop = loop
        self._own_loop = False
        self._async_store: AsyncRequestStore | None = None
        self._runner: Any = None
        self._stop: Any = None
        if kind == "sync":
            self.replica: Any = Replica(
                self.store, planner=planner, replica_id=replica_id, timing=timing,
                failpoints=failpoints,
            )  # fmt: skip
        else:
            if self._loop is None:
                self._loop, self._own_loop = LoopThread(), True
            self._async_store = AsyncRequestStore(async_client or async_twin(client), **options)
            self.replica = AsyncReplica(
                self._async_store, planner=AsyncSimPlanner(planner), replica_id=replica_id,
                timing=timing, failpoints=failpoints,
            )  # fmt: skip

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.replica, name)
        if self.kind == "sync":
            return method(*args, **kwargs)
        assert self._loop is not None
        return self._loop.run(method(*args, **kwargs))

    def apply_report(self, report: Report) -> ReportResult:
        result: ReportResult = self._call("apply_report", report)
        return result

    def apply_reports(self, reports: Sequence[Report]) -> list[ReportResult | StoreError]:
        results: list[ReportResult | StoreError] = self._call("apply_reports", reports)
        return results

    def submit(self, request_id: str) -> None:
        self._call("submit", request_id, **self.planner.create(request_id))

    def recover_once(self) -> int:
        claimed: int = self._call("recover_once")
        return claimed

    def drain(self, timeout: float | None = None) -> int:
        handed: int = self._call("drain", timeout)
        return handed

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = self.replica.counts
        return counts

    # -- the background loop ------------------------------------------------------------

    def start(self) -> None:
        """``run(stop)`` in the background (a thread, or a task on the loop)."""
        if self.kind == "sync":
            self._stop = threading.Event()
            self._runner = threading.Thread(
                target=self.replica.run, args=(self._stop,), daemon=True
            )
            self._runner.start()
            return
        assert self._loop is not None

        async def start() -> Any:
            self._stop = asyncio.Event()
            return asyncio.ensure_future(self.replica.run(self._stop))

        self._runner = self._loop.run(start())

    def stop(self) -> None:
        if self._runner is None:
            return
        if self.kind == "sync":
            self._stop.set()
            self._runner.join(timeout=30)
            assert not self._runner.is_alive()
        else:
            assert self._loop is not None
            runner = self._runner

            async def stop() -> None:
                self._stop.set()
                await asyncio.wait_for(runner, 30)

            self._loop.run(stop())
        self._runner = None

    def close(self) -> None:
        self.stop()
        if self._async_store is not None and self._loop is not None:
            self._loop.run(self._async_store.aclose())
        if self._own_loop and self._loop is not None:
            self._loop.stop()


def run_killing(
    harness: Harness, ids: Sequence[str], at_delivery: int, kill: Callable[[], Any],
    timeout: float,
) -> float:  # fmt: skip
    """Submit ``ids`` and ``pump`` them to the end, calling ``kill`` (a server's SIGKILL,
    say) at the ``at_delivery``-th delivery; returns when it was called
    (``time.monotonic()``). Fails if every request finished before it."""
    delivered = 0
    killed_at: float | None = None

    def deliver(reports: list[Any]) -> list[Any]:
        nonlocal delivered, killed_at
        delivered += 1
        if delivered == at_delivery:
            kill()
            killed_at = time.monotonic()
        return reports

    for rid in ids:
        harness.submit(rid)
    pump(harness, ids, deliver=deliver, timeout=timeout)
    assert killed_at is not None, "every request finished before the kill"
    return killed_at


def pump(
    harness: Harness,
    request_ids: Iterable[str],
    *,
    deliver: Callable[[list[Report]], list[Report]] = lambda reports: reports,
    batched: bool = False,
    timeout: float = 60.0,
) -> None:
    """Answer every pass sent until every request in ``request_ids`` is finished."""
    planner = harness.planner
    waiting = set(request_ids)
    end = time.monotonic() + timeout
    while waiting:
        assert time.monotonic() < end, f"not finished in {timeout} s: {sorted(waiting)}"
        if planner.sent:
            rid, partition, fwd_pass = planner.sent.pop(0)
            reports = deliver(planner.reports_for(rid, partition, fwd_pass))
            if batched:
                results = harness.apply_reports(reports)
            else:
                results = [harness.apply_report(report) for report in reports]
            for result in results:
                assert isinstance(result, ReportResult), result
                harness.statuses[result.status] += 1
        else:
            if not harness.recover_once():
                time.sleep(0.01)
        waiting -= {rid for rid in waiting if finished(harness.store, rid)}


def finished(store: RequestStore, rid: str) -> bool:
    try:
        return store.load_record(rid).finished_at > 0
    except StoreError:
        return False


def final_states(store: RequestStore, request_ids: Iterable[str]) -> dict[str, Any]:
    return {rid: canonical(store.load_request(rid)) for rid in request_ids}


def assert_matches(store: RequestStore, reference: dict[str, Any], ids: Iterable[str]) -> None:
    """Every request in ``ids`` ended as the crash-free reference run says it must."""
    got = final_states(store, ids)
    wrong = {rid: differences(reference[rid], got[rid]) for rid in got}
    assert not any(wrong.values()), wrong
