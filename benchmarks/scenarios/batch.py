"""Batched reports and steps: 64 requests' passes in a few calls, against one call each.

One operation is one forward pass of 64 requests (``shapes.pass_request``, 2 ranks, each
rank publishing its KV shard), by one process:

- ``64 passes, batched``: ``record_worker_reports`` of the 64 rank-0 reports (one call),
  the same of the 64 completing rank-1 reports (one call, each outcome carrying its lease),
  then ``take_steps`` of the 64 steps (one call);
- ``64 passes, one call each``: the same 128 reports and 64 steps, one
  ``record_worker_report`` / ``take_step`` call each.

Each operation times its reports and its steps apart (the ``Report`` values are built
before the reports' clock starts, for both rows), so the rows give reports/s and steps/s
as well as passes/s. The two rows run in alternating turns. Target: batched reports/s >=
5x one at a time.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec
import redis

from benchmarks.harness import Bench, Case, Check, Op, Row, Scenario, Spec, Verify, Worker
from benchmarks.scenarios.fastpath import CHECK_IN, REPLICA
from benchmarks.shapes import HOT, PASS_RANKS, PASS_WG, metadata, pass_request, rank_kv
from benchmarks.wire import recording_client
from store import RequestStore

MODULE = __name__
BATCH = 64
BATCHED = f"{BATCH} passes, batched"
SINGLES = f"{BATCH} passes, one call each"
TARGET = f"{BATCH} requests"
REPORTS_RATIO = 5.0


def reports_of(rids: list[str], p: int, rank: int, kv: Any) -> list[Any]:
    from store import Report

    return [
        Report(
            request_id=rid,
            partition=HOT,
            fwd_pass=p,
            worker_graph_id=PASS_WG,
            rank=rank,
            num_ranks=PASS_RANKS,
            new_tokens=1 if rank == 0 else 0,
            published={"kv": kv},
        )
        for rid in rids
    ]


def report_one(store: Any, report: Any) -> Any:
    """``record_worker_report`` of one ``Report``, its fields as the call's arguments."""
    fields = msgspec.structs.asdict(report)
    rid, partition = fields.pop("request_id"), fields.pop("partition")
    return store.record_worker_report(rid, partition, **fields, replica_id=REPLICA)


class Passes:
    """One pass of every request in ``rids``: reports then steps, batched or one call each."""

    def __init__(self, batched: bool) -> None:
        from store import Step

        self.batched = batched
        self.step = Step(metadata(), (PASS_WG,))
        self.kv = [rank_kv(rank) for rank in range(PASS_RANKS)]

    def report_all(self, store: Any, reports: list[Any]) -> list[Any]:
        if self.batched:
            return list(store.record_worker_reports(reports, replica_id=REPLICA))
        return [report_one(store, r) for r in reports]

    def step_all(self, store: Any, leases: list[Any]) -> list[Any]:
        if self.batched:
            return list(store.take_steps([(lease, self.step, CHECK_IN) for lease in leases]))
        return [store.take_step(lease, self.step, check_in=CHECK_IN) for lease in leases]

    def run(self, store: Any, rids: list[str], p: int, counters: Any) -> str | None:
        from store import StoreError

        clock = time.perf_counter_ns
        first, second = reports_of(rids, p, 0, self.kv[0]), reports_of(rids, p, 1, self.kv[1])
        began = clock()
        outcomes = self.report_all(store, first) + self.report_all(store, second)
        reported = clock()
        leases = [o.lease for o in outcomes[len(rids) :] if not isinstance(o, StoreError)]
        steps = self.step_all(store, [lease for lease in leases if lease is not None])
        stepped = clock()
        counters["report_ns"] += reported - began
        counters["step_ns"] += stepped - reported
        failed = [o for o in outcomes + steps if isinstance(o, StoreError)]
        if failed or len(steps) != len(rids) or any(s != p + 1 for s in steps):
            return f"failed: {failed[0] if failed else steps[:3]}"
        counters["reports"] += len(outcomes)
        counters["steps"] += len(steps)
        return None


def _calibrate(w: Worker, passes: Passes) -> None:
    """Round trips of one pass of all the requests, on the wire, on requests of its own."""
    client, recorded = recording_client(w.case.url)
    try:
        store = RequestStore(client, namespace=w.case.namespace)
        rids = [f"{rid}-calibration" for rid in w.case.targets_of(w.index)]
        for rid in rids:
            pass_request().create(store, rid)
        unused: Counter[str] = Counter()
        passes.run(store, rids, 0, unused)  # connected, scripts loaded, topologies cached
        recorded.clear()
        failed = passes.run(store, rids, 1, unused)
        if failed:
            raise RuntimeError(f"the calibration pass failed: {failed}")
        w.info["rtt_wire"] = recorded.rounds
    finally:
        client.close()


def _passes(w: Worker, batched: bool) -> Op:
    passes = Passes(batched)
    _calibrate(w, passes)
    case = w.case
    rids = case.targets_of(w.index)
    w.client = redis.Redis.from_url(case.url)
    store = w.store = RequestStore(w.client, namespace=case.namespace)
    at = [0]

    def op(k: int) -> str | None:
        outcome = passes.run(store, rids, at[0], w.counters)
        if outcome is None:
            at[0] = w.last_step = at[0] + 1
        return outcome

    op(0)  # warm: scripts loaded, topologies cached (checked, outside the timing)
    return op


OPS = {BATCHED: lambda w: _passes(w, True), SINGLES: lambda w: _passes(w, False)}


def prepare(bench: Bench, case: Case) -> Verify:
    store, shape = bench.store(case.namespace), pass_request()
    for rid in bench.targets(case):
        shape.create(store, rid)

    def verify(row: Row, c: Case, results: list[dict[str, Any]]) -> None:
        reached = max(r["last_step"] for r in results)
        held = {store.load_partition(rid, HOT).fwd_pass_number for rid in bench.targets(c)}
        ok = held == {reached} and reached == row.details["committed"] + 1  # + the warm pass
        bench.set_verified(row, ok, f"{BATCH} pass counts")

    return verify


def _rates(row: Row) -> None:
    counters = row.details.get("counters", {})
    for what in ("reports", "steps"):
        ns = counters.get(f"{what[:-1]}_ns", 0)
        row.details[f"{what}_per_s"] = counters.get(what, 0) / ns * 1e9 if ns else None
    row.details["passes_per_s"] = (row.ops_per_s or 0) * BATCH
    row.note(
        f"{row.details.get('info', {}).get('rtt_wire', '?')} RTT; "
        f"{row.details['reports_per_s'] or 0:,.0f} reports/s, "
        f"{row.details['steps_per_s'] or 0:,.0f} steps/s, "
        f"{row.details['passes_per_s']:,.0f} passes/s"
    )


def measure(bench: Bench) -> None:
    bench.log(f"batch ({BATCH} requests' passes, 1 process, in alternating turns)")
    specs = [
        Spec("batch", MODULE, BATCHED, 1, "distinct", "", prepare, requests=BATCH),
        Spec("batch", MODULE, SINGLES, 1, "distinct", "", prepare, requests=BATCH,
             beside=f"{BATCHED}|1|distinct"),
    ]  # fmt: skip
    for row in bench.measure_group(specs, rounds=bench.rounds):
        row.target = TARGET
        _rates(row)
        if row.operation == BATCHED:
            row.baseline = f"{SINGLES}|1|{TARGET}"


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    by_op = {r.operation: r for r in rows if r.section == "batch"}
    batched, singles = by_op.get(BATCHED), by_op.get(SINGLES)
    if batched is None or singles is None:
        return [Check(f"batched reports/s >= {REPORTS_RATIO:g}x one call each", None, "not run")]
    out = []
    for what, limit in (("reports", REPORTS_RATIO), ("steps", None), ("passes", None)):
        a, b = batched.details.get(f"{what}_per_s"), singles.details.get(f"{what}_per_s")
        text = f"batched {what}/s" + (
            f" >= {limit:g}x one call each" if limit else " vs one call each"
        )
        if not a or not b:
            out.append(Check(text, None, "not measured"))
            continue
        measured = f"{a / b:.2f}x ({a:,.0f} vs {b:,.0f} {what}/s)"
        out.append(Check(text, a / b >= limit if limit else None, measured, info=limit is None))
    return out


SCENARIO = Scenario(
    "batch", measure=measure, checks=checks, title=f"Batched calls, {BATCH} requests (issue 10)"
)
