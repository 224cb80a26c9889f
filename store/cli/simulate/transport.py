"""The simulated network: the lists that carry passes, reports and news between processes.

The fleet (workers and delivery) and the replica processes talk through Redis lists beside
(never inside) the store's key layout: a replica's planner pushes each pass it sends onto
``dispatch``; the workers' reports reach a replica through its ``inbox``; replicas tell the
fleet which requests they finished, which steps they handed over, and their stats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import redis
from redis.exceptions import RedisClusterException

from store.cli.simulate.model import Report
from store.errors import StoreConnectionError


class SimKeys:
    """The simulation's own lists, under ``<namespace>:sim``."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"{namespace}:sim"
        self.dispatch = f"{self.prefix}:dispatch"  # passes sent to the workers
        self.finished = f"{self.prefix}:finished"  # request ids a replica finished
        self.handed = f"{self.prefix}:handed"  # steps a draining replica handed over
        self.stats = f"{self.prefix}:stats"  # replicas' stats, flushed as JSON

    def inbox(self, replica_id: str) -> str:
        return f"{self.prefix}:inbox:{replica_id}"


_report_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def encode_report(report: Report) -> bytes:
    return _encoder.encode(report)


def decode_report(raw: bytes) -> Report:
    return _report_decoder.decode(raw)


def encode_dispatch(request_id: str, partition: str, fwd_pass: int) -> bytes:
    return _encoder.encode([request_id, partition, fwd_pass])


def decode_dispatch(raw: bytes) -> tuple[str, str, int]:
    rid, partition, fwd_pass = msgspec.json.decode(raw)
    return str(rid), str(partition), int(fwd_pass)


def encode_handed(replica_id: str, request_id: str, partition: str, at: float) -> bytes:
    return _encoder.encode([replica_id, request_id, partition, at])


def decode_handed(raw: bytes) -> tuple[str, str, str, float]:
    replica_id, rid, partition, at = msgspec.json.decode(raw)
    return str(replica_id), str(rid), str(partition), float(at)


# What the lists' own commands raise while Redis is unreachable (a restart, a failover):
# the store's calls raise StoreConnectionError; these are bare redis-py's.
UNREACHABLE: tuple[type[Exception], ...] = (
    StoreConnectionError, redis.ConnectionError, redis.TimeoutError,
    redis.exceptions.ReadOnlyError, redis.exceptions.ClusterError, RedisClusterException,
)  # fmt: skip


@contextlib.contextmanager
def as_store_error() -> Iterator[None]:
    """A list command that met Redis unreachable raises as the store's calls do, so that the
    runtime treats it as the same outage (a finish is retried by recovery)."""
    try:
        yield
    except UNREACHABLE as e:
        if isinstance(e, StoreConnectionError):
            raise
        raise StoreConnectionError(f"Redis unreachable: {e}") from e
