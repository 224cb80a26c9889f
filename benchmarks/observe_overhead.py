"""What ``store.observe`` costs per call, without the API, with it and no provider, and with an SDK.

    python -m benchmarks.observe_overhead [--calls N] [--repeats R]

Each case runs in a fresh interpreter (the API's global providers can be set only once, and
"without the API" hides the ``opentelemetry`` package from imports). In each, one run times,
interleaved and best of ``--repeats``:

- a bare loop (``for _ in range(n): pass``),
- ``with instruments.operation("record_worker_report", rid): pass``,
- ``instruments.count("duplicates")``,

and prints nanoseconds per call, the ratio against the bare loop of the same run, and the
overhead (call minus bare loop) as a share of a 90 us report (the report p50 on loopback):
the issue's target is a report p50 within 1.03x with the API and no provider.

The SDK case sets an SDK tracer provider exporting to an in-memory span exporter (through a
SimpleSpanProcessor, so the export is in the timing) and a meter provider with an in-memory
metric reader; spans are cleared between repeats, outside the timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

CASES = ("no API", "API, no provider", "SDK, in-memory")
REPORT_P50_NS = 90_000


def _hide_opentelemetry() -> None:
    # A None entry makes `import opentelemetry...` raise ImportError, as if not installed.
    for name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.metrics"):
        sys.modules[name] = None  # type: ignore[assignment]


def _set_sdk_providers() -> Callable[[], None]:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    return exporter.clear


def _time(loop: Callable[[int], None], calls: int) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        loop(calls)
        return (time.perf_counter_ns() - start) / calls
    finally:
        gc.enable()


def child(case: str, calls: int, repeats: int) -> dict[str, Any]:
    clear: Callable[[], None] = lambda: None  # noqa: E731
    if case == "no API":
        _hide_opentelemetry()
    elif case == "SDK, in-memory":
        clear = _set_sdk_providers()
    from store.observe import HAVE_OTEL, Instruments

    instruments = Instruments("bench")
    instruments.refresh()

    def bare(n: int) -> None:
        for _ in range(n):
            pass

    def operation(n: int) -> None:
        op = instruments.operation
        for _ in range(n):
            with op("record_worker_report", "req-1"):
                pass

    def count(n: int) -> None:
        add = instruments.count
        for _ in range(n):
            add("duplicates")

    loops = {"bare loop": bare, "operation": operation, "count": count}
    best = dict.fromkeys(loops, float("inf"))
    operation(min(calls, 1000))  # warm up: attribute dicts, first spans
    for _ in range(repeats):
        for name, loop in loops.items():
            best[name] = min(best[name], _time(loop, calls))
            clear()
    return {"case": case, "have_otel": HAVE_OTEL, "ns": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per row (best)")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        calls = min(args.calls, 20_000) if args.child == "SDK, in-memory" else args.calls
        print(json.dumps(child(args.child, calls, args.repeats)))
        return
    print(f"{'case':<18} {'row':<10} {'ns/call':>9} {'x bare':>8} {'overhead':>10} {'of 90 us':>9}")
    for case in CASES:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.observe_overhead", "--child", case,
             "--calls", str(args.calls), "--repeats", str(args.repeats)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        result = json.loads(out)
        if case != "no API" and not result["have_otel"]:
            print(f"{case:<18} skipped: opentelemetry-api is not installed")
            continue
        ns = result["ns"]
        bare = ns["bare loop"]
        for row, value in ns.items():
            overhead = value - bare
            print(
                f"{case:<18} {row:<10} {value:>9.1f} {value / bare:>7.1f}x "
                f"{overhead:>8.1f}ns {overhead / REPORT_P50_NS:>8.3%}"
            )


if __name__ == "__main__":
    main()
