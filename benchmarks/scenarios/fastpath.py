"""A 2-rank forward pass through the store's hot path, as a conductor replica drives it.

One operation is one whole pass of the LLM partition of a "tts" request (the simulation's
shape, ``shapes.pass_request``): rank 0 reports (1 new token, its KV shard of 16 pages),
rank 1 reports (its shard) and completes the pass, which grants the replica the lease on
the next step; then the step. Variants, all on one process, measured in alternating turns
(``harness.TURNS``) so that they meet the same machine state:

- ``pass: report+report+take_step``: ``record_worker_report(..., replica_id=,
  published={"kv": shard})`` per rank, then ``take_step(outcome.lease, Step(...),
  check_in=30.0)``;
- ``pass: report+report(then_step)``: the completing report takes the step itself
  (``then_step=Step(...)``), saving the step's round trip;
- ``... history off``: the first, with ``RequestStore(..., history_cap=0)``;
- ``pass (legacy): ...``: the protocol of ``--legacy REV`` (default f8f2fd5), in a pool
  process that imports that tree's store: per rank ``merge_publish_info(...,
  returning=False)`` then ``record_worker_report``, then ``advance_partition(fence=lease)``
  and ``release_lease(check_at=now + 30)``; that store also ZADDs the recovery index after
  the lease grant and the release;
- ``bare PING x1/x2/x3``: the round trips alone, the floor of wall time and client CPU.

What each row's figures are (``per_pass`` in the JSON details, and the row's notes):

- round trips per pass, counted twice: writes on the wire (a recording client, any tree)
  and the store's effects (its executor wrapped, current tree only), both over a few
  calibration passes on a request of their own before the timed loop (benchmarks.wire);
- Redis time per pass from ``INFO commandstats`` (the commands the client sent, script
  calls not counted twice) and the server's CPU from ``INFO cpu``, read around every timed
  slice (benchmarks.server);
- client CPU per pass: the worker's process time over its timed loops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.harness import (
    Bench,
    Case,
    Check,
    LoopDriver,
    Row,
    Scenario,
    Spec,
    Verify,
    Worker,
)
from benchmarks.server import ServerStats, per_call
from benchmarks.shapes import HOT, PASS_RANKS, PASS_WG, metadata, pass_request, rank_kv
from benchmarks.wire import recording_client, round_trips, tap_effects, top_level
from store import RequestExistsError, RequestStore

MODULE = __name__
TARGET = "2 ranks"
STEP = "pass: report+report+take_step"
IN_REPORT = "pass: report+report(then_step)"
NO_HISTORY = "pass: report+report+take_step, history off"
LEGACY = "pass (legacy): merge+report x2, advance, release"
PINGS = {n: f"bare PING x{n}" for n in (1, 2, 3)}
REPLICA = "bench-replica"
CHECK_IN = 30.0
CALIBRATION = 4  # passes counted on the wire and in effects, after one warm pass

# Targets of issue 10.
RTT_STEP, RTT_IN_REPORT = 3, 2
PING_TIMES = 4.0
REDIS_US = 100.0
CLIENT_CPU = 1.5
HISTORY = 1.10

Pass = Callable[[Any, str, int], "str | None"]  # (store, request, pass) -> outcome (None: ok)


def current_pass(*, then_step: bool) -> Pass:
    """The pass through this tree's fast path (see the module docstring)."""
    from store import Step  # not in the legacy tree: imported only where it runs

    step = Step(metadata(), (PASS_WG,))
    kv = [rank_kv(rank) for rank in range(PASS_RANKS)]

    def run(store: Any, rid: str, p: int) -> str | None:
        store.record_worker_report(
            rid, HOT, fwd_pass=p, worker_graph_id=PASS_WG, rank=0, num_ranks=PASS_RANKS,
            new_tokens=1, replica_id=REPLICA, published={"kv": kv[0]},
        )  # fmt: skip
        if then_step:
            done = store.record_worker_report(
                rid, HOT, fwd_pass=p, worker_graph_id=PASS_WG, rank=1, num_ranks=PASS_RANKS,
                replica_id=REPLICA, published={"kv": kv[1]}, then_step=step, check_in=CHECK_IN,
            )  # fmt: skip
            return None if done.stepped_to == p + 1 else "not stepped"
        done = store.record_worker_report(
            rid, HOT, fwd_pass=p, worker_graph_id=PASS_WG, rank=1, num_ranks=PASS_RANKS,
            replica_id=REPLICA, published={"kv": kv[1]},
        )  # fmt: skip
        if done.lease is None:
            return "no lease"
        store.take_step(done.lease, step, check_in=CHECK_IN)
        return None

    return run


def legacy_pass() -> Pass:
    """The pass as a replica drove the store of f8f2fd5 (public API of that tree only)."""
    meta = metadata()
    kv = [rank_kv(rank) for rank in range(PASS_RANKS)]

    def run(store: Any, rid: str, p: int) -> str | None:
        outcome = None
        for rank in range(PASS_RANKS):
            store.merge_publish_info(rid, HOT, {"kv": kv[rank]}, returning=False)
            outcome = store.record_worker_report(
                rid, HOT, fwd_pass=p, worker_graph_id=PASS_WG, rank=rank,
                num_ranks=PASS_RANKS, new_tokens=1 if rank == 0 else 0, replica_id=REPLICA,
            )  # fmt: skip
        if outcome is None or outcome.lease is None:
            return "no lease"
        store.advance_partition(
            rid, HOT, from_pass=p, metadata=meta, worker_graph_ids=[PASS_WG], fence=outcome.lease
        )
        store.release_lease(outcome.lease, check_at=time.time() + CHECK_IN)
        return None

    return run


def open_store(client: Any, namespace: str, options: dict[str, Any], rid: str) -> Any:
    """A store on ``client`` with ``options``, and request ``rid`` created in it."""
    store = RequestStore(client, namespace=namespace, **options)
    with contextlib.suppress(RequestExistsError):
        pass_request().create(store, rid)
    return store


def calibrate(w: Worker, run: Pass, options: dict[str, Any]) -> None:
    """Count what one pass sends, on a request of its own, into ``w.info``: round trips on
    the wire and in effects, and the commands the client sends itself by name."""
    client, recorded = recording_client(w.case.url)
    try:
        rid = f"{w.case.rid_for(w.index)}-calibration"
        store = open_store(client, w.case.namespace, options, rid)
        tap = tap_effects(store)
        run(store, rid, 0)  # connected, scripts loaded, topology cached
        recorded.clear()
        if tap is not None:
            tap.effects.clear()
        failed = [run(store, rid, p) for p in range(1, 1 + CALIBRATION)]
        if any(failed):
            raise RuntimeError(f"a calibration pass failed: {failed}")
        w.info["rtt_wire"] = recorded.rounds / CALIBRATION
        w.info["rtt_effects"] = None if tap is None else round_trips(tap.effects) / CALIBRATION
        sent = top_level(recorded.commands)
        w.info["sent"] = {name: n / CALIBRATION for name, n in sorted(sent.items())}
    finally:
        client.close()


def pass_row(make: Callable[[], Pass], **options: Any) -> Callable[[Worker], ServerStats]:
    def build(w: Worker) -> ServerStats:
        run = make()
        calibrate(w, run, options)
        rid = w.case.rid_for(w.index)
        w.client = redis.Redis.from_url(w.case.url)
        w.store = store = open_store(w.client, w.case.namespace, options, rid)
        at = [0]

        def op(k: int) -> str | None:
            p = at[0]
            outcome = run(store, rid, p)
            at[0] = p + 1 if outcome is None else store.load_partition(rid, HOT).fwd_pass_number
            w.last_step = at[0]
            return outcome

        op(0)  # the warm pass: outside the timing, counted by the check
        return ServerStats(LoopDriver(op), w.client, w)

    return build


def pings(n: int) -> Callable[[Worker], ServerStats]:
    def build(w: Worker) -> ServerStats:
        w.client = client = redis.Redis.from_url(w.case.url)
        client.ping()
        w.info.update(rtt_wire=float(n), rtt_effects=None, sent={"ping": float(n)})  # no store

        def op(k: int) -> str | None:
            for _ in range(n):
                client.ping()
            return None

        return ServerStats(LoopDriver(op), client, w)

    return build


OPS = {
    STEP: pass_row(lambda: current_pass(then_step=False)),
    IN_REPORT: pass_row(lambda: current_pass(then_step=True)),
    NO_HISTORY: pass_row(lambda: current_pass(then_step=False), history_cap=0),
    LEGACY: pass_row(legacy_pass),
    **{name: pings(n) for n, name in PINGS.items()},
}

# -- parent side -------------------------------------------------------------------------


def prepare(bench: Bench, case: Case) -> Verify | None:
    """The worker creates its request (the legacy one with its own store); the check:
    the partition is at the pass the worker reached, one pass per committed call."""
    if case.op in PINGS.values():
        return None

    def verify(row: Row, c: Case, results: list[dict[str, Any]]) -> None:
        reached = max(r["last_step"] for r in results)
        held = bench.store(c.namespace).load_partition(c.rid_for(0), HOT).fwd_pass_number
        ok = held == reached == row.details["committed"] + 1  # + the warm pass
        bench.set_verified(row, ok, "pass count")

    return verify


def specs(bench: Bench) -> list[Spec]:
    beside = f"{STEP}|1|one"
    out = [Spec("fastpath", MODULE, STEP, 1, "one", "", prepare)]
    for op in (IN_REPORT, NO_HISTORY, *PINGS.values()):
        out.append(Spec("fastpath", MODULE, op, 1, "one", "", prepare, beside=beside))
    legacy = bench.trees.get("legacy", {})
    if legacy.get("path"):
        out.append(
            Spec("fastpath", MODULE, LEGACY, 1, "one", "", prepare, tree="legacy", beside=beside)
        )
    else:
        bench.skip(LEGACY, legacy.get("skipped") or "no legacy tree")
    return out


def add_figures(row: Row) -> None:
    """Per pass: round trips, server time, client CPU; into details and the notes."""
    info = row.details.get("info", {})
    calls = row.details["committed"]
    figures: dict[str, Any] = {
        "rtt_wire": info.get("rtt_wire"),
        "rtt_effects": info.get("rtt_effects"),
        "client_cpu_us": row.details["client_cpu_us"],
    }
    if calls and "sent" in info:
        figures.update(per_call(row.details.get("counters", {}), info["sent"], calls))
    row.details["per_pass"] = figures
    rtt = f"{figures['rtt_wire']:g} RTT"
    if figures["rtt_effects"] not in (None, figures["rtt_wire"]):
        rtt += f" (effects: {figures['rtt_effects']:g})"
    parts = [rtt, f"client CPU {figures['client_cpu_us']:.0f} µs"]
    if "cmdstat_us" in figures:
        parts.append(
            f"Redis {figures['cmdstat_us']:.0f} µs cmdstats, {figures['cpu_us']:.0f} µs CPU"
        )
    row.note("; ".join(parts))


def measure(bench: Bench) -> None:
    bench.log("fastpath (2-rank passes, 1 process, in alternating turns)")
    for row in bench.measure_group(specs(bench), rounds=bench.rounds):
        row.target = TARGET
        add_figures(row)
        if row.operation != PINGS[1]:
            row.baseline = f"{PINGS[1]}|1|{TARGET}"


def _pp(row: Row | None, name: str) -> float | None:
    """A per-pass figure of a row (None: the row, or the figure, was not measured)."""
    if row is None:
        return None
    value = row.details.get("per_pass", {}).get(name)
    return None if value is None else float(value)


def _unshared(bench: Bench, check: Check) -> Check:
    """Server figures of a shared server include other clients' work: shown, not checked."""
    if bench.own_server or check.met is None:
        return check
    return Check(check.target, None, f"shared server, not checked: {check.measured}")


def _round_trips(op: str, row: Row | None, limit: int, legacy: Row | None) -> Check:
    wire, effects = _pp(row, "rtt_wire"), _pp(row, "rtt_effects")
    text = f"{op}: round trips <= {limit}"
    if wire is None:
        return Check(text, None, "not measured")
    counted = "not counted" if effects is None else f"{effects:g}"
    measured = f"{wire:g} on the wire, {counted} in the store's effects"
    old = _pp(legacy, "rtt_wire")
    if old is not None:
        measured += f"; legacy {old:g} in the same run"
    return Check(text, max(wire, effects or 0) <= limit, measured)


def _in_pings(op: str, row: Row | None, ping: Row | None) -> Check:
    text = f"{op}: p50 <= {PING_TIMES:g} PING p50s (same turns)"
    if row is None or ping is None or row.p50_us is None or ping.p50_us is None:
        return Check(text, None, "not measured")
    times = row.p50_us / ping.p50_us
    measured = f"{times:.2f} PINGs ({row.p50_us:,.0f} vs {ping.p50_us:,.1f} µs)"
    return Check(text, times <= PING_TIMES, measured)


def _redis(op: str, row: Row | None, legacy: Row | None, name: str, what: str) -> Check:
    text = f"{op}: Redis {what} per pass <= {REDIS_US:g} µs"
    value, old = _pp(row, name), _pp(legacy, name)
    if value is None:
        return Check(text, None, "not measured")
    measured = f"{value:.0f} µs"
    if old:
        measured += f"; legacy {old:.0f} µs, so {value / old:.2f}x"
    return Check(text, value <= REDIS_US, measured)


def _client_cpu(op: str, row: Row | None, pings: dict[int, Row | None]) -> Check:
    text = f"{op}: client CPU per pass <= {CLIENT_CPU:g}x that of its round trips as PINGs"
    n = round(_pp(row, "rtt_wire") or 0)  # as many PINGs as the pass's round trips
    cpu, floor = _pp(row, "client_cpu_us"), _pp(pings.get(n), "client_cpu_us")
    if cpu is None or not floor:
        return Check(text, None, f"not measured (no row of {n} PINGs)")
    measured = f"{cpu / floor:.2f}x ({cpu:.0f} vs {floor:.0f} µs of {n} PINGs)"
    return Check(text, cpu / floor <= CLIENT_CPU, measured)


def _history(on: Row | None, off: Row | None) -> Check:
    text = f"history's cost: Redis commandstats with history / without <= {HISTORY:.2f}x"
    with_it, without = _pp(on, "cmdstat_us"), _pp(off, "cmdstat_us")
    if not with_it or not without:
        return Check(text, None, "not measured")
    ratio = with_it / without
    measured = f"{ratio:.2f}x ({with_it:.0f} vs {without:.0f} µs)"
    cpu_on, cpu_off = _pp(on, "cpu_us"), _pp(off, "cpu_us")
    if cpu_on and cpu_off:
        measured += f"; server CPU {cpu_on / cpu_off:.2f}x ({cpu_on:.0f} vs {cpu_off:.0f} µs)"
    return Check(text, ratio <= HISTORY, measured)


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    by_op = {r.operation: r for r in rows if r.section == "fastpath"}
    legacy = by_op.get(LEGACY)
    pings = {n: by_op.get(name) for n, name in PINGS.items()}
    passes = [(STEP, RTT_STEP), (IN_REPORT, RTT_IN_REPORT)]
    out = [_round_trips(op, by_op.get(op), limit, legacy) for op, limit in passes]
    out += [_in_pings(op, by_op.get(op), pings[1]) for op, _ in passes]
    for name, what in (("cmdstat_us", "commandstats"), ("cpu_us", "server CPU")):
        out += [_unshared(bench, _redis(op, by_op.get(op), legacy, name, what)) for op, _ in passes]
    out += [_client_cpu(op, by_op.get(op), pings) for op, _ in passes]
    out.append(_unshared(bench, _history(by_op.get(STEP), by_op.get(NO_HISTORY))))
    return out


SCENARIO = Scenario(
    "fastpath",
    order=(STEP, IN_REPORT, NO_HISTORY, LEGACY, *PINGS.values()),
    measure=measure,
    checks=checks,
    title="Fast path, a 2-rank pass (issue 10)",
    trees=("legacy",),
)
