"""mstar-conductor-store: the M* conductor's per-request state, persistent and shared on Redis."""

from store.aio import AsyncRequestStore
from store.backoff import RetryPolicy
from store.codec import Codec
from store.codec.kinds import KindRegistry, default_registry, register_kind
from store.errors import (
    ConfigurationError,
    ConnectionNotFound,
    CorruptRecordError,
    EncodeError,
    EvictingServerError,
    FencedError,
    NotFoundError,
    PartitionNotFound,
    PayloadTooLargeError,
    ReplicaDrainingError,
    RequestExistsError,
    RequestNotFound,
    SchemaVersionError,
    StalePassError,
    StoreConnectionError,
    StoreError,
    StoreFullError,
    TransactionConflictError,
    UnknownKindError,
    UnknownStoredKindError,
    UnknownWorkerGraphError,
    ValidationError,
)
from store.keys import KeySpace
from store.ops.calls import Reconnect
from store.records import Lease, Report, ReportOutcome, RequestRecord, RequestState, Step
from store.replicas import AsyncReplicaRegistry, ReplicaRegistry
from store.runtime import (
    AsyncPlanner,
    AsyncReplica,
    Planner,
    Replica,
    ReportResult,
    ReportStatus,
    Timing,
)
from store.store import RequestStore

__all__ = [
    "AsyncPlanner",
    "AsyncReplica",
    "AsyncReplicaRegistry",
    "AsyncRequestStore",
    "Codec",
    "ConfigurationError",
    "ConnectionNotFound",
    "CorruptRecordError",
    "EncodeError",
    "EvictingServerError",
    "FencedError",
    "KeySpace",
    "KindRegistry",
    "Lease",
    "NotFoundError",
    "PartitionNotFound",
    "PayloadTooLargeError",
    "Planner",
    "Reconnect",
    "Replica",
    "ReplicaDrainingError",
    "ReplicaRegistry",
    "Report",
    "ReportOutcome",
    "ReportResult",
    "ReportStatus",
    "RequestExistsError",
    "RequestNotFound",
    "RequestRecord",
    "RequestState",
    "RequestStore",
    "RetryPolicy",
    "SchemaVersionError",
    "StalePassError",
    "Step",
    "StoreConnectionError",
    "StoreError",
    "StoreFullError",
    "Timing",
    "TransactionConflictError",
    "UnknownKindError",
    "UnknownStoredKindError",
    "UnknownWorkerGraphError",
    "ValidationError",
    "default_registry",
    "register_kind",
]
