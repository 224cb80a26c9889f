"""Replica liveness: one heartbeat costs one ZADD per replica, whatever it drives.

A replica beats every few seconds into ``<ns>:replicas`` (replica id -> last beat). Recovery
does not need it (a dead driver's leases simply run out); operators and ``mstar-store
replicas`` read it to see who is alive.
"""

from __future__ import annotations

import time
from typing import Any

from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH, KeySpace


class ReplicaRegistry:
    """Heartbeats of the conductor replicas of one namespace."""

    def __init__(self, client: Any, *, namespace: str = "mstar") -> None:
        self.client = client
        self.key = KeySpace(namespace).replicas

    def heartbeat(self, replica_id: str, *, now: float | None = None) -> None:
        if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
            raise ValidationError(f"replica id must be a str of 1 to {MAX_NAME_LENGTH} chars")
        self.client.zadd(self.key, {replica_id: now or time.time()})

    def last_beats(self) -> dict[str, float]:
        """Every replica seen, with the time of its last heartbeat, most recent first."""
        pairs = self.client.zrevrange(self.key, 0, -1, withscores=True)
        return {rid.decode(): score for rid, score in pairs}

    def live(self, *, within: float, now: float | None = None) -> list[str]:
        """Replicas that beat in the last ``within`` seconds."""
        since = (now or time.time()) - within
        return [rid.decode() for rid in self.client.zrangebyscore(self.key, since, "+inf")]

    def forget(self, replica_id: str) -> None:
        """Remove a replica that stopped cleanly."""
        self.client.zrem(self.key, replica_id)

    def prune(self, *, older_than: float, now: float | None = None) -> int:
        """Forget replicas silent for ``older_than`` seconds; returns how many."""
        cutoff = (now or time.time()) - older_than
        return int(self.client.zremrangebyscore(self.key, "-inf", f"({cutoff}"))
