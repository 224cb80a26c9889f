"""The store's operations at 1, 4 and 16 processes, each against the bare row it replaces.

The operations here take only the public API (``from store import RequestStore`` and its
errors), so the same factories also run in workers of another tree (scenarios/legacy.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from benchmarks.harness import (
    Bench,
    Case,
    Check,
    Op,
    Row,
    Scenario,
    Spec,
    Verify,
    Worker,
    figure,
)
from benchmarks.harness import ratio_check as ratio
from benchmarks.scenarios.baseline import SHAPES, WATCH
from benchmarks.shapes import (
    HOT,
    HUGE_RANKS,
    RANKS,
    WORKER_GRAPH,
    kv_shard,
    metadata,
    positions,
    request_shape,
)
from store import RequestExistsError, RequestStore, StalePassError, TransactionConflictError

MODULE = __name__
MERGE = "merge_publish_info"
MERGE_NO_READ = "merge_publish_info (no read-back)"
REPORT = "record_worker_report"
ROW_OPS = (MERGE, REPORT, "advance_partition", "load_request", "create+delete_request")


def connect(w: Worker, *, warm: bool = True) -> Any:
    """The worker's store, connected and warmed up outside the timed loop (``warm``: the
    targets' topology cached). With ``case.create`` it creates its own targets first.
    A worker that holds a store already (a wrapper's inner operation) keeps it as it is."""
    if w.store is not None:
        return w.store
    case = w.case
    w.store = RequestStore.from_url(case.url, namespace=case.namespace)
    w.client = w.store.client
    w.client.ping()
    if case.create:
        shape = request_shape(with_kv=True)
        for rid in case.targets_of(w.index):
            with contextlib.suppress(RequestExistsError):  # another process of the row did
                shape.create(w.store, rid)
    if warm:
        for rid in case.targets_of(w.index):
            w.store.load_record(rid)
    return w.store


def merge(w: Worker, *, returning: bool = True) -> Op:
    store, rid = connect(w), w.case.rid_for(w.index)
    shard = kv_shard(w.index % RANKS)
    writer = f"w{w.index}"

    def op(k: int) -> str | None:
        step = w.case.offset + k + 1
        other = {"kv": shard, "position": positions(step, writer)}
        try:
            store.merge_publish_info(rid, HOT, other, returning=returning)
        except TransactionConflictError:
            return "gave up"
        w.last_step = step
        return None

    return op


def report_rank(case: Case, index: int, k: int, callers: int) -> int:
    """A rank other than 0, new for every call: ``callers`` share the request, and the
    offset grows from slice to slice."""
    return 1 + case.offset + index + k * callers


def report_args(case: Case, index: int, rid: str, k: int, callers: int) -> dict[str, Any]:
    """A report of a rank other than 0: counts towards the worker graph, carries no tokens."""
    return {
        "request_id": rid,
        "partition_name": HOT,
        "fwd_pass": 0,
        "worker_graph_id": WORKER_GRAPH,
        "rank": report_rank(case, index, k, callers),
        "num_ranks": HUGE_RANKS,
    }


def report(w: Worker) -> Op:
    store, rid = connect(w), w.case.rid_for(w.index)

    def op(k: int) -> str | None:
        outcome = store.record_worker_report(**report_args(w.case, w.index, rid, k, w.case.procs))
        return None if outcome.applied else "duplicate"

    return op


def _advance(w: Worker) -> Op:
    """Processes on one request race: the loser of each pass gets StalePassError."""
    store, rid = connect(w), w.case.rid_for(w.index)
    meta = metadata(1)
    at = [store.load_partition(rid, HOT).fwd_pass_number]  # read before the timed loop

    def op(k: int) -> str | None:
        try:
            at[0] = store.advance_partition(
                rid, HOT, from_pass=at[0], metadata=meta, worker_graph_ids=[WORKER_GRAPH, "wg1"]
            )
        except StalePassError as e:
            at[0] = e.current
            return "stale"
        return None

    return op


def _load(w: Worker) -> Op:
    store, rid = connect(w), w.case.rid_for(w.index)

    def op(k: int) -> str | None:
        store.load_request(rid)
        return None

    return op


def _create_delete(w: Worker) -> Op:
    store, shape = connect(w, warm=False), request_shape(with_kv=False)
    shared = w.case.target == "one"

    def op(k: int) -> str | None:
        rid = w.case.rid if shared else f"{w.case.rid}-{w.index}-{k}"
        outcome = None
        try:
            shape.create(store, rid)
        except RequestExistsError:
            outcome = "create found it held"
        store.delete_request(rid)
        return outcome

    return op


OPS = {
    MERGE: merge,
    MERGE_NO_READ: lambda w: merge(w, returning=False),
    REPORT: report,
    "advance_partition": _advance,
    "load_request": _load,
    "create+delete_request": _create_delete,
}

# -- parent side: what each row works on, and the check of its final state --------------------


def verify_merge(bench: Bench, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
    """Every committed merge left its op id; every writer's last position is held."""
    store = bench.store(case.namespace)
    ok = True
    ops = 0
    last = {r["index"]: r["last_step"] for r in results}  # the last slice wins
    for rid, writers in bench.targets(case).items():
        ops += bench.client.zcard(store.keys.ops(rid))
        held = store.load_partition(rid, HOT).resource_publish_info
        counters = held["position"].counters
        ok &= sorted(held["kv"].info) == list(range(RANKS))
        ok &= all(counters.get(f"w{i}", 0) == last[i] for i in writers)
    ok &= ops == row.details["committed"]
    bench.set_verified(row, ok, "op ids + positions")
    row.details["gave_up"] = row.details["outcomes"].get("gave up", 0)


def verify_report(bench: Bench, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
    store = bench.store(case.namespace)
    held = sum(
        store.load_partition(rid, HOT).wg_rank_completions.get(WORKER_GRAPH, 0)
        for rid in bench.targets(case)
    )
    bench.set_verified(row, held == row.details["committed"], "rank count")


def _verify_advance(bench: Bench, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
    store = bench.store(case.namespace)
    held = sum(store.load_partition(rid, HOT).fwd_pass_number for rid in bench.targets(case))
    failed = sum(row.details["outcomes"].values())
    if failed:
        calls = row.details["calls"]
        row.note(f"{failed / calls:.0%} of calls stale; ops/s counts committed advances")
    bench.set_verified(row, held == row.details["committed"], "pass count")


def _verify_empty(bench: Bench, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
    left = list(bench.client.scan_iter(match=f"{case.namespace}:*", count=1000))
    bench.set_verified(row, not left, "no keys left")


VERIFY = {
    MERGE: verify_merge,
    MERGE_NO_READ: verify_merge,
    REPORT: verify_report,
    "advance_partition": _verify_advance,
    "create+delete_request": _verify_empty,
}


def prepare(bench: Bench, case: Case) -> Verify | None:
    """Create the requests a row works on (unless its workers do); return its final check."""
    check = VERIFY.get(case.op.removeprefix("scale "))
    if case.op != "create+delete_request" and case.target != "random" and not case.create:
        store = bench.store(case.namespace)
        shape = request_shape(with_kv=True)
        for rid in bench.targets(case):
            if not store.request_exists(rid):
                shape.create(store, rid)
    if check is None:
        return None
    return lambda row, c, results: check(bench, row, c, results)


def warm_up(bench: Bench) -> None:
    """Run each store operation once, so that every script is loaded on the server."""
    ns = bench.namespace()
    store = bench.store(ns)
    request_shape(with_kv=True).create(store, "warm")
    store.merge_publish_info("warm", HOT, {"kv": kv_shard(0)})
    store.record_worker_report(
        "warm", HOT, fwd_pass=0, worker_graph_id=WORKER_GRAPH, rank=0, num_ranks=2
    )
    store.advance_partition("warm", HOT, from_pass=0, metadata=metadata())
    store.load_request("warm")
    store.delete_request("warm")
    bench.cleanup(ns)


def _baseline(op: str, procs: int, target: str) -> str:
    """Merges against bare WATCH/MULTI, every other operation against bare HSET."""
    bare = WATCH if op.startswith(MERGE) else "bare HSET"
    return f"{bare}|{procs}|{target}"


def table(bench: Bench) -> list[Spec]:
    warm_up(bench)
    specs = [
        Spec("store", MODULE, op, n, t, _baseline(op, n, t), prepare)
        for op in ROW_OPS
        for n, t in SHAPES
    ]
    no_read = _baseline(MERGE, 1, "one")
    specs.append(Spec("store", MODULE, MERGE_NO_READ, 1, "one", no_read, prepare))
    return specs


# Issue 5's ratio targets: (what, measured row, baseline row, figure, limit, at most?).
RATIO_TARGETS = (
    ("uncontended merge p50 <= 0.9x bare 3-RTT WATCH/MULTI p50",
     f"{MERGE}|1|one", f"{WATCH}|1|one", "p50_us", 0.9, True),
    ("report (no published info) ops/s >= 0.8x bare HSET (1 proc)",
     f"{REPORT}|1|one", "bare HSET|1|one", "ops_per_s", 0.8, False),
    ("16 procs, one partition: committed merges/s >= 1.0x one process",
     f"{MERGE}|16|one", f"{MERGE}|1|one", "ops_per_s", 1.0, False),
    ("16 procs, one partition: p99 <= 3x p99 of 16 procs on distinct requests",
     f"{MERGE}|16|one", f"{MERGE}|16|distinct", "p99_us", 3.0, True),
)  # fmt: skip


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    by_key = {r.key: r for r in rows}
    out = [
        ratio(text, figure(by_key.get(a), what), figure(by_key.get(b), what), limit, le)
        for text, a, b, what, limit, le in RATIO_TARGETS
    ]
    merges = [r for r in rows if r.operation == MERGE]
    if merges:
        lost = [r for r in merges if not r.details.get("verified")]
        out.append(
            Check(
                "merges: nothing lost (op ids and positions verified, every row)",
                not lost,
                f"{len(merges) - len(lost)}/{len(merges)} rows verified",
            )
        )
        gave_up = sum(r.details.get("gave_up", 0) for r in merges)
        out.append(
            Check(
                "merges: no TransactionConflictError at default settings",
                gave_up == 0,
                f"{gave_up} calls gave up",
            )
        )
    return out


SCENARIO = Scenario("store", order=ROW_OPS, table=table, checks=checks)
