"""Replica liveness: one heartbeat costs one call per replica, whatever it drives.

A replica beats every few seconds into ``<ns>:replicas`` (replica id -> last beat, by the
Redis server's clock, so replicas whose clocks disagree still agree on who is silent).
Recovery does not need it (a dead driver's leases simply run out); operators and
``mstar-store replicas`` / ``top`` read it to see who is alive. An explicit ``now=`` (a time
of the caller's choosing, for tests and tools) replaces the server's clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from store.codec import domains
from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH
from store.ops.calls import ScriptCall
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
    if now is not None:
        domains.check_float(now, domains.TIME, what="now")
        beat: Command = ("ZADD", key, now, replica_id)
    else:  # by the server's clock
        beat = ScriptCall("replicas", [key], ["beat", replica_id]).command(core.scripts)
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
    domains.check_float(within, domains.DURATION, what="within")
    key = core.keys.replicas
    if now is not None:
        (ids,) = yield from core.send(key, [("ZRANGEBYSCORE", key, now - within, "+inf")], {})
    else:
        (ids,) = yield from core.script("replicas", [key], ["live", within], {})
    return [rid.decode() for rid in ids]


def forget(core: Core, replica_id: str) -> Op[None]:
    """Remove a replica that stopped cleanly."""
    key = core.keys.replicas
    yield from core.send(key, [("ZREM", key, replica_id)], {})


def prune(core: Core, *, older_than: float, now: float | None = None) -> Op[int]:
    """Forget replicas silent for ``older_than`` seconds; returns how many."""
    domains.check_float(older_than, domains.DURATION, what="older_than")
    key = core.keys.replicas
    if now is not None:
        cutoff = now - older_than
        (removed,) = yield from core.send(
            key, [("ZREMRANGEBYSCORE", key, "-inf", f"({cutoff}")], {}
        )
    else:
        (removed,) = yield from core.script("replicas", [key], ["prune", older_than], {})
    return int(removed)
