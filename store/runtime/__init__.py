"""The conductor replica runtime: the loop that applies reports, drives and recovers steps.

``Replica`` (sync) and ``AsyncReplica`` (asyncio) run the same decisions
(``store.runtime.decisions``); a conductor supplies a ``Planner`` and a ``Timing``.
"""

from store.runtime.aio import AsyncReplica
from store.runtime.decisions import FAILPOINTS, ReportResult, ReportStatus
from store.runtime.planner import AsyncPlanner, Planner
from store.runtime.sync import Replica
from store.runtime.timing import Timing

__all__ = [
    "FAILPOINTS",
    "AsyncPlanner",
    "AsyncReplica",
    "Planner",
    "Replica",
    "ReportResult",
    "ReportStatus",
    "Timing",
]
