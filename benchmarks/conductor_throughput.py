"""Passes per second and CPU per pass of mstar-ai's own ``Conductor`` driven by emulated
workers, store-backed (``store.integrations.mstar.StoreConductor``) against in-memory (the
engine's ``Conductor`` unmodified), at 1 and 256 requests in flight, in one run.

    python -m benchmarks.conductor_throughput            # ~8 minutes on 2 cores
    python -m benchmarks.conductor_throughput --quick    # 1 and 64 in flight, ~20 s
    python -m benchmarks.conductor_throughput --profile  # and where the store-backed turns'
                                                         # CPU goes at 256 (cProfile, top 15)

The issue's targets: store-backed passes/s >= 0.25x the in-memory conductor's at 256 in
flight, and <= 300 µs added p50 latency per pass at 1 in flight. A script that prints
figures (not a timed test). It starts its own ``redis-server`` (no persistence, a free port,
a temporary directory) pinned to CPU 1 where it can and pins itself to CPU 0 (as
``benchmarks.script_costs``); the Redis at 6379 is never touched.

**The conductors** (``tests.engine.oracle``): no workers, no sockets. The in-memory one is
``make_conductor``'s; the store-backed one is built the same way with ``launch=False`` (as
``tests/engine/test_store_conductor.py``), on ``RequestStore`` over the private server. Each
turn is one iteration of the engine's run loop (``run_loop_once``). Both get the same
communicator, ``PicklingCommunicator``: what the engine's ZMQ communicator does in the
conductor's process minus the socket calls, ``pickle.dumps`` of every message sent (at the
send, as ``send_pyobj``) and ``pickle.loads`` of every message received (``recv_pyobj``).
The messages delivered are pickled before the turn, outside the timing.

**The stand-in model** (``BenchModel``, a ``ScriptedModel`` with its forward-pass decision
replaced): 2 partitions, ``p0`` (walks prefill -> decode) streaming to ``p1`` over edge
``s01``, each pass one worker graph of 2 TP ranks (workers 0 and 1, colocated); 64 passes per
partition per request (so 128 passes a request), max output tokens far above that. Every
pass sends inputs (no self-triggered passes): the tensors its ranks persisted in the pass
before (one per rank), the previous ones unpersisted, so a request stays the same size pass
after pass; a partition's first pass gets a signal-only edge (``p0`` also the prompt tensor
from the preprocess worker, persisted to the end).

**The emulated workers**, between turns, outside the timing: each ``NewRequest`` or
``InputSignals`` (carrying inputs) of a pass not answered yet gets the ``WorkerGraphsDone``
of each rank of each worker graph of that pass's walk (``is_first_tp_rank`` for the first
worker of ``worker_graph_to_workers[wg]``), each carrying a persisted ``TensorPointerInfo``
of its own, token counts by edge name, the stream tokens consumed (``p1``) and an output's
loop indices; a ``DrainRequest`` gets the entity's ``ReadsDone``; a ``request_complete`` gets
the preprocess worker's ``ReadsDone``, and a new request is submitted in its place. The
store-backed conductor's sends of a turn leave at its next turn's commit, so the workers
answer what left, whenever it left. All replies go to the conductor at its next turn.

**Ramp**: requests start a few per turn (in flight / turns in a request's life), so at 256
their ages are spread and ingest and teardown fall in every turn; then the forms are
measured in alternating rounds, carrying on their requests, so each meets the same machine.

**Figures**, per form and requests in flight:

- ``passes/s``: passes completed (their last rank's report delivered) / wall time of the
  conductor's turns (only the turns: the emulated workers' time is outside); the
  store-backed form's turns that only commit count too (at 1 in flight every other turn).
- ``CPU µs/pass``: ``time.process_time()`` over the same turns (this process only).
- ``Redis CPU µs/pass`` (store-backed): the server process's ``used_cpu_sys+user`` (``INFO
  cpu``, read around each round) over the same passes, and the commands per pass
  (``INFO commandstats``).
- ``p50/p99 µs``: per pass, from the start of the turn that delivered its last report to
  when the last of the next pass's inputs left the conductor (store-backed: sent after the
  turn's commit, timestamped in the communicator's ``send``); the last pass of a request,
  which has no next pass, is not counted.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import types as store_types

if not store_types.engine_importable():  # pragma: no cover - the engine job has it
    raise SystemExit("mstar-ai is not installed: pip install 'mstar-store[engine]'")

from mstar.api_server.request_types import APIServerMessage
from mstar.model.base import ForwardPassArgs
from mstar.utils.ipc_format import (
    ConductorMessage,
    ConductorMessageType,
    DrainRequest,
    InputSignals,
    NewRequest,
    NewRequestConductor,
    ReadsDone,
    WorkerGraphsDone,
    WorkerMessage,
)

from benchmarks import server as stats
from benchmarks.script_costs import _pin, _server
from mstar.conductor.request_info import CurrentForwardConductorMetadata
from mstar.graph.base import GraphEdge, TensorPointerInfo
from mstar.graph.loop_indices import NestedLoopIndices
from store import RequestStore
from store.integrations.mstar import StoreConductor
from tests.engine.oracle import (
    PREPROCESS_WORKER,
    ConnectionShape,
    PartitionShape,
    RecordingCommunicator,
    ScriptedModel,
    Shape,
    StageShape,
    WalkShape,
    make_conductor,
    run_loop_once,
    unlaunched,
    write_config,
)

PASSES = 64  # per partition per request
EDGE = "s01"
PERSISTED = {"p0": "tok", "p1": "ctx"}  # the signal each partition's ranks persist
SHAPE = Shape(
    partitions=(
        PartitionShape(
            "p0",
            stages=(StageShape(nodes=("p0_s0n0",), ranks=(0, 1)),),
            walks=(WalkShape("p0_prefill", (0,)), WalkShape("p0_decode", (0,))),
            passes=PASSES,
        ),
        PartitionShape(
            "p1",
            stages=(StageShape(nodes=("p1_s0n0",), ranks=(0, 1)),),
            walks=(WalkShape("p1_chunk", (0,)),),
            passes=PASSES,
        ),
    ),
    connections=(ConnectionShape("p0", "p1", EDGE),),
)
MAX_OUTPUT_TOKENS = 1_000_000
# passes measured per form, by requests in flight, in alternating rounds
FULL = {1: 20_000, 256: 100_000}
QUICK = {1: 400, 64: 4_000}  # 64, not 256: the ramp to 256 alone takes ~20 s
ROUNDS, QUICK_ROUNDS = 8, 2
PROFILE_PASSES, PROFILE_IN_FLIGHT = 50_000, 256

# The targets.
TARGET_RATIO = 0.25  # store-backed passes/s over in-memory's, at 256 in flight
TARGET_ADDED_P50_US = 300.0  # store-backed p50 - in-memory p50, at 1 in flight

IN_MEMORY, STORE_BACKED = "in-memory", "store-backed"


# -- the model -----------------------------------------------------------------------------


class BenchModel(ScriptedModel):
    """``ScriptedModel(SHAPE)`` whose every pass sends inputs: the tensors the partition's
    ranks persisted in the pass before (the older ones unpersisted), or a signal-only edge."""

    def get_initial_forward_pass_args(self, partition_name: str, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        fwd = super().get_initial_forward_pass_args(partition_name, *args, **kwargs)
        if not fwd.inputs and not fwd.request_done:  # the consumer: triggered too
            first = self._first_nodes(self.shape.partition(partition_name))[0]
            fwd.inputs = [GraphEdge(next_node=first, name="x")]
        return fwd

    def get_partition_forward_pass_args(
        self,
        partition_name: str,
        partition_metadata: CurrentForwardConductorMetadata,
        persist_signals: dict[str, list[TensorPointerInfo]],
        incoming_connections: Any = None,
    ) -> ForwardPassArgs:
        p = self.shape.partition(partition_name)
        step = int(partition_metadata.kwargs.get("step", 0)) + 1
        walk = p.walks[-1].name
        metadata = CurrentForwardConductorMetadata(
            graph_walk=walk,
            is_prefill=False,
            input_modalities=list(partition_metadata.input_modalities),
            output_modalities=list(partition_metadata.output_modalities),
            kwargs=dict(partition_metadata.kwargs),
        )
        step_metadata = {"step": step, "walk": walk}
        if step >= p.passes:
            return ForwardPassArgs(metadata, [], [], request_done=True, step_metadata=step_metadata)
        held = persist_signals.get(PERSISTED[partition_name], [])
        ranks = len(p.stages[0].ranks)
        latest, older = held[-ranks:], held[:-ranks]
        first = self.walk_nodes(walk)[0]
        name = PERSISTED[partition_name]
        inputs = [GraphEdge(next_node=first, name=name, tensor_info=list(latest))]
        if not latest:
            inputs = [GraphEdge(next_node=first, name="x")]
        return ForwardPassArgs(metadata, inputs, list(older), step_metadata=step_metadata)


# -- the conductors --------------------------------------------------------------------------


class PicklingCommunicator(RecordingCommunicator):
    """The engine's ZMQ communicator without its sockets: ``send`` pickles the message (as
    ``send_pyobj``) and keeps ``(destination, bytes, perf_counter_ns)``; ``inbox`` holds
    pickled messages, unpickled when the conductor takes them (as ``recv_pyobj``).

    With ``pickled=False`` (``--transport none``) messages go both ways as the objects
    themselves, neither pickled nor copied: the conductor's decisions alone. (The emulated
    workers build every message afresh and read only what the conductor does not change
    after sending.)"""

    def __init__(self, pickled: bool = True) -> None:
        super().__init__()
        self.pickled = pickled

    def send(self, entity_id: str, msg: Any) -> None:
        data = pickle.dumps(msg, pickle.DEFAULT_PROTOCOL) if self.pickled else msg
        self.sent.append((entity_id, data, time.perf_counter_ns()))

    def get_all_new_messages(self, *args: Any, **kwargs: Any) -> list[Any]:
        inbox, self.inbox = self.inbox, []
        return [pickle.loads(data) for data in inbox] if self.pickled else inbox


def in_memory_conductor(tmp: Path, pickled: bool) -> tuple[Any, PicklingCommunicator]:
    conductor = make_conductor(SHAPE, tmp)
    conductor.model = BenchModel(SHAPE)  # the same graphs: only its forward-pass args differ
    comm = PicklingCommunicator(pickled)
    conductor.communicator = comm
    return conductor, comm


def store_conductor(
    tmp: Path, store: RequestStore, pickled: bool
) -> tuple[Any, PicklingCommunicator]:
    config = write_config(SHAPE, tmp)
    with unlaunched():
        conductor = StoreConductor(
            BenchModel(SHAPE), str(config), store=store, deployment="bench", launch=False,
            socket_path_prefix=str(tmp / "sockets"), stall_timeout=3600.0,
        )  # fmt: skip
    comm = PicklingCommunicator(pickled)
    conductor.communicator.inner = comm
    return conductor, comm


# -- the emulated workers ----------------------------------------------------------------------


def _msg(kind: ConductorMessageType, body: Any) -> ConductorMessage:
    return ConductorMessage(message_type=kind, body=body)


def _tensor(
    tensor_id: str, entity: str, rank: int, tp: int, node: str | None, walk: str | None
) -> TensorPointerInfo:
    return TensorPointerInfo(
        dims=[1, 4096], dtype="bfloat16", nbytes=8192, address=0x7F00_0000_0000,
        stride=[4096, 1], uuid=tensor_id, source_session_id=f"session-{entity}",
        source_entity=entity, source_tp_size=tp, source_tp_rank=rank,
        _source_node_name=node, _source_graph_walk=walk,
    )  # fmt: skip


def new_request(rid: str, seed: int) -> ConductorMessage:
    """The API server's NEW_REQUEST: the prompt persisted by the preprocess worker."""
    prompt = _tensor(f"{rid}/prompt", PREPROCESS_WORKER, 0, 1, None, None)
    return _msg(
        ConductorMessageType.NEW_REQUEST,
        NewRequestConductor(
            request_id=rid, initial_signals={"prompt": [prompt]},
            initial_input_modalities=["text"], initial_output_modalities=["text", "audio"],
            input_metadata={}, model_kwargs={"max_output_tokens": MAX_OUTPUT_TOKENS, "seed": seed},
        ),
    )  # fmt: skip


@dataclass
class Workers:
    """Every worker of the deployment, answering what the conductor sent (see the module
    docstring); and the bookkeeping of passes and latencies."""

    walk_wgs: dict[str, list[str]]  # graph walk -> its worker graphs (the deployment's)
    wg_nodes: dict[str, str]  # worker graph -> a node of it
    in_flight: int
    ramp: int  # new requests per turn until in_flight are
    prefix: str
    pickled: bool
    pending: list[Any] = field(default_factory=list)  # to the conductor at its next turn
    live: int = 0
    submitted: int = 0
    completed: int = 0
    answered: dict[tuple[str, str], int] = field(default_factory=dict)  # pass last answered
    assignments: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    passes_delivered: int = 0  # passes whose reports went with ``pending``
    awaiting: dict[tuple[str, str, int], int] = field(default_factory=dict)  # pass -> delivered at
    latencies_ns: list[int] = field(default_factory=list)
    submit: bool = True
    _completing: list[tuple[str, str, int]] = field(default_factory=list)

    @classmethod
    def of(
        cls, conductor: Any, in_flight: int, turns_per_pass: int, prefix: str, pickled: bool
    ) -> Workers:
        walk_wgs: dict[str, list[str]] = {}
        wg_nodes: dict[str, str] = {}
        for wg_id, wg in sorted(conductor.worker_graphs.items()):
            for walk in wg.graph_walks:
                walk_wgs.setdefault(walk, []).append(wg_id)
            wg_nodes[wg_id] = sorted(wg.section.get_nodes())[0]
        life = PASSES * turns_per_pass + 2
        ramp = max(1, -(-in_flight // life))
        return cls(walk_wgs, wg_nodes, in_flight, ramp, prefix, pickled)

    def top_up(self) -> None:
        """Submit new requests: a few per turn up to ``in_flight``."""
        for _ in range(min(self.ramp, self.in_flight - self.live)):
            if not self.submit:
                return
            rid = f"{self.prefix}-{self.submitted:07d}"
            self.pending.append(new_request(rid, self.submitted))
            self.submitted += 1
            self.live += 1

    def take(self) -> tuple[list[Any], int, list[tuple[str, str, int]]]:
        """What goes to the conductor now: messages (pickled, as the transport carries
        them), passes they complete, those passes."""
        out, self.pending = self.pending, []
        if self.pickled:
            out = [pickle.dumps(m, pickle.DEFAULT_PROTOCOL) for m in out]
        passes, self.passes_delivered = self.passes_delivered, 0
        keys, self._completing = self._completing, []
        return out, passes, keys

    def answer(
        self, sent: list[tuple[str, Any, int]], delivered: dict[tuple[str, str, int], int]
    ) -> None:
        """Read what left the conductor; queue the replies; close the latencies of passes
        whose next pass's inputs left (``delivered``: pass -> when its last report went)."""
        last_send: dict[tuple[str, str, int], int] = {}
        started: dict[tuple[str, str], int] = {}  # (request, partition) -> pass, this batch
        for destination, data, at in sent:
            message = pickle.loads(data) if self.pickled else data
            body = message.body
            if isinstance(message, APIServerMessage):
                if message.message_type == "request_complete":
                    self.pending.append(
                        _msg(
                            ConductorMessageType.READS_DONE,
                            ReadsDone(request_id=body.request_id, entity_id=PREPROCESS_WORKER),
                        )
                    )
                    self.live -= 1
                    self.completed += 1
                    self.assignments.pop(body.request_id, None)
                    for p in PERSISTED:
                        self.answered.pop((body.request_id, p), None)
                        delivered.pop((body.request_id, p, PASSES), None)
                elif message.message_type == "request_failed":
                    raise SystemExit(f"request {body.request_id} failed: {body.error_message}")
                continue
            if not isinstance(message, WorkerMessage):
                continue
            if isinstance(body, DrainRequest):
                self.pending.append(
                    _msg(
                        ConductorMessageType.READS_DONE,
                        ReadsDone(request_id=body.request_id, entity_id=destination),
                    )
                )
            elif isinstance(body, NewRequest):
                self.assignments[body.request_id] = body.worker_graph_to_workers
                self._run(body.request_info, started)
            elif isinstance(body, InputSignals) and body.inputs:
                key = self._run(body.request_info, started)
                last_send[key] = max(last_send.get(key, 0), at)
        for key, at in last_send.items():
            start = delivered.pop(key, None)
            if start is not None:
                self.latencies_ns.append(at - start)

    def _run(self, info: Any, started: dict[tuple[str, str], int]) -> tuple[str, str, int]:
        """A pass's inputs arrived (at one of its workers): every rank of every worker graph
        of its walk reports, once. Its number is counted here: the engine's ``fwd_index``
        in ``InputSignals`` is the pass before's (it increments after sending)."""
        rid, partition = info.request_id, info.partition_name
        fwd = started.get((rid, partition))
        if fwd is not None:  # another worker's copy of the same pass
            return rid, partition, fwd
        fwd = started[rid, partition] = self.answered.get((rid, partition), -1) + 1
        self.answered[rid, partition] = fwd
        wg_to_workers = self.assignments[rid]
        walk = info.graph_walk
        name = PERSISTED[partition]
        for wg in self.walk_wgs[walk]:
            workers = wg_to_workers[wg]
            for rank, worker in enumerate(workers):
                tensor = _tensor(
                    f"{rid}/{partition}/{fwd}/{rank}", worker, rank, len(workers),
                    self.wg_nodes[wg], walk,
                )  # fmt: skip
                body = WorkerGraphsDone(
                    request_id=rid,
                    worker_graph_ids=[wg],
                    is_first_tp_rank=rank == 0,
                    persist_signals={name: [tensor]},
                    new_token_counts={EDGE: 1, "text": 1} if partition == "p0" else {"audio": 1},
                    partition_name=partition,
                    stream_tokens_consumed={EDGE: fwd} if partition == "p1" else {},
                    output_loop_indices={
                        f"{partition}_out": NestedLoopIndices(["outer"], {"outer": fwd}, fwd)
                    },
                )
                self.pending.append(_msg(ConductorMessageType.WORKER_GRAPHS_DONE, body))
        self.passes_delivered += 1
        self._completing.append((rid, partition, fwd + 1))
        return rid, partition, fwd


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Form:
    name: str
    conductor: Any
    comm: PicklingCommunicator
    workers: Workers
    info: Any = None  # a client of the form's Redis, for its counters (store-backed only)
    turns: int = 0
    passes: int = 0
    wall_ns: int = 0
    cpu_ns: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    delivered: dict[tuple[str, str, int], int] = field(default_factory=dict)

    def turn(self, profiler: cProfile.Profile | None = None) -> int:
        """One turn of the run loop on what the workers sent; then their answers (untimed).
        Returns the passes it completed."""
        self.workers.top_up()
        messages, passes, keys = self.workers.take()
        self.comm.inbox.extend(messages)
        if profiler is not None:
            profiler.enable()
        cpu = time.process_time_ns()
        start = time.perf_counter_ns()
        outcome = run_loop_once(self.conductor, [])
        end = time.perf_counter_ns()
        cpu = time.process_time_ns() - cpu
        if profiler is not None:
            profiler.disable()
        if outcome.error is not None:
            raise SystemExit(f"{self.name}: the run loop raised {outcome.error!r}")
        for key in keys:
            self.delivered[key] = start
        sent, self.comm.sent = self.comm.sent, []
        self.workers.answer(sent, self.delivered)
        self.turns += 1
        self.passes += passes
        self.wall_ns += end - start
        self.cpu_ns += cpu
        return passes

    def warm(self) -> None:
        """Ramp up to the in-flight count (untimed): a few requests a turn over a request's
        life, so their ages are spread evenly; at 1 in flight, one request's life."""
        w = self.workers
        while w.submitted < w.in_flight or (w.in_flight == 1 and w.completed < 1):
            self.turn()
        self.reset()

    def reset(self) -> None:
        self.turns = self.passes = self.wall_ns = self.cpu_ns = 0
        self.counters.clear()
        self.workers.latencies_ns.clear()

    def run(self, passes: int, profiler: cProfile.Profile | None = None) -> None:
        before = stats.snapshot(self.info) if self.info is not None else None
        goal = self.passes + passes
        while self.passes < goal:
            self.turn(profiler)
        if before is not None:
            self.counters.update(stats.difference(before, stats.snapshot(self.info)))

    def figures(self) -> dict[str, float]:
        lat = sorted(self.workers.latencies_ns)
        n = self.passes
        calls = {
            k.removeprefix("calls:"): v for k, v in self.counters.items() if k.startswith("calls:")
        }
        calls.pop("info", None)
        return {
            "passes_s": n / (self.wall_ns / 1e9),
            "wall_us": self.wall_ns / n / 1e3,
            "cpu_us": self.cpu_ns / n / 1e3,
            "redis_cpu_us": self.counters.get("cpu_us", 0) / n
            if self.info is not None
            else float("nan"),
            "cmds": sum(calls.get(c, 0) for c in TOP_LEVEL) / n
            if self.info is not None
            else float("nan"),
            "p50_us": statistics.median(lat) / 1e3 if lat else float("nan"),
            "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e3 if lat else float("nan"),
            "turns_per_pass": self.turns / n,
        }


# commands the store sends itself (scripts' redis.calls are counted under their own names too)
TOP_LEVEL = ("evalsha", "eval", "get", "multi", "exec", "hgetall", "hmget", "zrange", "script")


def build(
    name: str, in_flight: int, tmp: Path, client: Any, namespace: str, pickled: bool = True
) -> Form:
    if name == IN_MEMORY:
        conductor, comm = in_memory_conductor(tmp / f"mem-{in_flight}", pickled)
        workers = Workers.of(conductor, in_flight, 1, f"m{in_flight}", pickled)
        return Form(name, conductor, comm, workers)
    store = RequestStore(client, namespace=namespace)
    conductor, comm = store_conductor(tmp / f"store-{in_flight}", store, pickled)
    workers = Workers.of(conductor, in_flight, 2, f"s{in_flight}", pickled)
    return Form(name, conductor, comm, workers, info=client)


def check(form: Form) -> None:
    """The conductor carries as many requests as the workers think live (those it
    completed but whose answer the store-backed one holds until its next commit count as
    live); the store holds the store-backed one's."""
    live = len(form.conductor.requests) - len(form.conductor.draining)
    held = getattr(form.conductor.communicator, "_sends", [])  # to leave at the next commit
    live += sum(
        isinstance(m, APIServerMessage) and m.message_type == "request_complete" for _, m in held
    )
    if live != form.workers.live:
        raise SystemExit(
            f"{form.name}: {live} requests live, the workers count {form.workers.live}"
        )
    if isinstance(form.conductor, StoreConductor):
        held = len(form.conductor._store.list_conductor_requests())
        if held != len(form.conductor.requests):
            raise SystemExit(
                f"{form.name}: the store holds {held}, the conductor {len(form.conductor.requests)}"
            )


# -- the report -----------------------------------------------------------------------------

COLUMNS = (
    ("passes_s", "passes/s", "{:,.0f}"),
    ("wall_us", "wall µs/pass", "{:.1f}"),
    ("cpu_us", "CPU µs/pass", "{:.1f}"),
    ("redis_cpu_us", "Redis CPU µs", "{:.1f}"),
    ("cmds", "cmds/pass", "{:.2f}"),
    ("p50_us", "p50 µs", "{:.0f}"),
    ("p99_us", "p99 µs", "{:.0f}"),
    ("turns_per_pass", "turns/pass", "{:.3f}"),
)


def table(rows: dict[tuple[int, str], dict[str, float]]) -> list[str]:
    lines = [f"{'in flight':>9}  {'conductor':12}" + "".join(f"  {t:>12}" for _, t, _ in COLUMNS)]
    for (n, name), row in rows.items():
        cells = "".join(f"  {fmt.format(row[k]):>12}" for k, _, fmt in COLUMNS)
        lines.append(f"{n:>9}  {name:12}{cells}".replace("nan", "  -"))
    lines += [
        "",
        f"{'store-backed / in-memory':24}  {'passes/s':>9}  {'CPU/pass':>9}  {'p50':>9}"
        f"  {'p50 added':>10}",
    ]
    for n in sorted({n for n, _ in rows}):
        mem, ours = rows[n, IN_MEMORY], rows[n, STORE_BACKED]
        lines.append(
            f"{f'{n} in flight':24}  {ours['passes_s'] / mem['passes_s']:8.3f}x  "
            f"{ours['cpu_us'] / mem['cpu_us']:8.2f}x  {ours['p50_us'] / mem['p50_us']:8.2f}x  "
            f"{ours['p50_us'] - mem['p50_us']:+7.0f} µs"
        )
    return lines


def verdicts(rows: dict[tuple[int, str], dict[str, float]]) -> list[str]:
    hi, lo = max(n for n, _ in rows), min(n for n, _ in rows)
    ratio = rows[hi, STORE_BACKED]["passes_s"] / rows[hi, IN_MEMORY]["passes_s"]
    added = rows[lo, STORE_BACKED]["p50_us"] - rows[lo, IN_MEMORY]["p50_us"]
    ok_ratio, ok_added = ratio >= TARGET_RATIO, added <= TARGET_ADDED_P50_US
    return [
        f"target: store-backed passes/s >= {TARGET_RATIO}x in-memory at {hi} in flight: "
        f"{ratio:.3f}x  {'PASS' if ok_ratio else 'FAIL'}",
        f"target: added p50 latency per pass <= {TARGET_ADDED_P50_US:.0f} µs at {lo} in flight: "
        f"{added:+.0f} µs  {'PASS' if ok_added else 'FAIL'}",
    ]


def commands(breakdown: dict[int, tuple[Counter[str], int]]) -> list[str]:
    """The store-backed form's commands per pass, by name (INFO commandstats: a script's
    redis.calls are counted under their own names too, marked ``(in scripts)``)."""
    lines = ["store-backed: Redis commands per pass (INFO commandstats; calls, µs)"]
    for n, (counters, passes) in breakdown.items():
        names = sorted(
            (k.removeprefix("calls:") for k in counters if k.startswith("calls:")),
            key=lambda c: -counters[f"usec:{c}"],
        )
        cells = [
            f"{c}{'' if c in TOP_LEVEL else ' (in scripts)'} {counters[f'calls:{c}'] / passes:.2f}"
            f", {counters[f'usec:{c}'] / passes:.1f} µs"
            for c in names
            if c != "info"
        ]
        lines.append(f"  {n} in flight: " + "; ".join(cells))
    return lines


def profile(tmp: Path, client: Any, passes: int, pickled: bool) -> list[str]:
    """cProfile of the store-backed conductor's turns only, at 256 in flight."""
    n = PROFILE_IN_FLIGHT
    form = build(STORE_BACKED, n, tmp / "profile", client, "mstar-bench-ct-prof", pickled)
    form.warm()
    profiler = cProfile.Profile()
    form.run(passes, profiler)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(15)
    lines = [f"cProfile: the store-backed conductor's turns at {n} in flight, "
             f"{form.passes:,} passes, top 15 by cumulative time"]  # fmt: skip
    lines += [line for line in out.getvalue().splitlines() if line.strip()][2:]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer passes")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile the store-backed turns at 256"
    )
    parser.add_argument(
        "--transport",
        choices=("pickle", "none"),
        default="pickle",
        help="pickle: messages pickled as the engine's ZMQ communicator does (default); "
        "none: handed over as objects, the conductor's decisions alone",
    )
    options = parser.parse_args(argv)
    pickled = options.transport == "pickle"
    targets = QUICK if options.quick else FULL
    rounds = QUICK_ROUNDS if options.quick else ROUNDS
    load = os.getloadavg()[0]
    rows: dict[tuple[int, str], dict[str, float]] = {}
    breakdown: dict[int, tuple[Counter[str], int]] = {}
    with tempfile.TemporaryDirectory(prefix="mstar-conductor-throughput-") as workdir:
        tmp = Path(workdir)
        server = _server(tmp)
        try:
            _pin(0)
            client = server.client()
            for n in targets:
                forms = [
                    build(name, n, tmp, client, f"mstar-bench-ct{n}", pickled)
                    for name in (IN_MEMORY, STORE_BACKED)
                ]
                for form in forms:
                    form.warm()
                for r in range(rounds):  # alternating: each meets the same machine state
                    for form in forms[r % 2 :] + forms[: r % 2]:
                        form.run(targets[n] // rounds)
                for form in forms:
                    check(form)
                    rows[n, form.name] = form.figures()
                    if form.info is not None:
                        breakdown[n] = (form.counters, form.passes)
                    print(f"{n} in flight, {form.name}: {form.passes:,} passes in "
                          f"{form.turns:,} turns, {form.workers.completed:,} requests completed",
                          file=sys.stderr, flush=True)  # fmt: skip
            print("\n".join(table(rows)))
            print()
            print("\n".join(verdicts(rows)))
            print()
            print("\n".join(commands(breakdown)))
            version = client.info("server")["redis_version"]
            cpus, after = os.cpu_count() or 1, os.getloadavg()[0]
            shown = ", ".join(f"{p:,} passes at {n}" for n, p in targets.items())
            print(f"\n(redis {version}; a request: {len(SHAPE.partitions)} partitions x {PASSES} "
                  f"passes of a 2-rank worker graph; {shown} in flight per form, in {rounds} "
                  f"alternating rounds; transport {options.transport}; load average {load:.2f} "
                  f"before, {after:.2f} after, {cpus} CPUs)")  # fmt: skip
            if options.profile:
                print()
                passes = PROFILE_PASSES // (10 if options.quick else 1)
                print("\n".join(profile(tmp, client, passes, pickled)))
            client.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
