"""Store-level records: what a replica needs besides the partition and connection states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from store.types import (
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    PartitionState,
    PublishedInfo,
    ResourceReqConfig,
    StreamingConnectionState,
)


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
    expires_at: float  # by the Redis server's clock (seconds since the epoch)
    sends: int = 0  # how often the partition's current pass was sent so far
    sent_at: float = 0.0  # when it was last sent (server clock; 0: never)


@dataclass(frozen=True)
class ReportOutcome:
    """What applying one worker-graph rank report did.

    ``applied`` is False for a duplicate delivery, which changed nothing. ``pass_complete``
    is True for the report that completed its forward pass (exactly one per pass), and
    also for a resent copy of it: a duplicate says what the first delivery did. When the
    report named its replica, ``lease`` is that replica's lease on the next step (also on a
    resend, while the lease is live) and ``partition`` the partition as stored right after
    the report, publish info included, to plan the step from (decoded on first access: a
    conductor that plans without it does not pay for it). With ``then_step`` the step was
    taken in the same call: ``stepped_to`` is the new pass, and the lease has ended;
    ``consumers`` (when asked for) holds the partitions it streams to as the step left them.
    """

    applied: bool
    rank_completions: int
    worker_graph_complete: bool
    pass_complete: bool
    lease: Lease | None = None
    stepped_to: int | None = None
    stored: Callable[[], PartitionState] | None = field(default=None, repr=False, compare=False)
    stored_consumers: Callable[[], dict[str, PartitionState]] | None = field(
        default=None, repr=False, compare=False
    )

    @cached_property
    def partition(self) -> PartitionState | None:
        """The partition as stored right after the report (with a lease only)."""
        return None if self.stored is None else self.stored()

    @cached_property
    def consumers(self) -> dict[str, PartitionState] | None:
        """After a step taken with the report (``stepped_to``) and asked for its consumers:
        the partitions this one streams to, by name, as they stand right after the step,
        without their published infos (``resource_publish_info`` is empty: their KV pages
        are not sent back with every step). What a conductor needs to decide whether a
        consumer's pass can be sent now, without reading it; None otherwise. Decoded on
        first access."""
        return None if self.stored_consumers is None else self.stored_consumers()


@dataclass(frozen=True)
class Step:
    """What follows a completed forward pass: the next pass's metadata and worker graphs,
    or ``done`` (the partition has run its last pass)."""

    metadata: CurrentForwardConductorMetadata
    worker_graph_ids: tuple[str, ...] = ()
    done: bool = False


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker-graph rank sends after a forward pass, for whatever transport.

    ``report_id`` names it across resends: the store applies it, and its published infos,
    once. Encode it for the wire with ``store.codec.reports`` (published infos travel as
    kind envelopes, never pickle).
    """

    request_id: str
    partition: str
    fwd_pass: int
    worker_graph_id: str
    rank: int
    num_ranks: int
    new_tokens: int = 0
    output_names: tuple[str, ...] = ()
    consumed: dict[str, int] = msgspec.field(default_factory=dict)
    published: dict[str, PublishedInfo] = msgspec.field(default_factory=dict)

    @property
    def report_id(self) -> str:
        """``<rid>/<partition>/<pass>/<worker graph>/<rank>``: what makes a resend a duplicate."""
        return (
            f"{self.request_id}/{self.partition}/{self.fwd_pass}/{self.worker_graph_id}/{self.rank}"
        )
