"""A request as mstar-ai's ``Conductor`` keeps it (``RequestData``), plus what its teardown
and its recovery need, in the engine's own classes.

Field names are ``RequestData``'s, so that a record read back compares field by field with
the engine's. Decided field by field (docs/conductor.md has the table):

- held: every field a second conductor needs to send the next pass, release persisted
  tensors and finish teardown, and the two times ``RequestComplete`` carries;
- not held: ``sharding_config`` (derived: the engine rebuilds it from
  ``worker_graph_to_workers`` with ``_build_request_sharding_config``) and the profiling
  fields ``graph_timings``, ``rx_info`` and ``tx_info`` (only with ``enable_prof``; lost with
  the conductor, as a profile of a dead process would be);
- added: ``worker_graph_walks`` (each worker graph's walks: the deployment map that sets a
  partition's next worker graphs, whose ids a restarted conductor would compute afresh),
  ``teardown`` (the engine's ``DrainingRequest``), ``early_reads_done`` and ``aborted_early``
  (teardown messages that outran their request), ``concluded`` (the request is complete),
  ``owner`` (the deployment whose conductor drives it) and ``answered`` (the API server was
  sent its ``RequestComplete`` or ``RequestFailed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from store.types import (
    CurrentForwardConductorMetadata,
    NestedLoopIndices,
    PartitionDefinition,
    PartitionState,
    PublishedInfo,
    ResourceReqConfig,
    StreamingConnectionState,
    TensorPointerInfo,
)

PREPROCESS_WORKER = "api_server_preprocess_worker"
"""The engine's ``Conductor.PREPROCESS_WORKER``: it holds a request's input signals."""


@dataclass
class Teardown:
    """The teardown barrier (the engine's ``DrainingRequest``): once every entity in
    ``expected_acks`` has sent READS_DONE, ``participants`` get the hard RemoveRequest.
    ``deadline`` is when the barrier is forced through anyway (the caller's clock)."""

    expected_acks: set[str]
    participants: set[str]
    failure_error: str | None = None
    failure_status: int = 500
    deadline: float = 0.0


@dataclass
class ConductorRequest:
    """One request's whole state, as ``RequestData`` holds it plus the store's additions."""

    request_id: str
    persist_signals: dict[str, list[TensorPointerInfo]]
    persist_signal_ref_cnt: dict[str, int]
    worker_graph_to_workers: dict[str, list[str]]
    all_worker_graph_ids: set[str]
    max_output_tokens: int
    random_seed: int
    resource_configs: dict[str, ResourceReqConfig]
    partition_states: dict[str, PartitionState] = field(default_factory=dict)
    partition_definitions: dict[str, PartitionDefinition] = field(default_factory=dict)
    streaming_connections: dict[str, StreamingConnectionState] = field(default_factory=dict)
    final_outputs: dict[str, NestedLoopIndices] = field(default_factory=dict)
    conductor_ingest_time: float = 0.0
    conductor_finish_time: float = 0.0
    worker_graph_walks: dict[str, set[str]] = field(default_factory=dict)
    teardown: Teardown | None = None
    early_reads_done: set[str] = field(default_factory=set)
    aborted_early: bool = False
    concluded: bool = False
    owner: str = ""
    answered: bool = False

    def workers(self) -> set[str]:
        """Every worker the request is assigned to (the engine's ``_request_workers``)."""
        return {w for workers in self.worker_graph_to_workers.values() for w in workers}


@dataclass
class WorkerGraphsDone:
    """A worker's report that it ran worker graphs of one partition's pass: the fields of
    the engine's ``mstar.utils.ipc_format.WorkerGraphsDone`` that a request's state takes.

    The store's operations take the engine's own message as well (read by attribute); this
    class is for callers without the engine. The profiling fields are not taken."""

    request_id: str
    worker_graph_ids: list[str]
    is_first_tp_rank: bool
    persist_signals: dict[str, list[TensorPointerInfo]] = field(default_factory=dict)
    new_token_counts: dict[str, int] = field(default_factory=dict)
    output_signal_names: int | list[str] = 0
    resource_publish_info: dict[str, PublishedInfo] = field(default_factory=dict)
    partition_name: str = "default"
    partition_done: bool = False
    stream_tokens_consumed: dict[str, int] = field(default_factory=dict)
    output_loop_indices: dict[str, NestedLoopIndices] = field(default_factory=dict)


@dataclass
class PassResult:
    """What the model decided for a partition's next pass (the engine's ``ForwardPassArgs``
    as ``_process_done_forward`` uses it), and what the caller sent with it.

    ``sent_tensor_uuids``: the uuid of every ``TensorPointerInfo`` in the inputs sent, one
    entry per worker each went to (the engine counts a reference per worker's copy); the
    caller splits the inputs to workers, with the request's sharding config. They count only
    when the pass is not the partition's last (the engine sends no inputs then)."""

    full_metadata: CurrentForwardConductorMetadata
    step_metadata: dict[str, Any] = field(default_factory=dict)
    request_done: bool = False
    sent_tensor_uuids: list[str] = field(default_factory=list)
    unpersist_tensors: list[TensorPointerInfo] = field(default_factory=list)


Unpersist = dict[str, dict[str, int]]
"""entity -> {uuid: times sent}: one ``UnpersistTensors`` message per entity."""


@dataclass(frozen=True)
class GraphsDoneOutcome:
    """What applying one ``WorkerGraphsDone`` did. ``ignored`` says why nothing was applied
    (the engine ignores the message too): ``"unknown request"``, ``"draining"``,
    ``"unknown partition"``. ``done_partitions``: whose pass is now complete."""

    done_partitions: tuple[str, ...] = ()
    ignored: str | None = None


@dataclass(frozen=True)
class PassOutcome:
    """What completing a partition's pass did, and so what the caller sends.

    ``fwd_index``: the pass number the next pass's inputs carry; ``producer_done``: the
    consumer partitions told their producer is done; ``unpersist``: the UnpersistTensors
    to send; ``request_done``: every partition is done (conclude the request next);
    ``ignored``: why nothing was done (the request is draining, as the engine skips it)."""

    partition: str
    fwd_index: int
    request_done: bool = False
    partition_done: bool = False
    forced_by_max_tokens: bool = False
    producer_done: tuple[str, ...] = ()
    unpersist: Unpersist = field(default_factory=dict)
    next_worker_graph_ids: frozenset[str] = frozenset()
    ignored: str | None = None


@dataclass(frozen=True)
class IngestOutcome:
    """``aborted``: an abort came before the request (the engine's early-abort tombstone):
    nothing was stored; send RemoveRequest to the preprocess worker, which holds its inputs."""

    aborted: bool = False


@dataclass(frozen=True)
class TeardownOutcome:
    """What a teardown step did, and what the caller sends.

    ``drain``: entities sent DRAIN_REQUEST (abort/fail); ``remove``: entities sent the hard
    RemoveRequest (the barrier finalized; the record is gone); ``failure``: (error, status)
    to send the API server as ``RequestFailed`` when finalized on the fail path;
    ``ignored``: why nothing was done, as the engine ignores it."""

    drain: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    failure: tuple[str, int] | None = None
    ignored: str | None = None


@dataclass(frozen=True)
class Conclusion:
    """The request is complete: what ``RequestComplete`` carries, the UnpersistTensors for
    what is still persisted, and the teardown barrier it entered."""

    final_outputs: dict[str, NestedLoopIndices]
    conductor_ingest_time: float
    conductor_finish_time: float
    unpersist: Unpersist
    teardown: TeardownOutcome
