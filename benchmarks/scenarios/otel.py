"""What OpenTelemetry costs a store call, end to end (issue 12).

The same report (``record_worker_report`` of a rank > 0, no published info: the store rows'
report) in three processes that differ only in what OpenTelemetry they see, each a pool of
its own whose ``prelude`` runs before anything imports the store:

- ``no OpenTelemetry API``: ``sys.modules["opentelemetry"] = None`` (and its submodules), so
  ``store.observe`` finds no API, as without the ``otel`` extra;
- ``API, no provider``: the API importable, no provider set (the API's proxies);
- ``SDK, in-memory``: an SDK tracer provider exporting every span to an in-memory exporter
  through a ``SimpleSpanProcessor`` (the export is in the timing), and a meter provider with
  an in-memory reader; the exporter is emptied every 1,024 calls.

The three processes are pinned to one CPU, so that none of them sits on the other core
than the others (where a round trip on this machine takes a different time, see
benchmarks/README.md), and run in alternating turns. The check compares the fastest turns,
as the legacy check does; ``benchmarks/observe_overhead.py`` measures the per-call cost of
the instruments alone. Target: API without provider within 1.03x of no API.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from benchmarks.harness import (
    Bench,
    Case,
    Check,
    Op,
    Pool,
    Row,
    Scenario,
    Spec,
    Verify,
    Worker,
    fastest_ratio,
)

MODULE = __name__
NO_API = "record_worker_report, no OpenTelemetry API"
API = "record_worker_report, API, no provider"
SDK = "record_worker_report, SDK, in-memory"
TREES = {NO_API: "otel-none", API: "otel-api", SDK: "otel-sdk"}
LIMIT = 1.03
CLEAR_EVERY = 1024

_exporter: Any = None  # the SDK case's span exporter


def _pin() -> None:
    """Onto the highest CPU this process may use (the same for the three pools)."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


def hide_api() -> None:
    """The prelude of ``no OpenTelemetry API``."""
    # A None entry makes `import opentelemetry...` raise ImportError, as if not installed
    # (redis-py may have imported it already: the store's own import is what counts).
    for name in [m for m in sys.modules if m.split(".")[0] == "opentelemetry"] + ["opentelemetry"]:
        sys.modules[name] = None  # type: ignore[assignment]
    _pin()


def api_only() -> None:
    """The prelude of ``API, no provider``."""
    _pin()


def sdk_in_memory() -> None:
    """The prelude of ``SDK, in-memory``."""
    global _exporter
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    _pin()


PRELUDES = {NO_API: hide_api, API: api_only, SDK: sdk_in_memory}


def _report(w: Worker) -> Op:
    from benchmarks.scenarios import store_ops  # imports the store: after the prelude
    from store import observe

    op = store_ops.report(w)
    w.info["have_otel"] = observe.HAVE_OTEL
    w.info["cpus"] = sorted(os.sched_getaffinity(0))
    if _exporter is None:
        return op
    w.info["spans"] = 0
    calls = [0]

    def traced(k: int) -> str | None:
        outcome = op(k)
        calls[0] += 1
        if calls[0] % CLEAR_EVERY == 0:  # rarely: the export list stays short
            w.info["spans"] += len(_exporter.get_finished_spans())
            _exporter.clear()
        return outcome

    return traced


OPS = dict.fromkeys(TREES, _report)


def prepare(bench: Bench, case: Case) -> Verify | None:
    from benchmarks.scenarios import store_ops

    return store_ops.prepare(bench, case)


def measure(bench: Bench) -> None:
    bench.log("otel (the same report in 3 pools: no API, API without provider, SDK)")
    try:
        for op, tree in TREES.items():
            bench.pools[tree] = Pool(1, prelude=f"{MODULE}:{PRELUDES[op].__name__}")
        head = f"{NO_API}|1|one"
        specs = [
            Spec("otel", MODULE, op, 1, "one", "", prepare, tree=tree,
                 beside="" if op == NO_API else head)
            for op, tree in TREES.items()
        ]  # fmt: skip
        for row in bench.measure_group(specs, rounds=bench.rounds):
            info = row.details.get("info", {})
            row.note(f"API importable: {info.get('have_otel')}; CPUs {info.get('cpus')}")
            if "spans" in info:
                row.note(f"{info['spans']:,} spans exported (counted every {CLEAR_EVERY:,})")
            if row.operation != NO_API:
                row.baseline = head
    finally:
        for tree in TREES.values():
            pool = bench.pools.pop(tree, None)
            if pool is not None:
                pool.close()


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    by_op = {r.operation: r for r in rows if r.section == "otel"}
    none, api, sdk = (by_op.get(op) for op in (NO_API, API, SDK))
    text = f"report p50 with the API and no provider <= {LIMIT:.2f}x without the API"
    if none is None or api is None:
        return [Check(text, None, "not measured")]
    imported = [r.details.get("info", {}).get("have_otel") for r in (none, api)]
    if imported != [False, True]:
        return [Check(text, False, f"the pools did not see what they should: {imported}")]
    out = [_compare(text, api, none, LIMIT)]
    if sdk is not None:
        out.append(_compare("report p50 with an SDK and in-memory export", sdk, none, None))
    return out


def _compare(text: str, row: Row, base: Row, limit: float | None) -> Check:
    ratio, fast, fast_base = fastest_ratio(row, base)
    whole = row.p50_us / base.p50_us  # type: ignore[operator]
    measured = (
        f"{ratio:.3f}x in the fastest turns ({fast:,.1f} vs {fast_base:,.1f} µs, "
        f"{fast - fast_base:+,.1f} µs); whole rows {whole:.3f}x "
        f"({row.p50_us:,.1f} vs {base.p50_us:,.1f} µs)"
    )
    if limit is None:
        return Check(text, None, measured, info=True)
    return Check(text, ratio <= limit, measured)


SCENARIO = Scenario(
    "otel",
    measure=measure,
    checks=checks,
    title="OpenTelemetry, per store call (issue 12)",
)
