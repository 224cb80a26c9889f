"""What the sync and the asyncio replica share: settings, books, and the duties of ``run``.

The drivers (``store.runtime.sync``, ``store.runtime.aio``) only run the programs of
``store.runtime.decisions`` and wait; everything they decide is here or there.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from store.errors import (
    ConfigurationError,
    EvictingServerError,
    ReplicaDrainingError,
    StoreConnectionError,
)
from store.keys import MAX_NAME_LENGTH
from store.observe import Instruments
from store.runtime import decisions, recovery
from store.runtime.books import Books
from store.runtime.decisions import Call, Program
from store.runtime.timing import HEARTBEAT, RECOVERY, Schedule, Timing

log = logging.getLogger("store.runtime")

Failpoints = Callable[[str], Any]


def default_replica_id() -> str:
    """Host, process and a random suffix: unique, and tells an operator where it runs."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def overrides(planner: object, method: str) -> bool:
    """Whether ``planner`` implements ``method`` itself (not the base class's default)."""
    from store.runtime.planner import AsyncPlanner, Planner

    implementation = getattr(type(planner), method, None)
    return implementation not in (getattr(Planner, method), getattr(AsyncPlanner, method))


class ReplicaBase:
    """A conductor replica's settings and books; see ``Replica`` / ``AsyncReplica``."""

    def __init__(
        self,
        store: Any,
        registry: Any,
        planner: Any,
        *,
        replica_id: str | None,
        timing: Timing,
        failpoints: Failpoints | None,
        rng: random.Random | None,
        instruments: Instruments | None,
        allow_eviction: bool = False,
    ) -> None:
        if timing.lease_ttl != store.lease_ttl:
            raise ConfigurationError(
                f"Timing.lease_ttl is {timing.lease_ttl:g} s but the store grants leases of "
                f"{store.lease_ttl:g} s: build the store with lease_ttl=timing.lease_ttl"
            )
        replica_id = default_replica_id() if replica_id is None else replica_id
        if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
            raise ConfigurationError(f"replica id must be a str of 1 to {MAX_NAME_LENGTH} chars")
        self.id = replica_id
        self.store = store
        self.registry = registry
        self.planner = planner
        self.timing = timing
        self.failpoints = failpoints
        self.books = Books(
            replica_id, store.keys, timing,
            clock=time.monotonic, wall_clock=time.time, rng=rng or random.Random(),
            instruments=instruments or Instruments(store.keys.namespace),
        )  # fmt: skip
        self.targets = {"store": store, "registry": registry, "planner": planner}
        self.predicts = overrides(planner, "predict_step")
        self.draining = False
        self.allow_eviction = allow_eviction
        self._flushed: dict[str, int] = {}

    @property
    def counts(self) -> dict[str, int]:
        """What this replica did so far: reports, duplicates, passes, dispatches, resends,
        nudges, takeovers, fenced, finished, handed_over, ... (cumulative)."""
        return dict(self.books.counts)

    def admit(self) -> None:
        """Refuse a report while draining (``ReplicaDrainingError``: deliver it elsewhere)."""
        if self.draining:
            raise ReplicaDrainingError(f"replica {self.id} is draining: send the report elsewhere")

    def duty(self, name: str) -> Program[bool]:
        """One background duty of ``run``; True when recovery left a backlog. A draining
        replica does none (its last beat is ``farewell``'s)."""
        if self.draining:
            return False
        if name == HEARTBEAT:
            yield from self.beat()
            return False
        if name == RECOVERY:
            looked, _ = yield from recovery.recover_once(self.books)
            return looked >= self.timing.recovery_batch
        yield from decisions.reap(self.books)
        return False

    def preflight(self) -> Program[None]:
        """Refuse to run on a server that may evict the store's keys (``run`` begins here)
        unless ``allow_eviction``. A server unreachable now is not refused: the loop waits
        for it as for any outage, and ``mstar-store doctor`` can say more later."""
        try:
            findings = yield Call("store", "check_eviction")
        except StoreConnectionError as e:
            log.warning("%s: could not check the eviction policy: %s", self.id, e)
            return
        fatal = [f.message for f in findings if f.level == "fatal"]
        if not fatal:
            return
        if self.allow_eviction:
            log.warning("%s: running anyway (allow_eviction=True): %s", self.id, fatal[0])
            return
        raise EvictingServerError(
            f"replica {self.id} refuses to run: {'; '.join(fatal)}; or build the replica "
            "with allow_eviction=True to run anyway",
            policies=fatal,
        )

    def beat(self) -> Program[None]:
        """One heartbeat: flush this replica's counters since the last beat to the registry."""
        retries = self.store.stats.retries
        self._flushed = yield from decisions.heartbeat(self.books, self._flushed, retries)

    def settle(self, schedule: Schedule, name: str, result: bool | Exception) -> None:
        """Book how duty ``name`` went: its backlog flag, or the error it met."""
        now = time.monotonic()
        if isinstance(result, StoreConnectionError):
            pause = schedule.failed(name, now)
            self.books.count("outages")
            log.warning(
                "%s: Redis unreachable (%s); %s again in %.2f s", self.id, result, name, pause
            )
        elif isinstance(result, Exception):
            schedule.failed(name, now)
            log.error("%s: %s failed", self.id, name, exc_info=result)
        else:
            schedule.done(name, now, backlog=result)

    def farewell(self) -> Program[None]:
        """The last flush, then leave the registry."""
        yield from self.beat()
        yield from decisions.leave(self.books)
