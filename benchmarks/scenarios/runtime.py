"""The async runtime at saturation: 256 requests in flight through one ``AsyncReplica``.

One process, one asyncio loop, one ``AsyncReplica`` on an ``AsyncRequestStore``; 256
requests of the simulation's "tts" shape (``shapes.pass_request``), each driven pass after
pass through its LLM partition (2 ranks, each publishing its KV shard). The planner knows
the next step ahead (``predict_step``), as a decode loop does, and dispatches nowhere: the
workers' reports are made up at once, so the figures are the runtime's and Redis's alone.

- ``runtime: apply_report each``: 256 tasks, one per request, each applying its rank-0
  report, then its rank-1 report (which completes the pass and takes the step in the same
  call), one ``apply_report`` each;
- ``runtime: apply_reports of 64``: 4 tasks of 64 requests each, each applying its 64
  rank-0 reports in one ``apply_reports``, then its 64 rank-1 reports in another (whose
  won steps the runtime takes, batched).

Figures per row: passes/s; Redis CPU per pass and its share of one core over the timed
slices (``INFO cpu``, benchmarks.server: the server is saturated when the share nears 1,
or the client is the bottleneck when it does not); the client's CPU per pass; pass
latency (p50/p99/max of a task's whole pass: its own requests' passes for the batched
row). No target: issue 10 asks for the figures.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis

from benchmarks.harness import AsyncDriver, Bench, Case, Check, Row, Scenario, Spec, Worker
from benchmarks.scenarios.batch import reports_of
from benchmarks.server import ServerStats
from benchmarks.shapes import HOT, PASS_RANKS, PASS_WG, metadata, pass_request, rank_kv

MODULE = __name__
IN_FLIGHT = 256
BATCH = 64
EACH = "runtime: apply_report each"
BATCHED = f"runtime: apply_reports of {BATCH}"
TARGET = f"{IN_FLIGHT} in flight"
REPLICA = "bench-runtime"


def _planner() -> Any:
    from store import Step
    from store.runtime import Planner

    step = Step(metadata(), (PASS_WG,))

    class DecodeForever(Planner):
        """Every pass is followed by the same decode pass, known ahead."""

        def next_step(self, request_id: str, partition: str, state: Any) -> Any:
            return step

        def predict_step(self, report: Any) -> Any:
            return step

        def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Any) -> None:
            return None

    return DecodeForever()


def _driver(w: Worker, per_task: int) -> ServerStats:
    from store import AsyncRequestStore, StoreError
    from store.runtime import AsyncReplica, ReportStatus

    case = w.case
    rids = case.targets_of(w.index)
    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(case.url)
    store = AsyncRequestStore(client, namespace=case.namespace)
    replica = AsyncReplica(store, planner=_planner(), replica_id=REPLICA)
    kv = [rank_kv(rank) for rank in range(PASS_RANKS)]
    groups = [rids[i : i + per_task] for i in range(0, len(rids), per_task)]
    at = [0] * len(groups)

    async def call(j: int, k: int) -> str | None:
        group, p = groups[j], at[j]
        results: list[Any] = []
        for rank in range(PASS_RANKS):
            reports = reports_of(group, p, rank, kv[rank])
            if per_task == 1:
                results.append(await replica.apply_report(reports[0]))
            else:
                results.extend(await replica.apply_reports(reports))
        failed = [r for r in results if isinstance(r, StoreError)]
        if failed:
            return f"failed: {failed[0]}"
        applied = all(r.status is ReportStatus.APPLIED for r in results)
        if not applied or not all(r.drove for r in results[len(group) :]):
            return f"not applied, or no step driven: {results[:2]}"
        at[j] = p + 1
        w.last_step = min(at)
        w.counters["passes"] += len(group)
        return None

    loop.run_until_complete(call(0, 0) if len(groups) == 1 else _warm(call, len(groups)))
    w.client = redis.Redis.from_url(case.url)  # INFO, outside the timing
    driver = AsyncDriver(loop, call, len(groups), [client.aclose, store.aclose])
    return Timed(driver, w.client, w)


class Timed(ServerStats):
    """``ServerStats`` that also adds each slice's wall time to the counters (``elapsed_us``):
    the denominator of Redis's share of a core."""

    def run(self, duration: float, start_at: float) -> Any:
        samples = super().run(duration, start_at)
        self.worker.counters["elapsed_us"] += round(samples[2] * 1e6)
        return samples


async def _warm(call: Any, tasks: int) -> None:
    """One pass of every task, outside the timing: connections open, scripts loaded."""
    outcomes = await asyncio.gather(*(call(j, 0) for j in range(tasks)))
    if any(outcomes):
        raise RuntimeError(f"a warm pass failed: {next(o for o in outcomes if o)}")


OPS = {EACH: lambda w: _driver(w, 1), BATCHED: lambda w: _driver(w, BATCH)}


def prepare(bench: Bench, case: Case) -> Any:
    store, shape = bench.store(case.namespace), pass_request()
    for rid in bench.targets(case):
        shape.create(store, rid)

    def verify(row: Row, c: Case, results: list[dict[str, Any]]) -> None:
        held = [store.load_partition(rid, HOT).fwd_pass_number for rid in bench.targets(c)]
        passes = row.details.get("counters", {}).get("passes", 0)
        ok = sum(held) == passes + len(held)  # + the warm pass
        bench.set_verified(row, ok, f"{IN_FLIGHT} pass counts")

    return verify


def add_figures(row: Row) -> None:
    """Passes/s, Redis CPU per pass and its share of a core, client CPU per pass."""
    counters = row.details.get("counters", {})
    passes, cpu_us = counters.get("passes", 0), counters.get("cpu_us", 0)
    elapsed = counters.get("elapsed_us", 0) / 1e6
    calls = row.details.get("calls", 0)
    row.details["passes_per_s"] = passes / elapsed if elapsed else None
    row.details["redis_cpu_us_per_pass"] = cpu_us / passes if passes else None
    row.details["redis_cpu_share"] = cpu_us / 1e6 / elapsed if elapsed else None
    client_us = row.details.get("client_cpu_us", 0) * calls
    row.details["client_cpu_us_per_pass"] = client_us / passes if passes else None
    row.note(
        f"{row.details['passes_per_s'] or 0:,.0f} passes/s; Redis CPU "
        f"{row.details['redis_cpu_us_per_pass'] or 0:.0f} µs/pass, "
        f"{(row.details['redis_cpu_share'] or 0) * 100:.0f}% of a core; client CPU "
        f"{row.details['client_cpu_us_per_pass'] or 0:.0f} µs/pass"
    )


def measure(bench: Bench) -> None:
    bench.log(f"runtime (AsyncReplica, {IN_FLIGHT} requests in flight, 1 process)")
    specs = [
        Spec("runtime", MODULE, EACH, 1, "distinct", "", prepare, requests=IN_FLIGHT),
        Spec("runtime", MODULE, BATCHED, 1, "distinct", "", prepare, requests=IN_FLIGHT,
             beside=f"{EACH}|1|distinct"),
    ]  # fmt: skip
    for row in bench.measure_group(specs, rounds=bench.rounds):
        row.target = TARGET
        add_figures(row)


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    out = []
    for row in (r for r in rows if r.section == "runtime"):
        d = row.details
        if not d.get("passes_per_s"):
            out.append(Check(f"{row.operation}: passes/s", None, "not measured"))
            continue
        measured = (
            f"{d['passes_per_s']:,.0f} passes/s, Redis CPU {d['redis_cpu_us_per_pass']:.0f} "
            f"µs/pass at {d['redis_cpu_share'] * 100:.0f}% of a core"
        )
        out.append(Check(f"{row.operation} ({TARGET})", None, measured, info=True))
    return out


SCENARIO = Scenario(
    "runtime",
    measure=measure,
    checks=checks,
    title=f"Async runtime, {IN_FLIGHT} requests in flight, 1 process (issue 10)",
)
