"""The conductor's per-request state: partitions, streaming connections, forward-pass info."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.resources.base import PublishedInfo
from ..engine.resources.spec import ResourceReqConfig
from ..graph.loop_indices import NestedLoopIndices

DEFAULT_PARTITION = "default"


def merge_publish_info(into: dict[str, PublishedInfo], other: dict[str, PublishedInfo]) -> None:
    """Fold one resource's published state into what is already held.

    Merging is the resource's own business (a KV cache folds in another rank's shard rather
    than replacing it), so an existing entry gets ``update`` and only a new key is taken
    wholesale.
    """
    for key, val in other.items():
        if key not in into:
            into[key] = val
        else:
            into[key].update(val)


@dataclass
class CurrentForwardConductorMetadata:
    """Full-model forward pass-level metadata for running the current forward pass."""

    graph_walk: str
    is_prefill: bool
    input_modalities: list[str] = field(default_factory=list)
    output_modalities: list[str] = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)  # type: ignore[type-arg]


@dataclass
class CurrentForwardPassInfo:
    """What the workers and engines are told about this request for the current pass."""

    request_id: str
    graph_walk: str
    fwd_index: int
    random_seed: int
    max_tokens: int
    resource_configs: dict[str, ResourceReqConfig] = field(default_factory=dict)
    step_metadata: dict = field(default_factory=dict)  # type: ignore[type-arg]
    resource_publish_info: dict[str, PublishedInfo] = field(default_factory=dict)
    partition_name: str = DEFAULT_PARTITION
    loop_stop_times: dict[str, NestedLoopIndices] = field(default_factory=dict)
    dynamic_loop_iter_counts: dict[str, int] = field(default_factory=dict)

    def update_publish_info(self, other: dict[str, PublishedInfo]) -> None:
        merge_publish_info(self.resource_publish_info, other)

    def clear_loop_stop_info(self) -> None:
        self.loop_stop_times.clear()
        self.dynamic_loop_iter_counts.clear()


@dataclass
class PartitionDefinition:
    """Defines a partition within a model's computation graph.

    Each partition has its own set of graph walks and transition logic, and can run
    asynchronously relative to other partitions.
    """

    name: str
    graph_walks: set[str]
    initial_walk: str | None = None
    producer_partitions: list[str] = field(default_factory=list)


@dataclass
class PartitionState:
    """Per-partition conductor-level state for a request."""

    partition_name: str
    metadata: CurrentForwardConductorMetadata
    fwd_pass_number: int = 0
    random_seed: int = 0
    is_done: bool = False
    completed_worker_graph_ids: set[str] = field(default_factory=set)
    current_worker_graph_ids: set[str] = field(default_factory=set)
    wg_rank_completions: dict[str, int] = field(default_factory=dict)
    num_output_tokens: int = 0
    curr_forward_outputs: list[str] = field(default_factory=list)
    resource_publish_info: dict[str, PublishedInfo] = field(default_factory=dict)


@dataclass
class StreamingConnectionState:
    """Per-connection streaming state tracked by the conductor."""

    from_partition: str
    to_partition: str
    edge_name: str
    token_count: int = 0
    consumed_count: int = 0
    producer_done: bool = False
