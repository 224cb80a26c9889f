"""The floor: bare redis-py round trips, and the naive pickle-the-whole-request design.

Pickle appears here only as the baseline issue 5 asks for; nothing the store writes is pickled.
The bare PING row is not declared here: the harness measures it as the run's reference, in a
slice of every round of every group (benchmarks.harness.REFERENCE_OP).
"""

from __future__ import annotations

import pickle
from typing import Any, cast

import redis

from benchmarks.harness import Bench, Case, Op, Row, Scenario, Spec, Verify, Worker
from benchmarks.shapes import HOT, RANKS, kv_shard, naive_request, positions
from store.types import merge_publish_info

MODULE = __name__
PROCS = (1, 4, 16)
# At 1 process "one" and "distinct" are the same, so there is one row.
SHAPES = [(1, "one")] + [(n, t) for n in PROCS[1:] for t in ("one", "distinct")]
WATCH = "bare WATCH/MULTI (3 RTT)"


def _connect(w: Worker) -> Any:
    w.client = redis.Redis.from_url(w.case.url)
    w.client.ping()  # connected before the timed loop
    return w.client


def _bare_key(w: Worker, what: str = "bare") -> str:
    return f"{w.case.namespace}:{what}:{w.case.rid_for(w.index)}"


def _bare_ping(w: Worker) -> Op:
    client = _connect(w)

    def op(k: int) -> str | None:
        client.ping()
        return None

    return op


def _bare_hset(w: Worker) -> Op:
    client, key = _connect(w), _bare_key(w)

    def op(k: int) -> str | None:
        client.hset(key, "value", k)
        return None

    return op


def _bare_watch(w: Worker) -> Op:
    """WATCH, HGET, then MULTI/HSET/EXEC: 3 round trips, retried at once on conflict."""
    client, key = _connect(w), _bare_key(w)

    def op(k: int) -> str | None:
        with client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    held = int(pipe.hget(key, "n") or 0)
                    pipe.multi()
                    pipe.hset(key, "n", held + 1)
                    pipe.execute()
                    w.counters["commits"] += 1
                    return None
                except redis.WatchError:
                    w.counters["retries"] += 1

    return op


def _naive_merge(w: Worker) -> Op:
    """The first design a team writes: the whole request pickled under one WATCHed key."""
    client, key = _connect(w), _bare_key(w, "naive")
    shard = kv_shard(w.index % RANKS)
    writer = f"w{w.index}"

    def op(k: int) -> str | None:
        step = w.case.offset + k + 1
        other = {"kv": shard, "position": positions(step, writer)}
        with client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    request = pickle.loads(pipe.get(key))
                    merge_publish_info(request["partitions"][HOT].resource_publish_info, other)
                    request["merges"] += 1
                    pipe.multi()
                    pipe.set(key, pickle.dumps(request))
                    pipe.execute()
                    w.counters["commits"] += 1
                    w.last_step = step
                    return None
                except redis.WatchError:
                    w.counters["retries"] += 1

    return op


OPS = {
    "bare PING": _bare_ping,
    "bare HSET": _bare_hset,
    WATCH: _bare_watch,
    "naive pickled request": _naive_merge,
}


def _prepare_watch(bench: Bench, case: Case) -> Verify:
    def verify(row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        held = sum(
            int(bench.client.hget(f"{case.namespace}:bare:{rid}", "n") or 0)
            for rid in bench.targets(case)
        )
        bench.set_verified(row, held == row.details["committed"], "count")

    return verify


def _prepare_naive(bench: Bench, case: Case) -> Verify:
    size = 0
    for rid in bench.targets(case):
        value = pickle.dumps(naive_request(rid))
        bench.client.set(f"{case.namespace}:naive:{rid}", value)
        size = len(value)

    def verify(row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        held = sum(
            pickle.loads(cast(bytes, bench.client.get(f"{case.namespace}:naive:{rid}")))["merges"]
            for rid in bench.targets(case)
        )
        row.details["bytes_per_request"] = size
        row.notes = f"{size:,} B/request"
        bench.set_verified(row, held == row.details["committed"], "count")

    return verify


def bare_baseline(op: str, procs: int, target: str) -> str:
    """Bare rows at 1 process against PING, at more against themselves at 1."""
    return "bare PING|1|one" if procs == 1 else f"{op}|1|one"


def table(bench: Bench) -> list[Spec]:
    specs = []
    for op, prepare in (("bare HSET", None), (WATCH, _prepare_watch)):
        specs += [
            Spec("baseline", MODULE, op, n, t, bare_baseline(op, n, t), prepare) for n, t in SHAPES
        ]
    for n, t in ((1, "one"), (4, "one"), (4, "distinct")):
        base = f"{WATCH}|{n}|{t}"
        specs.append(Spec("baseline", MODULE, "naive pickled request", n, t, base, _prepare_naive))
    return specs


SCENARIO = Scenario(
    "baseline",
    order=("bare PING", "bare HSET", "naive pickled request", WATCH),
    table=table,
)
