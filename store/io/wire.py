"""What the sync and async executors share: packing commands, classifying replies and errors.

The store's hot path is one script per operation, and redis-py's general command path
(retry wrappers, observability hooks, reply callbacks) costs the client more than the
script costs the server; so the executors pack the store's few commands themselves and
read the raw replies: bytes, ints and lists, with error replies turned into values.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio.cluster
import redis.cluster
import redis.sentinel
from redis import exceptions as rex

from store.errors import ConfigurationError, StoreConnectionError, StoreError
from store.ops.effects import Command, Disconnected, ErrorReply


class _Addressed(Protocol):
    @property
    def address(self) -> str: ...


E = TypeVar("E", bound=_Addressed)

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # hiredis is the optional "fast" extra
    _hiredis_pack = None

_KINDS = (
    (rex.NoScriptError, "NOSCRIPT"),
    (rex.MovedError, "MOVED"),  # before AskError: MovedError is an AskError
    (rex.AskError, "ASK"),
    (rex.TryAgainError, "TRYAGAIN"),
    (rex.MasterDownError, "MASTERDOWN"),  # before ClusterDownError, its base
    (rex.ClusterDownError, "CLUSTERDOWN"),
    (rex.ReadOnlyError, "READONLY"),
    (rex.OutOfMemoryError, "OOM"),
    (rex.NoPermissionError, "NOPERM"),
)


def pack(conn: Any, commands: Sequence[Command]) -> Any:
    """``commands`` as the bytes of one write on ``conn``."""
    # redis-py's packer inspects every argument in Python before handing it to hiredis; the
    # store only sends str, bytes, int and float, which hiredis packs as they are.
    if _hiredis_pack is None:
        return conn.pack_commands(commands)
    return [b"".join([_hiredis_pack(command) for command in commands])]


def server_address(pool: Any) -> str:
    """How errors name the server behind a connection pool."""
    kwargs = getattr(pool, "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    service = getattr(pool, "service_name", None)
    if service:
        sentinels = getattr(getattr(pool, "sentinel_manager", None), "sentinels", ())
        hosts = ",".join(
            "{host}:{port}".format(**s.connection_pool.connection_kwargs) for s in sentinels
        )
        return f"sentinel service {service!r}" + (f" at {hosts}" if hosts else "")
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def describe_client(client: Any) -> tuple[str, str]:
    """How ``client`` (sync or asyncio) reaches Redis: ``standalone``, ``sentinel`` or
    ``cluster``, and the server(s) it names."""
    if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster)):
        nodes = client.get_nodes()
        hosts = ",".join(f"{n.host}:{n.port}" for n in nodes[:3])
        return "cluster", f"cluster at {hosts}" if hosts else "a Redis Cluster"
    pool = getattr(client, "connection_pool", None)
    if getattr(pool, "service_name", None):
        return "sentinel", server_address(pool)
    return "standalone", server_address(pool) if pool is not None else "the server"


def group_by_server(
    endpoints: Sequence[E | BaseException], results: list[Any]
) -> list[tuple[E, list[int]]]:
    """The indexes of the sends bound for each server, in order; a send whose server could
    not be found gets its error as its result."""
    groups: dict[str, tuple[E, list[int]]] = {}
    for i, endpoint in enumerate(endpoints):
        if isinstance(endpoint, BaseException):
            results[i] = endpoint
        else:
            groups.setdefault(endpoint.address, (endpoint, []))[1].append(i)
    return list(groups.values())


def with_asking(commands: Sequence[Command], asking: bool) -> Sequence[Command]:
    return [("ASKING",), *commands] if asking else commands


def error_reply(error: rex.ResponseError) -> ErrorReply:
    """An error reply as the value operations look at."""
    message = str(error)
    for cls, kind in _KINDS:
        if isinstance(error, cls):
            node = None
            if kind in ("MOVED", "ASK"):
                node = (str(getattr(error, "host", "")), int(getattr(error, "port", 0)))
            return ErrorReply(kind, f"{kind} {message}", node)
    word = message.split(" ", 1)[0]
    if word in ("BUSY", "WRONGTYPE"):
        return ErrorReply(word, message)
    return ErrorReply("ERR", message)


def reply_value(reply: Any, command: Command) -> Any:
    """A reply with error replies inside an EXEC's array turned into values too."""
    if command[0] == "EXEC" and type(reply) is list:
        return [error_reply(r) if isinstance(r, rex.ResponseError) else r for r in reply]
    return reply


def cluster_failure(error: BaseException, where: str) -> StoreError:
    """A cluster client that could not learn the cluster: not one, or no node answers."""
    reason = str(error).rpartition(": ")[2] or type(error).__name__
    if "cluster mode is not enabled" in reason.lower():
        return ConfigurationError(
            f"{where} is no Redis Cluster ({reason}); use redis:// for a single server"
        )
    return StoreConnectionError(f"Redis Cluster unreachable at {where}: {reason}")


TLS_HINT = "TLS handshake failed: is the server configured for TLS?"


def _tls_failure(error: BaseException) -> BaseException | None:
    """The TLS handshake's failure behind ``error``, if that is what it is: an SSL error
    other than a certificate the client refused (a TLS server), or a handshake that timed
    out (a plain server waits for a command and never answers a ClientHello)."""
    seen: BaseException | None = error
    for _ in range(4):  # redis-py wraps the socket's error once or twice
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        if isinstance(seen, (TimeoutError, OSError)) and "handshake" in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def connect_failure(error: BaseException, where: str, pool: Any) -> BaseException:
    """What a failure to take a connection from ``pool`` becomes (``io_failure``). A TLS
    connection that timed out asks about TLS: a plain server never answers a handshake
    (redis.asyncio's timeout does not say it was the handshake's)."""
    tls = "SSL" in getattr(getattr(pool, "connection_class", None), "__name__", "")
    if tls and isinstance(error, redis.TimeoutError) and _tls_failure(error) is None:
        return Disconnected(f"{where}: {TLS_HINT} ({type(error).__name__}: {error})", node=where)
    return io_failure(error, where)


def io_failure(error: BaseException, where: str) -> BaseException:
    """What a redis-py exception met while sending or reading becomes.

    Failures that another try may heal (a lost connection, a timeout, a server still
    loading, a cluster or Sentinel in transition) become ``Disconnected``; the others
    (wrong password, missing permission, a garbled reply, a bad URL) become a typed
    ``StoreError`` at once, naming the server and what to check.
    """
    if isinstance(error, (rex.AuthenticationError, rex.AuthorizationError)):
        said = re.split(r"[,;]", str(error), maxsplit=1)[0]  # redis-py 8's HELLO text runs on
        return ConfigurationError(
            f"Redis at {where} refused the credentials ({said}); check the password or "
            "ACL user in the URL"
        )
    if isinstance(error, redis.RedisError) and "unknown command 'SENTINEL'" in str(error):
        # A ResponseError, or (redis-py 8.2) a MasterNotFoundError quoting one.
        return ConfigurationError(
            f"{where}: a host of the URL is no Sentinel (it does not know SENTINEL); a "
            "redis+sentinel:// URL names the Sentinels, not the master"
        )
    if isinstance(error, redis.sentinel.MasterNotFoundError):
        # redis-py 8.2 puts the Sentinel client's repr (a thousand characters) in the text.
        said = str(error).split(" : <", 1)[0]
        return Disconnected(f"{where}: MasterNotFoundError: {said}", node=where)
    tls = _tls_failure(error)
    if tls is not None:
        said = f"{where}: {TLS_HINT} ({type(error).__name__}: {error})"
        if isinstance(tls, ssl.SSLError):  # the server answered, and not in TLS
            return ConfigurationError(said)
        return Disconnected(said, node=where)  # no answer: plain Redis, or a silent one
    if isinstance(error, rex.MaxConnectionsError):  # a pool shared with others: wait
        return Disconnected(f"{where}: no free connection in the pool: {error}", node=where)
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return Disconnected(f"{where}: {type(error).__name__}: {error}", node=where)
    if isinstance(error, rex.SlotNotCoveredError):
        return Disconnected(f"{where}: {error}", node=where)
    if isinstance(error, rex.InvalidResponse):
        return StoreError(
            f"Redis at {where} sent a reply the client cannot parse ({error}); is that "
            "address a Redis server, and is TLS (rediss://) needed?"
        )
    if isinstance(error, rex.RedisClusterException):
        return cluster_failure(error, where)
    if isinstance(error, redis.RedisError):
        return StoreError(f"Redis at {where}: {type(error).__name__}: {error}")
    return error
