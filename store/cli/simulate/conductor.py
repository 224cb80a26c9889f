"""One simulated conductor replica process: a ``store.Replica`` fed from its inbox.

The process is what a conductor built on the runtime looks like: the runtime (``Replica``,
or ``AsyncReplica`` with ``aio``) applies the reports, drives, recovers, heartbeats and
drains; the process only carries reports from its inbox list to ``apply_reports`` (and
back onto its list when Redis could not be reached: delivering one again is safe) and
flushes its stats. SIGTERM drains it as a conductor's shutdown hook would: ``drain()`` at
once, beside the reports being applied (it refuses new ones, waits up to
``Timing.drain_timeout`` for those in flight, hands over the leases still held); what it
refused goes back onto the inbox for the fleet to reroute. It exits by itself when its
parent is gone or its lifetime is over.

Run as ``python -m store.cli.simulate.conductor '<json ProcessConfig>'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from store.aio import AsyncRequestStore
from store.cli.simulate import transport
from store.cli.simulate.measure import ReplicaStats, TimedStore
from store.cli.simulate.planner import AsyncSimPlanner, SimPlanner, to_report
from store.cli.simulate.transport import UNREACHABLE, SimKeys
from store.durability import split_durability
from store.errors import ReplicaDrainingError, StoreConnectionError, StoreError
from store.io.connect import async_client_from_url, client_from_url
from store.runtime import AsyncReplica, Replica, ReportStatus, Timing
from store.store import RequestStore

BATCH = 32  # reports taken from the inbox and applied in one apply_reports
IDLE = 0.005  # seconds between looks at an empty inbox
FLUSH_EVERY = 0.5  # seconds between stats flushes
OUTAGE_PAUSE = 0.1  # seconds before the next look after Redis was unreachable
ABANDONED = "the process exits: the step it was planning is abandoned"
STOP_WAIT = 10.0  # seconds the loop, and a drain, get to end at shutdown


@dataclass(frozen=True)
class ProcessConfig:
    """Everything a replica process needs, passed as one JSON argument."""

    redis_url: str
    namespace: str
    replica_id: str
    seed: int
    timing: dict[str, Any]
    parent_pid: int
    max_lifetime: float  # exit after this long whatever happens: a run never leaves orphans
    aio: bool = False
    # A step planned when the drain starts waits until the drain is over, as a planner
    # slower than the drain's wait would, and is then abandoned (the process exits): its
    # lease is handed over, and the benchmarks time how soon another replica takes it.
    slow_at_drain: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Carrier:
    """The process's side of the loop, sync or async alike: which reports to apply next,
    which go back after an outage, and the stats to flush."""

    def __init__(self, config: ProcessConfig) -> None:
        self.config = config
        self.keys = SimKeys(config.namespace)
        self.inbox = self.keys.inbox(config.replica_id)
        self.timing = Timing(**config.timing)
        self.stats = ReplicaStats()
        self.planner = SimPlanner(config.seed)
        self.retry: list[bytes] = []  # met an outage: applied again first
        self.end = time.monotonic() + config.max_lifetime
        self._flushed: dict[str, int] = {}
        self._next_flush = 0.0

    def alive(self, stop: Any) -> bool:
        return (
            not stop.is_set()
            and os.getppid() == self.config.parent_pid
            and time.monotonic() < self.end
        )

    def batch(self, popped: Sequence[bytes]) -> tuple[list[bytes], list[Any]]:
        raws, self.retry = [*self.retry, *popped], []
        return raws, [to_report(transport.decode_report(raw)) for raw in raws]

    def settle(self, raws: list[bytes], results: list[Any] | Exception) -> bool:
        """Book ``apply_reports``' results (or the error it raised); True if Redis was
        unreachable (the reports not known applied are kept to be applied again)."""
        if isinstance(results, StoreConnectionError | ReplicaDrainingError):
            self.retry = raws
            self.stats.count("redelivered", len(raws))
            return isinstance(results, StoreConnectionError)
        if isinstance(results, Exception):
            raise results
        outage = False
        for raw, result in zip(raws, results, strict=True):
            if isinstance(result, StoreConnectionError):
                self.retry.append(raw)
                self.stats.count("redelivered")
                outage = True
            elif isinstance(result, StoreError):
                # A conflict or a damaged record: the report is lost, its pass resent.
                self.stats.count("report_errors")
            elif result.status in (ReportStatus.STALE, ReportStatus.GONE):
                self.stats.count(result.status.value)  # late copies, absorbed
        return outage

    def handed(self, request_id: str, partition: str) -> bytes:
        """The notice of a step handed over now."""
        return transport.encode_handed(self.config.replica_id, request_id, partition, time.time())

    def flush_due(self) -> bool:
        return time.monotonic() >= self._next_flush

    def payload(self, counts: dict[str, int], retries: int) -> tuple[bytes, dict[str, int]]:
        """The stats since the last flush, and the totals to remember once it is sent."""
        totals = {**counts, "retries": retries}
        for name, n in self.stats.counters.items():
            totals[name] = totals.get(name, 0) + n
        delta = {k: n - self._flushed.get(k, 0) for k, n in totals.items()}
        data = {"latencies": self.stats.latencies, "counters": delta}
        return transport.encode(data), totals

    def flushed(self, totals: dict[str, int]) -> None:
        self._flushed = totals
        self.stats.take_latencies()
        self._next_flush = time.monotonic() + FLUSH_EVERY


def store_options(config: ProcessConfig, carrier: Carrier) -> tuple[str, dict[str, Any]]:
    """The URL for the client (without the store's query options) and the store's options,
    the same for both kinds."""
    url, durability = split_durability(config.redis_url)
    lease_ttl = carrier.timing.lease_ttl
    return url, {"namespace": config.namespace, "lease_ttl": lease_ttl, "durability": durability}


# -- sync -------------------------------------------------------------------------------------


def serve(config: ProcessConfig) -> None:
    carrier = Carrier(config)
    keys, planner = carrier.keys, carrier.planner
    url, options = store_options(config, carrier)
    client = client_from_url(url)
    store = RequestStore(client, **options)
    planner.sink = lambda sent: client.rpush(keys.dispatch, transport.encode_dispatch(*sent))

    def finished(rid: str) -> None:
        with transport.as_store_error():
            client.rpush(keys.finished, rid)

    def handed(rid: str, partition: str) -> None:
        with transport.as_store_error():
            client.rpush(keys.handed, carrier.handed(rid, partition))

    planner.on_finished = finished

    timed: Any = TimedStore(store, carrier.stats, handed)
    replica = Replica(
        timed, planner=planner, replica_id=config.replica_id, timing=carrier.timing,
        allow_eviction=True,  # throwaway data; `simulate` warned of an evicting server
    )  # fmt: skip
    stop, drained = threading.Event(), threading.Event()

    def drain() -> None:
        replica.drain()
        drained.set()

    drainer = threading.Thread(target=drain, daemon=True)
    if config.slow_at_drain:

        def slow() -> None:
            if stop.is_set():
                drained.wait(STOP_WAIT)
                raise ReplicaDrainingError(ABANDONED)

        planner.before_step = slow

    def shutdown(*_: Any) -> None:
        stop.set()
        if drainer.ident is None:  # in a thread: the main thread may be applying reports
            drainer.start()

    signal.signal(signal.SIGTERM, shutdown)
    loop = threading.Thread(target=replica.run, args=(stop,), daemon=True)
    loop.start()
    while carrier.alive(stop):
        try:
            popped = client.lpop(carrier.inbox, BATCH) or []
            if carrier.flush_due():
                data, totals = carrier.payload(replica.counts, store.stats.retries)
                client.rpush(keys.stats, data)
                carrier.flushed(totals)
        except UNREACHABLE:
            time.sleep(OUTAGE_PAUSE)
            continue
        if not (popped or carrier.retry):
            time.sleep(IDLE)
            continue
        raws, reports = carrier.batch(popped)
        results: list[Any] | Exception
        try:
            results = replica.apply_reports(reports)
        except (StoreConnectionError, ReplicaDrainingError) as e:
            results = e
        if carrier.settle(raws, results):
            time.sleep(OUTAGE_PAUSE)
    shutdown()  # also when not told to: the parent is gone, or the lifetime over
    loop.join(STOP_WAIT)
    drainer.join(carrier.timing.drain_timeout + STOP_WAIT)
    try:
        if carrier.retry:
            client.rpush(carrier.inbox, *carrier.retry)  # the fleet reroutes them
        data, _ = carrier.payload(replica.counts, store.stats.retries)
        client.rpush(keys.stats, data)
    except UNREACHABLE:
        pass  # stopping anyway: the fleet's pass deadlines cover what is lost
    client.close()


# -- asyncio ----------------------------------------------------------------------------------


async def serve_async(config: ProcessConfig) -> None:
    carrier = Carrier(config)
    keys = carrier.keys
    url, options = store_options(config, carrier)
    client = async_client_from_url(url)
    store = AsyncRequestStore(client, **options)

    async def sink(sent: tuple[str, str, int]) -> None:
        await client.rpush(keys.dispatch, transport.encode_dispatch(*sent))

    async def finished(rid: str) -> None:
        with transport.as_store_error():
            await client.rpush(keys.finished, rid)

    async def handed(rid: str, partition: str) -> None:
        with transport.as_store_error():
            await client.rpush(keys.handed, carrier.handed(rid, partition))

    planner = AsyncSimPlanner(carrier.planner, sink=sink, on_finished=finished)
    timed: Any = TimedStore(store, carrier.stats, handed)
    replica = AsyncReplica(
        timed, planner=planner, replica_id=config.replica_id, timing=carrier.timing,
        allow_eviction=True,  # as in serve
    )  # fmt: skip
    stop = asyncio.Event()
    drained: list[asyncio.Task[int]] = []

    def shutdown() -> None:
        stop.set()
        if not drained:
            drained.append(asyncio.ensure_future(replica.drain()))

    async def slow() -> None:
        if stop.is_set():
            await asyncio.wait([drained[0]], timeout=STOP_WAIT)
            raise ReplicaDrainingError(ABANDONED)

    if config.slow_at_drain:
        planner.before_step = slow

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, shutdown)
    loop = asyncio.create_task(replica.run(stop))
    while carrier.alive(stop):
        try:
            popped = await client.lpop(carrier.inbox, BATCH) or []
            if carrier.flush_due():
                data, totals = carrier.payload(replica.counts, store.stats.retries)
                await client.rpush(keys.stats, data)
                carrier.flushed(totals)
        except UNREACHABLE:
            await asyncio.sleep(OUTAGE_PAUSE)
            continue
        if not (popped or carrier.retry):
            await asyncio.sleep(IDLE)
            continue
        raws, reports = carrier.batch(popped)
        results: list[Any] | Exception
        try:
            results = await replica.apply_reports(reports)
        except (StoreConnectionError, ReplicaDrainingError) as e:
            results = e
        if carrier.settle(raws, results):
            await asyncio.sleep(OUTAGE_PAUSE)
    shutdown()
    await asyncio.wait_for(loop, STOP_WAIT)
    await drained[0]
    try:
        if carrier.retry:
            await client.rpush(carrier.inbox, *carrier.retry)
        data, _ = carrier.payload(replica.counts, store.stats.retries)
        await client.rpush(keys.stats, data)
    except UNREACHABLE:
        pass
    await store.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config = ProcessConfig(**json.loads(args[0]))
    # A Ctrl-C at the terminal reaches the whole process group: the replicas leave it to
    # `simulate`, which stops them (SIGTERM) on its way out, instead of dying mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The runtime logs outages and failed duties as warnings: the fleet keeps them in the
    # replica's log, shown if the process fails.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if config.aio:
        asyncio.run(serve_async(config))
    else:
        serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
