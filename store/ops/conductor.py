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

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store.conductor import layout, rules
from store.conductor.layout import FORMAT, RECENT_OPS, Early, Stored
from store.conductor.record import (
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    IngestOutcome,
    PassOutcome,
    PassResult,
    TeardownOutcome,
    WorkerGraphsDone,
)
from store.errors import (
    RequestExistsError,
    RequestNotFound,
    SchemaVersionError,
    StoreError,
    TransactionConflictError,
    ValidationError,
)
from store.keys import validate_request_id
from store.ops.batch import gather
from store.ops.calls import hash_reply
from store.ops.core import Core
from store.ops.effects import Op
from store.records import Lease

DRAIN_TTL = 120.0
"""Seconds a teardown barrier, or an abort or READS_DONE that came before its request,
waits (the engine's ``MSTAR_DRAIN_TTL_S`` default)."""
_STATE_FIELDS = ("head", "order", "early", "state")


@dataclass
class _Write:
    """What a change leaves: the request (None: no request is held), else an early record
    or nothing at all (``gone``); the outcomes; the index entry to add or remove."""

    outcomes: list[Any]
    request: ConductorRequest | None = None
    early: Early | None = None
    gone: bool = False
    index: str | None = None  # "add" | "remove"
    unchanged: bool = False  # nothing to write: the outcomes only


Change = Callable[[Stored], _Write | None]  # None: nothing to write; the outcome is in it


def ingest_request(
    core: Core, request: ConductorRequest, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[IngestOutcome]:
    """Hold a new request whole (``Conductor._do_ingest_request``'s ``RequestData``, as it is
    after the initial forward-pass arguments and the NewRequests' references).

    An abort that came first (the engine's tombstone) wins: nothing is stored and the
    outcome says ``aborted``. READS_DONE that came first are kept for its barrier. Raises
    ``RequestExistsError`` if the request is held already (by another op).
    """
    _check_request(core, request)
    rid = request.request_id

    def change(stored: Stored) -> _Write:
        if stored.request is not None or stored.gone:
            raise RequestExistsError("request is held already", request_id=rid)
        early = stored.early or Early()
        if early.aborted:
            return _Write([IngestOutcome(aborted=True)], gone=True)
        request.early_reads_done |= early.reads_done
        return _Write([IngestOutcome()], request=request, index="add")

    (outcome,) = yield from _apply(core, rid, op_id, lease, change, label="ingest")
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
        core, _message_rid(message), [GraphsDone(message)], op_id=op_id, lease=lease
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
    for step in steps:  # refused before anything is read
        if isinstance(step, GraphsDone):
            _checked_message(core, step.message, rid)
        elif isinstance(step, CompletePass):
            _checked(core, step.result, PassResult, rid, "result")
        elif not isinstance(step, Conclude):
            raise ValidationError(f"not a step: {type(step).__name__}", request_id=rid)

    def change(stored: Stored) -> _Write | None:
        request = stored.request
        if request is None:
            return _Write([_ignored(s, rid) for s in steps], unchanged=True)
        outcomes: list[Any] = []
        for step in steps:
            if isinstance(step, GraphsDone):  # a copy: a redo must not see this try's merges
                message = _checked_message(core, step.message, rid)
                outcomes.append(rules.apply_worker_graphs_done(request, message))
            elif isinstance(step, CompletePass):
                done = step.partition_done_from_worker
                outcomes.append(
                    rules.complete_pass(
                        request, step.partition, step.result, partition_done_from_worker=done
                    )
                )
            elif request.teardown is not None:  # the run loop skips a request in teardown
                ignored = TeardownOutcome(ignored="draining")
                outcomes.append(Conclusion({}, request.conductor_ingest_time, 0.0, {}, ignored))
            else:
                outcomes.append(rules.conclude(request, step.finish_time, step.deadline))
        return _after_teardown(request, outcomes)

    return (yield from _apply(core, rid, op_id, lease, change, label=_steps_label(steps)))


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

    def change(stored: Stored) -> _Write | None:
        if stored.gone:
            return _Write([TeardownOutcome(ignored="torn down")], gone=True)
        if stored.request is None:
            early = stored.early or Early()
            early.reads_done.add(entity)
            return _Write([TeardownOutcome(ignored="no barrier yet")], early=early)
        outcome = rules.reads_done(stored.request, entity)
        return _after_teardown(stored.request, [outcome])

    (outcome,) = yield from _apply(
        core, rid, op_id, lease, change, early_ttl=drain_ttl, label=f"reads done {entity}"
    )
    return outcome  # type: ignore[no-any-return]


def expire_teardown(
    core: Core, request_id: str, *, now: float, op_id: str | None = None, lease: Lease | None = None
) -> Op[TeardownOutcome]:
    """Force a barrier past its deadline through (``Conductor._sweep_expiry``)."""
    rid = validate_request_id(request_id)

    def change(stored: Stored) -> _Write | None:
        if stored.request is None:
            return None
        return _after_teardown(stored.request, [rules.expire(stored.request, now)])

    outcomes = yield from _apply(core, rid, op_id, lease, change, label="expire teardown")
    return outcomes[0] if outcomes else TeardownOutcome(ignored="unknown request")


def load_conductor_request(core: Core, request_id: str) -> Op[ConductorRequest]:
    """The request as held (``RequestNotFound`` when none is)."""
    rid = validate_request_id(request_id)
    stored = yield from _read(core, rid)
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
    _check_request(core, request)
    rid = request.request_id

    def change(stored: Stored) -> _Write:
        if stored.gone:
            raise RequestNotFound("request was torn down", request_id=rid)
        return _Write([], request=request, index=None if stored.request else "add")

    yield from _apply(core, rid, op_id, lease, change, label="save")


def save_conductor_requests(
    core: Core, requests: Sequence[ConductorRequest], leases: Sequence[Lease | None]
) -> Op[list[StoreError | None]]:
    """``save_conductor_request`` of many requests at once, pipelined (one round trip for
    all that this client wrote last). One entry per request: None, or the error it met."""
    if len(leases) != len(requests):
        raise ValidationError(f"{len(leases)} leases for {len(requests)} requests")
    ops = [
        save_conductor_request(core, r, lease=lease)
        for r, lease in zip(requests, leases, strict=True)
    ]
    return (yield from gather(ops))


def drop_conductor_requests(
    core: Core, request_ids: Sequence[str], leases: Sequence[Lease | None]
) -> Op[list[StoreError | None]]:
    """``drop_conductor_request`` of many requests at once, pipelined."""
    if len(leases) != len(request_ids):
        raise ValidationError(f"{len(leases)} leases for {len(request_ids)} requests")
    ops = [
        drop_conductor_request(core, rid, lease=lease)
        for rid, lease in zip(request_ids, leases, strict=True)
    ]
    return (yield from gather(ops))


def drop_conductor_request(
    core: Core, request_id: str, *, op_id: str | None = None, lease: Lease | None = None
) -> Op[None]:
    """The request was torn down (the engine popped it): keep only its op results, until
    they expire."""
    rid = validate_request_id(request_id)

    def change(stored: Stored) -> _Write | None:
        if stored.gone or (stored.request is None and stored.early is None):
            return None
        return _Write([], gone=True, index="remove")

    yield from _apply(core, rid, op_id, lease, change, label="drop")


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

    def change(stored: Stored) -> _Write | None:
        if stored.gone:
            return _Write([TeardownOutcome(ignored="torn down")], gone=True)
        if stored.request is None:
            if failure is not None:
                return None
            early = stored.early or Early()
            early.aborted = True
            return _Write([TeardownOutcome(ignored="unknown request")], early=early)
        outcome = rules.remove(stored.request, now + drain_ttl, failure)
        return _after_teardown(stored.request, [outcome])

    outcomes = yield from _apply(
        core, rid, op_id, lease, change, early_ttl=drain_ttl, label="fail" if failure else "abort"
    )
    return outcomes[0] if outcomes else TeardownOutcome(ignored="unknown request")


def _after_teardown(request: ConductorRequest, outcomes: list[Any]) -> _Write:
    """A barrier that finalized leaves no request behind (the engine pops it)."""
    for outcome in outcomes:
        teardown = outcome.teardown if isinstance(outcome, Conclusion) else outcome
        if isinstance(teardown, TeardownOutcome) and teardown.remove:
            return _Write(outcomes, gone=True, index="remove")
    return _Write(outcomes, request=request)


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


def _read(core: Core, rid: str) -> Op[Stored]:
    key = core.keys.conductor(rid)
    (flat,) = yield from core.send(key, [("HGETALL", key)], {"request_id": rid, "key": key})
    raw = {name.decode(errors="replace"): value for name, value in hash_reply(flat).items()}
    return layout.decode_stored(core.codec, rid, key, raw)


def _apply(
    core: Core,
    rid: str,
    op_id: str | None,
    lease: Lease | None,
    change: Change,
    *,
    early_ttl: float = DRAIN_TTL,
    label: str = "conductor",
) -> Op[list[Any]]:
    """Apply ``change`` to the latest version of the request and commit it (see above);
    ``label`` says what it did in the request's history."""
    op_id = op_id or core.new_op_id()
    if not isinstance(op_id, str) or not op_id or len(op_id) > 200:
        raise ValidationError("op_id must be a text of 1..200 characters", request_id=rid)
    key, cache = core.keys.conductor(rid), core.conductor_records
    where: dict[str, str | None] = {"request_id": rid, "key": key}
    try:
        for _ in range(core.retry.max_attempts):
            held = cache.get(rid)
            if held is None:
                stored = yield from _read(core, rid)
            else:  # decoded afresh: the change works on objects of its own
                stored = layout.decode_stored(core.codec, rid, key, held.raw)
            done = stored.raw.get(f"o:{op_id}")
            if done is not None:
                return layout.decode_result(core.codec, done, **where)
            write = change(stored)
            if write is None:
                return []
            if write.unchanged:
                return write.outcomes
            fields = _fields(core, write, early_ttl)
            ops = [*stored.ops, op_id]
            forget = ops.pop(0) if len(ops) > RECENT_OPS else ""
            fields["ops"] = layout.encode_ops(ops)
            result = layout.encode_result(core.codec, write.outcomes)
            doomed = [
                name
                for name in stored.raw
                if name not in fields and (name in _STATE_FIELDS or name[:2] in ("p:", "c:"))
            ]
            changed = [(n, v) for n, v in fields.items() if stored.raw.get(n) != v]
            expiry = _expiry(core, stored, write, early_ttl)
            args: list[Any] = [
                FORMAT, *(_fence(lease)), op_id, str(stored.version), result, forget, expiry,
                label, core.history_cap, str(len(doomed)), *doomed,
                *(x for pair in changed for x in pair),
            ]  # fmt: skip
            keys = [key, core.keys.lease(rid), core.keys.history(rid)]
            reply = yield from core.run(rid, "conductor_write", keys, args, RequestNotFound, lease)
            status = reply[0]
            if status == b"OK":
                raw = {n: v for n, v in stored.raw.items() if n not in doomed}
                raw.update(fields)
                raw[f"o:{op_id}"] = result
                raw.pop(f"o:{forget}", None)
                raw["ver"] = reply[1]
                cache.put(rid, Stored(version=int(reply[1]), raw=raw))
                yield from _index(core, rid, write)
                return write.outcomes
            cache.drop(rid)
            if status == b"DONE":
                return layout.decode_result(core.codec, reply[1], **where)
            if status == b"FORMAT":
                raise SchemaVersionError(int(reply[1]), int(FORMAT), **where)
            # STALE: another writer moved the request on; read it and redo the change
        raise TransactionConflictError(core.retry.max_attempts, **where)
    except BaseException:
        cache.drop(rid)  # whether it was written is unknown: read it next time
        raise


def _fields(core: Core, write: _Write, early_ttl: float) -> dict[str, bytes]:
    if write.request is not None:
        return layout.encode_request(
            core.codec, core.keys.conductor(write.request.request_id), write.request
        )
    if write.early is not None:
        return {"early": layout.encode_early(write.early)}
    return {"state": b"gone"}


def _expiry(core: Core, stored: Stored, write: _Write, early_ttl: float) -> str:
    """An early record lives ``early_ttl``; a torn-down one keeps its results for the
    dedupe window; a held request does not expire."""
    if write.request is not None:
        return "" if stored.request is not None else "persist"
    if write.early is not None:
        return str(max(1, int(early_ttl * 1000)))
    return "" if stored.gone else str(max(1, int(core.dedupe_window * 1000)))


def _fence(lease: Lease | None) -> tuple[str, str]:
    if lease is None:
        return "*", ""
    return lease.partition, str(lease.token)


def _index(core: Core, rid: str, write: _Write) -> Op[None]:
    if write.index is None:
        return
    key = core.keys.conductor_index
    if write.index == "add":
        request = write.request
        assert request is not None
        command: tuple[Any, ...] = ("ZADD", key, "NX", repr(request.conductor_ingest_time), rid)
    else:
        command = ("ZREM", key, rid)
    yield from core.send(key, [command], {"request_id": rid, "key": key})


# -- checking what callers pass ------------------------------------------------------------


def _message_rid(message: Any) -> str:
    rid = getattr(message, "request_id", None)
    if not isinstance(rid, str):
        raise ValidationError(
            f"expected a WorkerGraphsDone, got {type(message).__name__}", field="request_id"
        )
    return rid


_MESSAGE_FIELDS: dict[str, Any] = {
    name: declared
    for name, declared in typing.get_type_hints(WorkerGraphsDone).items()
    if name != "request_id"
}


def _checked_message(core: Core, message: Any, rid: str) -> WorkerGraphsDone:
    """The fields the rules take, from the engine's message or the store's, as values of
    their own (a redo must not see an earlier try's merges into them), each checked to its
    declared type, nested values too: a wrong one is refused naming it, never applied half
    or stored to fail every read after."""
    if _message_rid(message) != rid:
        raise ValidationError(
            f"message is about request {message.request_id!r}", request_id=rid, field="request_id"
        )
    values = {
        name: _checked(core, getattr(message, name, None), declared, rid, name)
        for name, declared in _MESSAGE_FIELDS.items()
    }
    for name in ("new_token_counts", "stream_tokens_consumed"):
        for edge, count in values[name].items():
            if count < 0:
                raise ValidationError(
                    f"WorkerGraphsDone.{name} maps edge names to counts >= 0: {edge!r}: {count!r}",
                    request_id=rid, field=name,
                )  # fmt: skip
    return WorkerGraphsDone(request_id=rid, **values)


def _checked(core: Core, value: Any, declared: Any, rid: str, name: str) -> Any:
    """``value`` through the codec as ``declared`` and back: a copy, or ``ValidationError``."""
    try:
        return core.codec.decode(core.codec.encode(value, declared), declared)
    except Exception as e:  # the codec's own, msgspec's, or a wrong nested value's
        raise ValidationError(
            f"{name}: not a valid {getattr(declared, '__name__', declared)}: {e}",
            request_id=rid, field=name,
        ) from e  # fmt: skip


def _check_request(core: Core, request: ConductorRequest) -> None:
    if not isinstance(request, ConductorRequest):
        raise ValidationError(f"expected a ConductorRequest, got {type(request).__name__}")
    rid = validate_request_id(request.request_id)
    for wg, workers in request.worker_graph_to_workers.items():
        if not workers:
            raise ValidationError(
                f"worker graph {wg!r} has no workers", request_id=rid,
                field="worker_graph_to_workers",
            )  # fmt: skip
    if not request.partition_states:
        raise ValidationError("a request has at least one partition", request_id=rid,
                              field="partition_states")  # fmt: skip
