"""No retry storm: workers slower than the base deadline are not buried under resends.

Every pass takes ``SLOW`` = 3x the base deadline. With the runtime's timing (deadlines
follow the pass latency it observes, double per send, are jittered), sends per advance
stay at most 1.5; with a naive timing (a fixed deadline, no backoff) the same run sends
every pass about three times, which shows that the measure can fail.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any

import fakeredis
import pytest

from store import Replica, RequestStore, Timing
from tests.runtime_planner import TwoRankPlanner

pytestmark = pytest.mark.fake

BASE = 0.1
SLOW = 3 * BASE
REQUESTS = 8
PASSES = 10

ADAPTIVE = Timing(
    lease_ttl=2.0, pass_deadline=BASE, max_pass_deadline=2.0, recovery_interval=0.01,
    heartbeat=0.5,
)  # fmt: skip
NAIVE = Timing(
    lease_ttl=2.0, pass_deadline=BASE, max_pass_deadline=BASE, deadline_factor=0.0,
    jitter=0.0, recovery_interval=0.01, heartbeat=0.5,
)  # fmt: skip


class SlowWorkers:
    """Answer every sent pass ``SLOW`` seconds after it was sent, each send on its own."""

    def __init__(self) -> None:
        self.due: list[tuple[float, int, tuple[str, str, int]]] = []
        self.lock = threading.Lock()
        self.sends = 0

    def send(self, sent: tuple[str, str, int]) -> None:
        with self.lock:
            self.sends += 1
            heapq.heappush(self.due, (time.monotonic() + SLOW, self.sends, sent))

    def answer(self, replica: Replica, planner: TwoRankPlanner, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                ready = self.due and self.due[0][0] <= time.monotonic()
                item = heapq.heappop(self.due) if ready else None
            if item is None:
                time.sleep(0.002)
                continue
            rid, _, fwd_pass = item[2]
            replica.apply_reports(planner.reports_for(rid, "llm", fwd_pass))


def run(timing: Timing) -> dict[str, Any]:
    store = RequestStore(
        fakeredis.FakeRedis(server=fakeredis.FakeServer()), namespace="ns",
        lease_ttl=timing.lease_ttl,
    )  # fmt: skip
    workers = SlowWorkers()
    planner = TwoRankPlanner(PASSES)
    planner.sink = workers.send
    replica = Replica(store, planner=planner, timing=timing, replica_id="r")
    stop = threading.Event()
    threads = [
        threading.Thread(target=replica.run, args=(stop,)),
        threading.Thread(target=workers.answer, args=(replica, planner, stop)),
    ]
    for thread in threads:
        thread.start()
    ids = [f"req-{i}" for i in range(REQUESTS)]
    try:
        for rid in ids:
            replica.submit(rid, **planner.create(rid))
        end = time.monotonic() + 60
        while not all(store.load_record(rid).finished_at for rid in ids):
            assert time.monotonic() < end, replica.counts
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    counts = replica.counts
    return {"sends": workers.sends, "advances": counts["passes"], **counts}


def test_sends_per_advance_stay_low_when_passes_outlast_the_base_deadline() -> None:
    adaptive = run(ADAPTIVE)
    assert adaptive["advances"] == REQUESTS * PASSES
    # A pass is sent at submit or after an advance (not after the last): 1.0 is no resend.
    assert adaptive["sends"] / adaptive["advances"] <= 1.5, adaptive
    naive = run(NAIVE)
    assert naive["advances"] == REQUESTS * PASSES
    assert naive["sends"] / naive["advances"] > 2.0, naive
