"""Leases on steps, the steps themselves, and the recovery index.

Every time that decides something (is a lease live, is a step due) is the Redis server's
clock, read inside the scripts: replicas whose clocks disagree still agree on leases.

Recovery reads the ``<ns>:deadlines`` index to learn which partitions to look at. The
check time held in the request's lease hash (``check[p]``) decides (``claim_step``); the
index must never come later than it, or a driver that dies is looked at late, or never.

On one server (standalone, Sentinel) every script that moves a check time moves the
partition's index entry with it, atomically: the index equals the check times, whatever
was refused, resent or lost. On a cluster the index lives in a slot of its own, out of the
scripts' reach, so the store writes it, and only in ways a refused or lost call cannot make
late: alongside a step, renewal, report or create goes an "only ever earlier" write
(``LT``; ``XLT`` for a renewal and a report, which move an existing entry but make none,
since most reports complete nothing), aimed ``CLUSTER_INDEX_LEAD`` before the check time
the script may set; an entry is made for a lease granted to a partition that had no check
time, removed, or moved later only after the script applied, as its reply says (a report
that granted a lease, a step that finishes the partition, a claim's answer), and losing
that write never hides the outcome from the caller. An early look finds the step not due
and puts the entry right, at the cost of one claim.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from store.codec import domains
from store.codec.leases import decode_leases
from store.errors import (
    NotFoundError,
    PartitionNotFound,
    StalePassError,
    StoreConnectionError,
    ValidationError,
)
from store.keys import validate_name, validate_request_id
from store.ops.args import check_replica_id, deadline_member
from store.ops.batch import gather
from store.ops.calls import ScriptCall, hash_reply
from store.ops.core import VERSION, Core
from store.ops.damage import reading, stored_int
from store.ops.effects import Op
from store.records import Lease, Step

log = logging.getLogger(__name__)

# How much earlier than the check time a cluster's index entry written alongside a script
# aims (seconds): more than the write can lag the script, less than any useful check_in.
CLUSTER_INDEX_LEAD = 0.5


def claim_step(
    core: Core, request_id: str, partition_name: str, replica_id: str
) -> Op[Lease | None]:
    """Take over a partition's next step if no live lease covers it and its check time has
    come; else None. A claim resent by the replica that holds the lease gets it back.

    Raises the request's fencing token, so every write fenced with an earlier lease is
    rejected from now on. The claimer reads the partition and redoes whatever the old
    driver may not have done (take the step if the pass is complete, else send the pass
    again): each of those is safe to repeat. ``Lease.sends`` and ``.sent_at`` say how often
    and when the current pass was last sent, for backing off resends.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    holder = check_replica_id(replica_id, rid)
    if not holder:
        raise ValidationError("claim_step needs a replica id", request_id=rid)
    keys = [
        core.keys.lease(rid), core.keys.partition(rid, name), core.keys.history(rid),
        core.keys.meta(rid), core.index_key(rid),
    ]  # fmt: skip
    args = [VERSION, name, holder, core.lease_ttl, core.history_cap]
    try:
        reply = yield from core.run(rid, "claim_step", keys, args, PartitionNotFound)
    except NotFoundError:
        # A recovery entry that outlived its request (scheduled by a replica racing the
        # delete): drop it, or due_steps would return it forever.
        yield from unschedule(core, rid, [name])
        raise
    status = reply[0]
    if not core.scripts_write_index:
        yield from _index_after_claim(core, rid, name, reply)
    if status in (b"OK", b"MINE"):
        if status == b"OK":
            core.instruments.count("takeovers")
            log.info("replica %s took over %s/%s at pass %s", holder, rid, name, reply[2])
        with reading(request_id=rid, key=core.keys.lease(rid)):
            return Lease(
                rid, name, holder, int(reply[1]), int(reply[2]), float(reply[4]),
                sends=int(reply[5]), sent_at=float(reply[6]),
            )  # fmt: skip
    return None  # not due, another replica's, or finished (nothing to recover)


def _index_after_claim(core: Core, rid: str, name: str, reply: list[Any]) -> Op[None]:
    """On a cluster: the index entry the claim's answer calls for (on one server the
    script wrote it): at the lease's expiry, or the check time; none once finished."""
    status = reply[0]
    if status == b"DONE":
        yield from after_applied(core, rid, unschedule(core, rid, [name]))
        return
    at = reply[{b"OK": 4, b"MINE": 4, b"HELD": 2}.get(status, 1)]
    yield from after_applied(core, rid, schedule_at(core, rid, name, float(at)))


def take_step(core: Core, lease: Lease, step: Step, *, check_in: float | None = None) -> Op[int]:
    """Take the lease's step in one call: advance the partition to the next pass (``step``:
    its metadata and worker graphs, or ``done``), record that it is being sent, end the
    lease, and have recovery look again in ``check_in`` seconds if nothing moves the
    partition on (``None``: never; the partition is done). Returns the new pass.

    Raises ``FencedError`` if the lease was superseded, ``StalePassError`` if the
    partition is not at the lease's pass any more. A step resent after a lost reply is
    recognised and returns the same pass.
    """
    rid = lease.request_id
    key = core.keys.partition(rid, lease.partition)
    metadata, wgs = core.encode_step(rid, key, step.metadata, step.worker_graph_ids)
    conns: tuple[str, ...] = ()
    if step.done:  # a partition that finishes marks its outgoing streams done
        conns = (yield from core.topology(rid)).outgoing(lease.partition)
    done = "1" if step.done else "0"
    reply = yield from _step(core, lease, metadata, done, check_in, wgs, conns, sent=True)
    if reply[0] == b"OK":
        core.instruments.count("passes")
    return int(reply[1])


def release_lease(
    core: Core, lease: Lease, *, check_in: float | None = None, sent: bool = True
) -> Op[None]:
    """End the lease without advancing: the current pass was sent (again), or the step is
    handed over. Recovery looks at the partition again in ``check_in`` seconds if no report
    moves it on (``0``: at once, so another replica takes it over now; ``None``: never, the
    partition is done). ``sent=False``: the pass was not sent (a hand-over, a pass that
    cannot run yet), so ``Lease.sends`` / ``.sent_at`` keep saying when it last was.
    Raises ``FencedError`` if the lease was superseded.
    """
    yield from _step(core, lease, "", "0", check_in, [], (), sent=sent)


def _step(
    core: Core,
    lease: Lease,
    metadata: bytes | str,
    done: str,
    check_in: float | None,
    wgs: Sequence[str],
    conns: Sequence[str],
    *,
    sent: bool,
) -> Op[list[Any]]:
    rid, name = lease.request_id, lease.partition
    keys = core.keys
    script_keys = [
        keys.partition(rid, name), keys.lease(rid), keys.history(rid), core.index_key(rid)
    ]  # fmt: skip
    if conns:
        script_keys += [keys.connection(rid, c) for c in conns]
    check = check_in_arg(check_in, rid)
    args = [
        VERSION, lease.pass_number, name, lease.token, lease.holder, metadata, done, check,
        core.history_cap, "1" if sent else "0", *wgs,
    ]  # fmt: skip
    reply: list[Any] = yield from core.run(
        rid, "step", script_keys, args, PartitionNotFound, lease,
        alongside=step_hint(core, rid, name, check),
    )  # fmt: skip
    if reply[0] == b"STALE":
        current = stored_int(
            reply[1], domains.PASS, request_id=rid, key=script_keys[0], field="fwd_pass_number"
        )
        raise StalePassError(lease.pass_number, current, request_id=rid, key=script_keys[0])
    if reply[0] == b"OK":  # not a resend recognised: a later lease may own the entry now
        yield from index_after_step(core, rid, name, check)
    return reply


def take_steps(
    core: Core, steps: Sequence[tuple[Lease, Step, float | None]]
) -> Op[list[int | Any]]:
    """Many ``take_step`` calls at once (``(lease, step, check_in)`` each), pipelined
    (``store.ops.batch``); one entry per step, the new pass or the ``StoreError`` it met."""
    return (
        yield from gather(
            [take_step(core, lease, step, check_in=check_in) for lease, step, check_in in steps]
        )
    )


def renew_lease(core: Core, lease: Lease, ttl: float | None = None) -> Op[Lease]:
    """Extend a lease still held, ``ttl`` seconds from now (default: the store's lease
    TTL); raises ``FencedError`` if it was superseded."""
    seconds = core.lease_ttl if ttl is None else ttl
    domains.check_float(seconds, domains.DURATION, what="ttl", request_id=lease.request_id)
    rid = lease.request_id
    keys = [core.keys.lease(rid), core.index_key(rid)]
    args = [lease.partition, lease.token, seconds]
    # A live lease has a check time, hence an entry: move it, never make one (a refused
    # renewal must not leave one behind).
    alongside = (
        () if core.scripts_write_index
        else [earlier_hints(core, rid, [lease.partition], seconds, mode="XLT")]
    )  # fmt: skip
    reply = yield from core.run(
        rid, "renew_lease", keys, args, PartitionNotFound, lease, alongside=alongside
    )
    with reading(request_id=rid, key=keys[0]):
        expires = float(reply[1])
    return Lease(
        rid, lease.partition, lease.holder, lease.token, lease.pass_number, expires,
        sends=lease.sends, sent_at=lease.sent_at,
    )  # fmt: skip


def schedule_check(core: Core, request_id: str, partition_name: str, in_seconds: float) -> Op[None]:
    """Have recovery look at the partition ``in_seconds`` from now (server clock) at the
    latest, unless something moves it on first; a later time already set is brought
    forward, an earlier one kept."""
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    domains.check_float(in_seconds, domains.DURATION, what="in_seconds", request_id=rid)
    yield from schedule(core, rid, name, in_seconds, mode="LT")


def due_steps(core: Core, *, limit: int = 100) -> Op[list[tuple[str, str]]]:
    """(request id, partition) pairs whose look is due by the server's clock, oldest first.

    Costs O(log n + returned), read from the recovery index; never a SCAN. A pair may be
    returned when its step is not due after all (the index is a hint): ``claim_step`` says.
    """
    domains.check_int(limit, domains.LIMIT, what="limit")
    index = core.keys.deadlines
    where: dict[str, str | None] = {"key": index}
    reply = yield from core.script("due_steps", [index], [limit], where)
    out = []
    for member in reply[0][1::2]:
        try:
            rid, _, name = member.decode().partition(" ")
        except UnicodeDecodeError:
            continue  # not a member the store writes; nothing to recover
        out.append((rid, name))
    return out


def leases(core: Core, request_id: str) -> Op[dict[str, Lease]]:
    """The live and lapsed leases held on the request's partitions, by partition."""
    rid = validate_request_id(request_id)
    key = core.keys.lease(rid)
    (raw,) = yield from core.send(key, [("HGETALL", key)], {"request_id": rid})
    return decode_leases(hash_reply(raw), rid, key)


# -- the recovery index -------------------------------------------------------------------


def check_in_arg(check_in: float | None, rid: str) -> str | float:
    """``check_in`` as the scripts take it: seconds, or '' for never."""
    if check_in is None:
        return ""
    domains.check_float(check_in, domains.DURATION, what="check_in", request_id=rid)
    return check_in


def step_hint(core: Core, rid: str, partition: str, check: str | float) -> list[ScriptCall]:
    """What goes alongside a step on a cluster: an only-ever-earlier entry at its check
    time (see the module docstring); nothing on one server, where the script writes it."""
    if core.scripts_write_index or check == "":
        return []
    return [earlier_hints(core, rid, [partition], float(check))]


def report_hint(
    core: Core, rid: str, partition: str, holder: str, step_check: str | float | None
) -> list[ScriptCall]:
    """What goes alongside a report on a cluster: the lease it may grant ``holder`` ends
    ``lease_ttl`` from now at the latest, and the step it may take sets ``step_check``.
    Only an existing entry is moved (most reports complete nothing): a partition without
    one gets it after the report, if it granted a lease (``index_after_report``)."""
    if core.scripts_write_index or not holder:
        return []
    at = core.lease_ttl
    if step_check not in (None, ""):
        at = min(at, float(step_check))
    return [earlier_hints(core, rid, [partition], at, mode="XLT")]


def index_after_report(
    core: Core, rid: str, partition: str, reply: list[Any], step_check: str | float | None
) -> Op[None]:
    """On a cluster, after a report that granted a lease: the entry of a partition that had
    no check time before (the alongside write moved only existing ones), at the lease's
    expiry or at the check time of the step taken with it; and none once a step taken
    with it left nothing to check."""
    if core.scripts_write_index or reply[0] != b"OK" or not int(reply[4]):
        return
    if int(reply[6]):  # stepped
        if step_check in (None, ""):
            yield from index_after_step(core, rid, partition, "")
        elif not int(reply[11]):
            at = float(reply[8]) + float(step_check)
            yield from after_applied(core, rid, schedule_at(core, rid, partition, at))
    elif not int(reply[11]):
        yield from after_applied(core, rid, schedule_at(core, rid, partition, float(reply[5])))


def after_applied(core: Core, rid: str, write: Op[None]) -> Op[None]:
    """An index write that follows an operation which applied: losing it must not hide the
    outcome from the caller. An entry left behind costs one early look; one missing until
    the partition's next step (whose write goes alongside it) is what a lost write costs,
    and only on a cluster."""
    try:
        yield from write
    except StoreConnectionError as e:
        log.warning(
            "recovery index of request %s not updated (%s): %s", rid, core.keys.deadlines, e
        )


def index_after_step(core: Core, rid: str, partition: str, check: str | float) -> Op[None]:
    """On a cluster, after a step that applied: a partition with nothing left to check
    leaves the index (an entry left behind by a crash only costs one early look)."""
    if check == "" and not core.scripts_write_index:
        yield from after_applied(core, rid, unschedule(core, rid, [partition]))


def schedule(core: Core, rid: str, partition: str, in_seconds: float, *, mode: str) -> Op[None]:
    call = _hint_call(core, mode, in_seconds, [deadline_member(rid, partition)])
    yield from core.script(call.name, call.keys, call.args, {"request_id": rid})


def schedule_at(core: Core, rid: str, partition: str, at: float) -> Op[None]:
    """The partition's entry at ``at`` (server seconds)."""
    yield from schedule(core, rid, partition, at, mode="AT")


def unschedule(core: Core, rid: str, partitions: Sequence[str]) -> Op[None]:
    members = [deadline_member(rid, p) for p in partitions]
    if members:
        call = _hint_call(core, "REM", 0, members)
        yield from core.script(call.name, call.keys, call.args, {"request_id": rid})


def earlier_hints(
    core: Core, rid: str, partitions: Sequence[str], in_seconds: float, *, mode: str = "LT"
) -> ScriptCall:
    """Entries ``in_seconds`` from now, or earlier where they are already (``mode="XLT"``:
    only entries that exist). Sent alongside the script that sets the check time, the write
    may run a little after it, by another node's clock: it aims ``CLUSTER_INDEX_LEAD``
    earlier, so that it still lands before the check time."""
    members = [deadline_member(rid, p) for p in partitions]
    return _hint_call(core, mode, in_seconds - CLUSTER_INDEX_LEAD, members)


def _hint_call(core: Core, mode: str, in_seconds: float, members: list[str]) -> ScriptCall:
    return ScriptCall("hint", [core.keys.deadlines], [mode, in_seconds, *members])
