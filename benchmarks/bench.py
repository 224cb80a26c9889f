"""The store against the floor: one run, one table, every ratio against a baseline of that run.

    python -m benchmarks.bench [--redis-url URL] [--quick] [--json out.json]

Starts its own throw-away redis-server (unless ``--redis-url``), measures the bare redis-py
baselines, the naive pickle-the-whole-request design, the store's operations at 1, 4 and 16
processes, the codec against pickle and latency against the number of requests held, then
prints one table and the issue's targets as a checklist. See benchmarks/README.md.

Only keys under the run's own namespace are ever written or deleted on a server the
benchmark did not start. Pickle appears here only as the baseline the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import platform
import random
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import redis

from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    PartitionState,
    StreamingConnectionState,
    merge_publish_info,
)
from mstar.engine.resources import (
    KVSequenceInfo,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
)
from store import RequestExistsError, RequestStore, StalePassError, TransactionConflictError
from store.codec.layout import RecordLayout

DEFAULT_JSON = Path(__file__).parent / "results" / "latest.json"
PROCS = (1, 4, 16)
HOT = "llm"  # the partition every store operation works on
WORKER_GRAPH = "wg0"
HUGE_RANKS = 1 << 50  # a worker graph that never completes: every report is a new rank

# The realistic shapes of the issue: KV caches with two cache labels on a 4-way tensor-parallel
# worker graph. A merge publishes one rank's shard (768/4 page indices per label); the codec
# measures a whole partition with 768 page indices per rank.
RANKS = 4
CACHE_LABELS = ("decoder", "draft")
SHARD_PAGES_PER_LABEL = 768 // 4
CODEC_PAGES_PER_RANK = 768


# -- realistic values -------------------------------------------------------------------


def kv_sequence(rng: random.Random, pages: int) -> KVSequenceInfo:
    return KVSequenceInfo(
        seq_len=pages * 16,
        latest_kv_transfer_info={"host": "10.0.3.17", "port": 18515, "engine": "e7", "slot": 3},
        page_indices=rng.sample(range(1, 60_000), pages),
    )


def kv_shard(
    rank: int, pages_per_label: int = SHARD_PAGES_PER_LABEL, seed: int = 0
) -> PublishedKVInfo:
    """What one rank publishes after a forward pass: its pages for each cache label."""
    rng = random.Random(seed * 1000 + rank)
    labels = {label: kv_sequence(rng, pages_per_label) for label in CACHE_LABELS}
    return PublishedKVInfo(info={rank: labels}, world_size=RANKS)


def kv_all_ranks(pages_per_label: int = SHARD_PAGES_PER_LABEL) -> PublishedKVInfo:
    info = PublishedKVInfo(world_size=RANKS)
    for rank in range(RANKS):
        info.update(kv_shard(rank, pages_per_label))
    return info


def positions(step: int, writer: str | None = None) -> PublishedPositionInfo:
    counters = {label: step for label in CACHE_LABELS}
    if writer is not None:
        counters[writer] = step
    return PublishedPositionInfo(counters=counters)


def metadata(step: int = 0) -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(
        graph_walk="decode",
        is_prefill=False,
        input_modalities=["text", "audio"],
        output_modalities=["text"],
        kwargs={"temperature": 0.6, "step": step},
    )


def partition(name: str, infos: dict[str, PublishedInfo] | None = None) -> PartitionState:
    return PartitionState(
        partition_name=name,
        metadata=metadata(),
        fwd_pass_number=0,
        random_seed=1234,
        current_worker_graph_ids={WORKER_GRAPH, "wg1"},
        wg_rank_completions={},
        resource_publish_info=dict(infos or {}),
    )


def codec_partition() -> PartitionState:
    """The codec rows' partition: 4 ranks of KV shards, 768 page indices per rank."""
    kv = kv_all_ranks(CODEC_PAGES_PER_RANK // len(CACHE_LABELS))
    return partition(HOT, {"kv": kv, "position": positions(512)})


@dataclass
class RequestShape:
    """What ``RequestStore.create_request`` takes, for one request."""

    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]
    max_output_tokens: int = 4096
    seed: int = 1234
    resource_configs: dict[str, Any] = field(default_factory=dict)
    partition_definitions: dict[str, Any] = field(default_factory=dict)

    def create(self, store: RequestStore, rid: str) -> None:
        store.create_request(
            rid,
            partitions=self.partitions,
            connections=self.connections,
            max_output_tokens=self.max_output_tokens,
            seed=self.seed,
            resource_configs=self.resource_configs,
            partition_definitions=self.partition_definitions,
        )


def request_shape(*, with_kv: bool) -> RequestShape:
    """Two partitions and one connection; ``with_kv``: as after the first passes of all ranks."""
    llm_infos: dict[str, PublishedInfo] = {}
    codec_infos: dict[str, PublishedInfo] = {}
    if with_kv:
        llm_infos = {"kv": kv_all_ranks(), "position": positions(512)}
        codec_infos = {"position": positions(64)}
    return RequestShape(
        partitions={"llm": partition("llm", llm_infos), "codec": partition("codec", codec_infos)},
        connections={"llm->codec": StreamingConnectionState("llm", "codec", "audio_tokens")},
        resource_configs={"sampler": SamplingReqConfig(seed=1234)},
        partition_definitions={
            "llm": PartitionDefinition("llm", {"prefill", "decode"}, "prefill"),
            "codec": PartitionDefinition("codec", {"decode"}, "decode", ["llm"]),
        },
    )


def naive_request(rid: str) -> dict[str, Any]:
    """The naive design's value: the whole request as one picklable dict."""
    shape = request_shape(with_kv=True)
    return {
        "request_id": rid,
        "max_output_tokens": shape.max_output_tokens,
        "seed": shape.seed,
        "partitions": shape.partitions,
        "connections": shape.connections,
        "resource_configs": shape.resource_configs,
        "merges": 0,
    }


# -- worker side: one operation per call ---------------------------------------------------


@dataclass
class Case:
    """One row: which operation, how many processes, on one target or one each."""

    op: str
    procs: int
    target: str  # "one", "distinct", "hot" or "random"
    url: str = ""
    namespace: str = ""
    duration: float = 2.0
    rid: str = ""  # the shared target, or the prefix of per-process / held targets
    held: int = 0  # scale rows: how many requests "<rid>-held-<i>" to pick from
    offset: int = 0  # grows from slice to slice: report ranks and positions never repeat

    def rid_for(self, index: int) -> str:
        return self.rid if self.target in ("one", "hot") else f"{self.rid}-{index}"


@dataclass
class Worker:
    """What one process holds while running one case."""

    case: Case
    index: int
    client: Any = None
    store: Any = None
    counters: Counter[str] = field(default_factory=Counter)
    last_step: int = 0


Op = Callable[[int], str | None]  # op(k) runs the k-th call; returns an outcome, None = ok


def _bare_ping(w: Worker) -> Op:
    client = w.client

    def op(k: int) -> str | None:
        client.ping()
        return None

    return op


def _bare_hset(w: Worker) -> Op:
    client, key = w.client, f"{w.case.namespace}:bare:{w.case.rid_for(w.index)}"

    def op(k: int) -> str | None:
        client.hset(key, "value", k)
        return None

    return op


def _bare_watch(w: Worker) -> Op:
    """WATCH, HGET, then MULTI/HSET/EXEC: 3 round trips, retried at once on conflict."""
    client, key = w.client, f"{w.case.namespace}:bare:{w.case.rid_for(w.index)}"

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
    client, key = w.client, f"{w.case.namespace}:naive:{w.case.rid_for(w.index)}"
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


def _merge(w: Worker, *, returning: bool = True) -> Op:
    store, rid = w.store, w.case.rid_for(w.index)
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


def _report(w: Worker) -> Op:
    """A report of a rank other than 0: counts towards the worker graph, carries no tokens."""
    store, rid, n = w.store, w.case.rid_for(w.index), w.case.procs

    def op(k: int) -> str | None:
        outcome = store.record_worker_report(
            rid,
            HOT,
            fwd_pass=0,
            worker_graph_id=WORKER_GRAPH,
            rank=1 + w.case.offset + w.index + k * n,
            num_ranks=HUGE_RANKS,
        )
        return None if outcome.applied else "duplicate"

    return op


def _advance(w: Worker) -> Op:
    """Processes on one request race: the loser of each pass gets StalePassError."""
    store, rid = w.store, w.case.rid_for(w.index)
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
    store, rid = w.store, w.case.rid_for(w.index)

    def op(k: int) -> str | None:
        store.load_request(rid)
        return None

    return op


def _create_delete(w: Worker) -> Op:
    store, shape = w.store, request_shape(with_kv=False)
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


def _scale_random(make: Callable[[Worker], Op]) -> Callable[[Worker], Op]:
    """The same operation, each call on a request drawn at random from those held."""

    def build(w: Worker) -> Op:
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


OPS: dict[str, Callable[[Worker], Op]] = {
    "bare PING": _bare_ping,
    "bare HSET": _bare_hset,
    "bare WATCH/MULTI (3 RTT)": _bare_watch,
    "naive pickled request": _naive_merge,
    "merge_publish_info": _merge,
    "merge_publish_info (no read-back)": lambda w: _merge(w, returning=False),
    "record_worker_report": _report,
    "advance_partition": _advance,
    "load_request": _load,
    "create+delete_request": _create_delete,
    "scale merge_publish_info": _merge,
    "scale record_worker_report": _report,
    "scale merge (random held)": _scale_random(_merge),
    "scale report (random held)": _scale_random(_report),
}
STORE_OPS = {name for name in OPS if not name.startswith(("bare", "naive"))}
BASELINE_OPS = ["bare PING", "bare HSET", "bare WATCH/MULTI (3 RTT)", "naive pickled request"]
STORE_ROW_OPS = [
    "merge_publish_info",
    "record_worker_report",
    "advance_partition",
    "load_request",
    "create+delete_request",
]


def _open(w: Worker) -> Op:
    """Connect and warm up outside the timed loop: connection made, topology cached."""
    case = w.case
    if case.op in STORE_OPS:
        w.store = RequestStore.from_url(case.url, namespace=case.namespace)
        w.client = w.store.client
        if case.op not in ("create+delete_request",) and case.target != "random":
            w.store.load_record(case.rid_for(w.index))
    else:
        w.client = redis.Redis.from_url(case.url)
    w.client.ping()
    return OPS[case.op](w)


def _run(op: Op, duration: float, start_at: float) -> tuple[array[int], Counter[str], float]:
    latencies: array[int] = array("q")
    outcomes: Counter[str] = Counter()
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    clock = time.perf_counter_ns
    began = clock()
    deadline = began + int(duration * 1e9)
    k = 0
    end = began
    while end < deadline:
        start = clock()
        outcome = op(k)
        end = clock()
        latencies.append(end - start)
        if outcome is not None:
            outcomes[outcome] += 1
        k += 1
    return latencies, outcomes, (end - began) / 1e9


def worker_main(conn: Any, index: int) -> None:
    """A pool process: run each slice it is sent, after the start signal, and send back samples.

    What a case opened (connection, store, the operation's state) is kept for its later
    slices, so a slice pays neither for connecting nor for warming up.
    """
    conn.send(("up", None))
    opened: dict[tuple[Any, ...], tuple[Worker, Op]] = {}
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            case = Case(**message)
            try:
                key = (case.op, case.procs, case.target, case.namespace, case.rid, case.held)
                if key not in opened:
                    w = Worker(case, index)
                    opened[key] = (w, _open(w))
                w, op = opened[key]
                w.case, w.counters = case, Counter()
                stats = w.store.stats if w.store is not None else None
                before = _merge_counts(stats)
                conn.send(("ready", None))
                start_at = conn.recv()
                if start_at is None:  # another process failed to set up: no run
                    conn.send(("aborted", None))
                    continue
                latencies, outcomes, elapsed = _run(op, case.duration, start_at)
                after = _merge_counts(stats)
                result = {
                    "latencies": latencies.tobytes(),
                    "outcomes": dict(outcomes),
                    "elapsed": elapsed,
                    "counters": dict(w.counters),
                    "transactions": after[0] - before[0],
                    "attempts": after[1] - before[1],
                    "last_step": w.last_step,
                    "index": index,
                }
                conn.send(("done", result))
            except Exception as e:  # reported to the parent, which stops the run
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        for w, _ in opened.values():
            if w.client is not None:
                w.client.close()


class Pool:
    """Spawned processes kept for the whole run, so no row pays for starting Python."""

    def __init__(self, size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.procs = []
        for index in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, index), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:  # started and imported: no later row shares the CPUs with that
            pipe.recv()

    def run(self, case: Case) -> list[dict[str, Any]]:
        pipes = self.pipes[: case.procs]
        for pipe in pipes:
            pipe.send(case.__dict__)
        # The start barrier: every process connected and warmed up, then all start at once.
        ready = [pipe.recv() for pipe in pipes]
        failed = [payload for kind, payload in ready if kind != "ready"]
        start_at = None if failed else time.time() + 0.02 + 0.002 * case.procs
        for pipe, (kind, _) in zip(pipes, ready, strict=True):
            if kind == "ready":
                pipe.send(start_at)
        done = [
            pipe.recv() for pipe, (kind, _) in zip(pipes, ready, strict=True) if kind == "ready"
        ]
        failed += [payload for kind, payload in done if kind == "error"]
        if failed:
            raise RuntimeError(f"{case.op} ({case.procs} procs, {case.target}): {failed[0]}")
        return [payload for _, payload in done]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=10)


# -- parent side: rows -----------------------------------------------------------------------


@dataclass
class Row:
    section: str
    operation: str
    procs: int | None
    target: str
    ops_per_s: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    retries_per_commit: float | None = None
    baseline: str = ""
    ratio_ops: float | None = None
    ratio_p50: float | None = None
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.operation}|{self.procs}|{self.target}"


def summarize(section: str, case: Case, results: list[dict[str, Any]]) -> Row:
    samples = array("q")
    outcomes: Counter[str] = Counter()
    counters: Counter[str] = Counter()
    for r in results:
        samples.frombytes(r["latencies"])
        outcomes.update(r["outcomes"])
        counters.update(r["counters"])
    calls = len(samples)
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
        p50_us=ordered[len(ordered) // 2] / 1e3,
        p99_us=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3,
    )
    transactions = sum(r["transactions"] for r in results)
    if transactions:
        row.retries_per_commit = (sum(r["attempts"] for r in results) - transactions) / transactions
    elif "commits" in counters:
        row.retries_per_commit = counters["retries"] / max(1, counters["commits"])
    row.details = {"calls": calls, "committed": committed, "outcomes": dict(outcomes)}
    notes = [f"{n} {what}" for what, n in sorted(outcomes.items())]
    if failed and case.op == "advance_partition":
        notes.append(f"{failed / calls:.0%} of calls stale; ops/s counts committed advances")
    row.notes = "; ".join(notes)
    return row


Verify = Callable[[Row, Case, list[dict[str, Any]]], None]


class Bench:
    def __init__(self, url: str, own_server: bool, quick: bool, pool: Pool) -> None:
        self.url = url
        self.own_server = own_server
        self.quick = quick
        self.duration = 0.7 if quick else 2.0
        self.pool = pool
        self.root = f"mstar-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.client = redis.Redis.from_url(url)
        self.rows: list[Row] = []
        self.memory: dict[str, Any] = {}
        self._cases = 0
        self._slices = 0

    def namespace(self) -> str:
        self._cases += 1
        return f"{self.root}:c{self._cases}"

    def store(self, namespace: str) -> RequestStore:
        return RequestStore.from_url(self.url, namespace=namespace)

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

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

    # -- rows over the pool ---------------------------------------------------------

    def measure_group(
        self, specs: list[tuple[str, str, int, str]], rounds: int, **extra: Any
    ) -> list[Row]:
        """Measure rows in ``rounds`` interleaved slices, so that a change of load on the
        machine during the run hits every row of the group alike (their ratios stay fair)."""
        shared_ns = extra.pop("namespace", None)
        duration = extra.pop("duration", self.duration) / rounds
        started = time.perf_counter()
        cases: list[tuple[str, Case, Verify | None, list[dict[str, Any]]]] = []
        for section, op, procs, target in specs:
            ns = shared_ns or self.namespace()
            case = Case(op, procs, target, self.url, ns, duration, **extra)
            case.rid = case.rid or "r"
            cases.append((section, case, self.prepare(case), []))
        for _ in range(rounds):
            for _, case, _, results in cases:
                self._slices += 1
                case.offset = self._slices * 1_000_000
                results += self.pool.run(case)
        rows = []
        for section, case, verify, results in cases:
            row = summarize(section, case, results)
            if verify is not None:
                verify(row, case, results)
            if shared_ns is None:
                self.cleanup(case.namespace)
            self.rows.append(row)
            rows.append(row)
            self.log(
                f"  {row.operation:28} {case.procs:>2} {case.target:8} "
                f"{row.ops_per_s:>9,.0f}/s p50 {row.p50_us:>7.0f} µs"
            )
        self.log(f"  ({time.perf_counter() - started:.1f} s)")
        return rows

    def prepare(self, case: Case) -> Verify | None:
        """Create what the case works on; return the check of its final state, if any."""
        targets = sorted({case.rid_for(i) for i in range(case.procs)})
        if case.op in ("bare PING", "bare HSET"):
            return None
        if case.op == "bare WATCH/MULTI (3 RTT)":
            return self._verify_bare
        if case.op == "naive pickled request":
            for rid in targets:
                value = pickle.dumps(naive_request(rid))
                self.client.set(f"{case.namespace}:naive:{rid}", value)
            case_bytes = len(value)
            return lambda row, c, results: self._verify_naive(row, c, case_bytes)
        if case.op == "create+delete_request" or case.target == "random":
            return self._verify_empty if case.op == "create+delete_request" else None
        store = self.store(case.namespace)
        shape = request_shape(with_kv=True)
        for rid in targets:
            if not store.request_exists(rid):
                shape.create(store, rid)
        if case.op.startswith("merge_publish_info"):
            return self._verify_merge
        if case.op == "record_worker_report":
            return self._verify_report
        if case.op == "advance_partition":
            return self._verify_advance
        return None

    # -- checks of the final state: nothing lost --------------------------------------------

    def _targets(self, case: Case) -> dict[str, list[int]]:
        """Target request -> the pool indexes that worked on it."""
        out: dict[str, list[int]] = {}
        for i in range(case.procs):
            out.setdefault(case.rid_for(i), []).append(i)
        return out

    def _set_verified(self, row: Row, ok: bool, what: str) -> None:
        row.details["verified"] = ok
        row.notes = "; ".join(filter(None, [row.notes, f"{what}: {'ok' if ok else 'LOST'}"]))

    def _verify_bare(self, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        held = sum(
            int(self.client.hget(f"{case.namespace}:bare:{rid}", "n") or 0)
            for rid in self._targets(case)
        )
        self._set_verified(row, held == row.details["committed"], "count")

    def _verify_naive(self, row: Row, case: Case, size: int) -> None:
        held = sum(
            pickle.loads(self.client.get(f"{case.namespace}:naive:{rid}"))["merges"]
            for rid in self._targets(case)
        )
        row.details["bytes_per_request"] = size
        row.notes = f"{size:,} B/request"
        self._set_verified(row, held == row.details["committed"], "count")

    def _verify_merge(self, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        """Every committed merge left its op id; every writer's last position is held."""
        store = self.store(case.namespace)
        ok = True
        ops = 0
        for rid, writers in self._targets(case).items():
            ops += self.client.zcard(store.keys.ops(rid))
            held = store.load_partition(rid, HOT).resource_publish_info
            counters = held["position"].counters  # type: ignore[attr-defined]
            kv = held["kv"].info  # type: ignore[attr-defined]
            ok &= sorted(kv) == list(range(RANKS))
            last = {r["index"]: r["last_step"] for r in results}  # the last slice wins
            ok &= all(counters.get(f"w{i}", 0) == last[i] for i in writers)
        ok &= ops == row.details["committed"]
        self._set_verified(row, ok, "op ids + positions")
        row.details["gave_up"] = row.details["outcomes"].get("gave up", 0)

    def _verify_report(self, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        store = self.store(case.namespace)
        held = sum(
            store.load_partition(rid, HOT).wg_rank_completions.get(WORKER_GRAPH, 0)
            for rid in self._targets(case)
        )
        self._set_verified(row, held == row.details["committed"], "rank count")

    def _verify_advance(self, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        store = self.store(case.namespace)
        held = sum(store.load_partition(rid, HOT).fwd_pass_number for rid in self._targets(case))
        self._set_verified(row, held == row.details["committed"], "pass count")

    def _verify_empty(self, row: Row, case: Case, results: list[dict[str, Any]]) -> None:
        left = list(self.client.scan_iter(match=f"{case.namespace}:*", count=1000))
        self._set_verified(row, not left, "no keys left")

    # -- sections -------------------------------------------------------------------------

    def table(self, sections: list[str]) -> None:
        """The baseline and store rows, all interleaved in slices: the targets compare rows
        with each other, and a neighbour's load on the machine then weighs on all alike."""
        specs: list[tuple[str, str, int, str]] = []
        shapes = [(1, "one")] + [(n, t) for n in PROCS[1:] for t in ("one", "distinct")]
        if "baseline" in sections:
            specs.append(("baseline", "bare PING", 1, "one"))
            for op in ("bare HSET", "bare WATCH/MULTI (3 RTT)"):
                specs += [("baseline", op, n, t) for n, t in shapes]
            op = "naive pickled request"
            specs += [("baseline", op, 1, "one"), ("baseline", op, 4, "one")]
            specs.append(("baseline", op, 4, "distinct"))
        if "store" in sections:
            self._warm_up()
            specs += [("store", op, n, t) for op in STORE_ROW_OPS for n, t in shapes]
            specs.append(("store", "merge_publish_info (no read-back)", 1, "one"))
        if specs:
            rounds = 2 if self.quick else 4
            self.log(f"{len(specs)} rows, interleaved in {rounds} rounds")
            self.measure_group(specs, rounds=rounds)

    def _warm_up(self) -> None:
        """Run each store operation once, so that every script is loaded on the server."""
        ns = self.namespace()
        store = self.store(ns)
        request_shape(with_kv=True).create(store, "warm")
        store.merge_publish_info("warm", HOT, {"kv": kv_shard(0)})
        store.record_worker_report(
            "warm", HOT, fwd_pass=0, worker_graph_id=WORKER_GRAPH, rank=0, num_ranks=2
        )
        store.advance_partition("warm", HOT, from_pass=0, metadata=metadata())
        store.load_request("warm")
        store.delete_request("warm")
        self.cleanup(ns)

    def codec(self) -> None:
        self.log("codec")
        state = codec_partition()
        codec = self.store(self.namespace()).codec
        kv = state.resource_publish_info["kv"]
        assert isinstance(kv, PublishedKVInfo)
        pages = sum(len(s.page_indices) for labels in kv.info.values() for s in labels.values())
        layout = RecordLayout(PartitionState, codec, exclude=("resource_publish_info",))

        def hash_encode() -> tuple[dict[bytes, bytes], dict[str, bytes]]:
            fields = {k.encode(): v for k, v in layout.encode(state).items()}
            return fields, {k: codec.encode_kind(v) for k, v in state.resource_publish_info.items()}

        def hash_decode(data: tuple[dict[bytes, bytes], dict[str, bytes]]) -> PartitionState:
            infos = {k: codec.decode_kind(v, PublishedInfo) for k, v in data[1].items()}
            return layout.decode(data[0], extra={"resource_publish_info": infos})

        def hash_size(data: tuple[dict[bytes, bytes], dict[str, bytes]]) -> int:
            return sum(len(k) + len(v) for part in data for k, v in part.items())

        Pair = tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], int], Any, str]
        pairs: dict[str, Pair] = {
            "codec PartitionState msgspec": (
                lambda: codec.encode(state),
                lambda b: codec.decode(b, PartitionState),
                len,
                state,
                "codec PartitionState pickle",
            ),
            "codec PartitionState pickle": (
                lambda: pickle.dumps(state),
                pickle.loads,
                len,
                state,
                "",
            ),
            "codec KV info msgspec (kind)": (
                lambda: codec.encode_kind(kv),
                lambda b: codec.decode_kind(b, PublishedInfo),
                len,
                kv,
                "codec KV info pickle",
            ),
            "codec KV info pickle": (lambda: pickle.dumps(kv), pickle.loads, len, kv, ""),
            "layout PartitionState hash": (
                hash_encode,
                hash_decode,
                hash_size,
                state,
                "codec PartitionState pickle",
            ),
        }
        timers: dict[tuple[str, str], Callable[[], Any]] = {}
        sizes = {}
        for name, (encode, decode, size_of, original, _) in pairs.items():
            data = encode()
            assert decode(data) == original, f"{name} does not round-trip"
            sizes[name] = size_of(data)
            timers[name, "both"] = lambda e=encode, d=decode: d(e())
            timers[name, "encode"] = encode
            timers[name, "decode"] = lambda d=decode, x=data: d(x)
        best = _micro(timers, 0.02 if self.quick else 0.05, rounds=7 if self.quick else 15)
        for name, (*_, baseline) in pairs.items():
            both, enc, dec = (best[name, what] for what in ("both", "encode", "decode"))
            size = sizes[name]
            row = Row(
                "codec", name, None, "-", ops_per_s=1e6 / both, p50_us=both, baseline=baseline
            )
            row.details = {"bytes": size, "page_indices": pages, "encode_us": enc, "decode_us": dec}
            row.notes = f"{size:,} B; encode {enc:.1f} + decode {dec:.1f} µs; {pages} page indices"
            self.rows.append(row)
            self.log(f"  {name:32} {both:8.1f} µs  {size:,} B")

    def scale(self) -> None:
        held_max = 10_000 if self.quick else 100_000
        self.log(f"scale (up to {held_max:,} requests held)")
        ns = self.namespace()
        store = self.store(ns)
        shape = request_shape(with_kv=True)
        shape.create(store, "hot")
        duration = 0.5 if self.quick else 1.0
        held = 0
        for size in (1, 1000, held_max):
            if size > 1:
                started = time.perf_counter()
                before = _used_memory(self.client)
                bulk_create(store, shape, "hot-held", held, size - 1)
                created = size - 1 - held
                per = (_used_memory(self.client) - before) / created
                self.log(
                    f"  held {size:,} requests (created {created:,} in "
                    f"{time.perf_counter() - started:.1f} s, {per:,.0f} B each)"
                )
                held = size - 1
                self.memory[str(size)] = {
                    "requests": size,
                    "bytes_per_request": per,
                    "measured_over": created,
                }
                sample = store.load_request(f"hot-held-{held - 1}")
                assert sample.partitions == shape.partitions, "bulk create differs from create"
            # The bare HSET rows are the reference: the number of requests held cannot change
            # them, so a change of theirs from one size to the next is the machine's load.
            specs = [
                ("scale", "scale merge_publish_info", 1, "hot"),
                ("scale", "scale record_worker_report", 1, "hot"),
                ("scale", "bare HSET", 1, "hot"),
            ]
            if held:
                specs.append(("scale", "scale merge (random held)", 1, "random"))
                specs.append(("scale", "scale report (random held)", 1, "random"))
            rows = self.measure_group(
                specs, rounds=4, namespace=ns, rid="hot", held=held, duration=duration
            )
            for row in rows:
                row.target = f"{row.target} @{size:,}"
                row.details["held"] = size
        if self.own_server:
            self.client.flushall()
        else:
            self.cleanup(ns)


def _merge_counts(stats: Any) -> tuple[int, int]:
    """(merges committed, tries spent): a server-side merge commits in its one try."""
    if stats is None:
        return 0, 0
    server = getattr(stats, "server_merges", 0)
    return stats.transactions + server, stats.attempts + server


def bulk_create(
    store: RequestStore, shape: RequestShape, prefix: str, start: int, stop: int
) -> None:
    """Create requests ``<prefix>-<i>`` for i in [start, stop) quickly: the store's own create
    script, pipelined 500 at a time, with the fields of the identical states encoded once.

    Uses the store's internals (its layouts and scripts) because a pipeline of the public
    ``create_request`` is not offered; if they change, this falls back to one call per request.
    """
    try:
        from store import scripts
        from store.records import RequestRecord

        script = store.client.register_script(scripts.source("create_request"))
        record_layout, part_layout = store._record, store._partition
        conn_layout, encode_infos = store._connection, store._encode_infos
    except (AttributeError, KeyError, ImportError):
        for i in range(start, stop):
            shape.create(store, f"{prefix}-{i}")
        return
    keys = store.keys
    fixed: list[tuple[Callable[[str], str], dict[str, bytes]]] = []
    for name, state in shape.partitions.items():
        fixed.append((lambda rid, n=name: keys.partition(rid, n), part_layout.encode(state)))
        infos = encode_infos("bulk", "bulk", state.resource_publish_info)
        fixed.append((lambda rid, n=name: keys.publish_info(rid, n), infos))
    for name, conn in shape.connections.items():
        fixed.append((lambda rid, n=name: keys.connection(rid, n), conn_layout.encode(conn)))
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


def _used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def _micro(
    timers: dict[Any, Callable[[], Any]], batch_seconds: float, rounds: int
) -> dict[Any, float]:
    """µs per call of each timer: the fastest of ``rounds`` batches of ``batch_seconds``.

    The timers take turns batch by batch, so that msgspec and pickle meet the same load; and
    the fastest batch counts, not the mean: on a shared machine the slower ones measure the
    neighbours, not the code.
    """
    sizes = {}
    for key, fn in timers.items():
        fn()
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < 0.01:
            fn()
            n += 1
        sizes[key] = max(1, int(batch_seconds / ((time.perf_counter() - t) / n)))
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(rounds):
        for key, fn in timers.items():
            t = time.perf_counter()
            for _ in range(sizes[key]):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t) / sizes[key] * 1e6)
    return best


# -- ratios, checklist, table ------------------------------------------------------------------


def _table_order(row: Row) -> tuple[int, int, int, int, int]:
    """Sections in run order; within one, by operation, processes, then one before distinct.
    Scale rows stay in the order measured (by requests held)."""
    if row.section == "scale":
        return (SECTIONS.index("scale"), 0, 0, 0, 0)
    ops = [*BASELINE_OPS, *STORE_ROW_OPS]
    name = row.operation.split(" (")[0]  # a variant sorts beside its operation
    op = ops.index(name) if name in ops else len(ops)
    return (SECTIONS.index(row.section), op, row.procs or 0, row.target != "one", 0)


def _baseline_of(row: Row) -> str:
    """Which row of the same run this row is compared with (its key)."""
    if row.section in ("codec",):
        return row.baseline
    target = row.target if row.procs and row.procs > 1 else "one"
    if row.section == "scale":
        if row.operation == "bare HSET":
            return "bare HSET|1|hot @1"
        base = "merge_publish_info" if "merge" in row.operation else "record_worker_report"
        return f"scale {base}|1|hot @1"
    if row.operation == "bare PING":
        return ""
    if row.operation.startswith("bare") and row.procs == 1:
        return "bare PING|1|one"
    if row.operation.startswith("bare"):
        return f"{row.operation}|1|one"
    if row.operation.startswith(("merge_publish_info", "naive pickled request")):
        return f"bare WATCH/MULTI (3 RTT)|{row.procs}|{target}"
    return f"bare HSET|{row.procs}|{target}"


def add_ratios(rows: list[Row]) -> None:
    by_key = {r.key: r for r in rows}
    by_name = {r.operation: r for r in rows if r.section == "codec"}
    for row in rows:
        base = (
            by_name.get(row.baseline) if row.section == "codec" else by_key.get(_baseline_of(row))
        )
        if base is None:
            continue
        row.baseline = base.operation + (f" {base.procs}p {base.target}" if base.procs else "")
        if row.section == "codec":
            row.ratio_p50 = row.p50_us / base.p50_us  # type: ignore[operator]
            row.ratio_ops = row.details["bytes"] / base.details["bytes"]
        else:
            row.ratio_ops = row.ops_per_s / base.ops_per_s  # type: ignore[operator]
            row.ratio_p50 = row.p50_us / base.p50_us  # type: ignore[operator]


@dataclass
class Check:
    target: str
    met: bool | None
    measured: str


def checklist(rows: list[Row], memory: dict[str, Any], flat_tolerance: float) -> list[Check]:
    by_key = {r.key: r for r in rows}
    codec = {r.operation: r for r in rows if r.section == "codec"}
    checks: list[Check] = []

    def get(op: str, procs: int, target: str) -> Row | None:
        return by_key.get(f"{op}|{procs}|{target}")

    def ratio_check(
        text: str, a: float | None, b: float | None, limit: float, le: bool, unit: str = ""
    ) -> None:
        if a is None or b is None:
            checks.append(Check(text, None, "not measured"))
            return
        r = a / b
        measured = f"{r:.3f}x ({a:,.0f} vs {b:,.0f} {unit})" if unit else f"{r:.2f}x"
        checks.append(Check(text, r <= limit if le else r >= limit, measured))

    merge1 = get("merge_publish_info", 1, "one")
    watch1 = get("bare WATCH/MULTI (3 RTT)", 1, "one")
    ratio_check(
        "uncontended merge p50 <= 0.9x bare 3-RTT WATCH/MULTI p50",
        merge1 and merge1.p50_us,
        watch1 and watch1.p50_us,
        0.9,
        True,
    )
    report1, hset1 = get("record_worker_report", 1, "one"), get("bare HSET", 1, "one")
    ratio_check(
        "report (no published info) ops/s >= 0.8x bare HSET (1 proc)",
        report1 and report1.ops_per_s,
        hset1 and hset1.ops_per_s,
        0.8,
        False,
    )
    m16, m16d = get("merge_publish_info", 16, "one"), get("merge_publish_info", 16, "distinct")
    ratio_check(
        "16 procs, one partition: committed merges/s >= 1.0x one process",
        m16 and m16.ops_per_s,
        merge1 and merge1.ops_per_s,
        1.0,
        False,
    )
    ratio_check(
        "16 procs, one partition: p99 <= 3x p99 of 16 procs on distinct requests",
        m16 and m16.p99_us,
        m16d and m16d.p99_us,
        3.0,
        True,
    )
    merges = [r for r in rows if r.operation == "merge_publish_info"]
    if merges:
        lost = [r for r in merges if not r.details.get("verified")]
        checks.append(
            Check(
                "merges: nothing lost (op ids and positions verified, every row)",
                not lost,
                f"{len(merges) - len(lost)}/{len(merges)} rows verified",
            )
        )
        gave_up = sum(r.details.get("gave_up", 0) for r in merges)
        checks.append(
            Check(
                "merges: no TransactionConflictError at default settings",
                gave_up == 0,
                f"{gave_up} calls gave up",
            )
        )
    for name, pickled in (
        ("codec PartitionState msgspec", "codec PartitionState pickle"),
        ("codec KV info msgspec (kind)", "codec KV info pickle"),
    ):
        a, b = codec.get(name), codec.get(pickled)
        ratio_check(
            f"{name}: encode+decode time <= 0.4x pickle", a and a.p50_us, b and b.p50_us, 0.4, True
        )
        ratio_check(
            f"{name}: bytes <= pickle bytes",
            a and a.details["bytes"],
            b and b.details["bytes"],
            1.0,
            True,
            unit="B",
        )
    sizes = sorted({r.details.get("held", 0) for r in rows if r.section == "scale"})
    reference = {
        r.details["held"]: r.p50_us
        for r in rows
        if r.section == "scale" and r.operation == "bare HSET"
    }
    for op in ("scale merge_publish_info", "scale record_worker_report"):
        scale = {r.details["held"]: r for r in rows if r.operation == op}
        if len(sizes) < 2 or not scale:
            continue
        lo, hi = sizes[0], sizes[-1]
        raw = scale[hi].p50_us / scale[lo].p50_us  # type: ignore[operator]
        drift = reference[hi] / reference[lo]  # type: ignore[operator]
        checks.append(
            Check(
                f"{op.split()[1]} p50 flat from {lo:,} to {hi:,} requests held (within "
                f"{flat_tolerance:.2f}x, after dividing out the bare HSET reference's drift)",
                raw / drift <= flat_tolerance,
                f"{raw / drift:.2f}x (raw {raw:.2f}x, reference drift {drift:.2f}x)",
            )
        )
    return checks


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(rows: list[Row], checks: list[Check], memory: dict[str, Any]) -> str:
    header = [
        "operation",
        "procs",
        "target",
        "ops/s",
        "p50 µs",
        "p99 µs",
        "retries/commit",
        "baseline",
        "x ops/s",
        "x p50",
        "notes",
    ]
    table = [header]
    section = None
    breaks = []
    for row in rows:
        if row.section != section:
            breaks.append(len(table))
            section = row.section
        ratio_ops = _fmt(row.ratio_ops, ".2f") + ("x" if row.ratio_ops is not None else "")
        if row.section == "codec" and row.ratio_ops is not None:
            ratio_ops += " B"
        table.append(
            [
                row.operation,
                _fmt(row.procs, "d"),
                row.target,
                _fmt(row.ops_per_s, ",.0f"),
                _fmt(row.p50_us, ",.1f" if (row.p50_us or 0) < 100 else ",.0f"),
                _fmt(row.p99_us, ",.0f"),
                _fmt(row.retries_per_commit, ".2f"),
                row.baseline,
                ratio_ops,
                _fmt(row.ratio_p50, ".2f") + ("x" if row.ratio_p50 is not None else ""),
                row.notes,
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    right = {1, 3, 4, 5, 6, 8, 9}
    lines = []
    for n, line in enumerate(table):
        if n in breaks and n > 1:
            lines.append("")
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(line)
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if memory:
        lines.append("")
        for held in memory.values():
            lines.append(
                f"Redis memory per held request (2 partitions, 1 connection, KV of "
                f"{RANKS} ranks), {held['requests']:,} held: "
                f"{held['bytes_per_request']:,.0f} B"
            )
    lines.append("")
    lines.append("Targets (issue 5):")
    for check in checks:
        state = "n/a" if check.met is None else ("met" if check.met else "NOT met")
        lines.append(f"  [{state:^7}] {check.target}: {check.measured}")
    return "\n".join(lines)


# -- comparing two runs ----------------------------------------------------------------------


def compare(old_path: str, new_path: str) -> str:
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    before = {(r["operation"], r["procs"], r["target"]): r for r in old["rows"]}
    lines = [
        f"{'operation':32} {'procs':>5} {'target':14} {'ops/s old':>10} {'ops/s new':>10} "
        f"{'new/old':>8} {'p50 old':>9} {'p50 new':>9} {'new/old':>8}"
    ]
    for r in new["rows"]:
        o = before.get((r["operation"], r["procs"], r["target"]))
        if o is None or not o["ops_per_s"] or not o["p50_us"]:
            continue
        lines.append(
            f"{r['operation']:32} {r['procs'] if r['procs'] is not None else '-':>5} "
            f"{r['target']:14} {o['ops_per_s']:>10,.0f} {r['ops_per_s']:>10,.0f} "
            f"{r['ops_per_s'] / o['ops_per_s']:>7.2f}x {o['p50_us']:>9,.1f} {r['p50_us']:>9,.1f} "
            f"{r['p50_us'] / o['p50_us']:>7.2f}x"
        )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------

SECTIONS = ("baseline", "store", "codec", "scale")


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--redis-url",
        help="use this Redis instead of starting one (only the "
        "run's own namespace is written and deleted)",
    )
    parser.add_argument("--quick", action="store_true", help="0.7 s per row, 10,000 held")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--flat-tolerance",
        type=float,
        default=1.25,
        help="p50 at the most requests held over p50 at 1 that counts as flat",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="print per-row ratios of two JSON results and exit",
    )
    return parser.parse_args(argv)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mstar-bench-") as tmp:
        server = None
        url = args.redis_url
        if url is None:
            from tests.servers import RedisServer  # only needed when we start one

            server = RedisServer(Path(tmp)).start()
            url = server.url
        pool = Pool(max(PROCS))
        try:
            bench = Bench(url, server is not None, args.quick, pool)
            info = bench.client.info("server")
            bench.table(sections)
            if "codec" in sections:
                bench.codec()
            if "scale" in sections:
                bench.scale()
        finally:
            pool.close()
            if server is not None:
                server.stop()
    bench.rows.sort(key=_table_order)
    add_ratios(bench.rows)
    checks = checklist(bench.rows, bench.memory, args.flat_tolerance)
    print(render(bench.rows, checks, bench.memory))
    elapsed = time.perf_counter() - started
    load = (load_before, os.getloadavg()[0])
    cpus = os.cpu_count() or 1
    print(
        f"\n(run took {elapsed:.0f} s; {'--quick' if args.quick else 'full'}; "
        f"redis {info['redis_version']}, redis-py {redis.__version__}, "
        f"msgspec {msgspec.__version__}, Python {platform.python_version()}, "
        f"{cpus} CPUs, load average {load[0]:.1f} before and {load[1]:.1f} after)"
    )
    if max(load) > cpus:
        print(
            "warning: the machine was busy with other work (load average above the CPU count); "
            "absolute figures are low and ratios noisy: run again when it is quiet"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "meta": {
                    "quick": args.quick,
                    "duration_per_row_s": bench.duration,
                    "elapsed_s": elapsed,
                    "redis": info["redis_version"],
                    "redis_py": redis.__version__,
                    "msgspec": msgspec.__version__,
                    "python": platform.python_version(),
                    "cpus": cpus,
                    "load_average": load,
                    "own_server": server is not None,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
                "rows": [r.__dict__ for r in bench.rows],
                "memory": bench.memory,
                "checks": [c.__dict__ for c in checks],
            },
            indent=1,
        )
    )
    print(f"results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
