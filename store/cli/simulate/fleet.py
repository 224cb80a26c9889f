"""The replica processes, the simulated workers and the unreliable delivery between them.

The fleet plays everything outside the conductor replicas: a frontend submits the requests
(``Replica.submit``, which sends their first passes); it takes each pass a replica sends
(the dispatch list), has the model's workers produce that pass's reports and pushes each
onto a random live replica's inbox after a random delay, some of them twice (the workers'
at-least-once delivery, reordered). It kills replicas with SIGKILL or drains them
(SIGTERM: the process calls ``drain()``), hands their inboxes to the living, times the
takeovers of the steps they held, and notices when a replica finishes a request.
"""

from __future__ import annotations

import heapq
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import msgspec

import store as store_package
from store.cli.simulate import model
from store.cli.simulate.conductor import ProcessConfig
from store.cli.simulate.measure import ReplicaStats
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import SimulationError, canonical, doubled
from store.cli.simulate.takeovers import DRAIN, KILL, Takeovers
from store.cli.simulate.transport import (
    SimKeys,
    decode_dispatch,
    decode_handed,
    encode_dispatch,
    encode_report,
)
from store.codec.leases import decode_leases
from store.durability import split_durability
from store.errors import NotFoundError
from store.replicas import ReplicaRegistry
from store.runtime import Replica, Timing
from store.store import RequestStore

REPLICA_MODULE = "store.cli.simulate.conductor"
# Seconds a replica gets to drain (hand over, flush, leave) after SIGTERM at the end.
STOP_GRACE = 10.0
AIM_TRIES, AIM_PAUSE = 200, 0.005  # an aimed kill freezes its victim this often, this apart
POLL_EVERY = 1.0  # seconds between looks at requests finished without a word, and takeovers


@dataclass(frozen=True)
class Delivery:
    """How unreliable the workers' delivery is."""

    duplicate_rate: float = 0.2  # share of reports delivered a second time
    reorder_window: float = 0.03  # each copy waits up to this long (seconds), so order varies
    late_window: float = 0.3  # a duplicate waits up to this long: it may arrive stale


@dataclass
class ReplicaProcess:
    replica_id: str
    process: subprocess.Popen[bytes]
    log_path: Path
    state: str = "running"  # running, draining, drained, killed, stopped, failed


@dataclass
class FleetCounters:
    dispatches: int = 0
    deliveries: int = 0
    duplicates_sent: int = 0
    rerouted: int = 0
    kills: int = 0
    drains: int = 0
    started: int = 0


@dataclass(order=True)
class _Pending:
    due: float
    seq: int
    target: str | None = field(compare=False)  # None: any live replica
    payload: bytes = field(compare=False)


class Fleet:
    """Replica processes over one Redis namespace, and the workers that feed them."""

    def __init__(
        self,
        client: Any,
        *,
        redis_url: str,
        namespace: str,
        seed: int,
        timing: Timing,
        delivery: Delivery,
        log_dir: Path,
        max_lifetime: float,
        aio: bool = False,
        slow_at_drain: bool = False,
        delete_finished: bool = True,
    ) -> None:
        self.client = client
        self.redis_url = redis_url
        self.namespace = namespace
        self.seed = seed
        self.timing = timing
        self.delivery = delivery
        self.log_dir = log_dir
        self.max_lifetime = max_lifetime
        self.aio = aio
        self.slow_at_drain = slow_at_drain
        self.delete_finished = delete_finished
        self.store = RequestStore(
            client, namespace=namespace, lease_ttl=timing.lease_ttl,
            durability=split_durability(redis_url)[1],
        )  # fmt: skip
        self.keys = SimKeys(namespace)
        self.planner = SimPlanner(seed, sink=self._send)
        self.frontend = Replica(
            self.store, planner=self.planner, replica_id="frontend", timing=timing
        )
        self.takeovers = Takeovers()
        self.doubled: dict[str, list[str]] = {}
        self.registry = ReplicaRegistry(client, namespace=namespace)
        self.rng = random.Random(seed)
        self.replicas: dict[str, ReplicaProcess] = {}
        self.counters = FleetCounters()
        self.stats = ReplicaStats()
        self.failures: list[str] = []
        self.requests: list[str] = []
        self.finished: dict[str, Any] = {}  # request id -> canonical final state
        self._to_create: list[str] = []
        self._queue: list[_Pending] = []
        self._seq = 0
        self._next_poll = 0.0

    # -- replicas -----------------------------------------------------------------------

    def spawn(self, command: Sequence[str] | None = None) -> str:
        """Start a replica process under a new id; ``command`` replaces the module entry."""
        self.counters.started += 1
        replica_id = f"replica-{self.counters.started}"
        config = ProcessConfig(
            redis_url=self.redis_url,
            namespace=self.namespace,
            replica_id=replica_id,
            seed=self.seed,
            timing=asdict(self.timing),
            parent_pid=os.getpid(),
            max_lifetime=self.max_lifetime,
            aio=self.aio,
            slow_at_drain=self.slow_at_drain,
        )
        argv = list(command or [sys.executable, "-m", REPLICA_MODULE])
        log_path = self.log_dir / f"{replica_id}.log"
        env = dict(os.environ)
        root = str(Path(store_package.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*argv, config.to_json()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, env=env,
            )  # fmt: skip
        self.replicas[replica_id] = ReplicaProcess(replica_id, process, log_path)
        return replica_id

    def live(self) -> list[str]:
        return [r.replica_id for r in self.replicas.values() if r.state == "running"]

    def wait_until_up(self, replica_ids: Iterable[str], timeout: float) -> None:
        """Wait for each replica's first heartbeat (a process takes a moment to import)."""
        wanted = set(replica_ids)
        deadline = time.monotonic() + timeout
        while not wanted <= set(self.registry.last_beats()):
            self._check_exits()
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(wanted - set(self.registry.last_beats())))
                raise SimulationError(f"replicas did not start within {timeout:.0f} s: {missing}")
            time.sleep(0.02)

    def kill(self, replica_id: str, *, aim: bool = False) -> None:
        """SIGKILL the replica; what waited in its inbox goes to the others, and the steps
        it held wait for a takeover. With ``aim``, only once it holds a lease (see
        ``_freeze``)."""
        replica = self.replicas[replica_id]
        killed_at, held = self._freeze(replica_id, aim=aim)
        replica.process.send_signal(signal.SIGKILL)
        replica.process.wait()
        replica.state = "killed"
        self.counters.kills += 1
        self._reroute(replica_id)
        for rid, partition in held:
            self.takeovers.expect(rid, partition, replica_id, killed_at, KILL)

    def drain(self, replica_id: str, *, aim: bool = False) -> None:
        """SIGTERM the replica: it ``drain()``s at once (the steps it hands over come
        back on the handed list); its inbox goes to the others once it has exited. With
        ``aim``, only once it holds a lease."""
        replica = self.replicas[replica_id]
        if aim:
            self._freeze(replica_id, aim=True)
        replica.process.send_signal(signal.SIGTERM)
        replica.process.send_signal(signal.SIGCONT)
        replica.state = "draining"
        self.counters.drains += 1

    def _freeze(self, replica_id: str, *, aim: bool) -> tuple[float, list[tuple[str, str]]]:
        """SIGSTOP the replica and read the steps it holds a live lease on (the instant
        and the steps). With ``aim``, thaw it and try again (a lease lasts one step,
        milliseconds) until it holds one, at most ``AIM_TRIES`` times: the benchmark's
        way to time takeovers after every kill, not only after the lucky ones."""
        process = self.replicas[replica_id].process
        for _ in range(AIM_TRIES if aim else 1):
            process.send_signal(signal.SIGSTOP)
            frozen_at = time.time()
            held = self._held_by(replica_id, frozen_at)
            if held or not aim:
                break
            process.send_signal(signal.SIGCONT)
            time.sleep(AIM_PAUSE)
        else:
            process.send_signal(signal.SIGSTOP)
        return frozen_at, held

    def _held_by(self, replica_id: str, now: float) -> list[tuple[str, str]]:
        pending = self.pending()
        pipe = self.client.pipeline(transaction=False)
        for rid in pending:
            pipe.hgetall(self.store.keys.lease(rid))
        held = []
        for rid, raw in zip(pending, pipe.execute(), strict=True):
            leases = decode_leases(raw, rid, self.store.keys.lease(rid))
            held += [
                (rid, partition)
                for partition, lease in leases.items()
                if lease.holder == replica_id and lease.expires_at > now
            ]
        return held

    def stop(self) -> None:
        """Stop every replica (SIGTERM, then SIGKILL after a grace) and collect their stats."""
        for replica in self.replicas.values():
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for replica in self.replicas.values():
            try:
                replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()
            if replica.state == "running":
                replica.state = "stopped"
        self._collect_stats()

    def _reroute(self, replica_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.keys.inbox(replica_id), 0, -1)
        pipe.delete(self.keys.inbox(replica_id))
        waiting, _ = pipe.execute()
        for payload in waiting:
            self._push(time.monotonic(), None, payload)
        self.counters.rerouted += len(waiting)

    def _check_exits(self) -> None:
        """A replica that exits on its own has hit a bug: record it, start another. One
        that drained has handed its leases over: what it left in its inbox goes on."""
        for replica in list(self.replicas.values()):
            if replica.state == "draining" and replica.process.poll() is not None:
                replica.state = "drained"
                self._reroute(replica.replica_id)
            if replica.state == "running" and replica.process.poll() is not None:
                replica.state = "failed"
                tail = replica.log_path.read_text(errors="replace").strip().splitlines()[-15:]
                self.failures.append(
                    f"{replica.replica_id} exited with code {replica.process.returncode}:\n    "
                    + "\n    ".join(tail)
                )
                self._reroute(replica.replica_id)
                self.spawn()

    # -- requests and workers ---------------------------------------------------------------

    def create(self, request_ids: Iterable[str]) -> None:
        """Submit the requests (in ``step``, so that an outage only delays them)."""
        ids = list(request_ids)
        self.requests += ids
        self._to_create += ids

    def _send(self, sent: tuple[str, str, int]) -> None:
        self.client.rpush(self.keys.dispatch, encode_dispatch(*sent))

    def pending(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.finished]

    def step(self) -> bool:
        """One round: workers run the passes sent, due reports are delivered. True if busy."""
        while self._to_create:
            rid = self._to_create[0]
            self.frontend.submit(rid, **self.planner.create(rid))
            self._to_create.pop(0)
        now = time.monotonic()
        busy = False
        dispatched = self.client.lpop(self.keys.dispatch, 256) or []
        for raw in dispatched:
            busy = True
            self.counters.dispatches += 1
            rid, partition, fwd_pass = decode_dispatch(raw)
            for report in model.reports(model.spec(self.seed, rid), partition, fwd_pass):
                payload = encode_report(report)
                self._push(now + self.rng.uniform(0, self.delivery.reorder_window), None, payload)
                if self.rng.random() < self.delivery.duplicate_rate:
                    self.counters.duplicates_sent += 1
                    late = self.rng.uniform(0, self.delivery.late_window)
                    self._push(now + late, None, payload)
        busy |= self._deliver(now)
        self._check_exits()
        self._collect_handed()
        self._collect_finished(now)
        self._collect_stats()
        return busy

    def _push(self, due: float, target: str | None, payload: bytes) -> None:
        self._seq += 1
        heapq.heappush(self._queue, _Pending(due, self._seq, target, payload))

    def _deliver(self, now: float) -> bool:
        live = self.live()
        if not live:
            return False
        pipe = self.client.pipeline(transaction=False)
        delivered = 0
        while self._queue and self._queue[0].due <= now:
            item = heapq.heappop(self._queue)
            target = item.target if item.target in live else self.rng.choice(live)
            pipe.rpush(self.keys.inbox(target), item.payload)
            delivered += 1
        if delivered:
            pipe.execute()
            self.counters.deliveries += delivered
        return bool(delivered)

    def _collect_handed(self) -> None:
        for raw in self.client.lpop(self.keys.handed, 256) or []:
            victim, rid, partition, at = decode_handed(raw)
            self.takeovers.expect(rid, partition, victim, at, DRAIN)

    def _collect_finished(self, now: float) -> None:
        done = [raw.decode() for raw in self.client.lpop(self.keys.finished, 256) or []]
        if now >= self._next_poll:  # a replica may die between finishing and telling
            done += self.pending()
            self._next_poll = now + POLL_EVERY
            for rid in self.takeovers.requests() - set(done):
                self._resolve_takeovers(rid)
        for rid in done:
            if rid in self.finished:
                continue
            try:
                state = self.store.load_request(rid)
            except NotFoundError:
                continue
            if not state.record.finished_at:
                continue
            self.finished[rid] = canonical(state)
            history = self.client.xrange(self.store.keys.history(rid))
            self.doubled[rid] = doubled(history)
            if rid in self.takeovers.requests():
                self.takeovers.resolve(rid, history)
            if self.delete_finished:
                self.store.delete_request(rid)

    def _resolve_takeovers(self, rid: str) -> None:
        since = int(self.takeovers.earliest(rid) * 1000) - 1
        self.takeovers.resolve(rid, self.client.xrange(self.store.keys.history(rid), min=since))

    def _collect_stats(self) -> None:
        for raw in self.client.lpop(self.keys.stats, 256) or []:
            self.stats.merge(msgspec.json.decode(raw))

    def describe_unfinished(self) -> dict[str, str]:
        """Where each unfinished request stands, read from the store."""
        out = {}
        for rid in self.pending():
            try:
                state = self.store.load_request(rid)
            except NotFoundError:
                out[rid] = "not held (deleted before it finished?)"
                continue
            parts = [
                f"{name} pass {p.fwd_pass_number}{' done' if p.is_done else ''} "
                f"completed {sorted(p.completed_worker_graph_ids)}"
                for name, p in state.partitions.items()
            ]
            parts += [
                f"{name} {c.token_count}/{c.consumed_count}{' done' if c.producer_done else ''}"
                for name, c in state.connections.items()
            ]
            leases = self.store.leases(rid)
            parts += [f"lease {p}: {lease.holder}" for p, lease in leases.items()]
            out[rid] = "; ".join(parts)
        return out

    def print_failures(self, out: TextIO) -> None:
        for failure in self.failures:
            print(f"  replica failure: {failure}", file=out)
