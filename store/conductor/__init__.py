"""A request held as mstar-ai's ``Conductor`` keeps it: the record, the engine's rules on
it, and its layout in Redis. The operations on it are ``store.ops.conductor``'s, methods
of ``RequestStore`` and ``AsyncRequestStore``."""

from store.conductor.record import (
    PREPROCESS_WORKER,
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    IngestOutcome,
    PassOutcome,
    PassResult,
    Teardown,
    TeardownOutcome,
    Unpersist,
    WorkerGraphsDone,
)

__all__ = [
    "PREPROCESS_WORKER",
    "Conclusion",
    "ConductorRequest",
    "GraphsDoneOutcome",
    "IngestOutcome",
    "PassOutcome",
    "PassResult",
    "Teardown",
    "TeardownOutcome",
    "Unpersist",
    "WorkerGraphsDone",
]
