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
from redis.cluster import RedisCluster

from store.backoff import RetryPolicy
from store.errors import StoreConnectionError, StoreError, TransactionConflictError

T = TypeVar("T")
Command = tuple[Any, ...]


@dataclass
class Plan(Generic[T]):
    """What a transaction body decided: the writes to commit and the result to return."""

    writes: list[Command] = field(default_factory=list)
    result: T | None = None


@dataclass
class Outcome(Generic[T]):
    result: T | None
    attempts: int


class _Moved(Exception):
    """The cluster moved the slot; refresh the slot map and try again."""


# Connection failures get few tries of their own: redis-py has retried each connect already.
MAX_CONNECTION_FAILURES = 3


def _connection_for(client: Any, key: str) -> tuple[Any, Any]:
    """A pooled connection to the server that owns ``key``, and the pool to return it to."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        pool = node.redis_connection.connection_pool
    else:
        pool = client.connection_pool
    return pool, pool.get_connection()


def _round_trip(conn: Any, commands: Sequence[Command]) -> list[Any]:
    """Send ``commands`` in one write and read every reply; error replies come back as values."""
    conn.send_packed_command(conn.pack_commands(commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as e:
            replies.append(e)
    return replies


def _raise_errors(replies: Sequence[Any], where: dict[str, str | None]) -> None:
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            # redis-py parses MOVED / ASK into these classes and strips the word from the
            # message, so match on the type (MovedError is an AskError).
            if isinstance(reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError)):
                raise _Moved(f"{type(reply).__name__}: {reply}")
            raise StoreError(f"Redis refused a command: {reply}", **where) from reply


def optimistic(
    client: Any,
    watch: Sequence[str],
    reads: Sequence[Command],
    body: Callable[[list[Any]], Plan[T]],
    policy: RetryPolicy,
    **where: str | None,
) -> Outcome[T]:
    """Run ``body`` over a consistent read of ``reads`` and commit its writes, with retries.

    All keys must share one hash slot. Raises ``TransactionConflictError`` when every try met
    a concurrent writer, ``StoreConnectionError`` when Redis stayed unreachable; either way
    nothing of a failed try was written.
    """
    last_error: Exception | None = None
    failures = 0
    for attempt in range(1, policy.max_attempts + 1):
        if attempt > 1:
            time.sleep(policy.delay(attempt - 1))
        try:  # redis-py connects on checkout, so an unreachable server fails here
            pool, conn = _connection_for(client, watch[0])
        except (redis.ConnectionError, redis.TimeoutError) as e:
            last_error = e
            failures += 1
            if failures >= MAX_CONNECTION_FAILURES:
                break
            continue
        healthy = False
        try:
            replies = _round_trip(conn, [("WATCH", *watch), *reads])
            _raise_errors(replies, where)
            try:
                plan = body(replies[1:])
            except BaseException:
                _round_trip(conn, [("UNWATCH",)])
                healthy = True
                raise
            if not plan.writes:
                _round_trip(conn, [("UNWATCH",)])
                healthy = True
                return Outcome(plan.result, attempt)
            replies = _round_trip(conn, [("MULTI",), *plan.writes, ("EXEC",)])
            healthy = True
            committed = replies[-1]
            if committed is None:  # a watched key changed: nothing was applied
                continue
            _raise_errors(replies[:-1], where)
            if isinstance(committed, list):
                _raise_errors(committed, where)
            return Outcome(plan.result, attempt)
        except _Moved as e:
            last_error = e
            client.nodes_manager.initialize()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # The outcome of an EXEC in flight is unknown; the next try reads again.
            last_error = e
            failures += 1
            if failures >= MAX_CONNECTION_FAILURES:
                break
        finally:
            if not healthy:
                conn.disconnect()
            pool.release(conn)
    if isinstance(last_error, (redis.ConnectionError, redis.TimeoutError)):
        raise StoreConnectionError(
            f"Redis unreachable after {failures} tries: {last_error}", **where
        ) from last_error
    raise TransactionConflictError(policy.max_attempts, **where)
