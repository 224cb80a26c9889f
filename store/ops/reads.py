"""Reads: a whole request as one consistent snapshot, or one of its records."""

from __future__ import annotations

from collections.abc import Sequence

from store.errors import (
    ConnectionNotFound,
    CorruptRecordError,
    PartitionNotFound,
    RequestNotFound,
    StoreError,
)
from store.keys import split_connection_name, validate_name, validate_request_id
from store.ops.batch import gather
from store.ops.core import Core, Topology
from store.ops.effects import Op
from store.records import RequestRecord, RequestState
from store.types import PartitionState, StreamingConnectionState


def load_request(core: Core, request_id: str) -> Op[RequestState]:
    """A consistent snapshot of the whole request."""
    rid = validate_request_id(request_id)
    keys = core.keys
    for _ in range(2):
        topology = yield from core.topology(rid)
        hash_keys = [keys.meta(rid)]
        hash_keys += [keys.partition(rid, p) for p in topology.partitions]
        hash_keys += [keys.publish_info(rid, p) for p in topology.partitions]
        hash_keys += [keys.connection(rid, c) for c in topology.connections]
        hashes = yield from core.load_hashes(rid, hash_keys)
        if not hashes[0]:
            core.forget(rid)
            raise RequestNotFound("no such request", request_id=rid)
        record = core.decode_record(rid, hashes[0])
        if (tuple(record.partitions), tuple(record.connections)) != (
            topology.partitions,
            topology.connections,
        ):
            core.forget(rid)  # recreated with another shape: read again
            continue
        n = len(topology.partitions)
        parts = {
            p: core.decode_partition(rid, p, hashes[1 + i], hashes[1 + n + i])
            for i, p in enumerate(topology.partitions)
        }
        conns = {
            c: core.decode_connection(rid, c, hashes[1 + 2 * n + i])
            for i, c in enumerate(topology.connections)
        }
        return RequestState(record, parts, conns)
    raise CorruptRecordError("request topology keeps changing under the read", request_id=rid)


def load_record(core: Core, request_id: str) -> Op[RequestRecord]:
    """The request-level record (max tokens, seed, configs, definitions, outputs)."""
    rid = validate_request_id(request_id)
    (raw,) = yield from core.load_hashes(rid, [core.keys.meta(rid)])
    if not raw:
        raise RequestNotFound("no such request", request_id=rid)
    return core.decode_record(rid, raw)


def load_partition(core: Core, request_id: str, partition_name: str) -> Op[PartitionState]:
    """The partition's state, publish info included, equal to what was stored."""
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    part, pub = yield from core.load_hashes(
        rid, [core.keys.partition(rid, name), core.keys.publish_info(rid, name)]
    )
    if not part:
        yield from core.raise_not_found(rid, PartitionNotFound, f"no partition {name!r}")
    return core.decode_partition(rid, name, part, pub)


def load_partitions(
    core: Core, partitions: Sequence[tuple[str, str]]
) -> Op[list[PartitionState | StoreError]]:
    """``load_partition`` of many (request id, partition name) pairs at once, pipelined to
    each Redis server (``store.ops.batch``): one entry per pair, in order, the state or the
    ``StoreError`` it met (a partition gone does not fail the others)."""
    return (yield from gather([load_partition(core, rid, name) for rid, name in partitions]))


def load_connection(core: Core, request_id: str, name: str) -> Op[StreamingConnectionState]:
    """One streaming connection of a request, by name (``<from>-><to>``); ``ConnectionNotFound``
    if the request has no such connection."""
    rid = validate_request_id(request_id)
    split_connection_name(name, request_id=rid)
    (raw,) = yield from core.load_hashes(rid, [core.keys.connection(rid, name)])
    if not raw:
        yield from core.raise_not_found(rid, ConnectionNotFound, f"no connection {name!r}")
    return core.decode_connection(rid, name, raw)


def topology(core: Core, request_id: str) -> Op[Topology]:
    """The request's partitions and streaming connections, as created (``outgoing(p)`` /
    ``incoming(p)`` name a partition's connections). Cached per process: a call usually
    costs no round trip."""
    rid = validate_request_id(request_id)
    return (yield from core.topology(rid))
