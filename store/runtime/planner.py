"""What a conductor implements: the decisions about its model, never the protocol.

The runtime owns the loop (apply reports, take steps under leases, recover, drain); a
planner only says what the next step of a partition is and how to send a pass to the
workers. Every method may be called more than once for the same pass (after a crash, a
resend, or by two replicas at once), so each must be a function of its arguments or
tolerate repeats: ``dispatch`` in particular must accept a pass it sent already (the
workers' duplicate reports are absorbed by the store).

Subclass ``Planner`` (sync) or ``AsyncPlanner`` (``async def`` methods; ``AsyncReplica``
takes either). Only ``next_step`` and ``dispatch`` are required.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from store.records import Report, RequestState, Step
from store.types import PartitionState


class Planner:
    """The sync planner interface, with defaults for everything but the two essentials."""

    def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        """The step after the pass ``state`` just completed (``state`` as stored after the
        pass: outputs, tokens, published info): the next pass, or ``Step(..., done=True)``."""
        raise NotImplementedError

    def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Step) -> None:
        """Send pass ``fwd_pass`` (its metadata and worker graphs: ``step``) to the workers.
        Called again for a pass that looked lost: must tolerate repeats."""
        raise NotImplementedError

    def predict_step(self, report: Report) -> Step | None:
        """The step after ``report``'s pass, if known before the pass completes (a decode
        step like the last); None if not. Saves the step's round trip: the report that
        completes the pass takes it in the same call. Must equal what ``next_step`` says."""
        return None

    def runnable(self, request_id: str, partition: str, state: RequestState) -> bool:
        """Can ``partition``'s current pass run now? A streaming consumer waits for its
        producer's tokens (``state.connections``); the runtime asks after every step of a
        producer, and before resending a pass."""
        return True

    def final_outputs(self, request_id: str, state: RequestState) -> Mapping[str, Any]:
        """The request's outputs, once every partition is done (stored with the request)."""
        return {}

    def finished(self, request_id: str, state: RequestState) -> None:
        """Called before a request is finished, at least once (again after a crash):
        e.g. to answer the client. ``state.record.final_outputs`` holds the outputs."""
        return None


class AsyncPlanner:
    """``Planner`` with ``async def`` methods, for ``AsyncReplica``."""

    async def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        """``Planner.next_step``, awaited."""
        raise NotImplementedError

    async def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Step) -> None:
        """``Planner.dispatch``, awaited: must tolerate repeats."""
        raise NotImplementedError

    async def predict_step(self, report: Report) -> Step | None:
        """``Planner.predict_step``, awaited (None: not known)."""
        return None

    async def runnable(self, request_id: str, partition: str, state: RequestState) -> bool:
        """``Planner.runnable``, awaited."""
        return True

    async def final_outputs(self, request_id: str, state: RequestState) -> Mapping[str, Any]:
        """``Planner.final_outputs``, awaited."""
        return {}

    async def finished(self, request_id: str, state: RequestState) -> None:
        """``Planner.finished``, awaited."""
        return None
