"""Latency against the number of requests held (1, 1,000, then 10,000 or 100,000), and Redis
memory per held request.

``hot`` rows work on one request while the others are held; ``random`` rows draw a held
request per call, so they include the store's topology cache misses. The bare HSET row of
each size is the reference: the number of requests held cannot change it, so its drift from
one size to the next is the machine's, and the flatness check divides it out.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from benchmarks.harness import Bench, Check, Factory, Op, Row, Scenario, Spec, Worker
from benchmarks.scenarios import baseline, store_ops
from benchmarks.shapes import RANKS, RequestShape, request_shape

MODULE = __name__
MERGE, REPORT = "scale merge_publish_info", "scale record_worker_report"


def _random_held(make: Callable[[Worker], Op]) -> Factory:
    """The same operation, each call on a request drawn at random from those held."""

    def build(w: Worker) -> Op:
        store_ops.connect(w, warm=False)  # one store for all: its cache misses are measured
        rng = random.Random(w.index)
        ops: dict[str, tuple[Worker, Op]] = {}

        def op(k: int) -> str | None:
            rid = f"{w.case.rid}-held-{rng.randrange(w.case.held)}"
            held = ops.get(rid)
            if held is None:
                inner = replace(w, case=replace(w.case, rid=rid, target="one"))
                held = ops[rid] = (inner, make(inner))
            held[0].case.offset = w.case.offset  # this slice's, not the first one's
            return held[1](k)

        return op

    return build


OPS: dict[str, Factory] = {
    MERGE: store_ops.merge,
    REPORT: store_ops.report,
    "scale merge (random held)": _random_held(store_ops.merge),
    "scale report (random held)": _random_held(store_ops.report),
}


def bulk_create(store: Any, shape: RequestShape, prefix: str, start: int, stop: int) -> None:
    """Create requests ``<prefix>-<i>`` for i in [start, stop) quickly: the store's own create
    script, pipelined 500 at a time, with the fields of the identical states encoded once.

    Uses the store's internals (its layouts) because a pipeline of the public
    ``create_request`` is not offered; if they change, this falls back to one call per request.
    """
    try:
        from store import RequestRecord, scripts

        script = store.client.register_script(scripts.source("create_request"))
        record_layout, part_layout = store._record, store._partition
        conn_layout, encode_infos = store._connection, store._encode_infos
    except (AttributeError, KeyError, ImportError, FileNotFoundError):
        for i in range(start, stop):
            shape.create(store, f"{prefix}-{i}")
        return
    keys = store.keys
    fixed: list[tuple[Callable[[str], str], dict[str, bytes]]] = []
    for name, state in shape.partitions.items():
        fixed.append((_key_of(keys.partition, name), part_layout.encode(state)))
        infos = encode_infos("bulk", "bulk", state.resource_publish_info)
        fixed.append((_key_of(keys.publish_info, name), infos))
    for name, conn in shape.connections.items():
        fixed.append((_key_of(keys.connection, name), conn_layout.encode(conn)))
    tail: list[Any] = []
    for _, fields in fixed:
        tail.append(len(fields))
        for k, v in fields.items():
            tail += [k, v]
    pipe = store.client.pipeline(transaction=False)
    now = time.time()
    for i in range(start, stop):
        rid = f"{prefix}-{i}"
        record = RequestRecord(
            request_id=rid,
            max_output_tokens=shape.max_output_tokens,
            seed=shape.seed,
            partitions=list(shape.partitions),
            connections=list(shape.connections),
            partition_definitions=shape.partition_definitions,
            resource_configs=shape.resource_configs,
            created_at=now,
        )
        meta = record_layout.encode(record)
        args: list[Any] = [uuid.uuid4().hex, len(meta)]
        for k, v in meta.items():
            args += [k, v]
        pipe.zadd(keys.index, {rid: now}, nx=True)
        script(
            keys=[keys.meta(rid), *(key(rid) for key, _ in fixed)], args=args + tail, client=pipe
        )
        if (i - start) % 500 == 499:
            pipe.execute()
    pipe.execute()


def _key_of(make: Callable[[str, str], str], name: str) -> Callable[[str], str]:
    return lambda rid: make(rid, name)


def _used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def _hold(bench: Bench, store: Any, shape: RequestShape, held: int, size: int) -> None:
    """Create requests until ``size`` are held; record Redis memory per request created."""
    started = time.perf_counter()
    before = _used_memory(bench.client)
    bulk_create(store, shape, "hot-held", held, size - 1)
    created = size - 1 - held
    per = (_used_memory(bench.client) - before) / created
    bench.log(
        f"  held {size:,} requests (created {created:,} in "
        f"{time.perf_counter() - started:.1f} s, {per:,.0f} B each)"
    )
    bench.memory[str(size)] = {
        "requests": size,
        "bytes_per_request": per,
        "measured_over": created,
        "shape": f"2 partitions, 1 connection, KV of {RANKS} ranks",
    }
    sample = store.load_request(f"hot-held-{size - 2}")
    assert sample.partitions == shape.partitions, "bulk create differs from create"


def measure(bench: Bench) -> None:
    held_max = 10_000 if bench.quick else 100_000
    bench.log(f"scale (up to {held_max:,} requests held)")
    ns = bench.namespace()
    store = bench.store(ns)
    shape = request_shape(with_kv=True)
    shape.create(store, "hot")
    duration = 0.5 if bench.quick else 1.0
    held = 0
    for size in (1, 1000, held_max):
        if size > 1:
            _hold(bench, store, shape, held, size)
            held = size - 1
        specs = [
            Spec("scale", MODULE, MERGE, 1, "hot"),
            Spec("scale", MODULE, REPORT, 1, "hot"),
            Spec("scale", baseline.MODULE, "bare HSET", 1, "hot"),
        ]
        if held:
            specs.append(Spec("scale", MODULE, "scale merge (random held)", 1, "random"))
            specs.append(Spec("scale", MODULE, "scale report (random held)", 1, "random"))
        rows = bench.measure_group(
            specs, rounds=4, namespace=ns, rid="hot", held=held, duration=duration
        )
        for row in rows:
            row.target = f"{row.target} @{size:,}"
            row.details["held"] = size
            base = row.operation if row.operation == "bare HSET" else _hot(row.operation)
            row.baseline = f"{base}|1|hot @1"
    if bench.own_server:
        # Freed in the background: a blocking FLUSHALL of 100,000 requests outlasts
        # redis-py's default 5 s socket timeout, and nothing is measured after this.
        bench.client.flushall(asynchronous=True)
    else:
        bench.cleanup(ns)


def _hot(operation: str) -> str:
    return MERGE if "merge" in operation else REPORT


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    tolerance = bench.options.get("flat_tolerance", 1.25)
    scale = [r for r in rows if r.section == "scale"]
    sizes = sorted({r.details.get("held", 0) for r in scale})
    reference = {r.details["held"]: r.p50_us for r in scale if r.operation == "bare HSET"}
    out = []
    for op in (MERGE, REPORT):
        by_size = {r.details["held"]: r for r in scale if r.operation == op}
        if len(sizes) < 2 or not by_size:
            continue
        lo, hi = sizes[0], sizes[-1]
        raw = by_size[hi].p50_us / by_size[lo].p50_us  # type: ignore[operator]
        drift = reference[hi] / reference[lo]  # type: ignore[operator]
        out.append(
            Check(
                f"{op.split()[1]} p50 flat from {lo:,} to {hi:,} requests held (within "
                f"{tolerance:.2f}x, after dividing out the bare HSET reference's drift)",
                raw / drift <= tolerance,
                f"{raw / drift:.2f}x (raw {raw:.2f}x, reference drift {drift:.2f}x)",
            )
        )
    return out


SCENARIO = Scenario("scale", measure=measure, checks=checks)
