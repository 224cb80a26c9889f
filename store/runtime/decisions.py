"""What a report, a claim or a recovery leads to: the runtime's decisions, written once.

Each decision is a program: a generator that yields ``Call``s (a method of the store, the
planner or the replica registry, with its arguments) and ``Failpoint``s, and is sent each
call's result back, or has its exception thrown in. ``store.runtime.sync`` runs programs
with plain calls, ``store.runtime.aio`` awaits them; nothing here does I/O.

Why every step is safe to redo (a replica may die between any two yields):

- a report is applied once (the store keys it by pass, worker graph and rank), and the
  report that completes a pass is granted the lease on the next step in the same call;
- a step (advance, send recorded, lease ended, next check set) is one call, recognised if
  resent, and fenced: once another replica claimed the step, it changes nothing;
- sending a pass again only makes the workers report again, which the store absorbs;
- a lease that is never ended runs out, and recovery (``store.runtime.recovery``)
  redoes what may be missing: the step if the pass is complete, else the pass is sent
  again, once its last send is no longer fresh.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from store.errors import (
    FencedError,
    NotFoundError,
    StalePassError,
    StoreConnectionError,
    StoreError,
    UnknownWorkerGraphError,
)
from store.ops.core import Topology
from store.records import Lease, Report, ReportOutcome, RequestState, Step
from store.runtime.books import Books
from store.stats import flush_commands
from store.types import PartitionState

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``target``'s method (``"store"``, ``"planner"`` or ``"registry"``)."""

    target: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Failpoint:
    """A named point between two steps, where tests make a replica die or stop."""

    name: str


Effect = Call | Failpoint
Program = Generator[Effect, Any, T]

# The points, in the order a pass goes through them.
FAILPOINTS = (
    "after_report",  # the report (and its published infos) recorded; the step not taken
    "after_claim",  # recovery claimed a step; nothing redone yet
    "after_step",  # the step taken (partition advanced, lease ended); the pass not sent
    "after_dispatch",  # the pass sent; consumers not nudged, nothing finished
    "before_release",  # recovery sent a pass again; its lease not ended
    "before_finish",  # final outputs stored; the request not finished
)


def store(method: str, *args: Any, **kwargs: Any) -> Call:
    return Call("store", method, args, kwargs)


def planner(method: str, *args: Any) -> Call:
    return Call("planner", method, args)


class ReportStatus(enum.Enum):
    """What became of a report."""

    APPLIED = "applied"  # recorded now
    DUPLICATE = "duplicate"  # recorded before: changed nothing
    STALE = "stale"  # its pass is over, or its worker graph is not in the pass
    GONE = "gone"  # its request is no longer held
    FENCED = "fenced"  # it won a step that another replica took over before it was taken


@dataclass(frozen=True, slots=True)
class ReportResult:
    """What ``apply_report`` did: the report's ``status``; whether this replica ``drove``
    the step the report's pass won (to ``new_pass``) and ``finished`` the request."""

    status: ReportStatus
    drove: bool = False
    new_pass: int | None = None
    finished: bool = False


# -- reports ---------------------------------------------------------------------------------


def apply_report(books: Books, report: Report, *, predict: bool) -> Program[ReportResult]:
    """Record one report; if it completed the pass (or a resend of it says so and the
    lease is still ours), take the step at once under that lease.

    With ``predict``, the planner is asked for the step ahead, and the report that
    completes the pass takes it in the same call (one round trip less per pass).
    """
    step: Step | None = (yield planner("predict_step", report)) if predict else None
    check = (
        {"then_step": step, "check_in": books.deadlines.check_in(1), "consumers": True}
        if step
        else {}
    )
    try:
        outcome = yield store(
            "record_worker_report", report.request_id, report.partition,
            fwd_pass=report.fwd_pass, worker_graph_id=report.worker_graph_id,
            rank=report.rank, num_ranks=report.num_ranks, new_tokens=report.new_tokens,
            output_names=report.output_names, consumed=report.consumed,
            published=report.published, replica_id=books.replica_id, **check,
        )  # fmt: skip
    except StoreError as e:
        return refused(e)
    status, lease = yield from recorded(books, report, outcome)
    if lease is None:
        return ReportResult(status)
    if outcome.stepped_to is not None:
        # This report took the step; a resend of it (its reply was lost) sends the new pass
        # again, since the first may never have been sent.
        assert step is not None  # only a step given with the report is taken in it
        if outcome.applied:
            books.count("passes")
        return (
            yield from stepped(
                books, lease, step, outcome.stepped_to, status, consumers=outcome.consumers
            )
        )
    assert outcome.partition is not None  # returned with every lease a report is granted
    step = yield planner("next_step", report.request_id, report.partition, outcome.partition)
    try:
        new_pass = yield store("take_step", lease, step, check_in=books.deadlines.check_in(1))
    except StoreError as e:
        return lost_step(books, lease, e)
    return (yield from took_step(books, lease, step, new_pass, status))


def apply_reports(
    books: Books, reports: Sequence[Report], *, predict: bool
) -> Program[list[ReportResult | StoreError]]:
    """``apply_report`` for many reports, batched: one call records a wave of them (with
    ``predict``, the reports that complete their pass take the predicted step in it), one
    call takes the steps the others won, one reads the streaming consumers the steps nudge
    (``nudge_many``). The results are those of applying them one at a time, in order, so a
    wave never holds a report that, one at a time, would have come after a step it takes
    part in: two reports of one request in a wave are of the same partition and pass, and
    no report appears twice. An error that ``apply_report`` would raise is that report's
    entry."""
    results: list[ReportResult | StoreError | None] = [None] * len(reports)
    for wave in waves(reports):
        nudges: list[Nudge] = []
        nudged: list[int] = []  # the report of each nudge
        batch = [reports[i] for i in wave]
        predicted: list[Step | None] = [None] * len(batch)
        if predict:
            for j, report in enumerate(batch):
                predicted[j] = yield planner("predict_step", report)
        ahead = (
            {
                "then_steps": predicted,
                "check_in": [books.deadlines.check_in(1) for _ in batch],
                "consumers": True,
            }
            if any(step is not None for step in predicted)
            else {}
        )
        outcomes = yield store("record_worker_reports", batch, replica_id=books.replica_id, **ahead)
        won: list[tuple[int, Lease, ReportStatus, Step]] = []
        for i, outcome, ahead_step in zip(wave, outcomes, predicted, strict=True):
            if isinstance(outcome, StoreError):
                results[i] = _refused_or_error(outcome)
                continue
            status, lease = yield from recorded(books, reports[i], outcome)
            if lease is None:
                results[i] = ReportResult(status)
                continue
            report = reports[i]
            if outcome.stepped_to is not None:  # took the predicted step: as apply_report
                assert ahead_step is not None
                if outcome.applied:
                    books.count("passes")
                results[i] = yield from stepped(
                    books, lease, ahead_step, outcome.stepped_to, status, nudges,
                    consumers=outcome.consumers,
                )  # fmt: skip
                if len(nudges) > len(nudged):  # this step left a nudge
                    nudged.append(i)
                continue
            step = yield planner(
                "next_step", report.request_id, report.partition, outcome.partition
            )
            won.append((i, lease, status, step))
        if won:
            yield from _take_won(books, won, results, nudges, nudged)
        for i, error in zip(nudged, (yield from nudge_many(books, nudges)), strict=True):
            if error is not None:
                results[i] = _refused_or_error(error)
    return [r for r in results if r is not None]


def _take_won(
    books: Books,
    won: list[tuple[int, Lease, ReportStatus, Step]],
    results: list[ReportResult | StoreError | None],
    nudges: list[Nudge],
    nudged: list[int],
) -> Program[None]:
    """The steps a wave's reports won, taken in one call; their nudges left in ``nudges``."""
    check_ins = [books.deadlines.check_in(1) for _ in won]
    passes = yield store(
        "take_steps",
        [(lease, step, c) for (_, lease, _, step), c in zip(won, check_ins, strict=True)],
    )
    for (i, lease, status, step), new_pass in zip(won, passes, strict=True):
        if isinstance(new_pass, StoreError):
            results[i] = _lost_or_error(books, lease, new_pass)
        else:
            results[i] = yield from took_step(books, lease, step, new_pass, status, nudges)
            if len(nudges) > len(nudged):  # this step left a nudge
                nudged.append(i)


def waves(reports: Sequence[Report]) -> list[list[int]]:
    """Indices of ``reports`` cut into waves that can be recorded in one call with the
    results of one at a time (see ``apply_reports``)."""
    out: list[list[int]] = []
    wave: list[int] = []
    ids: set[str] = set()
    passes: dict[str, tuple[str, int]] = {}
    for i, report in enumerate(reports):
        at = (report.partition, report.fwd_pass)
        if report.report_id in ids or passes.get(report.request_id, at) != at:
            out.append(wave)
            wave, ids, passes = [], set(), {}
        wave.append(i)
        ids.add(report.report_id)
        passes[report.request_id] = at
    if wave:
        out.append(wave)
    return out


def refused(error: StoreError) -> ReportResult:
    """The result of a report the store refused; errors that say nothing of the report
    (Redis unreachable, a damaged record) are raised for the caller to redeliver it."""
    if isinstance(error, StalePassError | UnknownWorkerGraphError):
        return ReportResult(ReportStatus.STALE)
    if isinstance(error, NotFoundError):
        return ReportResult(ReportStatus.GONE)
    raise error


def _refused_or_error(error: StoreError) -> ReportResult | StoreError:
    try:
        return refused(error)
    except StoreError as e:
        return e


def recorded(
    books: Books, report: Report, outcome: ReportOutcome
) -> Program[tuple[ReportStatus, Lease | None]]:
    """Book a recorded report; the lease it won on the next step, if any."""
    status = ReportStatus.APPLIED if outcome.applied else ReportStatus.DUPLICATE
    books.count("reports" if outcome.applied else "duplicates")
    lease = outcome.lease
    if lease is not None:
        books.completed(report.request_id, report.partition, report.fwd_pass)
        if outcome.stepped_to is None and not books.hold(lease):
            lease = None  # this replica's recovery claimed it first: that drive goes on
    yield Failpoint("after_report")
    return status, lease


def lost_step(books: Books, lease: Lease, error: StoreError) -> ReportResult:
    """``take_step`` refused: another replica claimed the step (it drives now), or the
    request is gone. Anything else is raised (the lease stays booked for ``drain``)."""
    if isinstance(error, FencedError | StalePassError):
        books.drop(lease)
        books.count("fenced")
        return ReportResult(ReportStatus.FENCED)
    if isinstance(error, NotFoundError):
        books.drop(lease)
        return ReportResult(ReportStatus.GONE)
    raise error


def _lost_or_error(books: Books, lease: Lease, error: StoreError) -> ReportResult | StoreError:
    try:
        return lost_step(books, lease, error)
    except StoreError as e:
        return e


def took_step(
    books: Books,
    lease: Lease,
    step: Step,
    new_pass: int,
    status: ReportStatus,
    nudges: list[Nudge] | None = None,
) -> Program[ReportResult]:
    books.drop(lease)
    books.count("passes")
    yield Failpoint("after_step")
    return (yield from stepped(books, lease, step, new_pass, status, nudges))


@dataclass(frozen=True, slots=True)
class Nudge:
    """A step's nudge of its partition's streaming consumers, left for ``nudge_many``."""

    rid: str
    producer: str
    state: RequestState | None
    topology: Topology
    consumers: Mapping[str, PartitionState] | None = None  # as the step left them


def stepped(
    books: Books,
    lease: Lease,
    step: Step,
    new_pass: int,
    status: ReportStatus,
    nudges: list[Nudge] | None = None,
    *,
    consumers: Mapping[str, PartitionState] | None = None,
) -> Program[ReportResult]:
    """After a step: send the new pass, or finish the request if every partition is done;
    then nudge the partition's streaming consumers (or, given ``nudges``, leave the nudge
    there for ``nudge_many``). ``consumers``: those partitions as the step left them, when
    the step returned them (a report's, see ``ReportOutcome.consumers``)."""
    rid, name = lease.request_id, lease.partition
    state: RequestState | None = None
    finished = False
    topology = yield store("topology", rid)
    if step.done:
        state, finished = yield from finish_if_done(books, lease, None)
    elif topology.incoming(name):
        # A consumer: its new pass may wait for tokens its producers have not streamed
        # yet; then the producer's next step nudges it (it reads the state after ours).
        state = yield from load(rid)
        if state is not None and (yield planner("runnable", rid, name, state)):
            yield from dispatch(books, rid, name, new_pass, step)
            yield Failpoint("after_dispatch")
    else:
        yield from dispatch(books, rid, name, new_pass, step)
        yield Failpoint("after_dispatch")
    if nudges is None:
        yield from nudge_consumers(books, rid, name, state, topology, after_step=consumers)
    elif topology.outgoing(name):
        nudges.append(Nudge(rid, name, state, topology, consumers))
    return ReportResult(status, drove=True, new_pass=new_pass, finished=finished)


def load(rid: str) -> Program[RequestState | None]:
    """The request's state; None once it is gone."""
    try:
        state: RequestState = yield store("load_request", rid)
    except NotFoundError:
        return None
    return state


def dispatch(books: Books, rid: str, name: str, fwd_pass: int, step: Step) -> Program[None]:
    """Send a pass through the planner. A send that fails (the transport to the workers is
    down, say) is logged and counted, not raised: the step is taken either way, and the
    pass's deadline has recovery send it again, as it would a pass whose workers died."""
    books.sent(rid, name, fwd_pass)
    try:
        yield planner("dispatch", rid, name, fwd_pass, step)
    except Exception as e:
        books.count("dispatch_errors")
        log.warning("sending pass %d of %s %s failed: %r", fwd_pass, rid, name, e)
        return
    books.count("dispatches")


def finish_if_done(
    books: Books, lease: Lease, state: RequestState | None
) -> Program[tuple[RequestState | None, bool]]:
    """If every partition is done: store the final outputs and finish the request, fenced
    by ``lease`` (whose step made its partition done). Returns the state read and whether
    this call finished the request. Partitions that finish together may both see all done
    and both finish: that is harmless (the same outputs, fenced writes)."""
    rid = lease.request_id
    try:
        if state is None:
            state = yield store("load_request", rid)
        assert state is not None
        if not all(part.is_done for part in state.partitions.values()):
            return state, False
        outputs = dict((yield planner("final_outputs", rid, state)))
        for name, value in outputs.items():
            yield store("set_final_output", rid, name, value, fence=lease)
        record = replace(state.record, final_outputs={**state.record.final_outputs, **outputs})
        yield planner("finished", rid, replace(state, record=record))
        yield Failpoint("before_finish")
        yield store("finish_request", rid, fence=lease, keep_for=books.timing.keep_for)
    except FencedError:
        books.count("fenced")  # another replica claimed the step: it finishes
        return state, False
    except NotFoundError:
        return state, False  # finished and removed already
    books.count("finished")
    return state, True


def nudge_consumers(
    books: Books,
    rid: str,
    producer: str,
    state: RequestState | None,
    topology: Topology | None = None,
    *,
    after_step: Mapping[str, PartitionState] | None = None,
) -> Program[None]:
    """Send the passes of ``producer``'s streaming consumers that its tokens made runnable.

    A consumer's pass is sent (without its lease: the consumer's own step set its check
    time, so recovery still covers it) if it has no report yet and the planner says it can
    run, unless this replica sent it already (another replica may send it too). Without a
    state at hand, the consumers' partitions are looked at first (as the producer's step
    left them, ``after_step``, else read): the whole request (the producer's KV pages above
    all) is read and decoded only if one of them may be sent.
    """
    topology = topology or (yield store("topology", rid))
    assert topology is not None
    consumers = topology.consumers(producer)
    if state is None:
        consumers = yield from _waiting(books, rid, consumers, after_step or {})
        state = (yield from load(rid)) if consumers else None
        if state is None:
            return
    yield from _send_runnable(books, rid, consumers, state)


def nudge_many(books: Books, nudges: Sequence[Nudge]) -> Program[list[StoreError | None]]:
    """``nudge_consumers`` of many steps, the consumers' partitions of those without a state
    read in one batched call; per nudge, the error that ``nudge_consumers`` would have
    raised (None: none)."""
    waiting: list[list[str]] = [[] for _ in nudges]
    unread: list[tuple[int, str]] = []
    for k, nudge in enumerate(nudges):
        if nudge.state is not None:
            continue
        for consumer in nudge.topology.consumers(nudge.producer):
            part = (nudge.consumers or {}).get(consumer)
            if part is None:
                unread.append((k, consumer))
            elif _may_send(books, nudge.rid, consumer, part):
                waiting[k].append(consumer)
    parts = (
        (yield store("load_partitions", [(nudges[k].rid, c) for k, c in unread])) if unread else []
    )
    errors: list[StoreError | None] = [None] * len(nudges)
    gone: set[int] = set()
    for (k, consumer), part in zip(unread, parts, strict=True):
        if isinstance(part, NotFoundError):
            gone.add(k)  # the request is gone
        elif isinstance(part, StoreError):
            errors[k] = errors[k] or part
        elif _may_send(books, nudges[k].rid, consumer, part):
            waiting[k].append(consumer)
    for k, nudge in enumerate(nudges):
        if errors[k] is not None or k in gone:
            continue
        try:
            if nudge.state is not None:
                consumers = nudge.topology.consumers(nudge.producer)
                yield from _send_runnable(books, nudge.rid, consumers, nudge.state)
            elif waiting[k]:
                state = yield from load(nudge.rid)
                if state is not None:
                    yield from _send_runnable(books, nudge.rid, waiting[k], state)
        except StoreError as e:
            errors[k] = e
    return errors


def _send_runnable(
    books: Books, rid: str, consumers: Sequence[str], state: RequestState
) -> Program[None]:
    """Send each consumer's current pass that may be sent (see ``_may_send``) and can run."""
    for name in consumers:
        part = state.partitions[name]
        if not _may_send(books, rid, name, part):
            continue
        if (yield planner("runnable", rid, name, state)):
            books.count("nudges")
            yield from dispatch(books, rid, name, part.fwd_pass_number, current_step(part))


def _waiting(
    books: Books, rid: str, consumers: list[str], after_step: Mapping[str, PartitionState]
) -> Program[list[str]]:
    """The consumers whose current pass this replica may send: as the step left them, or
    each read on its own."""
    waiting = []
    for name in consumers:
        part = after_step.get(name)
        if part is None:
            try:
                part = yield store("load_partition", rid, name)
            except NotFoundError:
                return []  # the request is gone
        if _may_send(books, rid, name, part):
            waiting.append(name)
    return waiting


def _may_send(books: Books, rid: str, name: str, part: PartitionState) -> bool:
    """The consumer's pass is not done, has no report yet, and this replica did not send it."""
    if part.is_done or any(part.wg_rank_completions.values()) or pass_complete(part):
        return False
    return bool(part.current_worker_graph_ids) and not books.sending(
        rid, name, part.fwd_pass_number
    )


# -- shared by the report path and recovery (store/runtime/recovery.py) ----------------------


def pass_complete(part: PartitionState) -> bool:
    """Every worker graph of the current pass has reported all its ranks."""
    wgs = part.current_worker_graph_ids
    return bool(wgs) and wgs <= part.completed_worker_graph_ids


def current_step(part: PartitionState) -> Step:
    """The partition's current pass, as ``dispatch`` takes it."""
    return Step(part.metadata, tuple(sorted(part.current_worker_graph_ids)))


# -- ingest, hand-over, duties ---------------------------------------------------------------


def submit(books: Books, request_id: str, create: Mapping[str, Any]) -> Program[None]:
    """Create a request (with its first pass's deadline) and send every partition's first
    pass that can run; a resubmission is recognised by the create's op id."""
    create = {"op_id": f"create:{request_id}", **create}
    check_in = books.deadlines.check_in(1)
    yield store("create_request", request_id, check_in=check_in, **create)
    state: RequestState = yield store("load_request", request_id)
    for name, part in state.partitions.items():
        if part.is_done or not part.current_worker_graph_ids:
            continue
        if (yield planner("runnable", request_id, name, state)):
            step = current_step(part)
            yield from dispatch(books, request_id, name, part.fwd_pass_number, step)


def hand_over(books: Books, lease: Lease) -> Program[bool]:
    """End a lease so that another replica takes the step at once; False if it was
    superseded already, or Redis is unreachable (the lease runs out by itself then)."""
    try:
        yield store("release_lease", lease, check_in=0, sent=False)
    except (FencedError, NotFoundError, StoreConnectionError):
        books.drop(lease)
        return False
    books.drop(lease)
    books.count("handed_over")
    return True


def heartbeat(
    books: Books, flushed: Mapping[str, int], store_retries: int
) -> Program[dict[str, int]]:
    """Beat and flush the counters since ``flushed``; returns the totals now flushed."""
    totals = books.totals(store_retries)
    held = books.held()
    commands = flush_commands(
        books.keys, books.replica_id, totals, flushed,
        leases=len(held), requests=len({lease.request_id for lease in held}),
        now=books.wall_clock(), heartbeat_interval=books.timing.heartbeat,
    )  # fmt: skip
    yield Call("registry", "heartbeat", (books.replica_id,), {"stats": commands})
    return totals


def reap(books: Books) -> Program[None]:
    """Delete abandoned requests (and kept ones expired), forget long-silent replicas."""
    yield store("reap", max_age=books.timing.max_request_age)
    yield Call("registry", "prune", (), {"older_than": books.timing.prune_after})


def leave(books: Books) -> Program[None]:
    yield Call("registry", "forget", (books.replica_id,))
