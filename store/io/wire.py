"""Commands sent in one write on one pooled connection to the node that owns a key.

The store's hot path is one script per operation, and redis-py's general command path (retry
wrappers, observability hooks, reply callbacks) costs the client more than the script costs
the server; so the store packs its few commands itself and reads the raw replies: bytes,
ints and lists, with error replies returned as values rather than raised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster

from store.errors import StoreConnectionError, StoreError

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # hiredis is the optional "fast" extra
    _hiredis_pack = None

Command = tuple[Any, ...]

# Connection failures get few tries of their own: redis-py has retried each connect already.
MAX_CONNECTION_FAILURES = 3


class Moved(Exception):
    """The cluster moved the key's slot; refresh the slot map and try again."""


@contextmanager
def connection(client: Any, key: str) -> Iterator[Any]:
    """A pooled connection to the server that owns ``key``.

    A connection that failed, or may have been left mid-reply, is closed rather than reused;
    callers raise ``StoreError`` only with every reply read and no WATCH pending.
    """
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        pool = node.redis_connection.connection_pool
    else:
        pool = client.connection_pool
    conn = pool.get_connection()  # redis-py connects here: an unreachable server fails now
    try:
        yield conn
    except (StoreError, Moved):
        raise  # raised after every reply was read: the connection is in step
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _pack(conn: Any, commands: Sequence[Command]) -> Any:
    # redis-py's packer inspects every argument in Python before handing it to hiredis; the
    # store only sends str, bytes, int and float, which hiredis packs as they are.
    if _hiredis_pack is None:
        return conn.pack_commands(commands)
    return [b"".join([_hiredis_pack(command) for command in commands])]


def round_trip(conn: Any, commands: Sequence[Command]) -> list[Any]:
    """Send ``commands`` in one write and read every reply; error replies come back as values."""
    conn.send_packed_command(_pack(conn, commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as e:
            replies.append(e)
    return replies


def raise_errors(replies: Sequence[Any], where: Mapping[str, str | None]) -> None:
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            # redis-py parses MOVED / ASK into these classes and strips the word from the
            # message, so match on the type (MovedError is an AskError).
            if isinstance(reply, (redis.exceptions.AskError, redis.exceptions.TryAgainError)):
                raise Moved(f"{type(reply).__name__}: {reply}")
            raise StoreError(f"Redis refused a command: {reply}", **where) from reply


def hash_reply(reply: Any) -> dict[bytes, bytes]:
    """A raw HGETALL reply as a dict: flat in RESP2, already paired in RESP3 (and fakeredis)."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


def refresh_slots(client: Any) -> None:
    if isinstance(client, RedisCluster):
        client.nodes_manager.initialize()


def _transaction(conn: Any, commands: Sequence[Command]) -> list[Any]:
    """``commands`` in MULTI..EXEC in one write; their replies (errors as values)."""
    replies = round_trip(conn, [("MULTI",), *commands, ("EXEC",)])
    raise_errors(replies[:-1], {})  # only a queueing error (a wrong arity, say) lands here
    executed = replies[-1]
    if not isinstance(executed, list):
        raise StoreError(f"MULTI..EXEC did not run: {executed!r}")
    return executed


class Scripts:
    """Runs the store's Lua scripts by EVALSHA, loading one the server does not hold yet.

    A script that met a lost connection is sent again (at most ``MAX_CONNECTION_FAILURES``
    times): every store script is idempotent or guarded by an operation id, so a second run
    after a first that did apply changes nothing (see the table in store.store).
    """

    def __init__(self, client: Any, sources: Mapping[str, str]) -> None:
        self.client = client
        self._sources = dict(sources)
        self._shas = {
            name: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
            for name, src in self._sources.items()
        }

    def __call__(
        self, name: str, keys: Sequence[str], args: Sequence[Any], **where: str | None
    ) -> Any:
        return self.run(name, keys, args, (), **where)[0]

    def run(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        reads: Sequence[Command],
        **where: str | None,
    ) -> list[Any]:
        """The script's reply, then the replies of ``reads`` run right after it, atomically.

        With ``reads``, the script and the reads go out as one MULTI..EXEC in one write: a
        read outside the script costs the server far less than the same read inside Lua.
        """
        call = ("EVALSHA", self._shas[name], len(keys), *keys, *args)
        failures = 0
        while True:
            try:
                with connection(self.client, keys[0]) as conn:
                    replies = self._send(conn, call, reads)
                    if isinstance(replies[0], redis.exceptions.NoScriptError):
                        load = ("EVAL", self._sources[name], *call[2:])
                        replies = self._send(conn, load, reads)
                    raise_errors(replies, where)
                    return replies
            except Moved:
                failures += 1
                if failures >= MAX_CONNECTION_FAILURES:
                    raise StoreError("the cluster kept moving the key's slot", **where) from None
                refresh_slots(self.client)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                failures += 1
                if failures >= MAX_CONNECTION_FAILURES:
                    raise StoreConnectionError(
                        f"Redis unreachable after {failures} tries: {e}", **where
                    ) from e

    @staticmethod
    def _send(conn: Any, call: Command, reads: Sequence[Command]) -> list[Any]:
        if not reads:
            return round_trip(conn, [call])
        return _transaction(conn, [call, *reads])
