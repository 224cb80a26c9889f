"""The fast-path pass with 100, then 10,000 requests in flight on one Redis; memory per request.

"In flight" means created and run part way, as a conductor holds them: each request is
the simulation's "tts" shape (``shapes.pass_request``) after ``WARM_PASSES`` passes of its
LLM partition (both ranks' reports with their KV shards, then the step: batched 64
requests at a time), so it holds its history stream, lease hash, recovery hint and
published KV as a live one does. Redis memory per request is ``INFO memory used_memory``
after filling, less before, over the requests added.

Rows, one process, interleaved per size with the reference:

- ``pass (random in flight)``: the fastpath scenario's pass (report, report, take_step) on
  a request drawn at random from those in flight, the pass each is at read once before the
  timed loop. It includes the store's topology cache misses: the cache holds the default
  number of requests (16,384; 4,096 before, which left 0.6 more round trips per pass at
  10,000 in flight), warmed with as many before the timed loop; the row's notes give the
  round trips per pass (the store's effects, counted in the timed loop);
- ``pass (one request)``: the same on one more request, the others held;
- ``bare PING``: the reference; the number of requests held cannot change it, so its drift
  between the sizes is the machine's, and the flatness checks divide it out.

Targets: p50 and p99 of the random pass at 10,000 within 1.25x of those at 100
(``--flat-tolerance``), and memory per request <= 12,000 B.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import redis

from benchmarks.harness import Bench, Check, Op, Row, Scenario, Spec, Worker
from benchmarks.scenarios import baseline
from benchmarks.scenarios.batch import BATCH, Passes
from benchmarks.scenarios.fastpath import current_pass
from benchmarks.shapes import HOT, PASS_PAGES, pass_request
from benchmarks.wire import tap_effects
from store import RequestStore
from store.ops.settings import DEFAULT_TOPOLOGY_CACHE_SIZE

MODULE = __name__
SIZES = (100, 10_000)
WARM_PASSES = 4
RANDOM = "pass (random in flight)"
HOT_PASS = "pass (one request)"
REFERENCE = "bare PING"
MEMORY_LIMIT = 12_000  # bytes per request in flight
CACHE = DEFAULT_TOPOLOGY_CACHE_SIZE  # requests whose topology the store remembers


def held_ids(prefix: str, start: int, stop: int) -> list[str]:
    return [f"{prefix}-held-{i}" for i in range(start, stop)]


def _passes_at(store: Any, client: Any, rids: list[str]) -> dict[str, int]:
    """The pass each request's LLM partition is at, read in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.hget(store.keys.partition(rid, HOT), "fwd_pass_number")
    return {rid: int(p) for rid, p in zip(rids, pipe.execute(), strict=True)}


def _pass_row(w: Worker) -> Op:
    case = w.case
    rids = [f"{case.rid}-hot"] if case.target == "hot" else held_ids(case.rid, 0, case.held)
    w.client = redis.Redis.from_url(case.url)
    store = w.store = RequestStore(w.client, namespace=case.namespace)
    at = _passes_at(store, w.client, rids)
    rng = random.Random(w.index)
    for rid in rng.sample(rids, min(len(rids), CACHE)):
        store.load_record(rid)  # the topology cache as full as it stays in a long run
    run = current_pass(then_step=False)
    tap = tap_effects(store, keep=False)
    counted = [0]

    def op(k: int) -> str | None:
        rid = rids[rng.randrange(len(rids))]
        p = at[rid]
        outcome = run(store, rid, p)
        at[rid] = p + 1 if outcome is None else store.load_partition(rid, HOT).fwd_pass_number
        if tap is not None:
            w.counters["round_trips"] += tap.trips - counted[0]
            counted[0] = tap.trips
        return outcome

    return op


OPS = {RANDOM: _pass_row, HOT_PASS: _pass_row}


def _used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def fill(store: Any, rids: list[str]) -> None:
    """Requests ``rids``: created, then ``WARM_PASSES`` passes each."""
    shape, passes = pass_request(), Passes(batched=True)
    for rid in rids:
        shape.create(store, rid)
    unused: Counter[str] = Counter()
    for first in range(0, len(rids), BATCH):
        chunk = rids[first : first + BATCH]
        for p in range(WARM_PASSES):
            failed = passes.run(store, chunk, p, unused)
            if failed:
                raise RuntimeError(f"filling the requests in flight: {failed}")


def measure(bench: Bench) -> None:
    bench.log(f"inflight (the pass at {' and '.join(f'{n:,}' for n in SIZES)} in flight)")
    ns = bench.namespace()
    store = bench.store(ns)
    prefix = "inflight"
    duration = 0.5 if bench.quick else 1.0
    held = 0
    try:
        fill(store, [f"{prefix}-hot"])  # the one request of the hot rows, not counted
        before = _used_memory(bench.client)
        for size in SIZES:
            started = time.perf_counter()
            fill(store, held_ids(prefix, held, size))
            after = _used_memory(bench.client)
            per = (after - before) / size
            bench.memory[f"inflight {size}"] = {
                "requests": size,
                "bytes_per_request": per,
                "measured_over": size,
                "shape": f"in flight: tts request after {WARM_PASSES} passes, 2 ranks x "
                f"{PASS_PAGES} KV pages",
            }
            bench.log(
                f"  {size:,} in flight (filled in {time.perf_counter() - started:.1f} s, "
                f"{per:,.0f} B each)"
            )
            held = size
            specs = [
                Spec("inflight", MODULE, RANDOM, 1, "random"),
                Spec("inflight", MODULE, HOT_PASS, 1, "hot"),
                Spec("inflight", baseline.MODULE, REFERENCE, 1, "hot"),
            ]
            rows = bench.measure_group(
                specs, rounds=4, namespace=ns, rid=prefix, held=size, duration=duration
            )
            for row in rows:
                row.target = f"{row.target} @{size:,}"
                row.details["held"] = size
                trips = row.details.get("counters", {}).get("round_trips")
                if trips:
                    per_pass = trips / row.details["calls"]
                    row.details["rtt_per_pass"] = per_pass
                    row.note(f"{per_pass:.2f} RTT/pass")
                if size != SIZES[0]:
                    row.baseline = f"{row.operation}|1|{row.target.split(' @')[0]} @{SIZES[0]:,}"
    finally:
        bench.cleanup(ns)


def _flat(
    rows: list[Row], op: str, what: str, tolerance: float, info: bool = False
) -> Check | None:
    by_size = {r.details["held"]: r for r in rows if r.operation == op}
    reference = {r.details["held"]: r for r in rows if r.operation == REFERENCE}
    lo, hi = SIZES[0], SIZES[-1]
    if not all(n in d for d in (by_size, reference) for n in (lo, hi)):
        return None
    raw = getattr(by_size[hi], what) / getattr(by_size[lo], what)
    drift = reference[hi].p50_us / reference[lo].p50_us  # type: ignore[operator]
    ratio = raw / drift
    name = what.removesuffix("_us")
    return Check(
        f"{op}: {name} flat from {lo:,} to {hi:,} in flight (within {tolerance:.2f}x, the "
        "PING reference's drift divided out)",
        None if info else ratio <= tolerance,
        f"{ratio:.2f}x (raw {raw:.2f}x: {getattr(by_size[lo], what):,.0f} to "
        f"{getattr(by_size[hi], what):,.0f} µs; reference drift {drift:.2f}x)",
        info=info,
    )


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    tolerance = bench.options.get("flat_tolerance", 1.25)
    mine = [r for r in rows if r.section == "inflight"]
    out = [
        c
        for c in (
            _flat(mine, RANDOM, "p50_us", tolerance),
            _flat(mine, RANDOM, "p99_us", tolerance),
            _flat(mine, HOT_PASS, "p50_us", tolerance, info=True),
        )
        if c is not None
    ]
    held = bench.memory.get(f"inflight {SIZES[-1]}")
    text = f"Redis memory per request in flight <= {MEMORY_LIMIT:,} B"
    if held is None:
        out.append(Check(text, None, "not measured"))
    else:
        per = held["bytes_per_request"]
        measured = f"{per:,.0f} B at {held['requests']:,}"
        if not bench.own_server:
            measured += " (shared server: others' writes count too)"
        out.append(Check(text, per <= MEMORY_LIMIT, measured))
    return out


SCENARIO = Scenario(
    "inflight",
    order=(RANDOM, HOT_PASS, REFERENCE),
    measure=measure,
    checks=checks,
    title="Requests in flight (issue 10)",
)
