"""Building a redis-py client from a URL: single server, Sentinel or Cluster.

redis://[:password@]host:port/db        rediss://...    unix:///path/to/socket
redis+sentinel://host:port[,host:port...]/service_name[/db]
redis+cluster://host:port[,host:port...]
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from store.errors import ConfigurationError, StoreConnectionError


def _hosts(netloc: str, url: str) -> tuple[list[tuple[str, int]], str | None]:
    password = None
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        password = unquote(auth.split(":", 1)[-1]) or None
    hosts = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"{url!r}: expected host:port, got {part!r}")
        hosts.append((host, int(port)))
    return hosts, password


def client_from_url(url: str, **kwargs: Any) -> Any:
    """A client for ``url``; replies stay bytes, as the store needs."""
    if kwargs.get("decode_responses"):
        raise ConfigurationError("the store needs decode_responses=False")
    scheme = urlsplit(url).scheme
    if scheme == "redis+sentinel":
        parts = urlsplit(url)
        hosts, password = _hosts(parts.netloc, url)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ConfigurationError(f"{url!r}: name the Sentinel service, e.g. /mymaster")
        db = int(path[1]) if len(path) > 1 else 0
        timeout = kwargs.pop("socket_timeout", 5.0)
        sentinel = Sentinel(hosts, socket_timeout=timeout)  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-untyped-call]
            path[0], db=db, password=password, **kwargs
        )
    if scheme == "redis+cluster":
        hosts, password = _hosts(urlsplit(url).netloc, url)
        nodes = [ClusterNode(h, p) for h, p in hosts]  # type: ignore[no-untyped-call]
        try:
            return RedisCluster(startup_nodes=nodes, password=password, **kwargs)
        except redis.RedisError as e:  # a cluster client connects as it is built
            raise StoreConnectionError(f"Redis Cluster unreachable at {url!r}: {e}") from e
    if scheme in ("redis", "rediss", "unix"):
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError as e:  # redis-py rejects a malformed URL with a bare ValueError
            raise ConfigurationError(f"bad Redis URL {url!r}: {e}") from e
    raise ConfigurationError(
        f"{url!r}: unsupported scheme {scheme!r}; use redis://, rediss://, unix://, "
        "redis+sentinel:// or redis+cluster://"
    )
