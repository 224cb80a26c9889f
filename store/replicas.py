"""The registry of replicas' heartbeats, sync and asyncio (operations in store.ops.replicas)."""

from __future__ import annotations

from typing import Any

from store.facade import Facade, async_method, sync_method
from store.io.aio import AsyncExecutor
from store.io.sync import SyncExecutor
from store.ops import replicas
from store.ops.calls import DEFAULT_RECONNECT, Reconnect
from store.ops.core import Core
from store.ops.settings import Settings


class ReplicaRegistry(Facade):
    """Heartbeats of the conductor replicas of one namespace; ``reconnect`` bounds how long
    a call keeps trying an unreachable Redis (default: the store's)."""

    def __init__(
        self, client: Any, *, namespace: str = "mstar", reconnect: Reconnect | None = None
    ) -> None:
        self._core = Core(Settings(namespace, reconnect=reconnect or DEFAULT_RECONNECT))
        self._executor = SyncExecutor(client)
        self.client = client
        self.key = self._core.keys.replicas

    heartbeat = sync_method(replicas.heartbeat)
    last_beats = sync_method(replicas.last_beats)
    live = sync_method(replicas.live)
    forget = sync_method(replicas.forget)
    prune = sync_method(replicas.prune)


class AsyncReplicaRegistry(Facade):
    """``ReplicaRegistry`` on a ``redis.asyncio`` client: the same methods, awaited."""

    def __init__(
        self, client: Any, *, namespace: str = "mstar", reconnect: Reconnect | None = None
    ) -> None:
        self._core = Core(Settings(namespace, reconnect=reconnect or DEFAULT_RECONNECT))
        self._executor = AsyncExecutor(client)
        self.client = client
        self.key = self._core.keys.replicas

    heartbeat = async_method(replicas.heartbeat)
    last_beats = async_method(replicas.last_beats)
    live = async_method(replicas.live)
    forget = async_method(replicas.forget)
    prune = async_method(replicas.prune)
