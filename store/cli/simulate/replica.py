"""One conductor replica: applies any worker report, drives the steps it wins, recovers others.

A replica keeps nothing of a request in memory between calls; everything it decides is read
from the store, so any replica may apply any report and a replica killed at any instant
loses nothing but the messages it had taken from its inbox (the pass deadline recovers
them). The loop (``serve``) heartbeats, takes reports from its inbox list and runs
recovery: ``due_steps`` -> ``claim_step`` -> redo the step -> ``release_lease``.

Run as a process with ``python -m store.cli.simulate.replica '<json ReplicaConfig>'``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from store.cli.simulate import model
from store.cli.simulate.model import Report, RequestSpec
from store.errors import (
    FencedError,
    NotFoundError,
    StalePassError,
    StoreConnectionError,
    TransactionConflictError,
    UnknownWorkerGraphError,
)
from store.io.connect import client_from_url
from store.records import Lease
from store.replicas import ReplicaRegistry
from store.store import RequestStore

# Operations whose latency the summary reports, in its order.
TIMED_OPERATIONS = ("report", "merge", "advance", "claim", "release")


class SimKeys:
    """The simulation's own lists, beside (never inside) the store's key layout."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"{namespace}:sim"
        self.dispatch = f"{self.prefix}:dispatch"  # passes sent to the workers
        self.finished = f"{self.prefix}:finished"  # request ids a replica finished
        self.stats = f"{self.prefix}:stats"  # replicas' stats, flushed as JSON

    def inbox(self, replica_id: str) -> str:
        return f"{self.prefix}:inbox:{replica_id}"


_report_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


def encode_report(report: Report) -> bytes:
    return _encoder.encode(report)


def decode_report(raw: bytes) -> Report:
    return _report_decoder.decode(raw)


def encode_dispatch(request_id: str, partition: str, fwd_pass: int) -> bytes:
    return _encoder.encode([request_id, partition, fwd_pass])


def decode_dispatch(raw: bytes) -> tuple[str, str, int]:
    rid, partition, fwd_pass = msgspec.json.decode(raw)
    return str(rid), str(partition), int(fwd_pass)


@dataclass
class ReplicaStats:
    """What a replica did since its last flush: latencies per operation and counters."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.latencies.setdefault(operation, []).append(elapsed)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def merge(self, other: dict[str, Any]) -> None:
        for op, samples in other.get("latencies", {}).items():
            self.latencies.setdefault(op, []).extend(samples)
        for name, n in other.get("counters", {}).items():
            self.count(name, n)

    def drain(self) -> dict[str, Any]:
        out = {"latencies": self.latencies, "counters": self.counters}
        self.latencies, self.counters = {}, {}
        return out


@dataclass(frozen=True)
class Timing:
    """The replicas' clocks; short in the simulation so that recovery shows in seconds."""

    lease_ttl: float = 2.0
    pass_deadline: float = 2.0  # no report for this long after a send: resend the pass
    heartbeat: float = 0.5
    recovery_interval: float = 0.1
    keep_for: float = 600.0  # a finished request is kept this long for the harness


class Replica:
    """A conductor replica's decisions over the store; no state of its own between calls."""

    def __init__(
        self,
        store: RequestStore,
        *,
        replica_id: str,
        seed: int,
        timing: Timing,
        keys: SimKeys,
    ) -> None:
        self.store = store
        self.id = replica_id
        self.seed = seed
        self.timing = timing
        self.keys = keys
        self.stats = ReplicaStats()
        self._specs: dict[str, RequestSpec] = {}

    def spec(self, request_id: str) -> RequestSpec:
        found = self._specs.get(request_id)
        if found is None:
            found = self._specs[request_id] = model.spec(self.seed, request_id)
        return found

    # -- reports ------------------------------------------------------------------------

    def handle(self, report: Report) -> None:
        """Apply one report: published info first, then the report; drive a completed pass."""
        rid, partition = report.request_id, report.partition
        try:
            infos = report.published()
            if infos:
                with self.stats.timed("merge"):
                    self.store.merge_publish_info(rid, partition, infos, op_id=report.report_id)
            with self.stats.timed("report"):
                outcome = self.store.record_worker_report(
                    rid, partition,
                    fwd_pass=report.fwd_pass, worker_graph_id=report.worker_graph_id,
                    rank=report.rank, num_ranks=report.num_ranks, new_tokens=report.new_tokens,
                    output_names=report.output_names, consumed=report.consumed,
                    replica_id=self.id,
                )  # fmt: skip
        except (StalePassError, UnknownWorkerGraphError):
            self.stats.count("stale")  # a late copy of a pass that has moved on
            return
        except NotFoundError:
            self.stats.count("gone")  # the request finished and was removed
            return
        except TransactionConflictError:
            self.stats.count("conflicts")  # the report is lost; the pass deadline resends it
            return
        if not outcome.applied:
            self.stats.count("duplicates")
            return
        self.stats.count("reports")
        if outcome.lease is not None:
            self.drive(outcome.lease)

    # -- driving a step -----------------------------------------------------------------

    def drive(self, lease: Lease) -> None:
        """Take the partition's next step: advance if its pass is complete, then send.

        Every part is safe to redo, which is what a replica that claims the step after this
        one died does: the advance is a compare-and-set on the pass, a resent pass only
        produces reports the store recognises. A superseded lease drops the step.
        """
        rid, partition = lease.request_id, lease.partition
        spec = self.spec(rid)
        try:
            part = self.store.load_partition(rid, partition)
            if not part.is_done and model.pass_complete(part):
                step = model.next_step(spec, partition, part.fwd_pass_number)
                try:
                    with self.stats.timed("advance"):
                        self.store.advance_partition(
                            rid, partition,
                            from_pass=part.fwd_pass_number, metadata=step.metadata,
                            worker_graph_ids=step.worker_graph_ids, done=step.done,
                            op_id=f"{rid}/{partition}/{part.fwd_pass_number}", fence=lease,
                        )  # fmt: skip
                    self.stats.count("advances")
                except StalePassError:
                    self.stats.count("stale_advances")  # advanced already: just resend
                part = self.store.load_partition(rid, partition)
            for consumer in model.consumers(spec, partition):
                self._nudge(spec, consumer)
            check_in: float | None = None
            if part.is_done:
                self._finish_if_done(spec, lease)
            else:
                self._send_if_ready(spec, partition, part.fwd_pass_number)
                check_in = self.timing.pass_deadline
            with self.stats.timed("release"):
                self.store.release_lease(lease, check_in=check_in)
        except FencedError:
            self.stats.count("fenced")  # another replica claimed the step: it drives now
        except NotFoundError:
            self.stats.count("gone")

    def recover(self) -> int:
        """Claim and redo the steps whose driver is gone or whose pass is overdue."""
        claimed = 0
        for rid, partition in self.store.due_steps(limit=50):
            try:
                with self.stats.timed("claim"):
                    lease = self.store.claim_step(rid, partition, self.id)
            except NotFoundError:
                continue
            if lease is None:
                continue
            claimed += 1
            self.stats.count("claims")
            self.drive(lease)
        return claimed

    def _nudge(self, spec: RequestSpec, partition: str) -> None:
        """Send a consumer's pass that the new tokens made runnable, unless it ran already."""
        part = self.store.load_partition(spec.request_id, partition)
        if part.is_done or model.pass_complete(part) or part.wg_rank_completions:
            return
        self._send_if_ready(spec, partition, part.fwd_pass_number)

    def _send_if_ready(self, spec: RequestSpec, partition: str, fwd_pass: int) -> None:
        rid = spec.request_id
        connections = {}
        if partition == model.CODEC:
            connections[model.STREAM] = self.store.load_connection(rid, model.STREAM)
        if model.ready(spec, partition, fwd_pass, connections):
            self.store.client.rpush(self.keys.dispatch, encode_dispatch(rid, partition, fwd_pass))
            self.stats.count("dispatched")

    def _finish_if_done(self, spec: RequestSpec, lease: Lease) -> None:
        rid = spec.request_id
        state = self.store.load_request(rid)
        if not all(p.is_done for p in state.partitions.values()):
            return  # the other partition's driver will see both done
        for name, value in model.final_outputs(spec, state).items():
            self.store.set_final_output(rid, name, value, fence=lease)
        self.store.finish_request(rid, fence=lease, keep_for=self.timing.keep_for)
        self.store.client.rpush(self.keys.finished, rid)
        self.stats.count("finished")


def ingest(store: RequestStore, keys: SimKeys, spec: RequestSpec, pass_deadline: float) -> None:
    """The frontend's part: create the request and send its first pass to the workers.

    Every partition goes on the recovery index at the pass deadline, so a first pass whose
    reports die with a replica is sent again.
    """
    rid = spec.request_id
    store.create_request(
        rid, **model.initial_request(spec), op_id=f"create:{rid}", check_in=pass_deadline
    )
    # The codec's first pass waits for streamed tokens: the LLM's driver sends it.
    store.client.rpush(keys.dispatch, encode_dispatch(rid, spec.producer, 0))


# -- the process --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaConfig:
    """Everything a replica process needs, passed as one JSON argument."""

    redis_url: str
    namespace: str
    replica_id: str
    seed: int
    timing: dict[str, float]
    parent_pid: int
    max_lifetime: float  # exit after this long whatever happens: a run never leaves orphans

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def serve(replica: Replica, config: ReplicaConfig, stopping: list[bool]) -> None:
    """Heartbeat, apply inbox reports, recover, flush stats; until told to stop."""
    store, keys, timing = replica.store, replica.keys, replica.timing
    registry = ReplicaRegistry(store.client, namespace=config.namespace)
    inbox = keys.inbox(replica.id)
    end = time.monotonic() + config.max_lifetime
    next_beat = next_recovery = next_flush = 0.0
    flushed_retries = 0
    while not stopping and time.monotonic() < end and os.getppid() == config.parent_pid:
        now = time.monotonic()
        try:
            if now >= next_beat:
                registry.heartbeat(replica.id)
                next_beat = now + timing.heartbeat
            batch = store.client.lpop(inbox, 32) or []
            for raw in batch:
                replica.handle(decode_report(raw))
            if now >= next_recovery:
                replica.recover()
                next_recovery = now + timing.recovery_interval
            if now >= next_flush:
                retries = store.stats.retries
                replica.stats.count("retries", retries - flushed_retries)
                flushed_retries = retries
                store.client.rpush(keys.stats, _encoder.encode(replica.stats.drain()))
                next_flush = now + 0.5
        except StoreConnectionError:
            replica.stats.count("connection_errors")
            time.sleep(0.1)
            continue
        if not batch:
            time.sleep(0.005)
    with contextlib.suppress(Exception):  # stopping anyway; the server may be gone
        replica.stats.count("retries", store.stats.retries - flushed_retries)
        store.client.rpush(keys.stats, _encoder.encode(replica.stats.drain()))
        registry.forget(replica.id)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config = ReplicaConfig(**json.loads(args[0]))
    client = client_from_url(config.redis_url)
    timing = Timing(**config.timing)
    store = RequestStore(client, namespace=config.namespace, lease_ttl=timing.lease_ttl)
    replica = Replica(
        store,
        replica_id=config.replica_id,
        seed=config.seed,
        timing=timing,
        keys=SimKeys(config.namespace),
    )
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    serve(replica, config, stopping)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
