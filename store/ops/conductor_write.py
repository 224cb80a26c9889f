"""The one way an operation on a request held as the engine's Conductor keeps it writes:
read the request (or take this client's latest version of it, ``StoredCache``), apply a
change in the client, and commit the fields that changed with ``conductor_write.lua``:
whole or not at all, only onto the version read (else read again and redo), fenced by the
lease, once per op id (a retry returns the first outcomes), with a line in its history."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from store.conductor import layout
from store.conductor.layout import FORMAT, RECENT_OPS, Early, Stored
from store.conductor.record import ConductorRequest
from store.errors import (
    RequestNotFound,
    SchemaVersionError,
    TransactionConflictError,
    ValidationError,
)
from store.ops.calls import hash_reply
from store.ops.core import Core
from store.ops.effects import Op
from store.records import Lease

DRAIN_TTL = 120.0
"""Seconds a teardown barrier, or an abort or READS_DONE that came before its request,
waits (the engine's ``MSTAR_DRAIN_TTL_S`` default)."""
_STATE_FIELDS = ("head", "order", "early", "state")
KEPT = str(RECENT_OPS)


@dataclass
class Commit:
    """What a change leaves: the request (None: no request is held), else an early record
    or nothing at all (``gone``); the outcomes; the index entry to add or remove."""

    outcomes: list[Any]
    request: ConductorRequest | None = None
    early: Early | None = None
    gone: bool = False
    index: str | None = None  # "add" | "remove"
    unchanged: bool = False  # nothing to write: the outcomes only


Change = Callable[[Stored], Commit | None]  # None: nothing to write; the outcome is in it


def read(core: Core, rid: str) -> Op[Stored]:
    key = core.keys.conductor(rid)
    (flat,) = yield from core.send(key, [("HGETALL", key)], {"request_id": rid, "key": key})
    raw, results = layout.split_results(
        {name.decode(errors="replace"): value for name, value in hash_reply(flat).items()}
    )
    return layout.decode_stored(core.codec, rid, key, raw, results=results)


def apply(
    core: Core,
    rid: str,
    op_id: str | None,
    lease: Lease | None,
    change: Change,
    *,
    early_ttl: float = DRAIN_TTL,
    label: str = "conductor",
    decode: bool = True,
) -> Op[list[Any]]:
    """Apply ``change`` to the latest version of the request and commit it (see above);
    ``label`` says what it did in the request's history; ``decode=False``: the change does
    not read the request held (a whole request written as it is), so the version this
    client wrote last is not decoded again."""
    op_id = op_id or core.new_op_id()
    if not isinstance(op_id, str) or not op_id or len(op_id) > 200 or "\n" in op_id:
        raise ValidationError(
            "op_id must be a text of 1..200 characters on one line", request_id=rid
        )
    key, cache = core.keys.conductor(rid), core.conductor_records
    where: dict[str, str | None] = {"request_id": rid, "key": key}
    try:
        for _ in range(core.retry.max_attempts):
            held = cache.get(rid)
            if held is None:
                stored = yield from read(core, rid)
            else:  # decoded afresh: the change works on objects of its own
                stored = layout.decode_stored(
                    core.codec, rid, key, held.raw, request=decode, results=held.results
                )
            done = stored.results.get(op_id)
            if done is not None:
                return layout.decode_result(core.codec, done, **where)
            write = change(stored)
            if write is None:
                return []
            if write.unchanged:
                return write.outcomes
            fields = encoded_fields(core, write, early_ttl)
            result = layout.encode_result(core.codec, write.outcomes)
            doomed = [
                name
                for name in stored.raw
                if name not in fields and (name in _STATE_FIELDS or name[:2] in ("p:", "c:"))
            ]
            changed = [(n, v) for n, v in fields.items() if stored.raw.get(n) != v]
            expiry = expiry_of(core, stored, write, early_ttl)
            args: list[Any] = [
                FORMAT, *(fence(lease)), op_id, str(stored.version), result, KEPT, expiry,
                label, core.history_cap, str(len(doomed)), *doomed,
                *(x for pair in changed for x in pair),
            ]  # fmt: skip
            keys = [key, core.keys.lease(rid), core.keys.history(rid)]
            reply = yield from core.run(rid, "conductor_write", keys, args, RequestNotFound, lease)
            status = reply[0]
            if status == b"OK":
                raw = {n: v for n, v in stored.raw.items() if n not in doomed}
                raw.update(fields)
                raw["ver"] = reply[1]
                results = dict(stored.results)  # the latest, as the script keeps them
                results[op_id] = result
                while len(results) > RECENT_OPS:
                    del results[next(iter(results))]
                cache.put(rid, Stored(version=int(reply[1]), raw=raw, results=results))
                yield from index(core, rid, write)
                return write.outcomes
            cache.drop(rid)
            if status == b"DONE":
                return layout.decode_result(core.codec, reply[1], **where)
            if status == b"FORMAT":
                raise SchemaVersionError(int(reply[1]), int(FORMAT), **where)
            # STALE: another writer moved the request on; read it and redo the change
        raise TransactionConflictError(core.retry.max_attempts, **where)
    except BaseException:
        cache.drop(rid)  # whether it was written is unknown: read it next time
        raise


def encoded_fields(core: Core, write: Commit, early_ttl: float) -> dict[str, bytes]:
    if write.request is not None:
        return layout.encode_request(
            core.codec, core.keys.conductor(write.request.request_id), write.request
        )
    if write.early is not None:
        return {"early": layout.encode_early(write.early)}
    return {"state": b"gone"}


def expiry_of(core: Core, stored: Stored, write: Commit, early_ttl: float) -> str:
    """An early record lives ``early_ttl``; a torn-down one keeps its results for the
    dedupe window; a held request does not expire."""
    if write.request is not None:
        return "" if stored.holds_request else "persist"
    if write.early is not None:
        return str(max(1, int(early_ttl * 1000)))
    return "" if stored.gone else str(max(1, int(core.dedupe_window * 1000)))


def fence(lease: Lease | None) -> tuple[str, str]:
    if lease is None:
        return "*", ""
    return lease.partition, str(lease.token)


def index(core: Core, rid: str, write: Commit) -> Op[None]:
    if write.index is None:
        return
    key = core.keys.conductor_index
    if write.index == "add":
        request = write.request
        assert request is not None
        command: tuple[Any, ...] = ("ZADD", key, "NX", repr(request.conductor_ingest_time), rid)
    else:
        command = ("ZREM", key, rid)
    yield from core.send(key, [command], {"request_id": rid, "key": key})
