"""``Replica``: the conductor replica runtime on a sync ``RequestStore``.

Apply reports from as many threads as the transport likes (``apply_report`` /
``apply_reports``), and run the background duties (heartbeats, recovery, reaping) in one
thread with ``run(stop)``; ``drain()`` hands the work over at shutdown. The decisions are
``store.runtime.decisions``; this module only runs them.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from store.errors import ConfigurationError, StoreConnectionError, StoreError
from store.observe import Instruments
from store.records import Report
from store.replicas import ReplicaRegistry
from store.runtime import decisions, recovery
from store.runtime.base import Failpoints, ReplicaBase, log
from store.runtime.decisions import Call, Program, ReportResult
from store.runtime.planner import AsyncPlanner, Planner
from store.runtime.timing import Schedule, Timing
from store.store import RequestStore

T = TypeVar("T")


class Replica(ReplicaBase):
    """One conductor replica: applies any report, drives the steps it wins, recovers the
    steps whose driver died, and hands its work over when it drains.

    ``timing.lease_ttl`` must be the store's ``lease_ttl``. ``failpoints`` is called with
    the name of each point of ``decisions.FAILPOINTS`` as it is passed (tests kill or stop
    the process there). ``allow_eviction=True`` lets ``run`` start on a server whose
    ``maxmemory-policy`` may evict keys (it warns instead of raising
    ``EvictingServerError``): only for throwaway data, since eviction loses requests.
    """

    def __init__(
        self,
        store: RequestStore,
        *,
        planner: Planner,
        replica_id: str | None = None,
        timing: Timing | None = None,
        registry: ReplicaRegistry | None = None,
        failpoints: Failpoints | None = None,
        rng: random.Random | None = None,
        instruments: Instruments | None = None,
        allow_eviction: bool = False,
    ) -> None:
        if isinstance(planner, AsyncPlanner):
            raise ConfigurationError(
                "Replica takes a sync Planner; use AsyncReplica for an AsyncPlanner"
            )
        registry = registry or ReplicaRegistry(store.client, namespace=store.keys.namespace)
        super().__init__(
            store, registry, planner, replica_id=replica_id, timing=timing or Timing(),
            failpoints=failpoints, rng=rng, instruments=instruments,
            allow_eviction=allow_eviction,
        )  # fmt: skip
        self._busy = 0
        self._idle = threading.Condition()

    # -- the work -------------------------------------------------------------------------

    def apply_report(self, report: Report) -> ReportResult:
        """Record ``report`` and drive the step it won, if any (see ``decisions``).

        Raises ``ReplicaDrainingError`` while draining, and errors that say nothing of the
        report (``StoreConnectionError``: deliver it again later, which is safe).
        """
        with self._working():
            return self._run(decisions.apply_report(self.books, report, predict=self.predicts))

    def apply_reports(self, reports: Sequence[Report]) -> list[ReportResult | StoreError]:
        """Many reports at once, with the results of ``apply_report`` one at a time; an
        error ``apply_report`` would raise is that report's entry."""
        with self._working():
            return self._run(decisions.apply_reports(self.books, reports, predict=self.predicts))

    def submit(self, request_id: str, **create: Any) -> None:
        """``create_request(request_id, **create)`` with the first pass's deadline, then
        send every first pass that can run."""
        with self._working():
            self._run(decisions.submit(self.books, request_id, create))

    def recover_once(self) -> int:
        """Claim the due steps and redo them; returns how many were claimed."""
        with self._working(admit=False):
            return self._run(recovery.recover_once(self.books))[1]

    # -- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Heartbeats, recovery and reaping until ``stop`` is set or the replica drains.

        Redis unreachable pauses a duty (growing, jittered, capped) and the loop goes on
        under the same identity; steps whose leases ran out meanwhile are recovered.
        Raises ``EvictingServerError`` first if the server may evict keys, unless the
        replica was built with ``allow_eviction=True``.
        """
        self._run(self.preflight())
        schedule = Schedule(self.timing, self.books.deadlines, time.monotonic())
        while not (stop.is_set() or self.draining):
            for name in schedule.due(time.monotonic()):
                result: bool | Exception
                try:
                    with self._working(admit=False):
                        result = self._run(self.duty(name))
                except Exception as e:
                    result = e
                self.settle(schedule, name, result)
            stop.wait(schedule.wait(time.monotonic()))

    def drain(self, timeout: float | None = None) -> int:
        """Stop taking reports and recovering; wait up to ``timeout`` (default
        ``timing.drain_timeout``) for the steps in flight, hand over every lease still
        held (another replica takes each at once), flush and leave the registry. Returns
        how many leases were handed over."""
        self.draining = True
        wait = self.timing.drain_timeout if timeout is None else timeout
        end = time.monotonic() + wait
        with self._idle:
            while self._busy and (left := end - time.monotonic()) > 0:
                self._idle.wait(left)
        handed = sum(
            self._run(decisions.hand_over(self.books, lease)) for lease in self.books.held()
        )
        try:
            self._run(self.farewell())
        except StoreConnectionError as e:
            log.warning("%s: could not leave the registry: %s", self.id, e)
        return handed

    # -- running programs -----------------------------------------------------------------

    @contextmanager
    def _working(self, *, admit: bool = True) -> Iterator[None]:
        if admit:
            self.admit()
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _run(self, program: Program[T]) -> T:
        """Drive ``program``: make each call it yields, send back the result or throw in
        the exception."""
        value: Any = None
        error: Exception | None = None
        try:
            while True:
                try:
                    effect = program.send(value) if error is None else program.throw(error)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value, error = None, None
                try:
                    if isinstance(effect, Call):
                        method: Callable[..., Any] = getattr(
                            self.targets[effect.target], effect.method
                        )
                        value = method(*effect.args, **effect.kwargs)
                    elif self.failpoints is not None:
                        self.failpoints(effect.name)
                except Exception as e:
                    error = e
        finally:
            program.close()
