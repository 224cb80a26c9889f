"""A request's life: create it, list it, finish it, delete it, reap the abandoned."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from mstar.conductor.request_info import PartitionState, StreamingConnectionState
from store.errors import RequestExistsError, RequestNotFound, ValidationError
from store.keys import connection_name, split_connection_name, validate_name, validate_request_id
from store.ops.core import Core, Topology, deadline_member
from store.ops.effects import Command, Op
from store.ops.fields import update_fields
from store.ops.leases import release_lease
from store.records import Lease, RequestRecord


def create_request(
    core: Core,
    request_id: str,
    *,
    partitions: Mapping[str, PartitionState],
    connections: Mapping[str, StreamingConnectionState] | None = None,
    max_output_tokens: int,
    seed: int = 0,
    resource_configs: Mapping[str, Any] | None = None,
    partition_definitions: Mapping[str, Any] | None = None,
    op_id: str | None = None,
) -> Op[None]:
    """Store a new request with all its partitions and connections, all or nothing.

    Raises ``RequestExistsError`` if the id is held already (a resend of this very create
    after a lost reply is recognised and succeeds).
    """
    rid = validate_request_id(request_id)
    connections = connections or {}
    _validate_topology(rid, partitions, connections)
    record = RequestRecord(
        request_id=rid,
        max_output_tokens=max_output_tokens,
        seed=seed,
        partitions=list(partitions),
        connections=list(connections),
        partition_definitions=dict(partition_definitions or {}),
        resource_configs=dict(resource_configs or {}),
        created_at=time.time(),
    )
    keys = core.keys
    meta_key = keys.meta(rid)
    hashes: list[tuple[str, dict[str, bytes]]] = [
        (meta_key, core.record_layout.encode(record, request_id=rid, key=meta_key))
    ]
    for name, state in partitions.items():
        key = keys.partition(rid, name)
        hashes.append((key, core.partition_layout.encode(state, request_id=rid, key=key)))
        pub = keys.publish_info(rid, name)
        hashes.append((pub, core.encode_infos(rid, pub, state.resource_publish_info)))
    for name, conn in connections.items():
        key = keys.connection(rid, name)
        hashes.append((key, core.connection_layout.encode(conn, request_id=rid, key=key)))
    args: list[Any] = [op_id or core.new_op_id()]
    for _, fields in hashes:
        args.append(len(fields))
        for field, value in fields.items():
            args += [field, value]
    where = {"request_id": rid}
    # Index first: a crash in between leaves an index entry without a request (which
    # readers skip and delete removes), never a request no index can find.
    yield from core.send(keys.index, [("ZADD", keys.index, "NX", record.created_at, rid)], where)
    status = yield from core.run(
        rid, "create_request", [k for k, _ in hashes], args, RequestNotFound
    )
    if status[0] == b"EXISTS":
        raise RequestExistsError("a request with this id is held already", request_id=rid)
    core.remember(rid, Topology(tuple(partitions), tuple(connections)))


def _validate_topology(
    rid: str,
    partitions: Mapping[str, PartitionState],
    connections: Mapping[str, StreamingConnectionState],
) -> None:
    if not partitions:
        raise ValidationError("a request needs at least one partition", request_id=rid)
    for name, state in partitions.items():
        validate_name(name, what="partition name", request_id=rid)
        if not isinstance(state, PartitionState):
            raise ValidationError(
                f"partition {name!r} must be a PartitionState, not {type(state).__name__}",
                request_id=rid,
            )
        if state.partition_name != name:
            raise ValidationError(
                f"partition stored as {name!r} is named {state.partition_name!r}",
                request_id=rid,
                field="partition_name",
            )
    for name, conn in connections.items():
        source, target = split_connection_name(name, request_id=rid)
        if not isinstance(conn, StreamingConnectionState):
            raise ValidationError(
                f"connection {name!r} must be a StreamingConnectionState", request_id=rid
            )
        if (conn.from_partition, conn.to_partition) != (source, target):
            raise ValidationError(
                f"connection stored as {name!r} joins "
                f"{connection_name(conn.from_partition, conn.to_partition)!r}",
                request_id=rid,
            )
        for end in (source, target):
            if end not in partitions:
                raise ValidationError(
                    f"connection {name!r} names partition {end!r}, which the request does not have",
                    request_id=rid,
                )


def list_requests(core: Core) -> Op[list[str]]:
    """Ids of the requests held, oldest first (read from the index, never a SCAN)."""
    index = core.keys.index
    (ids,) = yield from core.send(index, [("ZRANGE", index, 0, -1)], {})
    return [rid.decode() for rid in ids]


def request_exists(core: Core, request_id: str) -> Op[bool]:
    rid = validate_request_id(request_id)
    meta = core.keys.meta(rid)
    (held,) = yield from core.send(meta, [("EXISTS", meta)], {"request_id": rid})
    return bool(held)


def delete_request(core: Core, request_id: str) -> Op[bool]:
    """Remove the request and all its keys; False if it was not held."""
    rid = validate_request_id(request_id)
    core.forget(rid)
    try:
        topology: Topology | None = yield from core.load_topology(rid)
    except RequestNotFound:
        topology = None
    partitions = list(topology.partitions) if topology else []
    connections = list(topology.connections) if topology else []
    keys = core.keys
    where = {"request_id": rid}
    request_keys = keys.request_keys(rid, partitions, connections)
    yield from core.send(request_keys[0], [("UNLINK", *request_keys)], where)
    if partitions:
        members = [deadline_member(rid, p) for p in partitions]
        yield from core.send(keys.deadlines, [("ZREM", keys.deadlines, *members)], where)
    yield from core.send(keys.index, [("ZREM", keys.index, rid)], where)
    return topology is not None


def finish_request(
    core: Core, request_id: str, *, fence: Lease | None = None, keep_for: float | None = None
) -> Op[None]:
    """The request is done: delete it, or keep it ``keep_for`` seconds for inspection.

    Either way it leaves the recovery index; a kept request expires by TTL on every key.
    """
    rid = validate_request_id(request_id)
    topology = yield from core.topology(rid)
    if keep_for is None:
        if fence is not None:
            yield from release_lease(core, fence)
        yield from delete_request(core, rid)
        return
    yield from update_fields(
        core, rid, core.keys.meta(rid), core.record_layout, {"finished_at": time.time()},
        RequestNotFound, fence,
    )  # fmt: skip
    keys = core.keys
    partitions = list(topology.partitions)
    request_keys = keys.request_keys(rid, partitions, list(topology.connections))
    ttl = max(1, int(keep_for))
    expire: list[Command] = [("EXPIRE", key, ttl) for key in request_keys]
    where = {"request_id": rid}
    yield from core.send(request_keys[0], expire, where)
    members = [deadline_member(rid, p) for p in partitions]
    yield from core.send(keys.deadlines, [("ZREM", keys.deadlines, *members)], where)


def reap(core: Core, *, max_age: float, limit: int = 1000) -> Op[list[str]]:
    """Delete requests created more than ``max_age`` seconds ago (abandoned, or kept
    finished ones whose keys expired) and drop their index entries; returns their ids.
    """
    index = core.keys.index
    cutoff = time.time() - max_age
    (old,) = yield from core.send(
        index, [("ZRANGEBYSCORE", index, "-inf", cutoff, "LIMIT", 0, limit)], {}
    )
    reaped = []
    for raw in old:
        rid = raw.decode()
        yield from delete_request(core, rid)
        reaped.append(rid)
    return reaped
