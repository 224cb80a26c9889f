"""The fixed model of the conductor crash test (``tests/engine/test_kill.py``).

Two partitions: a producer ``p0`` (one node on ranks 0 and 1, TP 2, prefill then decode) and
a consumer ``p1`` (one node on rank 2) fed by the streaming connection ``p0 -> p1``.

``KillModel`` is ``oracle.ScriptedModel`` with the forward-pass decisions made independent of
message timing, so that two runs of the same requests (one conductor, or one killed and
replaced many times) must reach the same result for each request:

* every pass that does not end its partition sends inputs (stand-in workers cannot
  self-trigger from a stream buffer), the consumer's first pass included;
* a partition ends after exactly ``passes`` passes (the consumer does not end early on its
  producer's ``producer_done``, whose arrival depends on timing);
* a partition feeds and unpersists only the persisted signals its own workers produced
  (``<partition>_*``; the request's initial signals belong to the producer): the request's
  persisted signals are shared by both partitions, and what the other one has persisted so
  far depends on timing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from mstar.model.base import ForwardPassArgs

from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    StreamingConnectionState,
)
from mstar.graph.base import GraphEdge, TensorPointerInfo
from tests.engine.oracle import (
    ConnectionShape,
    PartitionShape,
    ScriptedModel,
    Shape,
    StageShape,
    WalkShape,
)

__all__ = [
    "EDGE",
    "PERSIST_NAME",
    "SHAPE",
    "KillModel",
    "expected_passes",
    "make_model",
    "owner",
    "write_config",
]

EDGE = "stream_01"
P0_PASSES = 5
P1_PASSES = 4

SHAPE = Shape(
    partitions=(
        PartitionShape(
            name="p0",
            stages=(StageShape(nodes=("p0_s0n0",), ranks=(0, 1)),),
            walks=(WalkShape("p0_prefill", (0,)), WalkShape("p0_decode", (0,))),
            passes=P0_PASSES,
        ),
        PartitionShape(
            name="p1",
            stages=(StageShape(nodes=("p1_s0n0",), ranks=(2,)),),
            walks=(WalkShape("p1_chunk", (0,)),),
            passes=P1_PASSES,
        ),
    ),
    connections=(ConnectionShape("p0", "p1", EDGE),),
)


def PERSIST_NAME(partition: str) -> str:
    """The name a partition's workers persist their per-pass tensor under."""
    return f"{partition}_h"


def owner(signal_name: str) -> str:
    """The partition a persisted signal belongs to (initial signals: the producer's)."""
    for p in SHAPE.partitions:
        if signal_name.startswith(f"{p.name}_"):
            return p.name
    return SHAPE.partitions[0].name


def expected_passes() -> dict[str, tuple[int, tuple[int, ...]]]:
    """partition -> (number of passes, ranks that run each of them)."""
    return {
        p.name: (p.passes, tuple(sorted({r for s in p.stages for r in s.ranks})))
        for p in SHAPE.partitions
    }


class KillModel(ScriptedModel):
    """``ScriptedModel(SHAPE)`` whose decisions do not depend on message timing."""

    def get_initial_forward_pass_args(
        self,
        partition_name: str,
        input_modalities: list[str],
        output_modalities: list[str],
        input_signals: dict[str, list[TensorPointerInfo]],
        model_kwargs: dict | None = None,
    ) -> ForwardPassArgs:
        args = super().get_initial_forward_pass_args(
            partition_name, input_modalities, output_modalities, input_signals, model_kwargs
        )
        if not args.request_done and not args.inputs:
            # the consumer: a signal-only edge instead of a self-triggered first pass
            first = self.walk_nodes(args.full_metadata.graph_walk)[0]
            args.inputs = [GraphEdge(next_node=first, name="x")]
        return args

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
        walk = p.walks[-1].name  # every pass after the first: prefill -> decode
        metadata.graph_walk = walk
        metadata.is_prefill = False
        metadata.kwargs["last_walk"] = partition_metadata.graph_walk
        step_metadata = {"step": step, "walk": walk}
        if step >= p.passes:
            return ForwardPassArgs(metadata, [], [], request_done=True, step_metadata=step_metadata)

        names = sorted(n for n in persist_signals if owner(n) == partition_name)
        fed = [n for i, n in enumerate(names) if (i + step) % 3 != 0 and persist_signals[n]]
        dropped = [n for i, n in enumerate(names) if (i + step) % 2 == 0]
        unpersist = [info for n in dropped for info in persist_signals[n]]
        first = self.walk_nodes(walk)[0]
        inputs = [
            GraphEdge(next_node=first, name=n, tensor_info=list(persist_signals[n])) for n in fed
        ] or [GraphEdge(next_node=first, name="x")]
        return ForwardPassArgs(metadata, inputs, unpersist, step_metadata=step_metadata)


def make_model() -> KillModel:
    """The module-level factory (``tests.engine.kill_model:make_model``)."""
    return KillModel(SHAPE)


def write_config(path: str | Path) -> str:
    """Write the model config YAML to ``path``; returns the path."""
    config: dict[str, Any] = SHAPE.config()
    Path(path).write_text(yaml.safe_dump(config))
    return str(path)
