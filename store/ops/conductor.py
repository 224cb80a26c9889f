"""One operation per thing mstar-ai's ``Conductor`` does to a request, on the whole request
as it keeps it (``store.conductor``).

Each operation reads the request (or takes this client's latest version of it, see
``StoredCache``), applies the engine's rule (``store.conductor.rules``) in the client, and
commits the fields that changed with ``conductor_write.lua``: whole or not at all, only
onto the version it read (else read again and redo), fenced by the lease, and once per op
id (a retry after a lost reply gets the first application's outcome). A pass that this
client drove last costs one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store.conductor import rules
from store.conductor.checks import (
    check_request,
    checked,
    checked_message,
    message_request_id,
)
from store.conductor.layout import Early, Stored
from store.conductor.record import (
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    IngestOutcome,
    PassOutcome,
    PassResult,
    TeardownOutcome,
)
from store.errors import (
    RequestExistsError,
    RequestNotFound,
    StoreError,
    ValidationError,
)
from store.keys import validate_request_id
from store.ops.batch import gather
from store.ops.conductor_write import DRAIN_TTL, Commit, apply, read
from store.ops.core import Core
from store.ops.effects import Op
from store.records import Lease


def ingest_request(
    core: Core, request: ConductorRequest, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[IngestOutcome]:
    """Hold a new request whole (``Conductor._do_ingest_request``'s ``RequestData``, as it is
    after the initial forward-pass arguments and the NewRequests' references).

    An abort that came first (the engine's tombstone) wins: nothing is stored and the
    outcome says ``aborted``. READS_DONE that came first are kept for its barrier. Raises
    ``RequestExistsError`` if the request is held already (by another op).
    """
    check_request(request)
    rid = request.request_id

    def change(stored: Stored) -> Commit:
        if stored.request is not None or stored.gone:
            raise RequestExistsError("request is held already", request_id=rid)
        early = stored.early or Early()
        if early.aborted:
            return Commit([IngestOutcome(aborted=True)], gone=True)
        request.early_reads_done |= early.reads_done
        return Commit([IngestOutcome()], request=request, index="add")

    (outcome,) = yield from apply(core, rid, op_id, lease, change, label="ingest")
    return outcome  # type: ignore[no-any-return]


def apply_worker_graphs_done(
    core: Core, message: Any, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[GraphsDoneOutcome]:
    """Take one ``WorkerGraphsDone`` (the engine's message, or ``store.conductor``'s), with
    the engine's rules: rank-0-only absorbs, tokens per edge, persisted signals from every
    rank, final outputs, each worker graph done when all its ranks reported. The outcome
    names the partitions whose pass is now complete (complete each with ``complete_pass``)
    or why the message was ignored, as the engine ignores it."""
    (outcome,) = yield from apply_conductor_steps(
        core, message_request_id(message), [GraphsDone(message)], op_id=op_id, lease=lease
    )
    return outcome  # type: ignore[no-any-return]


def complete_pass(
    core: Core,
    request_id: str,
    partition: str,
    result: PassResult,
    *,
    partition_done_from_worker: bool = False,
    op_id: str | None = None,
    lease: Lease | None = None,
) -> Op[PassOutcome]:
    """Complete ``partition``'s pass with the model's answer (``Conductor._process_done_
    forward``): next metadata, the max-token stop, producer_done, references of the inputs
    sent, the UnpersistTensors to send, and the reset to the next pass."""
    step = CompletePass(partition, result, partition_done_from_worker)
    (outcome,) = yield from apply_conductor_steps(
        core, request_id, [step], op_id=op_id, lease=lease
    )
    return outcome  # type: ignore[no-any-return]


def conclude_request(
    core: Core,
    request_id: str,
    *,
    finish_time: float,
    now: float,
    op_id: str | None = None,
    lease: Lease | None = None,
    drain_ttl: float = DRAIN_TTL,
) -> Op[Conclusion]:
    """Every partition is done (``Conductor._process_request_done``): what RequestComplete
    carries, the UnpersistTensors of what is still persisted, and the teardown barrier
    (which waits for the preprocess worker; forced at ``now + drain_ttl``)."""
    (outcome,) = yield from apply_conductor_steps(
        core, request_id, [Conclude(finish_time, now + drain_ttl)], op_id=op_id, lease=lease
    )
    return outcome  # type: ignore[no-any-return]


@dataclass(frozen=True)
class GraphsDone:
    """A step of ``apply_conductor_steps``: take one WorkerGraphsDone."""

    message: Any


@dataclass(frozen=True)
class CompletePass:
    """A step: complete a partition's pass (see ``complete_pass``)."""

    partition: str
    result: PassResult
    partition_done_from_worker: bool = False


@dataclass(frozen=True)
class Conclude:
    """A step: conclude the request (see ``conclude_request``); barrier forced at
    ``deadline``."""

    finish_time: float
    deadline: float


Step = GraphsDone | CompletePass | Conclude


def apply_conductor_steps(
    core: Core,
    request_id: str,
    steps: Sequence[Step],
    *,
    op_id: str | None = None,
    lease: Lease | None = None,
) -> Op[list[Any]]:
    """Apply ``steps`` to one request in order, as one write: what the engine's run loop
    does to a request in one turn (its WorkerGraphsDone, then the passes they completed,
    then its conclusion) for one round trip. One outcome per step; a step on a request not
    held (or torn down) is ignored, as the engine ignores it."""
    rid = validate_request_id(request_id)
    first = _checked_steps(core, rid, steps)  # refused before anything is read
    tries = 0

    def change(stored: Stored) -> Commit | None:
        nonlocal tries
        request = stored.request
        if request is None:
            return Commit([_ignored(s, rid) for s in steps], unchanged=True)
        tries += 1  # a redo takes copies of its own: it must not see the first try's merges
        values = first if tries == 1 else _checked_steps(core, rid, steps)
        outcomes: list[Any] = []
        for step, value in zip(steps, values, strict=True):
            if isinstance(step, GraphsDone):
                outcomes.append(rules.apply_worker_graphs_done(request, value))
            elif isinstance(step, CompletePass):
                done = step.partition_done_from_worker
                outcomes.append(
                    rules.complete_pass(
                        request, step.partition, value, partition_done_from_worker=done
                    )
                )
            elif request.teardown is not None:  # the run loop skips a request in teardown
                ignored = TeardownOutcome(ignored="draining")
                outcomes.append(Conclusion({}, request.conductor_ingest_time, 0.0, {}, ignored))
            else:
                outcomes.append(rules.conclude(request, step.finish_time, step.deadline))
        return _after_teardown(request, outcomes)

    return (yield from apply(core, rid, op_id, lease, change, label=_steps_label(steps)))


def abort_request(
    core: Core,
    request_id: str,
    *,
    now: float,
    op_id: str | None = None,
    lease: Lease | None = None,
    drain_ttl: float = DRAIN_TTL,
) -> Op[TeardownOutcome]:
    """The client went away (``Conductor._abort_request``): DRAIN_REQUEST to every
    participant and a barrier on all of their READS_DONE. An abort before the request is
    kept as a tombstone (``drain_ttl``): its ingest is then refused (``aborted``)."""
    return (yield from _teardown(core, request_id, op_id, lease, now, drain_ttl, None))


def fail_request(
    core: Core,
    request_id: str,
    error: str,
    *,
    now: float,
    op_id: str | None = None,
    lease: Lease | None = None,
    drain_ttl: float = DRAIN_TTL,
) -> Op[TeardownOutcome]:
    """A worker cannot serve the request (``Conductor._fail_requests``): as an abort, and
    the API server gets RequestFailed once the barrier completes. Ignored for a request not
    held or already draining (every TP rank reports the same failure)."""
    if not isinstance(error, str):
        raise ValidationError("error must be text", request_id=request_id, field="error")
    return (yield from _teardown(core, request_id, op_id, lease, now, drain_ttl, error))


def reads_done(
    core: Core,
    request_id: str,
    entity: str,
    *,
    op_id: str | None = None,
    lease: Lease | None = None,
    drain_ttl: float = DRAIN_TTL,
) -> Op[TeardownOutcome]:
    """``entity`` has no reads in flight for the request (``Conductor._handle_reads_done``):
    an ack to its barrier, which may finalize it (RemoveRequest to every participant, the
    request's state deleted); kept for a barrier not registered yet."""
    rid = validate_request_id(request_id)
    if not isinstance(entity, str) or not entity:
        raise ValidationError("entity must be a non-empty text", request_id=rid, field="entity")

    def change(stored: Stored) -> Commit | None:
        if stored.gone:
            return Commit([TeardownOutcome(ignored="torn down")], gone=True)
        if stored.request is None:
            early = stored.early or Early()
            early.reads_done.add(entity)
            return Commit([TeardownOutcome(ignored="no barrier yet")], early=early)
        outcome = rules.reads_done(stored.request, entity)
        return _after_teardown(stored.request, [outcome])

    (outcome,) = yield from apply(
        core, rid, op_id, lease, change, early_ttl=drain_ttl, label=f"reads done {entity}"
    )
    return outcome  # type: ignore[no-any-return]


def expire_teardown(
    core: Core, request_id: str, *, now: float, op_id: str | None = None, lease: Lease | None = None
) -> Op[TeardownOutcome]:
    """Force a barrier past its deadline through (``Conductor._sweep_expiry``)."""
    rid = validate_request_id(request_id)

    def change(stored: Stored) -> Commit | None:
        if stored.request is None:
            return None
        return _after_teardown(stored.request, [rules.expire(stored.request, now)])

    outcomes = yield from apply(core, rid, op_id, lease, change, label="expire teardown")
    return outcomes[0] if outcomes else TeardownOutcome(ignored="unknown request")


def load_conductor_request(core: Core, request_id: str) -> Op[ConductorRequest]:
    """The request as held (``RequestNotFound`` when none is)."""
    rid = validate_request_id(request_id)
    stored = yield from read(core, rid)
    if stored.request is None:
        raise RequestNotFound("no such request", request_id=rid, key=core.keys.conductor(rid))
    return stored.request


def list_conductor_requests(core: Core) -> Op[list[str]]:
    """Ids of the requests held as the engine's Conductor keeps them, oldest first."""
    key = core.keys.conductor_index
    (ids,) = yield from core.send(key, [("ZRANGE", key, 0, -1)], {"key": key})
    return [i.decode() for i in ids]


def save_conductor_request(
    core: Core, request: ConductorRequest, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[None]:
    """Write ``request`` whole, as a conductor that decided with the engine's own code holds
    it now (``store.integrations.mstar``): the store records the engine's result. Only the
    fields that changed are sent; fenced, on the version last read, once per op id."""
    check_request(request)
    rid = request.request_id

    def change(stored: Stored) -> Commit:
        if stored.gone:
            raise RequestNotFound("request was torn down", request_id=rid)
        return Commit([], request=request, index=None if stored.holds_request else "add")

    yield from apply(core, rid, op_id, lease, change, label="save", decode=False)


def save_conductor_requests(
    core: Core, requests: Sequence[ConductorRequest], leases: Sequence[Lease | None]
) -> Op[list[StoreError | None]]:
    """``save_conductor_request`` of many requests at once, pipelined (one round trip for
    all that this client wrote last). One entry per request: None, or the error it met."""
    return (yield from _each(core, save_conductor_request, requests, leases))


def drop_conductor_requests(
    core: Core, request_ids: Sequence[str], leases: Sequence[Lease | None]
) -> Op[list[StoreError | None]]:
    """``drop_conductor_request`` of many requests at once, pipelined."""
    return (yield from _each(core, drop_conductor_request, request_ids, leases))


def _each(
    core: Core, one: Callable[..., Op[None]], items: Sequence[Any], leases: Sequence[Lease | None]
) -> Op[list[StoreError | None]]:
    if len(leases) != len(items):
        raise ValidationError(f"{len(leases)} leases for {len(items)} requests")
    ops = [one(core, item, lease=lease) for item, lease in zip(items, leases, strict=True)]
    return (yield from gather(ops))


def drop_conductor_request(
    core: Core, request_id: str, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[None]:
    """The request was torn down (the engine popped it): keep only its op results, until
    they expire."""
    rid = validate_request_id(request_id)

    def change(stored: Stored) -> Commit | None:
        if stored.gone or (not stored.holds_request and stored.early is None):
            return None
        return Commit([], gone=True, index="remove")

    yield from apply(core, rid, op_id, lease, change, label="drop", decode=False)


def claim_conductor_request(
    core: Core, request_id: str, holder: str, *, ttl: float | None = None
) -> Op[Lease | None]:
    """The request-level lease for ``holder`` (taken, or renewed while held), to fence every
    write on the request with; None while another holder's lease is live. A claim after the
    holder's lease expired raises the fencing token: the old holder's writes are refused
    (``FencedError``) from then on."""
    rid = validate_request_id(request_id)
    if not isinstance(holder, str) or not holder:
        raise ValidationError("holder must be a non-empty text", request_id=rid, field="holder")
    seconds = core.lease_ttl if ttl is None else ttl
    if not isinstance(seconds, int | float) or not 0 < seconds < 10**6:
        raise ValidationError("ttl must be in (0, 1e6) seconds", request_id=rid, field="ttl")
    key = core.keys.lease(rid)
    reply = yield from core.run(
        rid, "claim_conductor", [key], [holder, repr(float(seconds))], RequestNotFound
    )
    if reply[0] != b"OK":
        return None
    return Lease(rid, "*", holder, int(reply[1]), 0, float(reply[2]))


# -- the write ---------------------------------------------------------------------------


def _teardown(
    core: Core,
    request_id: str,
    op_id: str | None,
    lease: Lease | None,
    now: float,
    drain_ttl: float,
    failure: str | None,
) -> Op[TeardownOutcome]:
    rid = validate_request_id(request_id)

    def change(stored: Stored) -> Commit | None:
        if stored.gone:
            return Commit([TeardownOutcome(ignored="torn down")], gone=True)
        if stored.request is None:
            if failure is not None:
                return None
            early = stored.early or Early()
            early.aborted = True
            return Commit([TeardownOutcome(ignored="unknown request")], early=early)
        outcome = rules.remove(stored.request, now + drain_ttl, failure)
        return _after_teardown(stored.request, [outcome])

    outcomes = yield from apply(
        core, rid, op_id, lease, change, early_ttl=drain_ttl, label="fail" if failure else "abort"
    )
    return outcomes[0] if outcomes else TeardownOutcome(ignored="unknown request")


def _after_teardown(request: ConductorRequest, outcomes: list[Any]) -> Commit:
    """A barrier that finalized leaves no request behind (the engine pops it)."""
    for outcome in outcomes:
        teardown = outcome.teardown if isinstance(outcome, Conclusion) else outcome
        if isinstance(teardown, TeardownOutcome) and teardown.remove:
            return Commit(outcomes, gone=True, index="remove")
    return Commit(outcomes, request=request)


def _checked_steps(core: Core, rid: str, steps: Sequence[Step]) -> list[Any]:
    """Each step's message or pass result, checked to its declared types and copied (the
    rules merge them into the request), or None (a conclusion)."""
    values: list[Any] = []
    for step in steps:
        if isinstance(step, GraphsDone):
            values.append(checked_message(core.codec, step.message, rid))
        elif isinstance(step, CompletePass):
            values.append(checked(core.codec, step.result, PassResult, rid, "result"))
        elif isinstance(step, Conclude):
            values.append(None)
        else:
            raise ValidationError(f"not a step: {type(step).__name__}", request_id=rid)
    return values


def _steps_label(steps: Sequence[Step]) -> str:
    """What a turn did, for the history: "graphs done x2, pass p0, conclude"."""
    parts: list[str] = []
    graphs = sum(isinstance(s, GraphsDone) for s in steps)
    if graphs:
        parts.append("graphs done" if graphs == 1 else f"graphs done x{graphs}")
    parts += [f"pass {s.partition}" for s in steps if isinstance(s, CompletePass)]
    parts += ["conclude" for s in steps if isinstance(s, Conclude)]
    return ", ".join(parts) or "nothing"


def _ignored(step: Step, rid: str) -> Any:
    if isinstance(step, GraphsDone):
        return GraphsDoneOutcome(ignored="unknown request")
    if isinstance(step, CompletePass):
        return PassOutcome(step.partition, 0, ignored="unknown request")
    raise RequestNotFound("no such request", request_id=rid)
