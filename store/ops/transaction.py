"""Optimistic transactions in two round trips: WATCH with the reads, then MULTI..EXEC.

redis-py's ``pipeline().watch()`` spends a round trip on WATCH and one on each read; here
WATCH and the reads go out in one write on one connection, the body computes the writes in
Python, and MULTI, the writes and EXEC go out in the second. The body must be pure (it only
computes from what was read), so a retry after a conflict is always safe. A connection lost
while EXEC was in flight leaves the outcome unknown: the retry reads again, and operations
guard against a second application themselves (see the op ids in ``store.ops``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from store.backoff import RetryPolicy
from store.durability import MASTER, Durability
from store.errors import TransactionConflictError
from store.ops.calls import DEFAULT_RECONNECT, Reconnect, Where, raise_error_replies
from store.ops.effects import (
    Command,
    Commit,
    Disconnected,
    ErrorReply,
    Op,
    RefreshSlots,
    Sleep,
    Unwatch,
    Watch,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class Plan(Generic[T]):
    """What a transaction body decided: the writes to commit and the result to return."""

    writes: list[Command] = field(default_factory=list)
    result: T | None = None
    step_aside: bool = False  # another writer has precedence: back off and read again
    # Which writer it steps aside for: the wait's patience starts again when that changes
    # (a queue of writers taking turns is progress; one writer holding on is a stall).
    waiting_for: object = None


@dataclass
class Outcome(Generic[T]):
    result: T | None
    attempts: int


def optimistic(
    watch: Sequence[str],
    reads: Sequence[Command],
    body: Callable[[list[Any]], Plan[T]],
    policy: RetryPolicy,
    where: Where,
    on_retry: Callable[[int], Op[None]] | None = None,
    reconnect: Reconnect = DEFAULT_RECONNECT,
    durability: Durability = MASTER,
) -> Op[Outcome[T]]:
    """Run ``body`` over a consistent read of ``reads`` and commit its writes, with retries.

    All keys must share one hash slot. Raises ``TransactionConflictError`` when
    ``policy.max_attempts`` tries met a concurrent writer (or the body kept stepping aside
    for the same writer for ``policy.max_wait`` seconds), ``StoreConnectionError`` when
    Redis stayed unreachable; either way nothing of a failed try was written. ``on_retry(failed)``
    runs before each retry. A body that returns ``Plan(step_aside=True)`` waits for another
    writer: that try is not counted as a conflict. With replicated ``durability`` a
    ``WAIT`` follows the EXEC in the same write (``ReplicationTimeoutError`` once committed).
    """
    wait = durability.wait_command()
    waited: Any = None
    patience = reconnect.patience()
    waiting = Reconnect(give_up_after=policy.max_wait).patience()
    waiting_for: object = None  # the writer the last step aside was for
    conflicts = 0
    asides = 0  # tries that stepped aside for another writer
    tries = 0  # reads that could have committed (stepping aside is not a try)
    started = False
    while True:
        if started:
            log.debug("transaction on %s retried after %d conflicts", watch[0], conflicts)
            if on_retry is not None:
                yield from on_retry(conflicts + asides)
            yield Sleep(policy.delay(max(1, conflicts + asides)))
        started = True
        tries += 1
        try:
            replies = yield Watch(watch[0], [("WATCH", *watch), *reads])
            if any(isinstance(r, ErrorReply) for r in replies):
                yield Unwatch()
                if _settling(replies):
                    yield RefreshSlots()
                    continue
                raise_error_replies(replies, where)
            try:
                plan = body(replies[1:])
            except BaseException:
                yield Unwatch()
                raise
            if plan.step_aside:
                yield Unwatch()
                tries -= 1
                asides += 1
                if plan.waiting_for != waiting_for:  # the writers ahead moved on
                    waiting_for = plan.waiting_for
                    waiting = Reconnect(give_up_after=policy.max_wait).patience()
                if waiting.next_pause() is None:
                    raise TransactionConflictError(conflicts + 1, **where)
                continue
            if not plan.writes:
                if wait is None:
                    yield Unwatch()
                else:  # a commit of an earlier try (its reply lost): wait for it as well
                    (_, waited) = yield Commit([("UNWATCH",), wait])
                    durability.check(waited, **where)
                return Outcome(plan.result, tries)
            commands = [("MULTI",), *plan.writes, ("EXEC",)]
            replies = yield Commit([*commands, wait] if wait is not None else commands)
            if wait is not None:
                replies, waited = replies[:-1], replies[-1]
        except Disconnected as e:
            # The outcome of an EXEC in flight is unknown; the next try reads again.
            pause = patience.after_failure(e)
            if pause is None:
                raise patience.gave_up(e, **where) from (e.__cause__ or e)
            yield Sleep(pause)
            yield RefreshSlots()
            continue
        committed = replies[-1]
        if committed is None:  # a watched key changed: nothing was applied
            conflicts += 1
            if conflicts >= policy.max_attempts:
                raise TransactionConflictError(policy.max_attempts, **where)
            continue
        if _settling(replies):  # the slot moved between WATCH and EXEC: nothing applied
            yield RefreshSlots()
            continue
        raise_error_replies(replies[:-1], where)
        if isinstance(committed, list):
            raise_error_replies(committed, where)
        if wait is not None:
            durability.check(waited, **where)
        return Outcome(plan.result, tries)


def _settling(replies: Sequence[Any]) -> bool:
    return any(
        isinstance(r, ErrorReply) and (r.kind in ("MOVED", "ASK") or r.transient) for r in replies
    )
