"""One whole simulation: reference run, replica fleet with kills and drains, comparison and
summary. Redis unreachable mid-run (a restart, a failover) is one line: the replicas' runtime
rides through it, and so does this loop."""

from __future__ import annotations

import math
import random
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import redis
from redis.exceptions import RedisClusterException

from store.cli import main as cli
from store.cli.progress import Progress
from store.cli.simulate import model
from store.cli.simulate.fleet import Delivery, Fleet, FleetCounters
from store.cli.simulate.measure import TIMED_OPERATIONS, ReplicaStats
from store.cli.simulate.reference import differences, fakeredis_with_lua, reference_run
from store.cli.simulate.takeovers import DRAIN, KILL
from store.cli.simulate.transport import UNREACHABLE
from store.errors import ConfigurationError
from store.io.connect import client_from_url, redacted
from store.keys import KeySpace
from store.replicas import ReplicaRegistry
from store.runtime import Timing
from store.store import RequestStore

# The replicas' clocks: short, so that recovery shows in seconds. A finished request is
# kept long enough for the fleet to read it; a drain waits little for steps in flight.
TIMING = Timing(
    lease_ttl=2.0, pass_deadline=2.0, max_pass_deadline=16.0, heartbeat=0.5,
    recovery_interval=0.1, keep_for=600.0, drain_timeout=2.0, retry_pause=0.05,
    max_retry_pause=1.0,
)  # fmt: skip
OUTAGE_PAUSE = 0.1  # seconds between the loop's tries while Redis is unreachable


def default_namespace() -> str:
    return f"sim-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class SimulationConfig:
    replicas: int = 3
    requests: int = 6
    kills: int = 1
    drains: int = 0  # of the kills, how many drain the replica instead of killing it
    aio: bool = False  # replicas on AsyncReplica
    # Benchmarks: kill or drain a replica only while it holds a lease, and let a drain
    # find a step in flight (``conductor.ProcessConfig.slow_at_drain``), so that every
    # kill and drain leaves a step to take over.
    aim: bool = False
    seed: int = 0
    redis_url: str | None = None  # None: an embedded fakeredis TCP server in this process
    namespace: str = field(default_factory=default_namespace)
    timeout: float = 120.0  # the whole run, reference included
    timing: Timing = TIMING
    delivery: Delivery = field(default_factory=Delivery)


@dataclass
class SimulationResult:
    config: SimulationConfig
    server: str = ""
    reference_seconds: float = 0.0
    elapsed: float = 0.0
    expected: dict[str, Any] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    mismatches: dict[str, list[str]] = field(default_factory=dict)
    unfinished: dict[str, str] = field(default_factory=dict)
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    counters: FleetCounters = field(default_factory=FleetCounters)
    failures: list[str] = field(default_factory=list)
    doubled: dict[str, list[str]] = field(default_factory=dict)  # request -> what twice
    takeovers: dict[str, list[float]] = field(default_factory=dict)  # kill/drain -> seconds
    awaiting_takeover: int = 0  # steps of killed or drained replicas never seen taken over
    outages: int = 0  # times the harness found Redis unreachable
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not (
            self.mismatches or self.unfinished or self.failures or self.timed_out
            or self.doubled
        )  # fmt: skip


def simulate(config: SimulationConfig, *, out: TextIO, err: TextIO) -> SimulationResult:
    """Run the simulation described by ``config``; the result says whether it held up."""
    deadline = time.monotonic() + config.timeout
    result = SimulationResult(config)
    ids = model.request_ids(config.requests)
    started = time.perf_counter()
    result.expected = reference_run(config.seed, ids, config.timing)
    result.reference_seconds = time.perf_counter() - started
    passes = sum(model.spec(config.seed, rid).passes for rid in ids)
    print(
        f"reference run (in-process fakeredis, 1 replica, no kills, no duplicates): "
        f"{len(ids)} requests, {passes} forward passes in {result.reference_seconds:.1f} s",
        file=out,
    )
    with _redis(config.redis_url, out) as (url, client), tempfile.TemporaryDirectory() as logs:
        result.server = redacted(url)
        _check_namespace_unused(client, config.namespace)
        fleet = Fleet(
            client,
            redis_url=url,
            namespace=config.namespace,
            seed=config.seed,
            timing=config.timing,
            delivery=config.delivery,
            log_dir=Path(logs),
            max_lifetime=config.timeout + 30,
            aio=config.aio,
            slow_at_drain=config.aim,
        )
        try:
            _run_fleet(fleet, config, ids, passes, deadline, result, out, err)
        finally:
            _unless_unreachable(fleet.stop, out)
            _unless_unreachable(lambda: _delete_namespace(client, config.namespace), out)
        result.stats, result.counters, result.failures = fleet.stats, fleet.counters, fleet.failures
        result.finished = fleet.finished
        result.doubled = {rid: what for rid, what in fleet.doubled.items() if what}
        result.takeovers = fleet.takeovers.latencies
        result.awaiting_takeover = len(fleet.takeovers.awaited)
    for rid in ids:
        if rid in result.finished:
            diff = differences(result.expected[rid], result.finished[rid])
            if diff:
                result.mismatches[rid] = diff
    return result


def _run_fleet(
    fleet: Fleet,
    config: SimulationConfig,
    ids: list[str],
    passes: int,
    deadline: float,
    result: SimulationResult,
    out: TextIO,
    err: TextIO,
) -> None:
    first = [fleet.spawn() for _ in range(config.replicas)]
    fleet.wait_until_up(first, timeout=max(1.0, min(60.0, deadline - time.monotonic())))
    # Kill at random points of the run, measured in passes sent, so every kill lands while
    # requests are in flight whatever the machine's speed. The first ``drains`` of them
    # drain their replica instead; the instants and victims are the same either way.
    rng = random.Random(f"kills:{config.seed}")
    kill_at = sorted(
        rng.randint(passes * 15 // 100, passes * 75 // 100) for _ in range(config.kills)
    )
    drains_left = config.drains
    started = time.monotonic()
    fleet.create(ids)
    progress = Progress(err, len(ids))
    unreachable = False
    try:
        while fleet.pending():
            if time.monotonic() > deadline:
                result.timed_out = True
                break
            try:
                if kill_at and fleet.counters.dispatches >= kill_at[0] and fleet.live():
                    kill_at.pop(0)
                    victim = rng.choice(fleet.live())
                    if drains_left:
                        drains_left -= 1
                        fleet.drain(victim, aim=config.aim)
                    else:
                        fleet.kill(victim, aim=config.aim)
                    fleet.spawn()
                busy = fleet.step()
            except UNREACHABLE as e:
                if not unreachable:
                    result.outages += 1
                    progress.interrupt(
                        f"Redis unreachable mid-run ({type(e).__name__}: {e}): the replicas "
                        "ride through it, and the run goes on when it answers",
                        out,
                    )
                unreachable = True
                time.sleep(OUTAGE_PAUSE)
                continue
            unreachable = False
            progress.update(len(fleet.finished), _detail(fleet, config), time.monotonic() - started)
            if not busy:
                time.sleep(0.002)
        progress.update(
            len(fleet.finished), _detail(fleet, config), time.monotonic() - started, force=True
        )
    finally:
        progress.close()
    result.elapsed = time.monotonic() - started
    result.unfinished = _unless_unreachable(fleet.describe_unfinished, out) or {}


def _detail(fleet: Fleet, config: SimulationConfig) -> str:
    counters = fleet.counters
    detail = f"kills {counters.kills}/{config.kills - config.drains}"
    return detail + (f"  drains {counters.drains}/{config.drains}" if config.drains else "")


def _unless_unreachable(call: Any, out: TextIO) -> Any:
    """``call()``; if Redis is unreachable, say so in one line (what it did is lost)."""
    try:
        return call()
    except UNREACHABLE as e:
        print(f"Redis unreachable at the end of the run ({type(e).__name__}: {e})", file=out)
        return None


# -- the summary -------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no samples)."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary_lines(result: SimulationResult) -> list[str]:
    config, counters, stats = result.config, result.counters, result.stats
    c = stats.counters
    total = len(result.expected)
    matched = sum(1 for rid in result.finished if rid not in result.mismatches)
    operations = sum(len(v) for v in stats.latencies.values())
    rate = operations / result.elapsed if result.elapsed else 0.0
    absorbed = c.get("duplicates", 0) + c.get("stale", 0)
    stopped = f"{counters.kills} SIGKILLed"
    if config.drains:
        stopped += f", {counters.drains} drained"
    rows = [
        ("requests finished", f"{len(result.finished)}/{total}"),
        ("final states", f"{matched}/{total} equal to the crash-free reference"),
        ("nothing doubled", f"{len(result.finished) - len(result.doubled)}/"
                            f"{len(result.finished)} finished requests applied each step "
                            f"and report once"),
        ("replica processes", f"{counters.started} started ({'async' if config.aio else 'sync'})"
                              f", {stopped} and restarted under new ids"),
        ("reports delivered", f"{counters.deliveries} ({counters.duplicates_sent} duplicate "
                              f"copies, {counters.rerouted} rerouted from dead replicas)"),
        ("duplicates absorbed", f"{absorbed} ({c.get('duplicates', 0)} repeated reports, "
                                f"{c.get('stale', 0)} stale after their pass moved on)"),
        ("takeovers (claims)", f"{c.get('takeovers', 0)} ({c.get('resends', 0)} passes "
                               f"resent, {c.get('handed_over', 0)} steps handed over)"),
        ("fenced writes", f"{c.get('fenced', 0)} rejected"),
        ("transaction retries", f"{c.get('retries', 0)} ({c.get('report_errors', 0)} "
                                f"reports gave up)"),
        ("passes sent", f"{counters.dispatches} ({c.get('passes', 0)} advances)"),
        ("operations", f"{operations} in {result.elapsed:.1f} s = {rate:.0f} ops/s"),
    ]  # fmt: skip
    for how, label in ((KILL, "takeover after kill"), (DRAIN, "takeover after drain")):
        if result.takeovers.get(how):
            rows.append((label, takeover_figures(result.takeovers[how], config.timing)))
    if result.awaiting_takeover:
        rows.append(("never taken over", f"{result.awaiting_takeover} steps (no claim seen)"))
    if result.outages:
        rows.append(("Redis unreachable", f"{result.outages} times mid-run, ridden through"))
    lines = ["summary"]
    lines += [f"  {label:<22}{value}" for label, value in rows]
    lines.append(f"  {'latency':<22}{'count':>7}{'p50 ms':>9}{'p99 ms':>9}")
    for op in TIMED_OPERATIONS:
        samples = stats.latencies.get(op, [])
        lines.append(
            f"    {op:<20}{len(samples):>7}{percentile(samples, 0.5) * 1e3:>9.2f}"
            f"{percentile(samples, 0.99) * 1e3:>9.2f}"
        )
    for failure in result.failures:
        lines.append(f"  replica failure: {failure}")
    if result.timed_out:
        lines.append(f"TIMEOUT: the run did not finish within {config.timeout:.0f} s")
    for rid, where in sorted(result.unfinished.items()):
        lines.append(f"  unfinished {rid}: {where}")
    for rid, what in sorted(result.doubled.items()):
        lines.append(f"  doubled {rid}: {'; '.join(what[:5])}")
    for rid, diff in sorted(result.mismatches.items()):
        lines.append(f"  mismatch {rid}: {len(diff)} difference(s) from the reference")
        lines += [f"    {line}" for line in diff[:10]]
    if result.ok:
        lines.append("result: OK, every request finished with the reference's final state")
    else:
        problems = []
        if result.unfinished:
            problems.append(f"{len(result.unfinished)} unfinished")
        if result.mismatches:
            problems.append(f"{len(result.mismatches)} differ from the reference")
        if result.doubled:
            problems.append(f"{len(result.doubled)} applied something twice")
        if result.failures:
            problems.append(f"{len(result.failures)} replica failures")
        if result.timed_out:
            problems.append("timed out")
        lines.append(f"result: FAILED ({', '.join(problems)})")
    return lines


def takeover_figures(samples: list[float], timing: Timing) -> str:
    """``n steps: p50 ... p99 ...``, each in seconds, lease TTLs and recovery intervals."""

    def one(q: float) -> str:
        s = percentile(samples, q)
        return f"{s:.2f} s = {s / timing.lease_ttl:.2f} TTL = {s / timing.recovery_interval:.1f} RI"

    return f"{len(samples)} steps: p50 {one(0.5)}, p99 {one(0.99)}"


# -- Redis -------------------------------------------------------------------------------


@contextmanager
def _redis(url: str | None, out: TextIO) -> Iterator[tuple[str, Any]]:
    """The Redis the replicas share: ``url``, or an embedded fakeredis TCP server."""
    if url is not None:
        client = cli.connect(url)
        try:
            client.ping()
        except (redis.RedisError, RedisClusterException) as e:
            raise cli.as_store_error(e, url) from e
        cli.warn_if_evicting(RequestStore(client, reconnect=cli.CLI_RECONNECT))
        try:
            yield url, client
        finally:
            client.close()
        return
    fakeredis = fakeredis_with_lua()
    server = fakeredis.TcpFakeServer(("127.0.0.1", 0))
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    url = f"redis://127.0.0.1:{server.server_address[1]}/0"
    print(
        f"embedded Redis: fakeredis TcpFakeServer on {url}, in this process (no server "
        "needed; slower than a real Redis)",
        file=out,
    )
    client = client_from_url(url)
    try:
        yield url, client
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _check_namespace_unused(client: Any, namespace: str) -> None:
    store = RequestStore(client, namespace=namespace)
    if store.list_requests() or ReplicaRegistry(client, namespace=namespace).last_beats():
        raise ConfigurationError(
            f"namespace {namespace!r} holds requests or replicas already; the simulation "
            "deletes its namespace when done, so give it one of its own (--namespace)"
        )


def _delete_namespace(client: Any, namespace: str) -> None:
    """Remove every key of the run (its requests are gone already; lists, index, heartbeats)."""
    KeySpace(namespace)  # validated: no glob characters can reach the pattern
    batch = list(client.scan_iter(match=f"{namespace}:*", count=500))
    for i in range(0, len(batch), 500):
        client.unlink(*batch[i : i + 500])
