"""Leases on steps and the recovery index: claim, release, renew, schedule, list due."""

from __future__ import annotations

import time

from store.errors import NotFoundError, PartitionNotFound, RequestNotFound, ValidationError
from store.keys import validate_name, validate_request_id
from store.ops.args import check_replica_id
from store.ops.calls import hash_reply
from store.ops.core import VERSION, Core, deadline_member
from store.ops.effects import Op
from store.records import Lease


def claim_step(
    core: Core, request_id: str, partition_name: str, replica_id: str
) -> Op[Lease | None]:
    """Take over a partition's next step if no live lease covers it; else None.

    Raises the request's fencing token, so every write fenced with an earlier lease is
    rejected from now on. The claimer reads the partition and redoes whatever the old
    driver may not have done (advance, if ``pass_number`` is still the completed pass;
    then send the pass): each of those is safe to repeat.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    holder = check_replica_id(replica_id, rid)
    if not holder:
        raise ValidationError("claim_step needs a replica id", request_id=rid)
    now = time.time()
    keys = [core.keys.lease(rid), core.keys.partition(rid, name)]
    args = [VERSION, name, holder, now, core.lease_ttl]
    try:
        reply = yield from core.run(rid, "claim_step", keys, args, PartitionNotFound)
    except NotFoundError:
        # A recovery entry that outlived its request (scheduled by a replica racing the
        # delete): drop it, or due_steps would return it forever.
        yield from unschedule(core, rid, name)
        raise
    if reply[0] != b"OK":
        return None
    lease = Lease(rid, name, holder, int(reply[1]), int(reply[2]), now + core.lease_ttl)
    yield from schedule(core, rid, name, lease.expires_at)
    return lease


def release_lease(core: Core, lease: Lease, *, check_at: float | None = None) -> Op[None]:
    """Record that the lease's step was sent; the lease ends.

    ``check_at`` is when recovery should look at the partition again if no report moves
    it on (the pass deadline); None takes it off the recovery index (partition done).
    Raises ``FencedError`` if the lease was superseded.
    """
    rid = lease.request_id
    keys = [core.keys.lease(rid)]
    args = [lease.partition, lease.token]
    yield from core.run(rid, "release_lease", keys, args, RequestNotFound, lease)
    if check_at is None:
        yield from unschedule(core, rid, lease.partition)
    else:
        yield from schedule(core, rid, lease.partition, check_at)


def renew_lease(core: Core, lease: Lease, ttl: float | None = None) -> Op[Lease]:
    """Extend a lease still held; raises ``FencedError`` if it was superseded."""
    expires = time.time() + (ttl or core.lease_ttl)
    rid = lease.request_id
    keys = [core.keys.lease(rid)]
    args = [lease.partition, lease.token, expires]
    yield from core.run(rid, "renew_lease", keys, args, RequestNotFound, lease)
    yield from schedule(core, rid, lease.partition, expires)
    return Lease(rid, lease.partition, lease.holder, lease.token, lease.pass_number, expires)


def schedule_check(core: Core, request_id: str, partition_name: str, at: float) -> Op[None]:
    """Ask recovery to look at the partition at ``at`` unless something moves it first."""
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    yield from schedule(core, rid, name, at)


def due_steps(
    core: Core, *, now: float | None = None, limit: int = 100
) -> Op[list[tuple[str, str]]]:
    """(request id, partition) pairs whose check time has passed, oldest first.

    Costs O(log n + returned), read from the recovery index; never a SCAN.
    """
    index = core.keys.deadlines
    until = now or time.time()
    (members,) = yield from core.send(
        index, [("ZRANGEBYSCORE", index, "-inf", until, "LIMIT", 0, limit)], {}
    )
    out = []
    for member in members:
        rid, _, name = member.decode().partition(" ")
        out.append((rid, name))
    return out


def leases(core: Core, request_id: str) -> Op[dict[str, Lease]]:
    """The live and lapsed leases held on the request's partitions, by partition."""
    rid = validate_request_id(request_id)
    key = core.keys.lease(rid)
    (raw,) = yield from core.send(key, [("HGETALL", key)], {"request_id": rid})
    fields = {k.decode(): v.decode() for k, v in hash_reply(raw).items()}
    out = {}
    for field, holder in fields.items():
        if field.startswith("holder[") and field.endswith("]"):
            name = field[7:-1]
            out[name] = Lease(
                rid,
                name,
                holder,
                int(fields.get(f"token[{name}]", 0)),
                int(fields.get(f"pass[{name}]", 0)),
                float(fields.get(f"expires[{name}]", 0)),
            )
    return out


def schedule(core: Core, rid: str, partition: str, at: float) -> Op[None]:
    index = core.keys.deadlines
    member = deadline_member(rid, partition)
    yield from core.send(index, [("ZADD", index, at, member)], {"request_id": rid})


def unschedule(core: Core, rid: str, partition: str) -> Op[None]:
    index = core.keys.deadlines
    member = deadline_member(rid, partition)
    yield from core.send(index, [("ZREM", index, member)], {"request_id": rid})
