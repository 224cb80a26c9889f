"""Runs operations on a ``redis.asyncio`` client: single server, Sentinel or Cluster.

The same contract as ``store.io.sync``, awaited: each ``Send`` takes a pooled connection to
the server that owns its key, writes all its commands at once and reads every reply. A task
cancelled mid-call leaves no connection in the pool with a reply unread (redis-py closes a
connection interrupted while sending or reading) and, since every write of the store is one
script or one MULTI..EXEC, nothing half written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from redis import exceptions as rex
from redis.asyncio.cluster import RedisCluster

from store.io.pipelines import Pipelines
from store.io.sync import check_client
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


class _Endpoint:
    """Connections to one server: a pool (single server, Sentinel) or a cluster node.

    A pool's connections are handed out through a semaphore as large as the pool, so that
    more tasks in flight than connections wait for one instead of failing (redis-py's
    asyncio pool raises ``MaxConnectionsError`` when it is exhausted). Connections given
    back stay with the endpoint (a free list, as in ``store.io.sync``): taking one then
    skips the pool's lock and its per-call bookkeeping. The executor never gives back a
    connection that may hold a reply unread (it closes it); a list made on another event
    loop is dropped, since its sockets belong to that loop.
    """

    __slots__ = ("_free", "_loop", "_slots", "address", "node", "pool")

    def __init__(self, address: str, pool: Any = None, node: Any = None) -> None:
        self.address = address
        self.pool = pool
        self.node = node
        limit = getattr(pool, "max_connections", None)
        self._slots = asyncio.Semaphore(limit) if isinstance(limit, int) and limit > 0 else None
        self._free: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self) -> Any:
        if self._slots is not None:
            await self._slots.acquire()
        try:
            if self.node is not None:
                return self.node.acquire_connection()
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                self._free, self._loop = [], loop
            if self._free:
                return self._free.pop()
            return await self.pool.get_connection()
        except BaseException as e:
            if self._slots is not None:
                self._slots.release()
            _raise_mapped(e, self.address, self.pool)

    @property
    def idle(self) -> tuple[Any, ...]:
        return tuple(self._free)

    async def give_back(self, conn: Any) -> None:
        try:
            if self.node is not None:
                release = getattr(self.node, "release", None)
                if release is not None:
                    release(conn)
                else:  # redis-py before 8: a cluster node's free list, as it releases itself
                    self.node._free.append(conn)
            elif conn.is_connected and self._loop is asyncio.get_running_loop():
                self._free.append(conn)
            else:
                await self.pool.release(conn)
        finally:
            if self._slots is not None:
                self._slots.release()


Held = tuple[_Endpoint, Any]
_Pipes = Pipelines[Held]


class AsyncExecutor:
    """Performs the effects of operations (``store.ops.effects``) with ``redis.asyncio``."""

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self._ready = not self.cluster
        if not self.cluster:
            pool = client.connection_pool
            self._single = _Endpoint(server_address(pool), pool=pool)

    def idle_connections(self) -> list[Any]:
        """The connections this executor keeps between calls (out of redis-py's pool)."""
        return [] if self.cluster else list(self._single.idle)

    async def run(self, op: Op[T]) -> T:
        """Drive ``op`` to its result, performing each effect it yields."""
        held: Held | None = None  # the connection of a pending WATCH
        pipes: _Pipes | None = None  # the connections of writes not collected yet
        value: Any = None
        error: BaseException | None = None
        started = time.monotonic()  # a call's patience counts from here (Reconnect)
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            while True:
                if task is not None and task.cancelling() > cancels:
                    # A cancel that redis-py swallowed (seen on CPython 3.11 with the hiredis
                    # parser: the read is cut off, the connection closed, and the task goes
                    # on). Honour it here, between two effects, where nothing is half done.
                    raise asyncio.CancelledError()
                try:
                    effect = op.send(value) if error is None else op.throw(error)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                error = None
                try:
                    if type(effect) is Send:  # most operations: one send, then their result
                        value = await self._send(effect)
                    elif isinstance(effect, (SendMany, Write, Collect)):
                        if pipes is None:
                            pipes = Pipelines()
                        if isinstance(effect, SendMany):
                            value = await self._send_many(pipes, effect.sends)
                        elif isinstance(effect, Write):
                            value = await self._write_sends(pipes, effect.sends)
                        else:
                            value = await self._collect(pipes, effect.ticket)
                    elif isinstance(effect, Watch):
                        endpoint = await self._endpoint(effect.key, None)
                        held = (endpoint, await endpoint.take())
                        value = await _exchange(held, effect.commands)
                    elif isinstance(effect, (Commit, Unwatch)):
                        taken, held = held, None
                        value = None
                        if taken is not None:
                            commands = (
                                effect.commands if isinstance(effect, Commit) else [("UNWATCH",)]
                            )
                            try:
                                value = await _exchange(taken, commands)
                            finally:
                                await taken[0].give_back(taken[1])
                    elif isinstance(effect, Sleep):
                        await asyncio.sleep(effect.seconds)
                        value = None
                    else:
                        await self._refresh()
                        value = None
                except Disconnected as e:
                    if held is not None:
                        await held[0].give_back(held[1])  # closed by _exchange
                        held = None
                    if e.since is None:
                        e.since = started
                    error = e
        finally:
            op.close()
            if held is not None:  # ended (or cancelled) with a WATCH pending: do not reuse
                await _close(held[1])
                await held[0].give_back(held[1])
            for endpoint, conn in pipes.abandoned() if pipes is not None else ():
                await _close(conn)  # replies unread: do not reuse
                await endpoint.give_back(conn)

    # -- connections ---------------------------------------------------------------------

    async def _endpoint(self, key: str, node: tuple[str, int] | None) -> _Endpoint:
        if not self.cluster:
            return self._single
        client = self.client
        try:
            if not self._ready:
                await client.initialize()  # the async cluster client learns its slots lazily
                self._ready = True
            found = client.get_node(node[0], node[1]) if node else client.get_node_from_key(key)
        except Exception as e:
            _raise_mapped(e, "cluster " + ",".join(client.nodes_manager.startup_nodes))
        if found is None:
            raise Disconnected(f"cluster node {node or key!r} is not known yet")
        return _Endpoint(f"{found.host}:{found.port}", node=found)

    async def _send(self, send: Send) -> list[Any]:
        endpoint = await self._endpoint(send.key, send.node)
        held = (endpoint, await endpoint.take())
        try:
            replies = await _exchange(held, with_asking(send.commands, send.asking))
        finally:
            await endpoint.give_back(held[1])
        return replies[1:] if send.asking else replies

    async def _send_many(self, pipes: _Pipes, sends: Sequence[Send]) -> list[Any]:
        """One write per server, all written before any is read; a server that fails
        fails only its own sends (their entries are the ``Disconnected`` met)."""
        return await self._collect(pipes, await self._write_sends(pipes, sends))

    async def _write_sends(self, pipes: _Pipes, sends: Sequence[Send]) -> int:
        """Write ``sends`` on each server's pipelined connection; their ticket."""
        ticket = pipes.new_ticket(sends)
        endpoints: list[_Endpoint | Disconnected] = []
        for send in sends:
            try:
                endpoints.append(await self._endpoint(send.key, send.node))
            except Disconnected as e:
                endpoints.append(e)
        for endpoint, members in group_by_server(endpoints, ticket.results):
            held = pipes.open.get(endpoint.address)
            try:
                if held is None:
                    held = pipes.open[endpoint.address] = (endpoint, await endpoint.take())
                ticket.parts.append((held, members))
                await _write(
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

    async def _collect(self, pipes: _Pipes, number: int) -> list[Any]:
        """The replies of ticket ``number``, read in the order written."""
        ticket = pipes.next_ticket(number)
        results, sends = ticket.results, ticket.sends
        try:
            for held, members in ticket.parts:
                for n, i in enumerate(members):
                    failed = pipes.failure(held)
                    if failed is None:
                        try:
                            results[i] = await _read(held, sends[i])
                            continue
                        except Disconnected as e:
                            pipes.break_off(held[0].address, held, e)
                            failed = e
                    for j in members[n:]:
                        results[j] = failed
                    break
        finally:
            for endpoint, conn in pipes.idle():
                await endpoint.give_back(conn)
        return results

    async def _refresh(self) -> None:
        if not self.cluster:
            return
        try:
            await self.client.nodes_manager.initialize()
            self._ready = True
        except Exception as e:  # every node unreachable: the next send says so
            log.debug("cluster slot refresh failed: %s", e)


async def round_trip(conn: Any, commands: Sequence[Command]) -> list[Any]:
    """Send ``commands`` in one write and read every reply; error replies come back as values."""
    async with _bounded(conn):
        await _send(conn, pack(conn, commands))
        return await _replies(conn, commands)


def _bounded(conn: Any) -> asyncio.Timeout | contextlib.nullcontext[None]:
    """One deadline, the connection's socket timeout, for a whole exchange.

    redis-py bounds each write itself with ``asyncio.wait_for`` (a task per write) and each
    reply with a timeout of its own: together about a fifth of the client's CPU of a round
    trip. So the executor writes through the connection's unbounded
    ``_send_packed_command`` (redis-py 6.1 to 8; tests/test_async.py checks it is there;
    a connection not made yet goes through redis-py's own send, which makes it), reads with
    ``timeout=math.inf`` (no bound of redis-py's own since 8), and bounds the exchange once
    here. A connection cut off by the deadline is closed by the caller.
    """
    timeout = conn.socket_timeout
    return asyncio.timeout(timeout) if timeout else contextlib.nullcontext()


async def _send(conn: Any, packed: Any) -> None:
    if conn.is_connected:
        await conn._send_packed_command(packed)
    else:  # redis-py connects it first (a cluster node makes its connections lazily)
        await conn.send_packed_command(packed, check_health=False)


async def _replies(conn: Any, commands: Sequence[Command]) -> list[Any]:
    replies: list[Any] = []
    for command in commands:
        try:
            reply = await conn.read_response(timeout=math.inf)
        except rex.ResponseError as e:
            replies.append(error_reply(e))
        else:
            replies.append(reply_value(reply, command))
    return replies


async def _exchange(held: Held, commands: Sequence[Command]) -> list[Any]:
    """One round trip on a taken connection; a failure closes it (the caller gives it back)."""
    try:
        return await round_trip(held[1], commands)
    except BaseException as e:
        await _close(held[1])
        _raise_mapped(e, held[0].address)


async def _write(held: Held, commands: Sequence[Command]) -> None:
    conn = held[1]
    try:
        async with _bounded(conn):
            await _send(conn, pack(conn, commands))
    except BaseException as e:
        await _close(held[1])
        _raise_mapped(e, held[0].address)


async def _read(held: Held, send: Send) -> list[Any]:
    """The replies of one send among those written on ``held``."""
    conn = held[1]
    try:
        async with _bounded(conn):
            replies = await _replies(conn, with_asking(send.commands, send.asking))
    except BaseException as e:
        await _close(conn)
        _raise_mapped(e, held[0].address)
    return replies[1:] if send.asking else replies


async def _close(conn: Any) -> None:
    """Close a connection that may hold an unread reply.

    redis-py closes a connection whose send or read was interrupted (a cancelled task
    included); this makes sure of it without letting a second failure hide the first.
    """
    try:
        await conn.disconnect(nowait=True)
    except Exception as e:
        log.debug("closing a broken connection: %r", e)


def _raise_mapped(error: BaseException, where: str, pool: Any = None) -> NoReturn:
    """Raise what ``error`` becomes (``store.io.wire.io_failure``; ``connect_failure`` for
    a connection taken from ``pool``); itself if no redis error."""
    failure = io_failure(error, where) if pool is None else connect_failure(error, where, pool)
    if failure is error:
        raise error
    raise failure from error
