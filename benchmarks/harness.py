"""The parent side of the harness: rows, interleaved slices, the reference across the run.

``Bench.measure_group`` runs a group of rows in interleaved slices over the pool
(benchmarks.workers), with a slice of the bare PING reference in every round, so the
reference spans the whole run; ``summarize`` turns the samples into a ``Row``; a scenario
declares its rows as ``Spec``s and itself as a ``Scenario``. The worker-side names a
scenario needs are re-exported here, so a scenario imports from one place.

Imports nothing of the project at module level (see benchmarks.workers).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks.workers import (
    AsyncDriver,
    Case,
    Driver,
    Factory,
    LoopDriver,
    Op,
    Pool,
    Samples,
    Worker,
)

__all__ = [
    "REFERENCE_KEY",
    "AsyncDriver",
    "Bench",
    "Case",
    "Check",
    "Driver",
    "Factory",
    "LoopDriver",
    "Op",
    "Pool",
    "Row",
    "Samples",
    "Scenario",
    "Spec",
    "Verify",
    "Worker",
    "fastest_ratio",
    "figure",
    "ratio_check",
    "summarize",
]

REFERENCE_MODULE = "benchmarks.scenarios.baseline"
REFERENCE_OP = "bare PING"
REFERENCE_KEY = f"{REFERENCE_OP}|1|one"


@dataclass
class Row:
    section: str
    operation: str
    procs: int | None
    target: str
    ops_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    max_us: float | None = None
    retries_per_commit: float | None = None
    baseline: str = ""  # shown: the row compared with; before add_ratios, that row's key
    ratio_ops: float | None = None
    ratio_p50: float | None = None
    ratio_ops_unit: str = ""  # "B" when ratio_ops compares bytes (the codec rows)
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.operation}|{self.procs}|{self.target}"

    @property
    def label(self) -> str:
        procs = f" {self.procs}p" if self.procs is not None else ""
        return f"{self.operation}{procs} {self.target}"

    def note(self, text: str) -> None:
        self.notes = "; ".join(filter(None, [self.notes, text]))


def percentile(ordered: Sequence[int], q: float) -> int:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summarize(section: str, case: Case, results: list[dict[str, Any]]) -> Row:
    samples: array[int] = array("q")
    per_slice: dict[int, array[int]] = {}
    outcomes: Counter[str] = Counter()
    counters: Counter[str] = Counter()
    for r in results:
        samples.frombytes(r["latencies"])
        per_slice.setdefault(r.get("slice", 0), array("q")).frombytes(r["latencies"])
        outcomes.update(r["outcomes"])
        counters.update(r["counters"])
    calls = len(samples)
    if not calls:
        raise RuntimeError(f"{case.op} ({case.procs} procs, {case.target}): no call completed")
    failed = sum(outcomes.values())
    committed = calls - failed
    per_process: dict[int, list[float]] = {}  # pool index -> [calls, seconds], over slices
    for r in results:
        calls_and_time = per_process.setdefault(r["index"], [0, 0.0])
        calls_and_time[0] += len(r["latencies"]) // 8
        calls_and_time[1] += r["elapsed"]
    rate = sum(n / t for n, t in per_process.values()) * committed / calls
    ordered = sorted(samples)
    row = Row(
        section,
        case.op,
        case.procs,
        case.target,
        ops_per_s=rate,
        p50_us=percentile(ordered, 0.5) / 1e3,
        p99_us=percentile(ordered, 0.99) / 1e3,
        max_us=ordered[-1] / 1e3,
    )
    transactions = sum(r["transactions"] for r in results)
    if transactions:
        row.retries_per_commit = (sum(r["attempts"] for r in results) - transactions) / transactions
    elif "commits" in counters:
        row.retries_per_commit = counters["retries"] / max(1, counters["commits"])
    row.details = {
        "calls": calls,
        "committed": committed,
        "outcomes": dict(outcomes),
        "slice_p50_us": [percentile(sorted(s), 0.5) / 1e3 for _, s in sorted(per_slice.items())],
        # the client's CPU per call: process time over the timed loops, every process
        "client_cpu_us": sum(r.get("cpu", 0.0) for r in results) / calls * 1e6,
    }
    if counters:
        row.details["counters"] = dict(counters)
    row.notes = "; ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
    return row


Verify = Callable[[Row, Case, list[dict[str, Any]]], None]
Prepare = Callable[["Bench", Case], Verify | None]


@dataclass
class Spec:
    """One row as a scenario declares it, for ``Bench.measure_group``."""

    section: str
    module: str
    op: str
    procs: int
    target: str
    baseline: str = ""  # the key of the row it is compared with, if any
    prepare: Prepare | None = None  # creates what it works on; returns the final check
    requests: int = 1
    tasks: int = 1
    tree: str = ""
    create: bool = False
    name: str = ""  # the row's operation as shown, if not ``op``
    beside: str = ""  # "op|procs|target" of a row to run right after, slice by slice

    @property
    def key(self) -> str:
        return f"{self.op}|{self.procs}|{self.target}"


# A row with partners (``Spec.beside``) runs each of its slices as this many turns, taken in
# alternation with its partners': a machine that switches state every second or two then
# still meets both in the same state, turn by turn.
TURNS = 5


def arrange(specs: list[Spec]) -> list[list[Spec]]:
    """``specs`` in run order, a row and the rows run beside it (if it is in the group)
    together: ``[[row, partner...], [row], ...]``."""
    keys = {s.key for s in specs}
    groups = [[s] for s in specs if s.beside not in keys]
    for spec in specs:
        if spec.beside in keys:
            next(g for g in groups if g[0].key == spec.beside).append(spec)
    return groups


class Bench:
    """One run: the server, the pools, the rows measured so far, the reference across them."""

    def __init__(self, url: str, own_server: bool, quick: bool, pools: dict[str, Pool]) -> None:
        self.url = url
        self.own_server = own_server
        self.quick = quick
        self.duration = 0.7 if quick else 2.0
        self.rounds = 2 if quick else 4
        self.pools = pools
        self.trees: dict[str, dict[str, Any]] = {}  # tree name -> rev, path (set by main)
        self.root = f"mstar-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.client = redis.Redis.from_url(url)
        self.rows: list[Row] = []
        self.memory: dict[str, Any] = {}
        self.skipped: list[str] = []  # what a scenario could not measure, and why
        self.options: dict[str, Any] = {}  # command-line settings scenarios read
        self.reference: Case | None = None
        self.reference_results: list[dict[str, Any]] = []
        self._cases = 0
        self._slices = 0

    def namespace(self) -> str:
        self._cases += 1
        return f"{self.root}:c{self._cases}"

    def store(self, namespace: str) -> Any:
        """A store of the current tree (the parent's), for preparing and checking rows."""
        from store import RequestStore

        return RequestStore.from_url(self.url, namespace=namespace)

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: skipped: {why}")
        self.log(f"{what}: skipped: {why}")

    def cleanup(self, namespace: str) -> None:
        """Delete this run's keys under ``namespace`` (SCAN, never a FLUSH on a foreign server)."""
        batch = []
        for key in self.client.scan_iter(match=f"{namespace}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                self.client.unlink(*batch)
                batch.clear()
        if batch:
            self.client.unlink(*batch)

    def targets(self, case: Case) -> dict[str, list[int]]:
        """Target request -> the pool indexes that worked on it."""
        out: dict[str, list[int]] = {}
        for i in range(case.procs):
            for rid in case.targets_of(i):
                out.setdefault(rid, []).append(i)
        return out

    def set_verified(self, row: Row, ok: bool, what: str) -> None:
        row.details["verified"] = ok
        row.note(f"{what}: {'ok' if ok else 'LOST'}")

    def _run_slice(self, case: Case, results: list[dict[str, Any]]) -> None:
        self._slices += 1
        case.offset = self._slices * 1_000_000
        for result in self.pools[case.tree].run(case):
            result["slice"] = self._slices
            results.append(result)

    def _reference_slice(self, duration: float) -> None:
        if self.reference is None:
            self.reference = Case(
                REFERENCE_MODULE, REFERENCE_OP, 1, "one", self.url, self.namespace(), rid="r"
            )
        self.reference.duration = duration
        self._run_slice(self.reference, self.reference_results)

    def measure_group(
        self,
        specs: list[Spec],
        rounds: int,
        *,
        duration: float | None = None,
        namespace: str | None = None,
        **extra: Any,
    ) -> list[Row]:
        """Measure rows in ``rounds`` interleaved slices, so that a change of load on the
        machine during the run hits every row of the group alike (their ratios stay fair).
        Every round also runs a slice of the bare PING reference; a row with partners runs
        its slice in ``TURNS`` turns alternating with theirs."""
        per_slice = (duration or self.duration) / rounds
        started = time.perf_counter()
        groups = arrange(specs)
        cases: list[tuple[Spec, Case, Verify | None, list[dict[str, Any]]]] = []
        for spec in (spec for group in groups for spec in group):
            case = Case(
                spec.module,
                spec.op,
                spec.procs,
                spec.target,
                self.url,
                namespace or self.namespace(),
                per_slice,
                requests=spec.requests,
                tasks=spec.tasks,
                tree=spec.tree,
                create=spec.create,
                **extra,
            )
            case.rid = case.rid or "r"
            verify = spec.prepare(self, case) if spec.prepare is not None else None
            cases.append((spec, case, verify, []))
        by_spec = {id(spec): (case, results) for spec, case, _, results in cases}
        for _ in range(rounds):
            self._reference_slice(per_slice)
            for group in groups:
                turns = TURNS if len(group) > 1 else 1
                for _ in range(turns):
                    for spec in group:
                        case, results = by_spec[id(spec)]
                        case.duration = per_slice / turns
                        self._run_slice(case, results)
        rows = []
        for spec, case, verify, results in cases:
            row = summarize(spec.section, case, results)
            row.operation = spec.name or spec.op
            row.baseline = spec.baseline
            row.details["store_from"] = sorted({str(r["store_from"]) for r in results})
            for r in results:
                if r["info"]:
                    row.details.setdefault("info", {}).update(r["info"])
            if verify is not None:
                verify(row, case, results)
            if namespace is None:
                self.cleanup(case.namespace)
            self.rows.append(row)
            rows.append(row)
            self.log(
                f"  {row.operation:34} {case.procs:>2} {case.target:8} "
                f"{row.ops_per_s or 0:>9,.0f}/s p50 {row.p50_us or 0:>7.0f} µs "
                f"max {row.max_us or 0:>9,.0f} µs"
            )
        self.log(f"  ({time.perf_counter() - started:.1f} s)")
        return rows

    def finish(self) -> Row | None:
        """The reference's row, from its slices over the whole run (None if it never ran)."""
        if self.reference is None:
            return None
        row = summarize("baseline", self.reference, self.reference_results)
        row.details["slices"] = len(row.details["slice_p50_us"])
        self.cleanup(self.reference.namespace)
        self.rows.append(row)
        return row


@dataclass
class Check:
    """One target of the run, ``met`` or not (None: not measured), with what was measured;
    ``info``: a figure shown beside the targets, with none of its own."""

    target: str
    met: bool | None
    measured: str
    info: bool = False


def fastest_ratio(current: Row, legacy: Row) -> tuple[float, float, float]:
    """current/legacy (or any row over the row it is compared with) of the two rows'
    fastest turn p50s, and those p50s (µs).

    This machine's loopback has two states, by where the scheduler puts the client: on the
    redis-server's core a PING takes 25 µs, on the other one about 100 µs (measured with
    taskset). Both trees meet both states, turn by turn, in no fixed proportion, so the
    whole-row p50s of the same code differed up to 2.5x between runs; the fastest of each
    row's turns (``harness.TURNS`` per slice, each of over a thousand calls) measures both
    in the same state, as the codec rows take their fastest batch.
    """
    fast_current = min(current.details["slice_p50_us"])
    fast_legacy = min(legacy.details["slice_p50_us"])
    return fast_current / fast_legacy, fast_current, fast_legacy


def figure(row: Row | None, name: str) -> float | None:
    """A row's attribute or detail ``name``; None when the row was not run."""
    if row is None:
        return None
    value = getattr(row, name) if hasattr(row, name) else row.details.get(name)
    return None if value is None else float(value)


def ratio_check(
    text: str, a: float | None, b: float | None, limit: float, le: bool, unit: str = ""
) -> Check:
    """``a / b`` against ``limit`` (``le``: at most, else at least)."""
    if a is None or b is None:
        return Check(text, None, "not measured")
    r = a / b
    measured = f"{r:.3f}x ({a:,.0f} vs {b:,.0f} {unit})" if unit else f"{r:.2f}x"
    return Check(text, r <= limit if le else r >= limit, measured)


@dataclass
class Scenario:
    """What a scenario module declares (as ``SCENARIO``); see benchmarks/scenarios/."""

    name: str  # the ``--only`` name and the table section
    order: Sequence[str] = ()  # operations in table order; "op (variant)" sorts beside "op"
    table: Callable[[Bench], list[Spec]] | None = None  # rows of the shared interleaved table
    measure: Callable[[Bench], None] | None = None  # rows measured on their own, after it
    checks: Callable[[list[Row], Bench], list[Check]] | None = None
    title: str | Callable[[Bench], str] = "Targets (issue 5)"  # heading of its checks
    trees: Sequence[str] = ()  # other trees its rows run on ("legacy": a --legacy worktree)
