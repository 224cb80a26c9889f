"""Runs operations on a redis-py client: single server, Sentinel or Cluster.

Each ``Send`` takes a pooled connection to the server that owns its key, writes all its
commands at once and reads every reply. A connection that failed, or may have been left
mid-reply, is closed rather than given back in use; a held WATCH connection is closed when
its operation ends without committing or unwatching.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from redis import exceptions as rex
from redis.cluster import RedisCluster

from store.errors import ConfigurationError
from store.io.pipelines import Pipelines
from store.io.wire import (
    connect_failure,
    error_reply,
    group_by_server,
    io_failure,
    pack,
    reply_value,
    server_address,
    with_asking,
)
from store.ops.effects import (
    Collect,
    Command,
    Commit,
    Disconnected,
    Op,
    Send,
    SendMany,
    Sleep,
    Unwatch,
    Watch,
    Write,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


def check_client(client: Any) -> None:
    kwargs: dict[str, Any] = getattr(client, "get_connection_kwargs", dict)()
    if kwargs.get("decode_responses"):
        raise ConfigurationError("the store needs a client with decode_responses=False")


def round_trip(conn: Any, commands: list[Command] | tuple[Command, ...] | Any) -> list[Any]:
    """Send ``commands`` in one write and read every reply; error replies come back as values."""
    conn.send_packed_command(pack(conn, commands))
    replies: list[Any] = []
    for command in commands:
        try:
            reply = conn.read_response()
        except rex.ResponseError as e:
            replies.append(error_reply(e))
        else:
            replies.append(reply_value(reply, command))
    return replies


class _Endpoint:
    """A pool of connections to one server, and how to name that server in errors.

    With ``keep``, connections given back stay with the endpoint (a free list) instead of
    going back to redis-py's pool: taking one then costs no lock, no pid check and no
    poll for stray data (the executor never gives back a connection that may hold a reply
    unread: it closes it). After a fork the child starts a list of its own.
    """

    __slots__ = ("_free", "_pid", "address", "keep", "pool")

    def __init__(self, pool: Any, address: str, *, keep: bool = False) -> None:
        self.pool = pool
        self.address = address
        self.keep = keep
        self._free: deque[Any] = deque()
        self._pid = os.getpid()

    def take(self) -> Any:
        if self.keep:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._free, self._pid = deque(), os.getpid()
            try:
                return self._free.pop()
            except IndexError:
                pass
        try:
            return self.pool.get_connection()  # redis-py connects here
        except Exception as e:
            _raise_mapped(e, self.address, self.pool)

    def give_back(self, conn: Any) -> None:
        # ``_sock``: redis-py before 8 has no ``is_connected`` (8's is ``_sock is not None``).
        if self.keep and self._pid == os.getpid() and conn._sock is not None:
            self._free.append(conn)
        else:
            self.pool.release(conn)


_Pipes = Pipelines[tuple[_Endpoint, Any]]


class SyncExecutor:
    """Performs the effects of operations (``store.ops.effects``) with redis-py."""

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        if not self.cluster:
            pool = client.connection_pool
            self._single = _Endpoint(pool, server_address(pool), keep=True)

    def run(self, op: Op[T]) -> T:
        """Drive ``op`` to its result, performing each effect it yields."""
        held: tuple[_Endpoint, Any] | None = None  # the connection of a pending WATCH
        pipes: _Pipes | None = None  # the connections of writes not collected yet
        value: Any = None
        error: BaseException | None = None
        started = time.monotonic()  # a call's patience counts from here (Reconnect)
        try:
            while True:
                try:
                    effect = op.send(value) if error is None else op.throw(error)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                error = None
                try:
                    if type(effect) is Send:  # most operations: one send, then their result
                        value = self._send(effect)
                    elif isinstance(effect, (SendMany, Write, Collect)):
                        if pipes is None:
                            pipes = Pipelines()
                        if isinstance(effect, SendMany):
                            value = self._send_many(pipes, effect.sends)
                        elif isinstance(effect, Write):
                            value = self._write_sends(pipes, effect.sends)
                        else:
                            value = self._collect(pipes, effect.ticket)
                    elif isinstance(effect, Watch):
                        held = self._take(effect.key, None)
                        value = self._exchange(held, effect.commands)
                    elif isinstance(effect, (Commit, Unwatch)):
                        taken, held = held, None
                        value = None
                        if taken is not None:
                            try:
                                commands = (
                                    effect.commands
                                    if isinstance(effect, Commit)
                                    else [("UNWATCH",)]
                                )
                                value = self._exchange(taken, commands)
                            finally:
                                taken[0].give_back(taken[1])
                    elif isinstance(effect, Sleep):
                        time.sleep(effect.seconds)
                        value = None
                    else:
                        self._refresh()
                        value = None
                except Disconnected as e:
                    if held is not None:
                        held[0].give_back(held[1])  # closed by _exchange or never used
                        held = None
                    if e.since is None:
                        e.since = started
                    error = e
        finally:
            op.close()
            if held is not None:  # the operation ended with a WATCH pending: do not reuse
                held[1].disconnect()
                held[0].give_back(held[1])
            for endpoint, conn in pipes.abandoned() if pipes is not None else ():
                conn.disconnect()  # replies unread: do not reuse
                endpoint.give_back(conn)

    # -- connections ---------------------------------------------------------------------

    def _endpoint(self, key: str, node: tuple[str, int] | None) -> _Endpoint:
        if not self.cluster:
            return self._single
        client = self.client
        try:
            if node is not None:
                found = client.get_node(host=node[0], port=node[1])
            else:
                found = client.get_node_from_key(key)
        except Exception as e:
            _raise_mapped(e, "cluster " + ",".join(client.nodes_manager.startup_nodes))
        if found is None or found.redis_connection is None:
            raise Disconnected(f"cluster node {node or key!r} is not known yet")
        return _Endpoint(found.redis_connection.connection_pool, f"{found.host}:{found.port}")

    def _take(self, key: str, node: tuple[str, int] | None) -> tuple[_Endpoint, Any]:
        return self._connect(self._endpoint(key, node))

    @staticmethod
    def _connect(endpoint: _Endpoint) -> tuple[_Endpoint, Any]:
        return endpoint, endpoint.take()

    @staticmethod
    def _exchange(held: tuple[_Endpoint, Any], commands: Any) -> list[Any]:
        """One round trip on a taken connection; a failure closes it (the caller gives
        it back)."""
        try:
            return round_trip(held[1], commands)
        except BaseException as e:
            held[1].disconnect()
            _raise_mapped(e, held[0].address)

    def _send(self, send: Send) -> list[Any]:
        held = self._take(send.key, send.node)
        try:
            replies = self._exchange(held, with_asking(send.commands, send.asking))
        finally:
            held[0].give_back(held[1])
        return replies[1:] if send.asking else replies

    def _send_many(self, pipes: _Pipes, sends: Sequence[Send]) -> list[Any]:
        """One write per server, all written before any is read; a server that fails
        fails only its own sends (their entries are the ``Disconnected`` met)."""
        return self._collect(pipes, self._write_sends(pipes, sends))

    def _write_sends(self, pipes: _Pipes, sends: Sequence[Send]) -> int:
        """Write ``sends`` on each server's pipelined connection; their ticket."""
        ticket = pipes.new_ticket(sends)
        endpoints: list[_Endpoint | Disconnected] = []
        for send in sends:
            try:
                endpoints.append(self._endpoint(send.key, send.node))
            except Disconnected as e:
                endpoints.append(e)
        for endpoint, members in group_by_server(endpoints, ticket.results):
            held = pipes.open.get(endpoint.address)
            try:
                if held is None:
                    held = pipes.open[endpoint.address] = self._connect(endpoint)
                ticket.parts.append((held, members))
                _write(
                    held,
                    [c for i in members for c in with_asking(sends[i].commands, sends[i].asking)],
                )
            except Disconnected as e:
                if held is None:  # no connection: nothing to read on it
                    for i in members:
                        ticket.results[i] = e
                else:
                    pipes.break_off(endpoint.address, held, e)
        return ticket.number

    def _collect(self, pipes: _Pipes, number: int) -> list[Any]:
        """The replies of ticket ``number``, read in the order written."""
        ticket = pipes.next_ticket(number)
        results, sends = ticket.results, ticket.sends
        try:
            for held, members in ticket.parts:
                for n, i in enumerate(members):
                    failed = pipes.failure(held)
                    if failed is None:
                        try:
                            results[i] = _read(held, sends[i])
                            continue
                        except Disconnected as e:
                            pipes.break_off(held[0].address, held, e)
                            failed = e
                    for j in members[n:]:
                        results[j] = failed
                    break
        finally:
            for endpoint, conn in pipes.idle():
                endpoint.give_back(conn)
        return results

    def _refresh(self) -> None:
        if not self.cluster:
            return
        try:
            self.client.nodes_manager.initialize()
        except Exception as e:  # every node unreachable: the next send says so
            log.debug("cluster slot refresh failed: %s", e)


def _write(held: tuple[_Endpoint, Any], commands: Sequence[Command]) -> None:
    try:
        held[1].send_packed_command(pack(held[1], commands))
    except BaseException as e:
        held[1].disconnect()
        _raise_mapped(e, held[0].address)


def _read(held: tuple[_Endpoint, Any], send: Send) -> list[Any]:
    """The replies of one send among those written on ``held``."""
    conn = held[1]
    replies: list[Any] = []
    try:
        for command in with_asking(send.commands, send.asking):
            try:
                reply = conn.read_response()
            except rex.ResponseError as e:
                replies.append(error_reply(e))
            else:
                replies.append(reply_value(reply, command))
    except BaseException as e:
        conn.disconnect()
        _raise_mapped(e, held[0].address)
    return replies[1:] if send.asking else replies


def _raise_mapped(error: BaseException, where: str, pool: Any = None) -> NoReturn:
    """Raise what ``error`` becomes (``store.io.wire.io_failure``; ``connect_failure`` for
    a connection taken from ``pool``); itself if no redis error."""
    failure = io_failure(error, where) if pool is None else connect_failure(error, where, pool)
    if failure is error:
        raise error
    raise failure from error
