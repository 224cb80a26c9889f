"""mstar-conductor-store: the M* conductor's per-request state, persistent and shared on Redis.

Names are imported on first use, so that ``import store`` (and the ``mstar-store`` CLI, which
chooses where the engine's types come from before anything reads them) starts quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store.aio import AsyncRequestStore
    from store.backoff import RetryPolicy
    from store.codec import Codec
    from store.codec.kinds import KindRegistry, default_registry, register_kind
    from store.durability import Durability
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
        ReplicationTimeoutError,
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

_MODULES: dict[str, str] = {
    "AsyncRequestStore": "store.aio",
    "RetryPolicy": "store.backoff",
    "Codec": "store.codec",
    "KindRegistry": "store.codec.kinds",
    "default_registry": "store.codec.kinds",
    "register_kind": "store.codec.kinds",
    "Durability": "store.durability",
    "ConfigurationError": "store.errors",
    "ConnectionNotFound": "store.errors",
    "CorruptRecordError": "store.errors",
    "EncodeError": "store.errors",
    "EvictingServerError": "store.errors",
    "FencedError": "store.errors",
    "NotFoundError": "store.errors",
    "PartitionNotFound": "store.errors",
    "PayloadTooLargeError": "store.errors",
    "ReplicaDrainingError": "store.errors",
    "ReplicationTimeoutError": "store.errors",
    "RequestExistsError": "store.errors",
    "RequestNotFound": "store.errors",
    "SchemaVersionError": "store.errors",
    "StalePassError": "store.errors",
    "StoreConnectionError": "store.errors",
    "StoreError": "store.errors",
    "StoreFullError": "store.errors",
    "TransactionConflictError": "store.errors",
    "UnknownKindError": "store.errors",
    "UnknownStoredKindError": "store.errors",
    "UnknownWorkerGraphError": "store.errors",
    "ValidationError": "store.errors",
    "KeySpace": "store.keys",
    "Reconnect": "store.ops.calls",
    "Lease": "store.records",
    "Report": "store.records",
    "ReportOutcome": "store.records",
    "RequestRecord": "store.records",
    "RequestState": "store.records",
    "Step": "store.records",
    "AsyncReplicaRegistry": "store.replicas",
    "ReplicaRegistry": "store.replicas",
    "AsyncPlanner": "store.runtime",
    "AsyncReplica": "store.runtime",
    "Planner": "store.runtime",
    "Replica": "store.runtime",
    "ReportResult": "store.runtime",
    "ReportStatus": "store.runtime",
    "Timing": "store.runtime",
    "RequestStore": "store.store",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncPlanner",
    "AsyncReplica",
    "AsyncReplicaRegistry",
    "AsyncRequestStore",
    "Codec",
    "ConfigurationError",
    "ConnectionNotFound",
    "CorruptRecordError",
    "Durability",
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
    "ReplicationTimeoutError",
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
