"""``merge_publish_info``: server-side for the kinds the server can merge, else optimistic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from store.codec.published import MergedInfos, check_label
from store.errors import (
    PartitionNotFound,
    RequestNotFound,
    TransactionConflictError,
    ValidationError,
)
from store.keys import validate_name, validate_request_id
from store.ops.args import pairs
from store.ops.calls import hash_reply
from store.ops.core import VERSION, Core, window
from store.ops.effects import Command, Op
from store.ops.transaction import Outcome, Plan, optimistic
from store.schema import VERSION_FIELD
from store.types import PublishedInfo
from store.upgrade import RecordOutdated, upgrade_stored

# An optimistic merge that lost this many rounds queues for the partition's claim, which
# makes server-side merges wait (CLAIM_MS at most). A waiter that has not asked for its
# turn in QUEUE_LAPSE_MS (its task was cancelled, its process died) loses its place.
CLAIM_AFTER = 4
CLAIM_MS = 200
QUEUE_LAPSE_MS = 1000


def merge_publish_info(
    core: Core,
    request_id: str,
    partition_name: str,
    other: Mapping[str, PublishedInfo],
    *,
    op_id: str | None = None,
    returning: bool = True,
) -> Op[Mapping[str, PublishedInfo]]:
    """``merge_publish_info`` on the stored partition, applied once, all labels or none.

    KV and position infos (exactly those types) are merged by the server in one script:
    no WATCH, no retry, however many replicas merge at once (see store/codec/published.py).
    Any other kind runs as an optimistic transaction: WATCH the publish-info hash (and
    the request's meta, so a deleted request is not written to), read it, fold ``other``
    in with each kind's own ``update``, write in MULTI/EXEC, retried with jittered
    backoff on conflict. Returns the merged infos of the labels in ``other``, as stored
    right after this merge (a server-side merge decodes them on first access);
    ``returning=False`` skips reading them back and returns an empty mapping.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    keys = core.keys
    pub = keys.publish_info(rid, name)
    labels = sorted(other)
    if not labels:
        return {}
    for label in labels:
        check_label(label, request_id=rid, key=pub)
        info = other[label]
        if core.codec.registry.name_of(type(info)) is None:  # fail before any round trip
            core.codec.encode_kind(info, request_id=rid, key=pub, field=label)
    op = f"merge:{op_id or core.new_op_id()}"
    server = core.published.server_merge(other, request_id=rid, key=pub)
    if server is not None:
        reads: list[Command] = [("HGETALL", pub)] if returning else []
        merge_keys = [
            keys.partition(rid, name), pub, keys.ops(rid), keys.merging(rid, name),
            keys.history(rid),
        ]  # fmt: skip
        args = [VERSION, op, core.dedupe_window, core.history_cap, name, *server]
        waiting = core.busy_waiting(pub, request_id=rid)
        while True:
            reply, *read = yield from core.run(
                rid, "merge_parts", merge_keys, args, PartitionNotFound, reads=reads
            )
            if reply[0] != b"BUSY":
                break
            yield from waiting.pause(reply)  # an optimistic merge holds the partition
        if reply[0] == b"DUP":
            core.instruments.count("duplicates")
        if reply[0] != b"KIND":
            core.stats.server_merges += 1
            if not returning:
                return {}
            wanted = {label.encode() for label in labels}
            fields = {
                f: v for f, v in hash_reply(read[0]).items() if f.partition(b"[")[0] in wanted
            }
            decode = core.published.decode
            return MergedInfos(lambda: decode(fields, request_id=rid, key=pub))
        # A label holds another kind, or this kind stored whole: the kind's own update
        # decides, in the optimistic path.
    merged = yield from _merge_optimistic(core, rid, name, other, labels, op)
    return merged if returning else {}


def _merge_optimistic(
    core: Core,
    rid: str,
    name: str,
    other: Mapping[str, PublishedInfo],
    labels: list[str],
    op: str,
) -> Op[dict[str, PublishedInfo]]:
    keys = core.keys
    meta, part = keys.meta(rid), keys.partition(rid, name)
    pub, ops = keys.publish_info(rid, name), keys.ops(rid)
    claim, queue, token = keys.merging(rid, name), keys.merging_queue(rid, name), core.new_op_id()
    own_claim = token.encode()
    queued = False  # lost enough rounds to commit only while holding the claim
    seen_claim: bytes | None = None  # the claim as the last read saw it
    now, window_seconds = window(core)
    where = {"request_id": rid, "key": pub}

    def on_retry(failed: int) -> Op[None]:
        # Server-side merges commit far faster than a read-merge-write round, and many
        # optimistic merges on one partition keep invalidating each other: after a few
        # lost rounds, a merge queues for the partition's claim (held for at most CLAIM_MS)
        # and commits only while it holds it. While it is held, server-side merges and
        # the other optimistic merges step aside; the queue hands the claim to the
        # starved merges in the order they queued, so none waits behind luckier ones.
        nonlocal queued
        if failed >= CLAIM_AFTER and seen_claim != own_claim:
            queued = True
            yield from core.script("merge_claim", [claim, queue], [*claim_args, "TAKE"], where)

    reads: list[Command] = [
        ("HGETALL", pub),
        ("HGET", part, VERSION_FIELD),
        ("EXISTS", meta),
        ("ZSCORE", ops, op),
        ("GET", claim),
    ]

    def body(replies: list[Any]) -> Plan[dict[str, PublishedInfo]]:
        nonlocal seen_claim
        flat, version, request_held, seen, claimer = replies
        seen_claim = claimer
        if version is None:
            if not request_held:
                raise RequestNotFound("no such request", request_id=rid)
            raise PartitionNotFound(f"no partition {name!r}", request_id=rid, key=part)
        core.check_version(rid, part, version)
        held_fields = hash_reply(flat)
        merged = core.published.decode(held_fields, labels, request_id=rid, key=pub)
        if seen is not None:  # this very merge committed before a lost reply
            return Plan([], merged)
        if claimer != own_claim and (claimer is not None or queued):
            # another merge holds the claim, or this one waits for its turn
            return Plan(step_aside=True, waiting_for=claimer)
        for label in labels:
            held_info = merged.get(label)
            if held_info is None:
                merged[label] = other[label]
                continue
            if type(other[label]) is not type(held_info):  # the engine's update assumes its kind
                raise ValidationError(
                    f"cannot merge: a {type(other[label]).__name__} into the "
                    f"{type(held_info).__name__} held",
                    request_id=rid,
                    key=pub,
                    field=label,
                )
            try:
                held_info.update(other[label])
            except (TypeError, ValueError) as e:
                raise ValidationError(
                    f"cannot merge: {e}", request_id=rid, key=pub, field=label
                ) from e
        fields: dict[str, bytes] = {}
        for label in labels:
            fields.update(core.published.encode(label, merged[label], request_id=rid, key=pub))
        # A label stored whole now that was stored in parts before loses its parts.
        wanted = {label.encode() for label in labels}
        written = {f.encode("utf-8", "surrogateescape") for f in fields}
        stale = [f for f in held_fields if f.partition(b"[")[0] in wanted and f not in written]
        writes: list[Command] = [("HSET", pub, *pairs(fields))]
        if stale:
            writes.append(("HDEL", pub, *stale))
        writes += [
            ("ZADD", ops, now, op),
            ("ZREMRANGEBYSCORE", ops, "-inf", now - window_seconds),
        ]
        return Plan(writes, merged)

    claim_args = [token, CLAIM_MS, QUEUE_LAPSE_MS]

    def leave() -> Op[None]:  # out of the queue, and the claim freed if this merge holds it
        yield from core.script("merge_claim", [claim, queue], [*claim_args, "LEAVE"], where)

    def run() -> Op[Outcome[dict[str, PublishedInfo]]]:
        return optimistic(
            [pub, meta], reads, body, core.retry, where, on_retry, core.reconnect, core.durability
        )

    try:
        try:
            outcome = yield from run()
        except RecordOutdated:  # the body wrote nothing: upgrade the partition, merge again
            yield from upgrade_stored(keys, rid, [part], core.retry, reconnect=core.reconnect)
            outcome = yield from run()
    except TransactionConflictError:
        core.instruments.count("conflicts")
        if queued:
            yield from leave()
        raise
    except GeneratorExit:  # abandoned by its driver (a cancelled task): the claim lapses
        raise
    except BaseException:
        if queued:
            yield from leave()
        raise
    if queued:  # let the next in turn and server-side merges go on
        yield from leave()
    core.stats.transactions += 1
    core.stats.attempts += outcome.attempts
    if outcome.attempts > 1:
        core.instruments.count("retries", outcome.attempts - 1)
    assert outcome.result is not None
    return outcome.result
