"""Replica liveness: one heartbeat costs one ZADD per replica, whatever it drives.

A replica beats every few seconds into ``<ns>:replicas`` (replica id -> last beat). Recovery
does not need it (a dead driver's leases simply run out); operators and ``mstar-store
replicas`` read it to see who is alive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH
from store.ops.core import Core
from store.ops.effects import Command, Op, Send


def heartbeat(
    core: Core, replica_id: str, *, now: float | None = None, stats: Sequence[Command] = ()
) -> Op[None]:
    """Record that the replica is alive; ``stats`` (``store.stats.flush_commands``) go in
    the same round trip, grouped by key so that each key's commands stay in order on the
    server that owns it (the keys may sit in different cluster slots)."""
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
        raise ValidationError(f"replica id must be a str of 1 to {MAX_NAME_LENGTH} chars")
    key = core.keys.replicas
    beat: Command = ("ZADD", key, now or time.time(), replica_id)
    if not stats:
        yield from core.send(key, [beat], {})
        return
    by_key: dict[str, list[Command]] = {key: [beat]}
    for command in stats:
        by_key.setdefault(str(command[1]), []).append(command)
    yield from core.send_all([Send(k, commands) for k, commands in by_key.items()], {})


def last_beats(core: Core) -> Op[dict[str, float]]:
    """Every replica seen, with the time of its last heartbeat, most recent first."""
    key = core.keys.replicas
    (flat,) = yield from core.send(key, [("ZREVRANGE", key, 0, -1, "WITHSCORES")], {})
    if flat and isinstance(flat[0], list):  # RESP3 pairs
        return {rid.decode(): float(score) for rid, score in flat}
    return {rid.decode(): float(score) for rid, score in zip(flat[::2], flat[1::2], strict=True)}


def live(core: Core, *, within: float, now: float | None = None) -> Op[list[str]]:
    """Replicas that beat in the last ``within`` seconds."""
    key = core.keys.replicas
    since = (now or time.time()) - within
    (ids,) = yield from core.send(key, [("ZRANGEBYSCORE", key, since, "+inf")], {})
    return [rid.decode() for rid in ids]


def forget(core: Core, replica_id: str) -> Op[None]:
    """Remove a replica that stopped cleanly."""
    key = core.keys.replicas
    yield from core.send(key, [("ZREM", key, replica_id)], {})


def prune(core: Core, *, older_than: float, now: float | None = None) -> Op[int]:
    """Forget replicas silent for ``older_than`` seconds; returns how many."""
    key = core.keys.replicas
    cutoff = (now or time.time()) - older_than
    (removed,) = yield from core.send(key, [("ZREMRANGEBYSCORE", key, "-inf", f"({cutoff}")], {})
    return int(removed)
