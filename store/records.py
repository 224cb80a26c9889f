"""Store-level records: what a replica needs besides the partition and connection states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.conductor.request_info import (
    PartitionDefinition,
    PartitionState,
    StreamingConnectionState,
)
from mstar.engine.resources import ResourceReqConfig


@dataclass
class RequestRecord:
    """Request-level data a replica needs to resume a request it did not start."""

    request_id: str
    max_output_tokens: int
    seed: int
    partitions: list[str]
    connections: list[str]
    partition_definitions: dict[str, PartitionDefinition] = field(default_factory=dict)
    resource_configs: dict[str, ResourceReqConfig] = field(default_factory=dict)
    final_outputs: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0


@dataclass
class RequestState:
    """A consistent snapshot of one whole request."""

    record: RequestRecord
    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]


@dataclass(frozen=True)
class ReportOutcome:
    """What applying one worker-graph rank report did.

    ``applied`` is False for a duplicate delivery, which changed nothing. ``pass_complete``
    is True for exactly one report per forward pass: the one that completed it.
    """

    applied: bool
    rank_completions: int
    worker_graph_complete: bool
    pass_complete: bool
