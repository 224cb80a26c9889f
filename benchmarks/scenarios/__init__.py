"""The benchmark's scenarios, one module each, in the order they run and are shown.

A scenario module declares ``SCENARIO`` (a ``benchmarks.harness.Scenario``: its rows for the
shared interleaved table and/or its own measurement, and its checks) and ``OPS`` (the
operations its worker processes run, by name). Adding one: write the module, add its name
here. Nothing is imported until asked for: a spawned worker imports this package before it
may set its ``sys.path`` (benchmarks.harness).
"""

from __future__ import annotations

import importlib

from benchmarks.harness import Scenario

MODULES = (
    "baseline",
    "store_ops",
    "legacy",
    "codec",
    "aio",
    "fastpath",
    "batch",
    "runtime",
    "otel",
    "inflight",
    "scale",  # last: it leaves up to 100,000 requests to free
)


def load() -> list[Scenario]:
    return [importlib.import_module(f"{__name__}.{name}").SCENARIO for name in MODULES]
