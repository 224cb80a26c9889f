"""The real Redis the ``real`` tests run against: which server it is, whether it is safe to use.

``REDIS_URL`` takes every form the store takes (``redis://``, ``rediss://``, ``unix://``,
``redis+sentinel://host:port/service``, ``redis+cluster://host:port,...``): clients are built
by ``store.io.connect.client_from_url``, so a cluster URL gives a cluster client.

The server is probed once per process: the pytest header names it, and a server that holds
keys outside the project's own throwaway namespaces (someone's live data, perhaps) is refused
unless ``MSTAR_TEST_ALLOW_FOREIGN_KEYS=1``. Tests never delete such keys, but they do write
next to them, and their load could hurt a live deployment.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.sentinel import SentinelConnectionPool

from store.errors import StoreError
from store.io.connect import client_from_url, redacted
from tests.servers import no_retry

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ALLOW_FOREIGN_KEYS = "MSTAR_TEST_ALLOW_FOREIGN_KEYS"
PROBE_TIMEOUT = 0.5
SAMPLE_KEYS = 2000  # SCANned at most, over every master together: cheap on any server
SAMPLE_CALLS = 20  # SCANs per master at most, as a sparse keyspace returns near-empty pages
SHOWN = 5

# Namespaces the project's own code creates, each with a random part, and throws away:
#   t-<12 hex> (and t-<word>-<12 hex>, t-<12 hex>-<word>): the test fixtures and tests;
#   sim-<8 hex>: `mstar-store simulate` without --namespace;
#   mstar-bench-<pid>-<6 hex>: benchmarks/bench.py;
#   mstar-demo: `mstar-store demo`, which deletes its requests unless --keep.
# A deployment's namespace (default "mstar") is never among them.
OWN_NAMESPACE = re.compile(
    rb"(?:t-(?:[a-z]+-)*[0-9a-f]{12}(?:-[a-z]+)*"
    rb"|sim-[0-9a-f]{8}"
    rb"|mstar-bench-[0-9]+-[0-9a-f]{6}"
    rb"|mstar-demo):"
)


def redis_url_for_tests() -> str:
    """``REDIS_URL`` if set, else ``redis://127.0.0.1:6379/0``."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def connect(url: str | None = None, **kwargs: Any) -> Any:
    """A bytes-returning client for ``url`` (default: the tests' real Redis), of any topology."""
    return client_from_url(url or redis_url_for_tests(), **kwargs)


def masters(client: Any) -> list[Any]:
    """One plain client per master: every node of a cluster that owns slots, else ``client``."""
    if isinstance(client, RedisCluster):
        return [node.redis_connection for node in client.get_primaries()]
    return [client]


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


def delete_namespace(client: Any, namespace: str) -> int:
    """SCAN + UNLINK every ``<namespace>:*`` key, on every master; returns how many went."""
    deleted = 0
    for node in masters(client):
        batch: list[bytes] = []
        for key in node.scan_iter(match=f"{_glob_escape(namespace)}:*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += client.unlink(*batch)  # a cluster client splits it by slot
                batch.clear()
        if batch:
            deleted += client.unlink(*batch)
    return deleted


def _sample(node: Any, limit: int) -> Iterator[bytes]:
    """Up to about ``limit`` keys of one server, in a bounded number of SCAN calls."""
    cursor, seen = 0, 0
    for _ in range(SAMPLE_CALLS):
        cursor, keys = node.scan(cursor=cursor, count=min(limit, 1000))
        yield from keys
        seen += len(keys)
        if cursor == 0 or seen >= limit:
            return


@dataclass(frozen=True)
class Probe:
    """What the real Redis at ``url`` is, or why it could not be asked."""

    url: str
    error: str | None = None
    version: str = ""
    mode: str = ""
    keys: int = 0
    sampled: int = 0
    foreign_count: int = 0
    foreign: list[bytes] = field(default_factory=list)  # the first few, to name them

    def header(self) -> str:
        source = "REDIS_URL" if os.environ.get("REDIS_URL") else "REDIS_URL unset, default"
        where = f"real Redis ({source}): {redacted(self.url)}"
        if self.error is not None:
            return f"{where}: {self.error}"
        line = f"{where}: Redis {self.version}, {self.mode}, {self.keys} keys"
        if self.foreign:
            verdict = (
                f"allowed by {ALLOW_FOREIGN_KEYS}=1"
                if _allowed()
                else f"real tests refused (set {ALLOW_FOREIGN_KEYS}=1 to run them anyway)"
            )
            line += f"\n  {self._foreign_keys()}: {verdict}"
        return line

    def refusal(self) -> str | None:
        """Why the real tests must not run here, or ``None``."""
        if self.error is not None:
            return f"real Redis at {redacted(self.url)}: {self.error}"
        if self.foreign and not _allowed():
            return (
                f"real Redis at {redacted(self.url)} holds keys outside test namespaces, "
                f"maybe someone's live data ({self._foreign_keys()}). Point REDIS_URL at a "
                f"server of your own, or set {ALLOW_FOREIGN_KEYS}=1 to use this one anyway "
                "(tests only ever delete keys of their own namespaces)"
            )
        return None

    def _foreign_keys(self) -> str:
        shown = ", ".join(repr(k.decode(errors="replace")) for k in self.foreign)
        return f"{self.foreign_count} of {self.sampled} keys sampled are foreign, e.g. {shown}"


def _allowed() -> bool:
    return os.environ.get(ALLOW_FOREIGN_KEYS, "") not in ("", "0")


def _mode(client: Any, nodes: list[Any]) -> str:
    if isinstance(client, RedisCluster):
        return f"cluster with {len(nodes)} masters"
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        host, port = pool.get_master_address()
        return f"sentinel master {host}:{port} ({pool.service_name})"
    return "standalone"


def _probe(url: str) -> Probe:
    with closing(
        connect(
            url,
            socket_timeout=PROBE_TIMEOUT,
            socket_connect_timeout=PROBE_TIMEOUT,
            retry=no_retry(),
        )
    ) as client:
        nodes = masters(client)
        versions = {str(n.info("server")["redis_version"]) for n in nodes}
        sample = [key for node in nodes for key in _sample(node, SAMPLE_KEYS // len(nodes))]
        foreign = [key for key in sample if not OWN_NAMESPACE.match(key)]
        return Probe(
            url,
            version=", ".join(sorted(versions)),
            mode=_mode(client, nodes),
            keys=sum(n.dbsize() for n in nodes),
            sampled=len(sample),
            foreign_count=len(foreign),
            foreign=foreign[:SHOWN],
        )


def probe_server(url: str) -> Probe:
    """What the server at ``url`` is and holds, or why it does not answer."""
    try:
        return _probe(url)
    except (redis.RedisError, OSError, StoreError) as e:
        return Probe(url, error=f"does not answer: {type(e).__name__}: {e}")


@functools.cache
def probe() -> Probe:
    """The tests' real Redis, probed once per process (the header and the fixtures share it)."""
    return probe_server(redis_url_for_tests())
