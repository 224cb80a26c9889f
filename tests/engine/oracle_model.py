"""The oracle's model: random model shapes (partitions, streaming connections, node groups
with TP) and ``ScriptedModel``, whose forward-pass decisions are a pure function of their
arguments, so that the store side can make the very same call."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from mstar.conductor.conductor import Conductor
from mstar.distributed.base import ShardingConfig
from mstar.graph.special_destinations import EMIT_TO_CLIENT
from mstar.model.base import ForwardPassArgs, Model, WorkerGraph
from mstar.streaming.chunk_policy import FixedChunkPolicy
from mstar.streaming.topology import Connection, PartitionTopology, StreamingGraphEdge

from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    StreamingConnectionState,
)
from mstar.engine.resources import KVReqConfig, NodeResourceSpec, SamplingReqConfig
from mstar.graph.base import (
    GraphEdge,
    GraphNode,
    GraphSection,
    Parallel,
    Sequential,
    TensorPointerInfo,
)

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
