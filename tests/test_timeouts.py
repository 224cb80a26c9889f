"""``from_url`` sets connect and socket timeouts and a bounded redis-py retry itself, so a
call never blocks while Redis is down, whatever the redis-py version (6.1 sets no socket
timeout at all). Checked on the clients it builds; nothing connects."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from store.io.connect import (
    CONNECT_RETRIES,
    CONNECT_TIMEOUT,
    SOCKET_TIMEOUT,
    async_client_from_url,
    client_from_url,
)

URLS = [
    "redis://127.0.0.1:1/0",
    "rediss://127.0.0.1:1/0",
    "unix:///tmp/no-such-redis.sock",
    "redis+sentinel://127.0.0.1:1/mymaster",
]


def _kwargs(client: Any) -> dict[str, Any]:
    return dict(client.connection_pool.connection_kwargs)


@pytest.mark.fake
@pytest.mark.parametrize("build", [client_from_url, async_client_from_url], ids=["sync", "async"])
@pytest.mark.parametrize("url", URLS)
def test_from_url_sets_timeouts_and_a_bounded_retry(build: Any, url: str) -> None:
    kwargs = _kwargs(build(url))

    assert kwargs["socket_timeout"] == SOCKET_TIMEOUT
    assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT
    retry = kwargs["retry"]
    assert retry._retries == CONNECT_RETRIES  # bounded, not redis-py's default


@pytest.mark.fake
@pytest.mark.parametrize("build", [client_from_url, async_client_from_url], ids=["sync", "async"])
def test_the_callers_timeouts_win(build: Any) -> None:
    kwargs = _kwargs(build(URLS[0], socket_timeout=0.5, socket_connect_timeout=0.25))
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.5, 0.25)


@pytest.mark.fake
def test_a_sentinel_is_asked_with_the_same_timeouts() -> None:
    client = client_from_url(URLS[-1])
    (sentinel,) = client.connection_pool.sentinel_manager.sentinels
    kwargs = sentinel.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == SOCKET_TIMEOUT
    assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT
    assert isinstance(client, redis.Redis)
