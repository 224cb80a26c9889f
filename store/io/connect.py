"""Building a redis-py client (sync or asyncio) from a URL: single server, Sentinel or Cluster.

redis://[:password@]host:port/db        rediss://...    unix:///path/to/socket
redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]
redis+cluster://[:password@]host:port[,host:port...]

Timeouts and redis-py's own retry are set explicitly (unless the caller passes them), so a
call never blocks for as long as Redis is down, whatever the redis-py version: redis-py
before 8 sets no socket timeout at all, and 8 retries a failed connect on its own. Here
redis-py tries once, with connect and read timeouts of ``timeouts(reconnect)``; the store's
own retry (``store.Reconnect``) tries again within its bound, so that one setting,
``Reconnect.give_up_after``, bounds how long any call waits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from store.errors import ConfigurationError
from store.io.wire import cluster_failure
from store.ops.calls import DEFAULT_RECONNECT, Reconnect

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
# A third of the default bound each, so that two tries fit in it; still far longer than any
# store script or read should take (a pass is a fraction of a millisecond).
CONNECT_TIMEOUT = DEFAULT_RECONNECT.attempt_timeout
SOCKET_TIMEOUT = DEFAULT_RECONNECT.attempt_timeout
CONNECT_RETRIES = 0  # redis-py's own: none; the store's Reconnect retries within its bound


@dataclass(frozen=True)
class ServerSpec:
    """What a URL names: a scheme, its hosts and credentials, and the rest of the URL."""

    url: str
    scheme: str
    hosts: list[tuple[str, int]]
    password: str | None = None
    username: str | None = None
    service: str = ""
    db: int = 0


def parse_url(url: str) -> ServerSpec:
    """The server(s) ``url`` names; ``ConfigurationError`` for a URL the store cannot use."""
    if not isinstance(url, str):
        raise ConfigurationError(f"a Redis URL must be a str, not {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"{redacted(url)!r}: unsupported scheme {scheme!r}; use redis://, rediss://, "
            "unix://, redis+sentinel:// or redis+cluster://"
        )
    if scheme in ("redis", "rediss"):
        named = parts.path.strip("/")
        if named and not named.isdigit():  # redis-py would use db 0 without a word
            raise ConfigurationError(
                f"{redacted(url)!r}: the database must be a number (/0 to /15), not {named!r}"
            )
    if scheme in ("redis", "rediss", "unix"):
        return ServerSpec(url, scheme, [])
    hosts, username, password = _hosts(parts.netloc, url)
    if scheme == "redis+cluster":
        return ServerSpec(url, scheme, hosts, password, username)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ConfigurationError(f"{redacted(url)!r}: name the Sentinel service, e.g. /mymaster")
    if len(path) > 1 and not path[1].isdigit():
        raise ConfigurationError(f"{redacted(url)!r}: the database must be a number")
    db = int(path[1]) if len(path) > 1 else 0
    return ServerSpec(url, scheme, hosts, password, username, path[0], db)


def _hosts(netloc: str, url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    username = password = None
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        user, _, secret = auth.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    hosts = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"{redacted(url)!r}: expected host:port, got {part!r}")
        hosts.append((host, int(port)))
    return hosts, username, password


def timeouts(reconnect: Reconnect | None) -> dict[str, float]:
    """The connect and read timeouts a client needs for ``reconnect``'s bound to hold."""
    attempt = (reconnect or DEFAULT_RECONNECT).attempt_timeout
    return {"socket_connect_timeout": attempt, "socket_timeout": attempt}


def _options(kwargs: dict[str, Any], retry_class: type) -> dict[str, Any]:
    if kwargs.get("decode_responses"):
        raise ConfigurationError("the store needs decode_responses=False")
    options = dict(kwargs)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)
    options.setdefault(
        "retry", retry_class(ExponentialBackoff(cap=0.5, base=0.05), CONNECT_RETRIES)
    )
    return options


def _sentinel_options(options: dict[str, Any]) -> dict[str, Any]:
    """What the Sentinels are asked with: the same timeouts and (no) retry as the master."""
    names = ("socket_timeout", "socket_connect_timeout", "retry")
    return {"sentinel_kwargs": {name: options[name] for name in names}}


def client_from_url(url: str, **kwargs: Any) -> Any:
    """A redis-py client for ``url``; replies stay bytes, as the store needs."""
    spec = parse_url(url)
    options = _options(kwargs, Retry)
    auth: dict[str, Any] = {"username": spec.username, "password": spec.password}
    if spec.scheme == "redis+sentinel":
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            spec.hosts, **_sentinel_options(options)
        )
        return sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            spec.service, db=spec.db, **auth, **options
        )
    if spec.scheme == "redis+cluster":
        nodes = [ClusterNode(h, p) for h, p in spec.hosts]  # type: ignore[no-untyped-call]
        try:
            return RedisCluster(startup_nodes=nodes, **auth, **options)
        # A cluster client connects as it is built; RedisClusterException is no RedisError.
        except (redis.RedisError, RedisClusterException) as e:
            raise cluster_failure(e, redacted(url)) from e
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:  # redis-py rejects a malformed URL with a bare ValueError
        raise ConfigurationError(f"bad Redis URL {redacted(url)!r}: {e}") from e


def async_client_from_url(url: str, **kwargs: Any) -> Any:
    """A ``redis.asyncio`` client for ``url`` (it connects on first use)."""
    spec = parse_url(url)
    options = _options(kwargs, redis.asyncio.retry.Retry)
    auth: dict[str, Any] = {"username": spec.username, "password": spec.password}
    if spec.scheme == "redis+sentinel":
        sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            spec.hosts, **_sentinel_options(options)
        )
        return sentinel.master_for(spec.service, db=spec.db, **auth, **options)
    if spec.scheme == "redis+cluster":
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in spec.hosts]
        return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, **auth, **options)
    try:
        return redis.asyncio.Redis.from_url(url, **options)
    except ValueError as e:
        raise ConfigurationError(f"bad Redis URL {redacted(url)!r}: {e}") from e


def redacted(url: str) -> str:
    """The URL without its password (userinfo or ``password=`` query), for logs and errors."""
    url = re.sub(r"//[^/@]*@", "//***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


def close_client(client: Any) -> None:
    """Close a sync client's connections, and its Sentinels' if it came from ``master_for``."""
    client.close()
    for sentinel in _sentinels_of(client):
        sentinel.close()


async def aclose_client(client: Any) -> None:
    """Close an asyncio client's connections, and its Sentinels' if it has any."""
    await client.aclose()
    for sentinel in _sentinels_of(client):
        await sentinel.aclose()


def _sentinels_of(client: Any) -> list[Any]:
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    return list(getattr(manager, "sentinels", ()))
