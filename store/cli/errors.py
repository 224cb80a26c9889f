"""Redis errors as store errors, so that ``main`` prints them as one line, not a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from store.errors import StoreConnectionError, StoreError


@contextmanager
def redis_errors(*, request_id: str | None = None) -> Iterator[None]:
    """Re-raise redis-py's errors from a command's direct reads as ``StoreError``."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreConnectionError(f"Redis unreachable: {e}", request_id=request_id) from e
    except redis.RedisError as e:
        raise StoreError(f"Redis refused a command: {e}", request_id=request_id) from e
