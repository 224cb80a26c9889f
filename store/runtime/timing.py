"""The replica's clocks: how long leases last, when a pass is sent again, how often duties run.

Everything here is pure: times come in as arguments, randomness from the ``rng`` passed in,
so the same code serves the sync and the asyncio replica and is unit-tested without a
clock.
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from collections import deque
from dataclasses import dataclass, field

from store.errors import ConfigurationError


@dataclass(frozen=True)
class Timing:
    """A replica's timing. The defaults are for production; each says why.

    Every duration is in seconds. A pass is sent again when no report completed it within
    its deadline: ``max(pass_deadline, deadline_factor x p99 of the pass latencies this
    replica observed)``, doubled for every send of the pass so far (capped at
    ``max_pass_deadline``) and stretched by up to ``jitter`` (a fraction), so that a slow
    fleet of workers is not buried under resends and steps due together spread apart.
    """

    # A lease covers one step (plan, take, send: milliseconds). 10 s rides through a GC
    # pause or a Redis failover (the store reconnects for 5 s) without handing the step
    # over, and a dead driver's step is retaken within 10 s. Must equal the store's.
    lease_ttl: float = 10.0
    # The floor of a pass's deadline: a decode pass takes tens of ms, a long prefill a few
    # seconds; below 5 s cold starts (no latency observed yet) would resend prefills.
    pass_deadline: float = 5.0
    # A pass is late at 4x the p99 latency observed: a p99 is exceeded by 1 pass in 100,
    # 4x of it almost never by a pass that is merely slow.
    deadline_factor: float = 4.0
    # The backoff's cap: a pass sent many times without an answer is tried every 2 min.
    max_pass_deadline: float = 120.0
    jitter: float = 0.25
    # Liveness for operators (`mstar-store replicas`, `top`); one ZADD and a stats flush.
    heartbeat: float = 2.0
    # How often due steps are looked for: one ZRANGEBYSCORE per replica, cheap; it bounds
    # what recovery adds to a takeover (a handed-over step waits at most this long).
    recovery_interval: float = 1.0
    recovery_batch: int = 100  # steps claimed per look at most: a backlog drains in turns
    # Reaping abandoned requests reads the index by age: once a minute is plenty.
    reap_interval: float = 60.0
    max_request_age: float = 86_400.0  # a request not finished within a day is abandoned
    # Replicas silent this long leave the registry (30 missed heartbeats).
    prune_after: float = 60.0
    # A finished request is kept 5 min for inspection (`mstar-store show`, `history`).
    keep_for: float = 300.0
    # How long drain() waits for steps in flight before handing their leases over.
    drain_timeout: float = 5.0
    # Pauses after Redis could not be reached (the store itself retried for 5 s first).
    retry_pause: float = 0.1
    max_retry_pause: float = 5.0
    # Pass latencies remembered for the p99 (the latest ones).
    latency_window: int = 256

    def __post_init__(self) -> None:
        for name in (
            "lease_ttl", "pass_deadline", "max_pass_deadline", "heartbeat",
            "recovery_interval", "reap_interval", "max_request_age", "prune_after",
            "keep_for", "retry_pause", "max_retry_pause",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"Timing.{name} must be a positive number, not {value!r}")
        if self.pass_deadline > self.max_pass_deadline:
            raise ConfigurationError("Timing.pass_deadline must not exceed max_pass_deadline")
        if not 0 <= self.jitter <= 1 or self.deadline_factor < 0 or self.drain_timeout < 0:
            raise ConfigurationError(
                "Timing needs 0 <= jitter <= 1, deadline_factor >= 0, drain_timeout >= 0"
            )
        if self.recovery_batch < 1 or self.latency_window < 1:
            raise ConfigurationError("Timing.recovery_batch and latency_window must be >= 1")


class Latencies:
    """The latest pass latencies this replica observed, and their p99 (thread-safe).

    Kept in arrival order (to drop the oldest) and in order of size, so the p99 is read
    without sorting: every report asks for it (its step's check time), every pass adds one.
    """

    def __init__(self, size: int) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._ordered: list[float] = []
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        value = max(0.0, seconds)
        with self._lock:
            if len(self._samples) == self._samples.maxlen:
                del self._ordered[bisect.bisect_left(self._ordered, self._samples[0])]
            self._samples.append(value)
            bisect.insort(self._ordered, value)

    def p99(self) -> float | None:
        """None before the first sample."""
        with self._lock:
            n = len(self._ordered)
            return self._ordered[min(n - 1, math.ceil(0.99 * n) - 1)] if n else None


@dataclass
class Deadlines:
    """When a pass counts as lost: the deadline of its next send (see ``Timing``)."""

    timing: Timing
    latencies: Latencies
    rng: random.Random = field(default_factory=random.Random)

    def base(self) -> float:
        p99 = self.latencies.p99()
        observed = self.timing.deadline_factor * p99 if p99 is not None else 0.0
        return min(self.timing.max_pass_deadline, max(self.timing.pass_deadline, observed))

    def wait(self, send: int) -> float:
        """How long send number ``send`` (1 for the first) of a pass waits for its reports,
        before jitter."""
        doublings = min(max(send, 1) - 1, 30)
        return min(self.timing.max_pass_deadline, self.base() * 2.0**doublings)

    def check_in(self, send: int) -> float:
        """``wait(send)``, stretched by up to ``jitter``: what a step sets as its check."""
        return self.wait(send) * (1.0 + self.rng.uniform(0.0, self.timing.jitter))

    def retry_pause(self, failures: int) -> float:
        """The pause after ``failures`` duties in a row met an unreachable Redis: doubling
        from ``retry_pause``, capped, with full jitter above half of it."""
        ceiling = min(
            self.timing.max_retry_pause, self.timing.retry_pause * 2.0 ** min(failures, 30)
        )
        return self.rng.uniform(ceiling / 2, ceiling)


HEARTBEAT, RECOVERY, REAP = "heartbeat", "recovery", "reap"


class Schedule:
    """When each background duty of ``run`` is next due (monotonic seconds).

    A duty that met an unreachable Redis is tried again after a growing, jittered pause
    (``Deadlines.retry_pause``); one that succeeds goes back to its interval. A recovery
    look that came back full runs again at once: a backlog is worked off in batches.
    """

    def __init__(self, timing: Timing, deadlines: Deadlines, now: float) -> None:
        self.timing = timing
        self.deadlines = deadlines
        self.next = {HEARTBEAT: now, RECOVERY: now, REAP: now + timing.reap_interval}
        self.failures = 0

    def due(self, now: float) -> list[str]:
        return [duty for duty, at in self.next.items() if at <= now]

    def done(self, duty: str, now: float, *, backlog: bool = False) -> None:
        self.failures = 0
        interval = {
            HEARTBEAT: self.timing.heartbeat,
            RECOVERY: 0.0 if backlog else self.timing.recovery_interval,
            REAP: self.timing.reap_interval,
        }[duty]
        self.next[duty] = now + interval

    def failed(self, duty: str, now: float) -> float:
        """Redis was unreachable: the pause before the duty is tried again."""
        self.failures += 1
        pause = self.deadlines.retry_pause(self.failures)
        self.next[duty] = now + pause
        return pause

    def wait(self, now: float) -> float:
        return max(0.0, min(self.next.values()) - now)
