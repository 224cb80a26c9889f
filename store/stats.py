"""Namespace statistics in Redis, for ``mstar-store top``: written with heartbeats, bounded.

On a cluster a script cannot write a namespace-wide key from the slot of a request's keys,
so the store's scripts count nothing namespace-wide. Each replica counts in process
(``store.observe.Instruments.totals()``) and flushes with every heartbeat, in the same
pipeline as its ``ZADD <ns>:replicas``:

    <ns>:replica:<replica_id>   hash: the replica's cumulative counters (every name of
                                ``COUNTERS``), ``leases`` held now, ``requests`` in flight on
                                it, ``at`` (time of the flush); expires ``EXPIRY_BEATS``
                                heartbeats after the last flush
    <ns>:stats:<epoch minute>   hash: counter -> events in that minute, the HINCRBY of each
                                replica's deltas since its previous flush; expires
                                ``BUCKET_TTL`` seconds after its last write

A flush is at most four commands per replica, whatever it drives; ``top`` reads two buckets,
three sorted-set counts and one hash per live replica, never anything per request.

The counts are for people, not for correctness: a flush whose reply was lost and that is
sent again adds its deltas twice, and a replica killed between flushes loses what it had
not flushed. Everything here is pure (commands and replies as plain data); the caller sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH, KeySpace
from store.observe import COUNTERS
from store.ops.calls import hash_reply

# Every counter goes into the minute buckets; only those that changed are written.
BUCKET_FIELDS: tuple[str, ...] = tuple(COUNTERS)
BUCKET_TTL = 15 * 60
EXPIRY_BEATS = 3
SECONDS_PER_BUCKET = 60
LIVE_WITHIN = 5.0  # a replica that beat within this many seconds is alive

Command = tuple[str | int | float, ...]  # (name, *args), for ``execute_command(*command)``


def minute_of(t: float) -> int:
    """The epoch minute a time falls in: the suffix of its ``<ns>:stats:<minute>`` bucket."""
    return int(t // SECONDS_PER_BUCKET)


def flush_commands(
    keys: KeySpace,
    replica_id: str,
    totals: Mapping[str, int],
    flushed: Mapping[str, int],
    *,
    leases: int,
    requests: int,
    now: float,
    heartbeat_interval: float,
) -> list[Command]:
    """The commands that publish one replica's statistics at ``now``.

    ``totals`` are its cumulative counters now, ``flushed`` those of its last flush that
    succeeded (empty at start-up): keep ``flushed`` until the pipeline returns, so a failed
    flush folds into the next one instead of being lost.
    """
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
        raise ValidationError(f"replica id must be a str of 1 to {MAX_NAME_LENGTH} chars")
    if not heartbeat_interval > 0:
        raise ValidationError(f"heartbeat interval must be positive, not {heartbeat_interval}")
    deltas = {}
    for name in BUCKET_FIELDS:
        delta = totals.get(name, 0) - flushed.get(name, 0)
        if delta < 0:
            raise ValidationError(
                f"counter {name!r} went down from {flushed.get(name, 0)} to "
                f"{totals.get(name, 0)}: flush the totals of one Instruments object"
            )
        if delta:
            deltas[name] = delta
    replica_key = keys.replica_stats(replica_id)
    fields: list[str | int | float] = []
    for name in BUCKET_FIELDS:
        fields += [name, totals.get(name, 0)]
    fields += ["leases", leases, "requests", requests, "at", repr(now)]
    commands: list[Command] = [
        ("HSET", replica_key, *fields),
        ("PEXPIRE", replica_key, math.ceil(EXPIRY_BEATS * heartbeat_interval * 1000)),
    ]
    if deltas:
        bucket = keys.stats_bucket(minute_of(now))
        commands += [("HINCRBY", bucket, name, delta) for name, delta in deltas.items()]
        commands.append(("EXPIRE", bucket, BUCKET_TTL))
    return commands


# -- reading them back ------------------------------------------------------------------------


def parse_counts(raw: Mapping[bytes, bytes]) -> dict[str, int]:
    """Integer fields of a stats hash; a field that is not an integer is left out."""
    counts = {}
    for field, value in raw.items():
        try:
            counts[field.decode()] = int(value)
        except (UnicodeDecodeError, ValueError):
            continue
    return counts


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica last flushed; ``flushed_at`` is None when its hash is gone or bad."""

    replica_id: str
    last_beat: float
    counters: dict[str, int]
    leases: int | None
    requests: int | None
    flushed_at: float | None


def parse_replica(replica_id: str, last_beat: float, raw: Mapping[bytes, bytes]) -> ReplicaStats:
    counts = parse_counts(raw)
    try:
        flushed_at: float | None = float(raw[b"at"])
    except (KeyError, ValueError):
        flushed_at = None
    return ReplicaStats(
        replica_id=replica_id,
        last_beat=last_beat,
        counters={name: counts.get(name, 0) for name in COUNTERS},
        leases=counts.get("leases"),
        requests=counts.get("requests"),
        flushed_at=flushed_at,
    )


def last_minute(
    current: Mapping[str, int], previous: Mapping[str, int], now: float
) -> dict[str, float]:
    """Events in the 60 s before ``now``, estimated from two minute buckets.

    The current minute's bucket counts whole; of the previous minute's, the share that falls
    in the window, as if its events were spread evenly over that minute (the sliding-window
    estimate rate limiters use).
    """
    into_minute = (now % SECONDS_PER_BUCKET) / SECONDS_PER_BUCKET
    return {
        name: current.get(name, 0) + previous.get(name, 0) * (1.0 - into_minute)
        for name in BUCKET_FIELDS
    }


# -- a namespace at a glance (``top``, ``doctor``) ------------------------------------------


def overview_reads(keys: KeySpace, at: float, within: float) -> list[tuple[str, list[Command]]]:
    """The reads of ``Overview``, as (key, commands) pairs for one round trip: sorted-set
    counts and two minute buckets, nothing per request."""
    minute = minute_of(at)
    return [
        (keys.index, [("ZCARD", keys.index)]),
        (keys.deadlines, [
            ("ZCOUNT", keys.deadlines, "-inf", at),
            ("ZRANGE", keys.deadlines, 0, 0, "WITHSCORES"),
        ]),
        (keys.replicas, [
            ("ZREVRANGEBYSCORE", keys.replicas, "+inf", at - within, "WITHSCORES"),
            ("ZCARD", keys.replicas),
        ]),
        (keys.stats_bucket(minute), [("HGETALL", keys.stats_bucket(minute))]),
        (keys.stats_bucket(minute - 1), [("HGETALL", keys.stats_bucket(minute - 1))]),
    ]  # fmt: skip


@dataclass(frozen=True)
class Overview:
    """A namespace's requests, due steps and replicas at ``at``."""

    at: float
    in_flight: int
    steps_due: int
    oldest_due: float | None  # when the oldest due step fell due
    oldest_step: str | None  # which: "<request id> <partition>"
    live: list[tuple[str, float]]  # (replica id, last beat), most recent first
    registered: int  # replicas in the registry, live or silent
    current: dict[str, int]  # this minute's bucket
    previous: dict[str, int]  # the minute before's


def parse_overview(replies: Sequence[Sequence[Any]], at: float) -> Overview:
    """``Overview`` from the replies of ``overview_reads``, in order."""
    (in_flight,), (due, first_due), (beats, registered), (current,), (previous,) = replies
    firsts = scored(first_due)
    overdue = firsts[0] if firsts and firsts[0][1] <= at else None
    return Overview(
        at=at,
        in_flight=int(in_flight),
        steps_due=int(due),
        oldest_due=None if overdue is None else overdue[1],
        oldest_step=None if overdue is None else overdue[0].decode(errors="backslashreplace"),
        live=[(rid.decode(errors="backslashreplace"), beat) for rid, beat in scored(beats)],
        registered=int(registered),
        current=parse_counts(hash_reply(current)),
        previous=parse_counts(hash_reply(previous)),
    )


def scored(reply: list[Any]) -> list[tuple[bytes, float]]:
    """A WITHSCORES reply as (member, score) pairs: flat in RESP2, paired in RESP3."""
    if reply and isinstance(reply[0], list):
        return [(member, float(score)) for member, score in reply]
    return [(m, float(s)) for m, s in zip(reply[::2], reply[1::2], strict=True)]
