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
    finished_at: float = 0.0


@dataclass
class RequestState:
    """A consistent snapshot of one whole request."""

    record: RequestRecord
    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]


@dataclass(frozen=True)
class Lease:
    """A replica's right to drive one partition's next step, until ``expires_at``.

    ``token`` is the request's fencing token at the grant: a later claim by another
    replica raises it, and every write fenced with this lease is then rejected.
    ``pass_number`` is the forward pass the step is about (the pass that just completed,
    or, for a claimed step, the pass the partition was at).
    """

    request_id: str
    partition: str
    holder: str
    token: int
    pass_number: int
    expires_at: float


@dataclass(frozen=True)
class ReportOutcome:
    """What applying one worker-graph rank report did.

    ``applied`` is False for a duplicate delivery, which changed nothing. ``pass_complete``
    is True for exactly one report per forward pass: the one that completed it; when the
    report named its replica, ``lease`` is that replica's lease on the next step.
    """

    applied: bool
    rank_completions: int
    worker_graph_complete: bool
    pass_complete: bool
    lease: Lease | None = None
