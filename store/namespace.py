"""``NamespaceReader``: a namespace as the operators' tools read it (operations in store.ops.scan).

``mstar-store migrate``, ``top`` and ``history`` walk a namespace rather than a request;
they read through this facade so that every failure is the store's typed error, whatever
the topology.
"""

from __future__ import annotations

from typing import Any, TypeVar

from redis.cluster import RedisCluster

from store.facade import Facade, sync_method
from store.io.sync import SyncExecutor
from store.keys import INDEX_SUFFIX, namespace_of_index
from store.ops import scan
from store.ops.calls import DEFAULT_RECONNECT, Reconnect
from store.ops.core import Core
from store.ops.effects import Op
from store.ops.scan import Node
from store.ops.settings import Settings

T = TypeVar("T")


class NamespaceReader(Facade):
    """Reads over one namespace of a redis-py client (single server, Sentinel or Cluster)."""

    def __init__(
        self, client: Any, *, namespace: str = "mstar", reconnect: Reconnect | None = None
    ) -> None:
        self._core = Core(Settings(namespace=namespace, reconnect=reconnect or DEFAULT_RECONNECT))
        self._executor = SyncExecutor(client)
        self.client = client
        self.keys = self._core.keys
        self.reconnect = self._core.reconnect

    def nodes(self) -> list[Node]:
        """The servers a scan of every key must visit: a cluster's masters, or the one."""
        if isinstance(self.client, RedisCluster):
            primaries = self.client.get_primaries()  # type: ignore[no-untyped-call]
            return [(node.host, node.port) for node in primaries]
        return [None]

    def run(self, op: Op[T]) -> T:
        """Run an operation built outside this facade (``store.upgrade.upgrade_stored``)."""
        result: T = self._executor.run(op)
        return result

    def namespaces_holding(
        self, request_id: str | None = None, *, scan_limit: int = 100_000
    ) -> list[tuple[str, int, bool]]:
        """The other namespaces whose request index holds requests, as (namespace, how
        many, whether ``request_id`` is one of them): those holding it first, then the
        fullest. What a "no such request" or an empty ``ls`` may point to. Reads at most
        ``scan_limit`` keys of each server (SCAN for ``<ns>:requests`` sorted sets)."""
        indexes: list[str] = []
        for node in self.nodes():
            cursor, seen = 0, 0
            while True:
                cursor, found = self.key_page(node, cursor, f"*{INDEX_SUFFIX}", 1000, "zset")
                indexes += [k.decode(errors="replace") for k in found]
                seen += 1000
                if cursor == 0 or seen >= scan_limit:
                    break
        names = {key: namespace_of_index(key) for key in indexes}
        others = [key for key, name in names.items() if name and name != self.keys.namespace]
        reads = [(key, [("ZCARD", key), ("ZSCORE", key, request_id or "")]) for key in others]
        held = [
            (names[key] or key, int(size), score is not None)
            for key, (size, score) in zip(others, self.read_many(reads, {}), strict=True)
            if int(size)
        ]
        return sorted(held, key=lambda h: (not h[2], -h[1], h[0]))

    index_size = sync_method(scan.index_size)
    zset_page = sync_method(scan.zset_page)
    key_page = sync_method(scan.key_page)
    read_many = sync_method(scan.read_many)
    history_page = sync_method(scan.history_page)
    server_info = sync_method(scan.server_info)
