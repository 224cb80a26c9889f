"""A request's life: create it, list it, finish it, delete it, reap the abandoned."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from store.codec import domains
from store.errors import (
    RequestExistsError,
    RequestNotFound,
    StoreConnectionError,
    StoreError,
    ValidationError,
)
from store.keys import connection_name, split_connection_name, validate_name, validate_request_id
from store.ops.args import deadline_member, join_ids
from store.ops.calls import ScriptCall
from store.ops.core import VERSION, Core, Topology
from store.ops.effects import Op, Send
from store.ops.leases import check_in_arg, earlier_hints
from store.records import Lease, RequestRecord
from store.types import PartitionState, StreamingConnectionState

log = logging.getLogger(__name__)


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
    check_in: float | None = None,
) -> Op[None]:
    """Store a new request with all its partitions and connections, all or nothing.

    With ``check_in``, recovery looks at each partition that many seconds from now unless
    a report moves it on first (the first pass's deadline: a first pass whose reports are
    lost is sent again). Raises ``RequestExistsError`` if the id is held already (a resend
    of this very create after a lost reply is recognised and succeeds).
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
        fields = core.partition_layout.encode(state, request_id=rid, key=key)
        # The per-pass bookkeeping the scripts keep (see count_pending in _lib.lua).
        pending = state.current_worker_graph_ids - state.completed_worker_graph_ids
        fields["_pending"] = str(len(pending)).encode()
        ids = state.current_worker_graph_ids | state.completed_worker_graph_ids
        fields["_wgs"] = join_ids(sorted(ids | set(state.wg_rank_completions)))
        hashes.append((key, fields))
        pub = keys.publish_info(rid, name)
        hashes.append((pub, core.encode_infos(rid, pub, state.resource_publish_info)))
    for name, conn in connections.items():
        key = keys.connection(rid, name)
        hashes.append((key, core.connection_layout.encode(conn, request_id=rid, key=key)))
    check = check_in_arg(check_in, rid)
    args: list[Any] = [op_id or core.new_op_id(), core.history_cap, check, len(partitions)]
    args += list(partitions)
    for _, fields in hashes:
        args.append(len(fields))
        for field, value in fields.items():
            args += [field, value]
    where = {"request_id": rid}
    # Index first: a crash in between leaves an index entry without a request (which
    # readers skip and delete removes), never a request no index can find.
    first: list[Send] = [Send(keys.index, [("ZADD", keys.index, "NX", record.created_at, rid)])]
    if check != "" and not core.scripts_write_index:  # see store/ops/leases.py
        hint = earlier_hints(core, rid, list(partitions), min(float(check), core.lease_ttl))
        first.append(Send(keys.deadlines, [hint.command(core.scripts)]))
    yield from core.send_all(first, where)
    script_keys = [keys.meta(rid), keys.lease(rid), keys.history(rid), core.index_key(rid)]
    script_keys += [k for k, _ in hashes[1:]]
    status = yield from core.run(rid, "create_request", script_keys, args, RequestNotFound)
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
    """Ids of the requests held, oldest first (read from the index, never a SCAN). A
    damaged entry that is no UTF-8 comes back with its bad bytes escaped (``\\xff``):
    reading it then says it is no request id."""
    index = core.keys.index
    (ids,) = yield from core.send(index, [("ZRANGE", index, 0, -1)], {})
    return [rid.decode(errors="backslashreplace") for rid in ids]


def request_exists(core: Core, request_id: str) -> Op[bool]:
    """Whether the request's record is held (one EXISTS)."""
    rid = validate_request_id(request_id)
    meta = core.keys.meta(rid)
    (held,) = yield from core.send(meta, [("EXISTS", meta)], {"request_id": rid})
    return bool(held)


def kept_until(core: Core, request_id: str) -> Op[float | None]:
    """When a request finished with ``keep_for`` expires (its keys are gone after), as
    ``<ns>:finished`` records it until ``reap``; None if it holds no such entry. It tells an
    index entry of a request that expired as planned from one of an interrupted create or
    delete."""
    rid = validate_request_id(request_id)
    key = core.keys.finished
    (score,) = yield from core.send(key, [("ZSCORE", key, rid)], {"request_id": rid})
    return None if score is None else float(score)


def delete_request(core: Core, request_id: str, *, fence: Lease | None = None) -> Op[bool]:
    """Remove the request and all its keys; False if it was not held.

    Fenced like every write a driving replica relies on: with ``fence``, refused
    (``FencedError``) once that lease was superseded; without, while any replica holds a
    live lease on the request. An operator removing an abandoned request whatever its
    leases say uses ``force_delete_request``.
    """
    rid = validate_request_id(request_id)
    return (yield from _delete(core, rid, fence, guarded=True))


def force_delete_request(core: Core, request_id: str) -> Op[bool]:
    """Remove the request and all its keys even while a replica holds a live lease on it
    (that replica's next write gets ``RequestNotFound``): for an operator removing a
    request whose driver is stuck. False if it was not held."""
    rid = validate_request_id(request_id)
    return (yield from _delete(core, rid, None, guarded=False))


def _delete(core: Core, rid: str, fence: Lease | None, *, guarded: bool) -> Op[bool]:
    """Delete the request's keys in one script (checked against the topology this process
    knows), then its index entries. The index goes last: a crash in between leaves an
    index entry without a request (readers skip it, a second delete removes it).
    ``guarded``: refuse while a live lease covers the request (unless ``fence`` is it)."""
    keys = core.keys
    where = {"request_id": rid}
    topology = core.cached_topology(rid)
    for _ in range(_SHAPE_TRIES):
        if topology is None:
            try:
                topology = yield from core.load_topology(rid)
            except RequestNotFound:
                topology = Topology((), ())
        partitions, connections = list(topology.partitions), list(topology.connections)
        request_keys = keys.request_keys(rid, partitions, connections)
        args: list[Any] = [len(partitions), *partitions, len(connections), *connections]
        if fence is not None:
            args += [fence.partition, fence.token]
        else:
            args += ["*" if guarded else "", ""]
        status = yield from core.run(
            rid, "delete_request", request_keys, args, RequestNotFound, fence
        )
        if status[0] != b"SHAPE":
            break
        core.forget(rid)  # recreated with another shape since this process read it
        topology = None
    else:
        raise StoreError("the request's topology keeps changing under the delete", **where)
    core.forget(rid)
    # GONE after a topology was read: deleted meanwhile, or by this very call's first try
    # (its reply lost): either way it was held when the call began.
    held = status[0] == b"OK" or (status[0] == b"GONE" and bool(partitions))
    cleanup: list[Send] = [
        Send(keys.index, [("ZREM", keys.index, rid)]),
        Send(keys.finished, [("ZREM", keys.finished, rid)]),
    ]
    if partitions:  # a plain ZREM, which Redis runs on a full server (the hint script not)
        members = [deadline_member(rid, p) for p in partitions]
        cleanup.append(Send(keys.deadlines, [("ZREM", keys.deadlines, *members)]))
    yield from core.send_all(cleanup, where)
    return held


# Reads of the topology before the delete script gives up: only a request deleted and
# created again, with another shape, between each read and each script makes it try again.
_SHAPE_TRIES = 8


def finish_request(
    core: Core, request_id: str, *, fence: Lease | None = None, keep_for: float | None = None
) -> Op[None]:
    """The request is done: delete it, or keep it ``keep_for`` seconds for inspection.

    Either way it leaves the recovery index and every lease on it ends; a kept request
    expires by TTL on every key, and ``reap`` drops its index entry once it has. Without
    ``fence`` it is refused (``FencedError``) while a replica holds a live lease on it.
    """
    rid = validate_request_id(request_id)
    if keep_for is None:
        yield from _delete(core, rid, fence, guarded=True)
        core.instruments.count("finished")
        return
    domains.check_float(keep_for, domains.DURATION, what="keep_for", request_id=rid)
    topology = yield from core.topology(rid)
    keys = core.keys
    partitions = list(topology.partitions)
    request_keys = keys.request_keys(rid, partitions, list(topology.connections))
    finished = core.record_layout.encode_field(
        "finished_at", time.time(), request_id=rid, key=keys.meta(rid)
    )["finished_at"]
    partition, token = (fence.partition, fence.token) if fence else ("*", "")
    args = [VERSION, partition, token, keep_for, core.history_cap, finished]
    yield from core.run(rid, "finish_request", request_keys, args, RequestNotFound, fence)
    # Only once the finish is applied (a refused one, a zombie's, must not put a live
    # request where reap deletes it, nor take its partitions from recovery): both are
    # idempotent, so a resend after a lost reply is harmless. A crash in between leaves
    # a finished request that recovery finds and drops (claims of it answer DONE).
    members = [deadline_member(rid, p) for p in partitions]
    hints = [
        ScriptCall("hint", [keys.deadlines], ["REM", 0, *members]),
        ScriptCall("hint", [keys.finished], ["SET", keep_for, rid]),
    ]
    yield from core.send_all(
        [Send(h.keys[0], [h.command(core.scripts)]) for h in hints], {"request_id": rid}
    )
    core.instruments.count("finished")


def reap(core: Core, *, max_age: float, limit: int = 1000) -> Op[list[str]]:
    """Delete requests created more than ``max_age`` seconds ago (abandoned, or kept
    finished ones whose keys expired) and drop their index entries; returns their ids.
    One that a replica still drives under a live lease is left (and logged).
    """
    domains.check_float(max_age, domains.DURATION, what="max_age")
    domains.check_int(limit, domains.LIMIT, what="limit")
    keys = core.keys
    cutoff = time.time() - max_age
    now = time.time()
    (old, expired) = yield from core.send_all(
        [
            Send(keys.index, [("ZRANGEBYSCORE", keys.index, "-inf", cutoff, "LIMIT", 0, limit)]),
            Send(keys.finished, [("ZRANGEBYSCORE", keys.finished, "-inf", now, "LIMIT", 0, limit)]),
        ],
        {},
    )
    reaped = []
    for raw in dict.fromkeys([*old[0], *expired[0]]):
        try:
            rid = validate_request_id(raw.decode())
        except (UnicodeDecodeError, ValidationError):
            log.warning("reap: dropping index entry %r, which is no request id", raw[:80])
            yield from core.send_all(
                [
                    Send(keys.index, [("ZREM", keys.index, raw)]),
                    Send(keys.finished, [("ZREM", keys.finished, raw)]),
                ],
                {},
            )
            continue
        try:  # an old request still driven under a live lease is not abandoned: kept
            yield from _delete(core, rid, None, guarded=True)
        except StoreConnectionError:
            raise
        except StoreError as e:  # one damaged request does not stop the others
            log.warning("reap: could not delete %s: %s", rid, e)
            continue
        reaped.append(rid)
    if reaped:
        log.info("reaped %d requests", len(reaped))
    return reaped
