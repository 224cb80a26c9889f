"""What one replica keeps in memory: the leases it holds, the passes it sent, its counters.

None of it is needed for correctness (everything that decides is in the store): the books
let ``drain`` hand over the leases still held, let deadlines follow the pass latency this
replica observed, and spare a streaming consumer a second send of the same pass. Every
method is thread-safe (the sync replica applies reports from many threads).
"""

from __future__ import annotations

import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable

from store.keys import KeySpace
from store.observe import COUNTERS, Instruments
from store.records import Lease
from store.runtime.timing import Deadlines, Latencies, Timing

# How many sent passes are remembered (until they complete), oldest forgotten first.
MEMORY = 65_536


class Books:
    """One replica's in-process state (see the module docstring)."""

    def __init__(
        self,
        replica_id: str,
        keys: KeySpace,
        timing: Timing,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        rng: random.Random,
        instruments: Instruments,
    ) -> None:
        self.replica_id = replica_id
        self.keys = keys
        self.timing = timing
        self.clock = clock  # monotonic: latencies and local lease expiry
        self.wall_clock = wall_clock  # only for the stats flush
        self.latencies = Latencies(timing.latency_window)
        self.deadlines = Deadlines(timing, self.latencies, rng)
        self.instruments = instruments
        self.counts: Counter[str] = Counter()  # the runtime's own: dispatches, resends, ...
        self._held: dict[tuple[str, str], tuple[Lease, float]] = {}
        self._sent: OrderedDict[tuple[str, str, int], _Sending] = OrderedDict()
        self._lock = threading.Lock()

    # -- counters -------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """A store counter (``store.observe.COUNTERS``, flushed for ``top``) or one of the
        runtime's own (``counts``)."""
        if name in COUNTERS:
            self.instruments.count(name, n)
        with self._lock:
            self.counts[name] += n

    # -- leases ---------------------------------------------------------------------------

    def hold(self, lease: Lease) -> bool:
        """Book a lease this replica was granted; False if this very lease is booked
        already: another of its threads or tasks drives the step (a claim by the holder
        gives the holder its live lease back, so recovery may meet a step a report of
        this replica just won)."""
        key = (lease.request_id, lease.partition)
        with self._lock:
            found = self._held.get(key)
            if found is not None and found[0].token == lease.token:
                return False
            self._held[key] = (lease, self.clock() + self.timing.lease_ttl)
            return True

    def drop(self, lease: Lease) -> None:
        """Forget ``lease`` (ended or superseded); a newer lease on the step stays."""
        with self._lock:
            key = (lease.request_id, lease.partition)
            found = self._held.get(key)
            if found is not None and found[0].token <= lease.token:
                del self._held[key]

    def held(self) -> list[Lease]:
        """The leases this replica holds and that have not run out by its own clock (it
        counts from before the grant, so it never thinks a lapsed lease live)."""
        now = self.clock()
        with self._lock:
            for key in [k for k, (_, until) in self._held.items() if until <= now]:
                del self._held[key]
            return [lease for lease, _ in self._held.values()]

    # -- passes ---------------------------------------------------------------------------

    def sent(self, request_id: str, partition: str, fwd_pass: int) -> None:
        """This replica sent a pass (for the first time, or again)."""
        key = (request_id, partition, fwd_pass)
        now = self.clock()
        with self._lock:
            sending = self._sent.get(key)
            if sending is None:
                self._sent[key] = _Sending(now)
                while len(self._sent) > MEMORY:
                    self._sent.popitem(last=False)
            else:
                sending.last = now

    def completed(self, request_id: str, partition: str, fwd_pass: int) -> None:
        """The pass completed: one latency sample from its first send, if this replica
        sent it (a pass whose first send was lost counts as slow: deadlines err long)."""
        with self._lock:
            sending = self._sent.pop((request_id, partition, fwd_pass), None)
        if sending is not None:
            self.latencies.add(self.clock() - sending.first)

    def sending(self, request_id: str, partition: str, fwd_pass: int) -> bool:
        """Whether this replica sent the pass and has not seen it complete."""
        with self._lock:
            return (request_id, partition, fwd_pass) in self._sent

    def since_sent(self, request_id: str, partition: str, fwd_pass: int) -> float | None:
        """Seconds since this replica last sent the pass; None if it did not."""
        with self._lock:
            sending = self._sent.get((request_id, partition, fwd_pass))
        return None if sending is None else self.clock() - sending.last

    def totals(self, store_retries: int) -> dict[str, int]:
        """The cumulative store counters to flush, with the store's optimistic retries."""
        totals = self.instruments.totals()
        totals["retries"] = totals.get("retries", 0) + store_retries
        return totals


class _Sending:
    __slots__ = ("first", "last")

    def __init__(self, first: float) -> None:
        self.first = first
        self.last = first
