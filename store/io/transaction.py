"""Optimistic transactions in two round trips: WATCH with the reads, then MULTI..EXEC.

redis-py's ``pipeline().watch()`` spends a round trip on WATCH and one on each read; here
WATCH and the reads go out in one write on one connection, the body computes the writes in
Python, and MULTI, the writes and EXEC go out in the second. The body must be pure (it only
computes from what was read), so a retry after a conflict is always safe. A connection lost
while EXEC was in flight leaves the outcome unknown: the retry reads again, and operations
guard against a second application themselves (see the op ids in store.store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis

from store.backoff import RetryPolicy
from store.errors import StoreConnectionError, TransactionConflictError
from store.io.wire import (
    MAX_CONNECTION_FAILURES,
    Command,
    Moved,
    connection,
    raise_errors,
    refresh_slots,
    round_trip,
)

T = TypeVar("T")


@dataclass
class Plan(Generic[T]):
    """What a transaction body decided: the writes to commit and the result to return."""

    writes: list[Command] = field(default_factory=list)
    result: T | None = None


@dataclass
class Outcome(Generic[T]):
    result: T | None
    attempts: int


def optimistic(
    client: Any,
    watch: Sequence[str],
    reads: Sequence[Command],
    body: Callable[[list[Any]], Plan[T]],
    policy: RetryPolicy,
    on_retry: Callable[[int], None] | None = None,
    **where: str | None,
) -> Outcome[T]:
    """Run ``body`` over a consistent read of ``reads`` and commit its writes, with retries.

    All keys must share one hash slot. Raises ``TransactionConflictError`` when every try met
    a concurrent writer, ``StoreConnectionError`` when Redis stayed unreachable; either way
    nothing of a failed try was written. ``on_retry(failed_tries)`` runs before each retry.
    """
    last_error: Exception | None = None
    failures = 0
    for attempt in range(1, policy.max_attempts + 1):
        if attempt > 1:
            if on_retry is not None:
                on_retry(attempt - 1)
            time.sleep(policy.delay(attempt - 1))
        try:
            with connection(client, watch[0]) as conn:
                replies = round_trip(conn, [("WATCH", *watch), *reads])
                raise_errors(replies, where)
                try:
                    plan = body(replies[1:])
                except BaseException:
                    round_trip(conn, [("UNWATCH",)])
                    raise
                if not plan.writes:
                    round_trip(conn, [("UNWATCH",)])
                    return Outcome(plan.result, attempt)
                replies = round_trip(conn, [("MULTI",), *plan.writes, ("EXEC",)])
            committed = replies[-1]
            if committed is None:  # a watched key changed: nothing was applied
                continue
            raise_errors(replies[:-1], where)
            if isinstance(committed, list):
                raise_errors(committed, where)
            return Outcome(plan.result, attempt)
        except Moved as e:
            last_error = e
            refresh_slots(client)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # The outcome of an EXEC in flight is unknown; the next try reads again.
            last_error = e
            failures += 1
            if failures >= MAX_CONNECTION_FAILURES:
                break
    if isinstance(last_error, (redis.ConnectionError, redis.TimeoutError)):
        raise StoreConnectionError(
            f"Redis unreachable after {failures} tries: {last_error}", **where
        ) from last_error
    raise TransactionConflictError(policy.max_attempts, **where)
