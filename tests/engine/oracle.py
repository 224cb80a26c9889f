"""The engine's own in-memory conductor as an oracle for differential tests.

mstar-ai 0.2.1's ``Conductor`` runs here unmodified: only its worker launch is skipped and
its communicator replaced (no processes, no sockets), so every decision (ingest, rank
counting, forward-pass bookkeeping, ref counts, the drain barrier) is the engine's own code.
A ``ScriptedModel`` built from a random ``Shape`` stands in for a real model: real
``WorkerGraph``s and ``ShardingConfig``s, and forward-pass decisions that are a pure function
of their arguments, so another implementation of the conductor's state (the Redis-backed
store) can call the very same function and must reach the very same state.

Messages are generated against the oracle's evolving state (``next_message``): what a
worker could plausibly report next, plus the odd late, unknown or failing message.

Nothing from ``store`` is imported: this is the engine's side of the comparison.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import random
import weakref
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import mstar.conductor.conductor as conductor_module
import yaml
from hypothesis import strategies as st
from mstar.conductor.conductor import Conductor
from mstar.distributed.base import ShardingConfig
from mstar.graph.special_destinations import EMIT_TO_CLIENT
from mstar.model.base import ForwardPassArgs, Model, WorkerGraph
from mstar.streaming.chunk_policy import FixedChunkPolicy
from mstar.streaming.topology import Connection, PartitionTopology, StreamingGraphEdge
from mstar.utils.ipc_format import (
    AbortRequest,
    ConductorMessage,
    ConductorMessageType,
    FailRequests,
    NewRequestConductor,
    ReadsDone,
    WorkerGraphsDone,
)

from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    StreamingConnectionState,
)
from mstar.engine.resources import KVReqConfig, NodeResourceSpec, SamplingReqConfig
from mstar.engine.resources.kv.manager import KVSequenceInfo, PublishedKVInfo
from mstar.engine.resources.position.manager import PublishedPositionInfo
from mstar.graph.base import (
    GraphEdge,
    GraphNode,
    GraphSection,
    Parallel,
    Sequential,
    TensorPointerInfo,
)
from mstar.graph.loop_indices import NestedLoopIndices

__all__ = [
    "MAX_WORKERS",
    "PREPROCESS_WORKER",
    "SHARDED_SIGNAL",
    "ConnectionShape",
    "LoopOutcome",
    "PartitionShape",
    "RecordingCommunicator",
    "ScriptedModel",
    "Shape",
    "StageShape",
    "WalkShape",
    "choices",
    "finishing_messages",
    "make_conductor",
    "new_request_message",
    "next_message",
    "quiet_conductor_logs",
    "run_loop_once",
    "shapes",
]

logger = logging.getLogger(__name__)

MAX_WORKERS = 8
PREPROCESS_WORKER = Conductor.PREPROCESS_WORKER
# The one signal sharded along dim 0 (``sharding_config.shard_dim`` in the YAML) when a shape
# asks for it: its tensors are 12 rows, which any source/destination TP size 1-4 divides.
SHARDED_SIGNAL = "h"
SHARD_ROWS = 12
PERSIST_NAMES = (SHARDED_SIGNAL, "tok", "ctx")
SAMPLER, KV = "sampler", "kv"


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageShape:
    """One node group: its nodes (adjacent in a walk, so one worker graph), ranks and TP."""

    nodes: tuple[str, ...]
    ranks: tuple[int, ...]  # len == tp_size: one instance, no data-parallel replicas
    walk_scoped: bool = False  # give the node group a ``graph_walks:`` list

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class WalkShape:
    """A graph walk: which of its partition's stages it runs, in order."""

    name: str
    stages: tuple[int, ...]
    parallel: bool = False


@dataclass(frozen=True)
class PartitionShape:
    name: str
    stages: tuple[StageShape, ...]
    walks: tuple[WalkShape, ...]  # walks[0] first (prefill), the last one after (decode)
    passes: int  # forward passes after which the model ends this partition


@dataclass(frozen=True)
class ConnectionShape:
    from_partition: str
    to_partition: str
    edge_name: str


@dataclass(frozen=True)
class Shape:
    """A model's partitions, streaming connections and node groups: hashable, so a test can
    cache one conductor per shape."""

    partitions: tuple[PartitionShape, ...]
    connections: tuple[ConnectionShape, ...] = ()
    sharded: bool = False  # SHARDED_SIGNAL gets ``shard_dim: 0``
    max_concurrent_requests: int | None = None

    def partition(self, name: str) -> PartitionShape:
        for p in self.partitions:
            if p.name == name:
                return p
        raise KeyError(name)

    def incoming(self, name: str) -> tuple[ConnectionShape, ...]:
        return tuple(c for c in self.connections if c.to_partition == name)

    def outgoing(self, name: str) -> tuple[ConnectionShape, ...]:
        return tuple(c for c in self.connections if c.from_partition == name)

    def is_consumer(self, name: str) -> bool:
        return bool(self.incoming(name))

    def workers(self) -> set[int]:
        return {r for p in self.partitions for s in p.stages for r in s.ranks}

    def node_groups(self) -> list[dict[str, Any]]:
        groups = []
        for p in self.partitions:
            for s in p.stages:
                group: dict[str, Any] = {"node_names": list(s.nodes), "ranks": list(s.ranks)}
                if s.tp_size > 1:
                    group["tp_size"] = s.tp_size
                # The engine refuses walk-scoped TP groups holding a streaming consumer.
                if s.walk_scoped and not self.is_consumer(p.name):
                    group["graph_walks"] = [w.name for w in p.walks]
                groups.append(group)
        return groups

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"model": "scripted", "max_seq_len": 4096}
        cfg["node_groups"] = self.node_groups()
        if self.sharded:
            cfg["sharding_config"] = {"shard_dim": {SHARDED_SIGNAL: 0}}
        if self.max_concurrent_requests is not None:
            cfg["max_concurrent_requests"] = self.max_concurrent_requests
        return cfg


@st.composite
def _partition(draw: st.DrawFn, name: str, free_ranks: list[int], consumer: bool) -> Any:
    n_stages = draw(st.integers(1, 2))
    stages = []
    for i in range(n_stages):
        tp = draw(st.integers(1, 4))
        # colocate with ranks already in use, or take fresh ones (the pool bounds the total)
        ranks = tuple(
            sorted(
                draw(st.lists(st.sampled_from(free_ranks), min_size=tp, max_size=tp, unique=True))
            )
        )
        n_nodes = draw(st.integers(1, 2))
        nodes = tuple(f"{name}_s{i}n{j}" for j in range(n_nodes))
        stages.append(StageShape(nodes=nodes, ranks=ranks, walk_scoped=draw(st.booleans())))
    walk_names = [f"{name}_chunk"] if consumer else [f"{name}_prefill"]
    if draw(st.booleans()):
        walk_names.append(f"{name}_decode")
    walks = []
    for i, w in enumerate(walk_names):
        if i == 0:
            chosen = tuple(range(n_stages))  # the first walk runs every stage
        else:
            chosen = tuple(
                sorted(draw(st.sets(st.integers(0, n_stages - 1), min_size=1, max_size=n_stages)))
            )
        walks.append(WalkShape(name=w, stages=chosen, parallel=draw(st.booleans())))
    return PartitionShape(
        name=name,
        stages=tuple(stages),
        walks=tuple(walks),
        passes=draw(st.integers(1, 6)),
    )


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    """1-3 partitions, a streaming DAG between them, 1-2 stages each of TP 1-4 on <= 8 ranks."""
    n = draw(st.integers(1, 3))
    names = [draw(st.sampled_from(["default", "p0"]))] if n == 1 else [f"p{i}" for i in range(n)]
    connections = []
    for j in range(1, n):
        producers = draw(st.sets(st.integers(0, j - 1), max_size=j))
        # a producer's consumers may share one edge name (its tokens then count for each)
        connections += [
            ConnectionShape(f"p{i}", f"p{j}", draw(st.sampled_from([f"stream_{i}{j}", f"s{i}"])))
            for i in sorted(producers)
        ]
    consumers = {c.to_partition for c in connections}
    pool = list(range(MAX_WORKERS))
    partitions = [draw(_partition(name, pool, name in consumers)) for name in names]
    # The engine indexes its worker list by rank (GlobalParallelConfig): ranks must be 0..n-1.
    used = sorted({r for p in partitions for s in p.stages for r in s.ranks})
    renumber = {r: i for i, r in enumerate(used)}
    partitions = [
        dataclasses.replace(
            p,
            stages=tuple(
                dataclasses.replace(s, ranks=tuple(renumber[r] for r in s.ranks)) for s in p.stages
            ),
        )
        for p in partitions
    ]
    return Shape(
        partitions=tuple(partitions),
        connections=tuple(connections),
        sharded=draw(st.booleans()),
        max_concurrent_requests=draw(st.sampled_from([None, 1, 2])),
    )


def choices(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[list[int]]:
    """Abstract choices for ``next_message``: plain integers, so hypothesis shrinks them."""
    return st.lists(st.integers(0, 2**32 - 1), min_size=min_size, max_size=max_size)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def _chunk_policy() -> FixedChunkPolicy:
    return FixedChunkPolicy(chunk_size=4)


class ScriptedModel(Model):
    """A ``Model`` whose graphs come from a ``Shape`` and whose forward-pass decisions are a
    deterministic function of the arguments alone (never of the object passed in, which it
    does not mutate): equal arguments give equal ``ForwardPassArgs``.

    Per partition: the first walk, then the last one (prefill -> decode); a step counter kept
    in ``metadata.kwargs`` through ``step_metadata``; inputs carrying the persisted
    ``TensorPointerInfo``s (so ref counts move) or a signal-only edge; some persist signals
    unpersisted; ``request_done`` after ``passes`` passes. A consumer partition also ends
    once its producers are done and it consumed all they produced, and on alternate passes
    sends no inputs (it self-triggers from its stream buffer).
    """

    def __init__(self, shape: Shape):
        self.shape = shape

    # -- graphs ---------------------------------------------------------------------------

    def _node(self, p: PartitionShape, name: str, first: bool) -> GraphNode:
        inputs = ["x"]
        if first:
            inputs += [c.edge_name for c in self.shape.incoming(p.name)]
        outputs = [GraphEdge(next_node=EMIT_TO_CLIENT, name=f"{name}_out", output_modality="text")]
        outputs += [
            StreamingGraphEdge(
                next_node=self._first_nodes(self.shape.partition(c.to_partition))[0],
                name=c.edge_name,
                target_partition=c.to_partition,
            )
            for c in self.shape.outgoing(p.name)
        ]
        return GraphNode(name=name, input_names=inputs, outputs=outputs)

    @staticmethod
    def _first_nodes(p: PartitionShape) -> tuple[str, ...]:
        return p.stages[p.walks[0].stages[0]].nodes

    def walk_nodes(self, walk_name: str) -> list[str]:
        """The walk's node names in order (the first one receives the conductor's inputs)."""
        for p in self.shape.partitions:
            for w in p.walks:
                if w.name == walk_name:
                    return [n for i in w.stages for n in p.stages[i].nodes]
        raise KeyError(walk_name)

    def get_graph_walk_graphs(self) -> dict[str, GraphSection]:
        graphs: dict[str, GraphSection] = {}
        for p in self.shape.partitions:
            for w in p.walks:
                sections: list[GraphSection] = []
                for i in w.stages:
                    # stage 0 takes the partition's incoming streams, in whichever walk
                    nodes = [self._node(p, name, first=i == 0) for name in p.stages[i].nodes]
                    sections.append(nodes[0] if len(nodes) == 1 else Sequential(list(nodes)))
                if len(sections) == 1:
                    graphs[w.name] = sections[0]
                else:
                    graphs[w.name] = (Parallel if w.parallel else Sequential)(sections)
        return graphs

    def get_worker_graphs(self, config_path: str) -> list[WorkerGraph]:
        """The engine's division, with ids named after their walk (``p0_prefill#0``) instead of
        random uuids, so examples replay identically and ids can be read in failures."""
        wgs = super().get_worker_graphs(config_path)
        per_walk: dict[str, int] = {}
        for wg in wgs:
            (walk,) = wg.graph_walks
            wg.worker_graph_id = f"{walk}#{per_walk.setdefault(walk, 0)}"
            per_walk[walk] += 1
        return wgs

    def get_default_sharding_config(self) -> ShardingConfig:
        nodes = {n for p in self.shape.partitions for s in p.stages for n in s.nodes}
        return ShardingConfig(groups=[], tp_enabled_nodes=nodes, shard_dim={})

    def get_partitions(self) -> list[PartitionDefinition]:
        return [
            PartitionDefinition(
                name=p.name,
                graph_walks={w.name for w in p.walks},
                initial_walk=None if self.shape.is_consumer(p.name) else p.walks[0].name,
                producer_partitions=[c.from_partition for c in self.shape.incoming(p.name)],
            )
            for p in self.shape.partitions
        ]

    def get_partition_topology(self) -> PartitionTopology:
        return PartitionTopology(
            partitions=[p.name for p in self.shape.partitions],
            connections=[
                Connection(c.from_partition, c.to_partition, c.edge_name, _chunk_policy)
                for c in self.shape.connections
            ],
        )

    # -- per request ----------------------------------------------------------------------

    def get_max_output_tokens(self, **model_kwargs: Any) -> int:
        return int(model_kwargs.get("max_output_tokens", 64))

    def get_request_resource_configs(
        self,
        partition_fwd_args: dict[str, ForwardPassArgs],
        model_kwargs: dict | None = None,
    ) -> dict[str, Any]:
        kwargs = model_kwargs or {}
        walks = sorted(a.full_metadata.graph_walk for a in partition_fwd_args.values())
        return {
            SAMPLER: SamplingReqConfig(temperature=float(kwargs.get("temperature", 0.6))),
            KV: KVReqConfig(needed_labels=["main"] + [w for w in walks if w]),
        }

    def get_initial_forward_pass_args(
        self,
        partition_name: str,
        input_modalities: list[str],
        output_modalities: list[str],
        input_signals: dict[str, list[TensorPointerInfo]],
        model_kwargs: dict | None = None,
    ) -> ForwardPassArgs:
        p = self.shape.partition(partition_name)
        kwargs = model_kwargs or {}
        metadata = CurrentForwardConductorMetadata(
            graph_walk=p.walks[0].name,
            is_prefill=not self.shape.is_consumer(partition_name),
            input_modalities=list(input_modalities),
            output_modalities=list(output_modalities),
        )
        step_metadata = {"step": 0, "walk": p.walks[0].name}
        if kwargs.get("skip_partition") == partition_name:
            # "a partition not active at all in the request"
            return ForwardPassArgs(metadata, [], [], request_done=True, step_metadata=step_metadata)
        if self.shape.is_consumer(partition_name):
            return ForwardPassArgs(metadata, [], [], step_metadata=step_metadata)
        first = self.walk_nodes(p.walks[0].name)[0]
        inputs = [
            GraphEdge(next_node=first, name=name, tensor_info=list(infos))
            for name, infos in sorted(input_signals.items())
        ] or [GraphEdge(next_node=first, name="x")]
        return ForwardPassArgs(metadata, inputs, [], step_metadata=step_metadata)

    def get_partition_forward_pass_args(
        self,
        partition_name: str,
        partition_metadata: CurrentForwardConductorMetadata,
        persist_signals: dict[str, list[TensorPointerInfo]],
        incoming_connections: list[StreamingConnectionState] | None = None,
    ) -> ForwardPassArgs:
        p = self.shape.partition(partition_name)
        metadata = copy.deepcopy(partition_metadata)
        step = int(metadata.kwargs.get("step", 0)) + 1
        conns = sorted(incoming_connections or [], key=lambda c: c.edge_name)
        consumer = self.shape.is_consumer(partition_name)

        done = step >= p.passes
        if consumer and conns:
            backlog = sum(max(0, c.token_count - c.consumed_count) for c in conns)
            done = done or (all(c.producer_done for c in conns) and backlog == 0)
        walk = p.walks[-1].name  # every pass after the first: prefill -> decode
        metadata.graph_walk = walk
        metadata.is_prefill = False
        metadata.kwargs["last_walk"] = partition_metadata.graph_walk
        step_metadata = {
            "step": step,
            "walk": walk,
            "tokens": sum(c.token_count for c in conns),
            "consumed": sum(c.consumed_count for c in conns),
        }
        if done:
            return ForwardPassArgs(metadata, [], [], request_done=True, step_metadata=step_metadata)

        names = sorted(persist_signals)
        # which persisted signals feed the next pass, and which are then let go
        fed = [n for i, n in enumerate(names) if (i + step) % 3 != 0 and persist_signals[n]]
        dropped = [n for i, n in enumerate(names) if (i + step) % 2 == 0]
        unpersist = [info for n in dropped for info in persist_signals[n]]
        first = self.walk_nodes(walk)[0]
        if consumer and step % 2 == 1:
            inputs: list[GraphEdge] = []  # self-triggered from the stream buffer
        else:
            inputs = [
                GraphEdge(next_node=first, name=n, tensor_info=list(persist_signals[n]))
                for n in fed
            ] or [GraphEdge(next_node=first, name="x")]
        return ForwardPassArgs(metadata, inputs, unpersist, step_metadata=step_metadata)

    def forward_pass_args(
        self,
        partition_name: str,
        partition_metadata: CurrentForwardConductorMetadata,
        persist_signals: dict[str, list[TensorPointerInfo]],
        incoming_connections: list[StreamingConnectionState] | None = None,
    ) -> ForwardPassArgs:
        """The call the conductor makes after a forward pass, for the store side to make too."""
        return self.get_partition_forward_pass_args(
            partition_name,
            partition_metadata,
            persist_signals,
            incoming_connections,
        )

    # -- never reached without workers ------------------------------------------------------

    def get_node_resources(self) -> list[NodeResourceSpec]:
        return []

    def process_prompt(
        self, prompt, input_modalities, output_modalities, tensors=None, prompt_parts=None, **kwargs
    ):
        return {}

    def postprocess(self, output, modality, request_kwargs=None) -> bytes:
        return b""

    def get_submodule(
        self, node_name, device="cpu", tp_group=None, autocast_dtype=None, sp_group=None
    ):
        return None


# ---------------------------------------------------------------------------------------------
# The conductor
# ---------------------------------------------------------------------------------------------


class RecordingCommunicator:
    """Stands in for the ZMQ communicator: ``send`` records a copy of the message as it was
    when sent (the real one pickles it then; the conductor keeps mutating what it refers
    to), and ``get_all_new_messages`` hands out what ``run_loop_once`` put in the inbox."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.sent: list[tuple[str, Any]] = []
        self.inbox: list[Any] = []

    def send(self, entity_id: str, msg: Any) -> None:
        self.sent.append((entity_id, copy.deepcopy(msg)))

    def get_all_new_messages(self, *args: Any, **kwargs: Any) -> list:
        messages, self.inbox = self.inbox, []
        return messages


class _UnlaunchedConductor(Conductor):
    """The engine's conductor minus its worker processes (and so minus their atexit hook)."""

    def _launch_workers(self) -> None:
        return


def make_conductor(shape: Shape, tmp_path: Path | str, drain_ttl_s: float = 120.0) -> Conductor:
    """An engine ``Conductor`` over a ``ScriptedModel(shape)``, with no workers or sockets.

    Writes the model config YAML under ``tmp_path``. During construction only the
    communicator factory and the free-port probe are patched; ``sent`` on
    ``conductor.communicator`` then lists every ``(destination, message)``.
    """
    tmp = Path(tmp_path)
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(shape.config()))
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(conductor_module, "make_communicator", RecordingCommunicator)
        )
        stack.enter_context(mock.patch.object(conductor_module, "_pick_free_tcp_port", lambda: 0))
        stack.enter_context(mock.patch.dict(os.environ, {"MSTAR_DRAIN_TTL_S": str(drain_ttl_s)}))
        return _UnlaunchedConductor(
            model=ScriptedModel(shape),
            model_config_file=str(config),
            socket_path_prefix=str(tmp / "sockets"),
            log_level="WARNING",
        )


@dataclass
class LoopOutcome:
    """What one pass of the run loop did: the messages it sent, and the exception its
    ``except Exception`` swallowed (the rest of that batch is then dropped)."""

    sent: list[tuple[str, Any]] = field(default_factory=list)
    error: Exception | None = None


def run_loop_once(conductor: Conductor, messages: Sequence[Any]) -> LoopOutcome:
    """Deliver ``messages`` as one batch and run one iteration of ``Conductor.run()``'s loop.

    The messages are deep-copied first, as the pickling transport would (the conductor keeps
    and mutates parts of them, e.g. ``initial_signals``). The body below is copied from
    mstar-ai 0.2.1 ``mstar/conductor/conductor.py`` lines 1344-1408 (``while True:``), with
    ``self`` as ``conductor``, without nvtx ranges and the closing sleep, and recording the
    swallowed exception.
    """
    self = conductor
    comm: RecordingCommunicator = self.communicator  # type: ignore[assignment]
    comm.inbox.extend(copy.deepcopy(list(messages)))
    first_sent = len(comm.sent)
    error: Exception | None = None

    # ---- verbatim from Conductor.run() (0.2.1), minus nvtx and sleep ----
    # fmt: off
    try:
        done_partition_forwards: list[tuple[str, str, bool]] = []

        startup_backlog = self._startup_message_backlog
        self._startup_message_backlog = []
        for message in startup_backlog + self.communicator.get_all_new_messages():
            if message.message_type == ConductorMessageType.NEW_REQUEST:
                self._ingest_request(message.body)
            elif message.message_type == ConductorMessageType.ABORT_REQUEST:
                self._abort_request(message.body.request_id)
            elif message.message_type == ConductorMessageType.FAIL_REQUESTS:
                self._fail_requests(message.body)
            elif message.message_type == ConductorMessageType.READS_DONE:
                self._handle_reads_done(message.body)
            elif message.message_type == ConductorMessageType.WORKER_GRAPHS_DONE:
                rid = message.body.request_id
                # Draining requests linger in self.requests (concurrency
                # accounting) but are being torn down — ignore late dones.
                if rid not in self.requests or rid in self.draining:
                    conductor_module.logger.debug(
                        "WORKER_GRAPHS_DONE for unknown request %s (already completed?)", rid
                    )
                    continue

                done_parts = self._process_worker_graphs_done(message.body)
                for pname in done_parts:
                    done_partition_forwards.append(
                        (rid, pname, message.body.partition_done)
                    )
            else:
                raise ValueError(f"Unknown message type: {message.message_type}")

        completed_requests = []

        for request_id, partition_name, p_done in done_partition_forwards:
            if request_id not in self.requests or request_id in self.draining:
                continue  # already completed by another partition in this cycle
            all_done = self._process_done_forward(
                request_id, partition_name,
                partition_done_from_worker=p_done,
            )
            if all_done:
                completed_requests.append(request_id)

        for request_id in dict.fromkeys(completed_requests):
            if request_id in self.requests and request_id not in self.draining:
                self._process_request_done(request_id)

        self._sweep_expiry()

    except Exception as exc:
        conductor_module.logger.exception("Conductor error in main loop")
        error = exc
    # fmt: on
    # ---- end of the copy ----

    return LoopOutcome(sent=comm.sent[first_sent:], error=error)


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def _msg(kind: ConductorMessageType, body: Any) -> ConductorMessage:
    return ConductorMessage(message_type=kind, body=body)


# Per conductor, a counter for fresh tensor uuids: deterministic for a fresh conductor fed
# the same calls, unique within it.
_UUID_COUNTERS: weakref.WeakKeyDictionary[Conductor, Iterator[int]] = weakref.WeakKeyDictionary()


def _fresh_uuid(conductor: Conductor, request_id: str) -> str:
    counter = _UUID_COUNTERS.setdefault(conductor, iter(range(1 << 62)))
    return f"{request_id}/t{next(counter)}"


def _tensor(
    uuid: str,
    name: str,
    entity: str,
    rank: int = 0,
    tp: int = 1,
    node: str | None = None,
    walk: str | None = None,
) -> TensorPointerInfo:
    dims = [SHARD_ROWS, 4] if name == SHARDED_SIGNAL else [3, 5]
    return TensorPointerInfo(
        dims=dims,
        dtype="bfloat16",
        nbytes=dims[0] * dims[1] * 2,
        address=0x1000,
        stride=[dims[1], 1],
        uuid=uuid,
        source_session_id=f"host:{entity}",
        source_entity=entity,
        source_tp_size=tp,
        source_tp_rank=rank,
        _source_node_name=node,
        _source_graph_walk=walk,
    )


def new_request_message(shape: Shape, request_id: str, choice: int) -> ConductorMessage:
    """A NEW_REQUEST with persisted initial signals from the preprocess worker and
    model_kwargs that sometimes pin the seed, cap the output tokens or skip a partition."""
    r = random.Random(choice)
    signals = {
        name: [
            _tensor(f"{request_id}/in{name}{i}", name, PREPROCESS_WORKER)
            for i in range(r.randint(1, 2))
        ]
        for name in r.sample(PERSIST_NAMES, r.randint(0, 2))
    }
    kwargs: dict[str, Any] = {}
    if r.random() < 0.4:
        kwargs["seed"] = r.randint(0, 2**31)
    if r.random() < 0.15:
        kwargs["max_output_tokens"] = r.randint(2, 30)
    if r.random() < 0.2:
        kwargs["temperature"] = r.choice([0.0, 1.0])
    if len(shape.partitions) > 1 and r.random() < 0.1:
        kwargs["skip_partition"] = r.choice(shape.partitions).name
    return _msg(
        ConductorMessageType.NEW_REQUEST,
        NewRequestConductor(
            request_id=request_id,
            initial_signals=signals,
            initial_input_modalities=["text"],
            initial_output_modalities=r.choice([["text"], ["audio"], ["text", "audio"]]),
            input_metadata={},
            model_kwargs=kwargs,
        ),
    )


def _first_rank_slot(wg_id: str, fwd_pass: int, n_ranks: int) -> int:
    """Which of a worker graph's reports in a pass comes from TP rank 0 (the one with
    ``is_first_tp_rank``): fixed per (wg, pass), so ranks interleave but only one is first."""
    return zlib.crc32(f"{wg_id}:{fwd_pass}".encode()) % n_ranks


def _pending_counts(pending: Sequence[Any], request_id: str, partition: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in pending:
        body = m.body
        if (
            m.message_type == ConductorMessageType.WORKER_GRAPHS_DONE
            and body.request_id == request_id
            and body.partition_name == partition
        ):
            for wg in body.worker_graph_ids:
                counts[wg] = counts.get(wg, 0) + 1
    return counts


def _open_wgs(
    conductor: Conductor, request_id: str, partition: str, pending: Sequence[Any]
) -> dict[str, int]:
    """Current worker graphs of the partition still owed reports -> reports received so far
    (the batch's pending messages included)."""
    data = conductor.requests[request_id]
    ps = data.partition_states[partition]
    extra = _pending_counts(pending, request_id, partition)
    counts = {}
    for wg in sorted(ps.current_worker_graph_ids):
        got = ps.wg_rank_completions.get(wg, 0) + extra.get(wg, 0)
        if got < len(data.worker_graph_to_workers[wg]):
            counts[wg] = got
    return counts


def _worker_graphs_done(
    conductor: Conductor,
    request_id: str,
    partition: str,
    wg_ids: list[str],
    counts: dict[str, int],
    first: bool,
    r: random.Random,
) -> ConductorMessage:
    """A plausible report: what the named worker graphs of one rank produced."""
    shape: Shape = conductor.model.shape
    data = conductor.requests[request_id]
    ps = data.partition_states[partition]
    walk = ps.metadata.graph_walk
    persist: dict[str, list[TensorPointerInfo]] = {}
    for wg in wg_ids:
        if r.random() < 0.5:
            continue
        workers = data.worker_graph_to_workers[wg]
        slot = _first_rank_slot(wg, ps.fwd_pass_number, len(workers))
        rank = (counts.get(wg, 0) - slot) % len(workers)  # the slot's report is rank 0's
        nodes = sorted(conductor.worker_graphs[wg].section.get_nodes())
        name = r.choice(PERSIST_NAMES)
        persist.setdefault(name, []).append(
            _tensor(
                _fresh_uuid(conductor, request_id),
                name,
                workers[rank],
                rank=rank,
                tp=len(workers),
                node=r.choice(nodes),
                walk=walk,
            )
        )
    body = WorkerGraphsDone(
        request_id=request_id,
        worker_graph_ids=wg_ids,
        is_first_tp_rank=first,
        persist_signals=persist,
        partition_name=partition,
    )
    out_edges = [c.edge_name for c in shape.outgoing(partition)]
    if r.random() < 0.7:
        names = [*out_edges, "text"] if r.random() < 0.8 else ["text"]
        body.new_token_counts = {n: r.randint(0, 2) for n in names}
    incoming = data.get_incoming_connections(partition)
    if incoming and r.random() < 0.7:
        body.stream_tokens_consumed = {
            c.edge_name: r.randint(c.consumed_count, max(c.consumed_count, c.token_count))
            for c in incoming
        }
        if r.random() < 0.2:
            # names that are not this partition's: unknown, or another connection's (the
            # engine applies a name to every connection this partition does not produce)
            other = sorted({c.edge_name for c in shape.connections} | {"elsewhere"})
            body.stream_tokens_consumed[r.choice(other)] = r.randint(0, 5)
    if r.random() < 0.5:
        world = max(len(data.worker_graph_to_workers[wg]) for wg in wg_ids)
        rank = r.randrange(world)
        body.resource_publish_info = {
            KV: PublishedKVInfo.build_for_rank(
                rank,
                world,
                {
                    "main": KVSequenceInfo(
                        seq_len=r.randint(1, 64),
                        latest_kv_transfer_info=None,
                        page_indices=sorted(r.sample(range(16), 2)),
                    ),
                },
            ),
        }
        if r.random() < 0.5:
            body.resource_publish_info["pos"] = PublishedPositionInfo(
                counters={"main": r.randint(0, 64)}
            )
    if r.random() < 0.4:
        body.output_loop_indices = {
            f"{partition}_out": NestedLoopIndices(
                loop_name_order=["outer"],
                loop_indices={"outer": r.randint(0, 4)},
                wg_fwd_pass_idx=ps.fwd_pass_number,
            ),
        }
    if r.random() < 0.3:
        body.output_signal_names = [f"{wg}_out" for wg in wg_ids]  # the list the loop keeps
    else:
        body.output_signal_names = r.randint(0, 2)  # the declared int, which it ignores
    if incoming and r.random() < 0.15:
        body.partition_done = True
    return _msg(ConductorMessageType.WORKER_GRAPHS_DONE, body)


def _valid_report(
    conductor: Conductor, request_id: str, r: random.Random, pending: Sequence[Any]
) -> ConductorMessage | None:
    data = conductor.requests[request_id]
    live = [p for p, ps in sorted(data.partition_states.items()) if not ps.is_done]
    r.shuffle(live)
    for partition in live:
        ps = data.partition_states[partition]
        open_wgs = _open_wgs(conductor, request_id, partition, pending)
        if not open_wgs:
            continue
        first = r.random() < 0.5
        for is_first in (first, not first):
            candidates = [
                wg
                for wg, got in open_wgs.items()
                if (
                    got
                    == _first_rank_slot(
                        wg, ps.fwd_pass_number, len(data.worker_graph_to_workers[wg])
                    )
                )
                == is_first
            ]
            if candidates:
                break
        else:
            continue
        chosen = sorted(r.sample(candidates, r.randint(1, len(candidates))))
        return _worker_graphs_done(conductor, request_id, partition, chosen, open_wgs, is_first, r)
    return None


def next_message(
    conductor: Conductor,
    request_id: str,
    choice: int,
    pending: Sequence[Any] = (),
) -> ConductorMessage:
    """A message for ``request_id`` built from the oracle's current state and ``choice``.

    Mostly a worker's valid report (one rank, 1..n of the partition's open worker graphs,
    ``is_first_tp_rank`` on exactly one report per graph and pass); else an abort, a
    worker's failure, READS_DONE from a participant (before or after the barrier), a late
    report, or one naming an unknown partition or worker graph (the engine's KeyError).
    ``pending``: messages already in the same batch, not yet applied.
    """
    r = random.Random(choice)
    shape: Shape = conductor.model.shape
    data = conductor.requests.get(request_id)
    live = data is not None and request_id not in conductor.draining
    if live and r.random() < 0.8:
        msg = _valid_report(conductor, request_id, r, pending)
        if msg is not None:
            return msg
    roll = r.random()
    if roll < 0.04:
        return _msg(ConductorMessageType.ABORT_REQUEST, AbortRequest(request_id=request_id))
    if roll < 0.08:
        return _msg(
            ConductorMessageType.FAIL_REQUESTS,
            FailRequests(
                errors={
                    request_id: "scripted failure",
                    **({"ghost": "x"} if r.random() < 0.3 else {}),
                }
            ),
        )
    if roll < 0.45:
        return _msg(
            ConductorMessageType.READS_DONE,
            ReadsDone(request_id=request_id, entity_id=_reader(conductor, request_id, r)),
        )
    # a report the conductor must tolerate: late, or naming what this request lacks
    partition = r.choice(shape.partitions).name
    wg_ids = sorted(conductor.worker_graphs)
    kind = r.random()
    if kind < 0.5:
        wgs = [r.choice(wg_ids)]
    elif kind < 0.8:
        partition = "no_such_partition"
        wgs = [r.choice(wg_ids)]
    else:
        wgs = [r.choice(wg_ids), "no_such_wg"]
    return _msg(
        ConductorMessageType.WORKER_GRAPHS_DONE,
        WorkerGraphsDone(
            request_id=request_id,
            worker_graph_ids=wgs,
            is_first_tp_rank=r.random() < 0.5,
            partition_name=partition,
            new_token_counts={"text": 1},
            output_loop_indices={"late": NestedLoopIndices(["outer"], {"outer": 0}, 0)},
        ),
    )


def _reader(conductor: Conductor, request_id: str, r: random.Random) -> str:
    drain = conductor.draining.get(request_id)
    if drain is not None and drain.expected_acks and r.random() < 0.8:
        return r.choice(sorted(drain.expected_acks))
    workers = [f"worker_{k}" for k in sorted(conductor.model.shape.workers())]
    return r.choice([PREPROCESS_WORKER, *workers])


def finishing_messages(conductor: Conductor, request_id: str) -> list[ConductorMessage]:
    """One batch that moves ``request_id`` towards its end: every rank's report for every
    open worker graph of one live partition (rank 0 first, producers first), or the
    READS_DONE the drain barrier waits for. Empty when the conductor holds nothing for it."""
    if request_id in conductor.draining:
        return [
            _msg(ConductorMessageType.READS_DONE, ReadsDone(request_id=request_id, entity_id=e))
            for e in sorted(conductor.draining[request_id].expected_acks)
        ]
    data = conductor.requests.get(request_id)
    if data is None:
        return []
    r = random.Random(0)
    for partition, ps in data.partition_states.items():  # producers come first
        if ps.is_done:
            continue
        open_wgs = _open_wgs(conductor, request_id, partition, ())
        if not open_wgs:
            # Every graph reported, yet the pass was never processed: an exception later in
            # that batch dropped it. Only another report moves the partition on.
            stuck = sorted(ps.current_worker_graph_ids)[:1]
            return (
                [_worker_graphs_done(conductor, request_id, partition, stuck, {}, first=False, r=r)]
                if stuck
                else []
            )
        out = []
        for wg, got in open_wgs.items():
            n = len(data.worker_graph_to_workers[wg])
            slot = _first_rank_slot(wg, ps.fwd_pass_number, n)
            for k in range(got, n):
                msg = _worker_graphs_done(
                    conductor, request_id, partition, [wg], {wg: k}, first=k == slot, r=r
                )
                msg.body.partition_done = False
                out.append(msg)
        return out
    return []


@contextlib.contextmanager
def quiet_conductor_logs() -> Iterator[None]:
    """The run loop logs every swallowed exception with a traceback: hush it in tests."""
    log = logging.getLogger(conductor_module.__name__)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
