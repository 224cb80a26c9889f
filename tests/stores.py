"""Both stores behind one test contract.

The contract tests are written against the sync API. For the ``async`` variant they get a
``BlockingView`` of an ``AsyncRequestStore``: each method call runs the coroutine to its end
on an event loop in a thread of its own and returns its result or raises its error, so the
same assertions check the asyncio executor, its client and its connection handling.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import fakeredis
import redis
import redis.asyncio

from store import AsyncRequestStore, RequestStore
from store.io.connect import client_from_url

CALL_TIMEOUT = 60.0


class LoopThread:
    """An event loop running in a daemon thread until ``stop``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Any, timeout: float = CALL_TIMEOUT) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class BlockingView:
    """An async store whose coroutine methods are called as blocking ones.

    ``client`` is the sync client the test passed in (on the same server), so that raw
    reads and writes of a test work as with a sync store.
    """

    def __init__(self, store: AsyncRequestStore, loop: LoopThread, client: Any) -> None:
        self._store = store
        self._loop = loop
        self.client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run(attr(*args, **kwargs))

        return call


def async_twin(client: Any) -> Any:
    """A ``redis.asyncio`` client on the same server (or fake server) as sync ``client``."""
    if isinstance(client, fakeredis.FakeRedis):
        server = client.connection_pool.connection_kwargs["server"]
        return fakeredis.FakeAsyncRedis(server=server)
    if isinstance(client, redis.cluster.RedisCluster):
        nodes = [redis.asyncio.cluster.ClusterNode(n.host, n.port) for n in client.get_primaries()]
        return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes)
    kwargs = client.connection_pool.connection_kwargs
    same = {k: kwargs[k] for k in ("db", "username", "password") if k in kwargs}
    if "path" in kwargs:
        return redis.asyncio.Redis(unix_socket_path=kwargs["path"], **same)
    return redis.asyncio.Redis(host=kwargs["host"], port=kwargs["port"], **same)


StoreFactory = Callable[..., Any]


class Stores:
    """Makes stores of one kind (``sync`` or ``async``) and closes what it made."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._loop: LoopThread | None = None
        self._made: list[AsyncRequestStore] = []
        self._clients: list[Any] = []

    def __call__(self, client: Any, **options: Any) -> Any:
        """A store on ``client``'s server with ``options``: a ``RequestStore``, or a
        ``BlockingView`` of an ``AsyncRequestStore`` on an asyncio twin of ``client``."""
        if self.kind == "sync":
            return RequestStore(client, **options)
        if self._loop is None:
            self._loop = LoopThread()
        store = AsyncRequestStore(async_twin(client), **options)
        self._made.append(store)
        return BlockingView(store, self._loop, client)

    def from_url(self, url: str, **options: Any) -> Any:
        """A store of this kind from ``url``, as ``RequestStore.from_url`` builds one."""
        if self.kind == "sync":
            return RequestStore.from_url(url, **options)
        if self._loop is None:
            self._loop = LoopThread()
        store = AsyncRequestStore.from_url(url, **options)
        self._made.append(store)
        self._clients.append(client := client_from_url(url))
        return BlockingView(store, self._loop, client)

    def close(self) -> None:
        for client in self._clients:
            client.close()
        if self._loop is None:
            return
        for store in self._made:
            self._loop.run(store.aclose())
        self._loop.stop()


def stores_of(kind: str) -> Iterator[Stores]:
    stores = Stores(kind)
    try:
        yield stores
    finally:
        stores.close()
