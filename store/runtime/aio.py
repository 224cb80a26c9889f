"""``AsyncReplica``: the conductor replica runtime on an ``AsyncRequestStore``.

The same decisions as ``Replica`` (``store.runtime.decisions``), awaited: apply reports
from as many tasks as the transport likes, run ``await replica.run(stop)`` as a task, and
``await replica.drain()`` at shutdown. The planner may be an ``AsyncPlanner`` or a sync
``Planner`` (its methods are called directly: keep them quick).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import time
from collections.abc import Sequence
from types import CoroutineType
from typing import Any, TypeVar

from store.aio import AsyncRequestStore
from store.errors import StoreConnectionError, StoreError
from store.observe import Instruments
from store.records import Report
from store.replicas import AsyncReplicaRegistry
from store.runtime import decisions, recovery
from store.runtime.base import Failpoints, ReplicaBase, log
from store.runtime.decisions import Call, Program, ReportResult
from store.runtime.planner import AsyncPlanner, Planner
from store.runtime.timing import Schedule, Timing

T = TypeVar("T")


class AsyncReplica(ReplicaBase):
    """``Replica`` for asyncio programs: the same methods, awaited."""

    def __init__(
        self,
        store: AsyncRequestStore,
        *,
        planner: AsyncPlanner | Planner,
        replica_id: str | None = None,
        timing: Timing | None = None,
        registry: AsyncReplicaRegistry | None = None,
        failpoints: Failpoints | None = None,
        rng: random.Random | None = None,
        instruments: Instruments | None = None,
        allow_eviction: bool = False,
    ) -> None:
        registry = registry or AsyncReplicaRegistry(store.client, namespace=store.keys.namespace)
        super().__init__(
            store, registry, planner, replica_id=replica_id, timing=timing or Timing(),
            failpoints=failpoints, rng=rng, instruments=instruments,
            allow_eviction=allow_eviction,
        )  # fmt: skip
        self._busy = 0
        self._idle: asyncio.Event | None = None  # made in the loop that first needs it
        self._working = _Working(self)

    # -- the work -------------------------------------------------------------------------

    async def apply_report(self, report: Report) -> ReportResult:
        """See ``Replica.apply_report``."""
        self.admit()
        with self._working:
            return await self._run(
                decisions.apply_report(self.books, report, predict=self.predicts)
            )

    async def apply_reports(self, reports: Sequence[Report]) -> list[ReportResult | StoreError]:
        """See ``Replica.apply_reports``."""
        self.admit()
        with self._working:
            batched = decisions.apply_reports(self.books, reports, predict=self.predicts)
            return await self._run(batched)

    async def submit(self, request_id: str, **create: Any) -> None:
        """See ``Replica.submit``."""
        self.admit()
        with self._working:
            await self._run(decisions.submit(self.books, request_id, create))

    async def recover_once(self) -> int:
        """See ``Replica.recover_once``."""
        with self._working:
            return (await self._run(recovery.recover_once(self.books)))[1]

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """See ``Replica.run``."""
        await self._run(self.preflight())
        schedule = Schedule(self.timing, self.books.deadlines, time.monotonic())
        while not (stop.is_set() or self.draining):
            for name in schedule.due(time.monotonic()):
                result: bool | Exception
                try:
                    with self._working:
                        result = await self._run(self.duty(name))
                except Exception as e:
                    result = e
                self.settle(schedule, name, result)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), schedule.wait(time.monotonic()))

    async def drain(self, timeout: float | None = None) -> int:
        """See ``Replica.drain``."""
        self.draining = True
        wait = self.timing.drain_timeout if timeout is None else timeout
        if self._busy:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle_event().wait(), wait)
        handed = 0
        for lease in self.books.held():
            handed += await self._run(decisions.hand_over(self.books, lease))
        try:
            await self._run(self.farewell())
        except StoreConnectionError as e:
            log.warning("%s: could not leave the registry: %s", self.id, e)
        return handed

    # -- running programs -----------------------------------------------------------------

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if not self._busy:
                self._idle.set()
        return self._idle

    async def _run(self, program: Program[T]) -> T:
        """Drive ``program``, awaiting each call it yields (and a planner's or failpoint's
        result when it is awaitable)."""
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
                        target = self.targets[effect.target]
                        value = getattr(target, effect.method)(*effect.args, **effect.kwargs)
                    elif self.failpoints is not None:
                        value = self.failpoints(effect.name)
                    if type(value) is CoroutineType or (
                        value is not None and inspect.isawaitable(value)
                    ):
                        value = await value
                except Exception as e:
                    error = e
        finally:
            program.close()


class _Working:
    """The replica's work in progress, counted so that ``drain`` can wait for none. Entered
    and left without waiting: a plain ``with`` inside the coroutines."""

    __slots__ = ("_replica",)

    def __init__(self, replica: AsyncReplica) -> None:
        self._replica = replica

    def __enter__(self) -> None:
        replica = self._replica
        replica._busy += 1
        if replica._idle is not None:  # else nobody waits: drain makes it, as it finds it
            replica._idle.clear()

    def __exit__(self, *exc: object) -> None:
        replica = self._replica
        replica._busy -= 1
        if not replica._busy and replica._idle is not None:
            replica._idle.set()
