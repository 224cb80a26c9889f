"""What ``check_server`` finds, and how a server's settings are judged: pure, no I/O.

A finding is one line for an operator: which check, how bad, and what to do. ``fatal``
means the store cannot keep its guarantees on that server (an evicting Redis drops keys
and with them requests, index entries and the op ids that stop a resend being applied
twice); ``warning`` means a weaker guarantee the operator should know of.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "warning", "fatal"]
LEVELS: tuple[Level, ...] = ("ok", "warning", "fatal")
SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``check`` (e.g. ``eviction``), ``level``, a one-line message."""

    check: str
    level: Level
    message: str

    def line(self) -> str:
        return f"{self.level:<7} {self.check:<11} {self.message}"


def worst(findings: list[Finding]) -> Level:
    return max((f.level for f in findings), key=LEVELS.index, default="ok")


@dataclass(frozen=True)
class ServerSettings:
    """What one server says of itself; None where it would not say (CONFIG or INFO
    refused, as on managed services and fakeredis)."""

    node: str
    version: str | None = None
    mode: str | None = None  # INFO's redis_mode: standalone, cluster, sentinel
    policy: str | None = None  # maxmemory-policy
    aof: bool | None = None
    appendfsync: str | None = None
    rdb_saves: bool | None = None  # a `save` schedule is set

    @classmethod
    def parse(cls, node: str, info: Mapping[str, str], config: Mapping[str, str]) -> ServerSettings:
        policy = config.get("maxmemory-policy") or info.get("maxmemory_policy")
        aof = config.get("appendonly") or info.get("aof_enabled")
        save = config.get("save")
        return cls(
            node=node,
            version=info.get("redis_version"),
            mode=info.get("redis_mode"),
            policy=policy or None,
            aof=None if aof is None else aof in ("yes", "1"),
            appendfsync=config.get("appendfsync") or None,
            rdb_saves=None if save is None else bool(save.strip()),
        )


def eviction(settings: ServerSettings) -> Finding:
    where = settings.node
    if settings.policy is None:
        return Finding(
            "eviction", "warning",
            f"{where}: cannot read maxmemory-policy (CONFIG GET and INFO memory refused); "
            f"make sure it is {SAFE_POLICY}",
        )  # fmt: skip
    if settings.policy != SAFE_POLICY:
        return Finding(
            "eviction", "fatal",
            f"{where}: maxmemory-policy is {settings.policy}: Redis may evict the store's "
            f"keys under memory pressure (requests vanish, resends apply twice); run "
            f"CONFIG SET maxmemory-policy {SAFE_POLICY} (and set it in redis.conf)",
        )  # fmt: skip
    return Finding("eviction", "ok", f"{where}: maxmemory-policy {SAFE_POLICY}")


def persistence(settings: ServerSettings) -> Finding:
    where = settings.node
    if settings.aof is None:
        return Finding("persistence", "warning", f"{where}: cannot read whether AOF is on")
    if not settings.aof:
        lost = (
            "everything written since the last RDB snapshot"
            if settings.rdb_saves is not False
            else "everything (no AOF, no RDB snapshots)"
        )
        return Finding(
            "persistence", "warning",
            f"{where}: appendonly no: a crash or restart of Redis loses {lost}; "
            "run with appendonly yes",
        )  # fmt: skip
    fsync = settings.appendfsync or "unknown (CONFIG GET refused)"
    loses = {"always": "nothing acknowledged", "everysec": "up to a second of writes"}
    cost = loses.get(settings.appendfsync or "", "what the OS had not flushed")
    message = f"{where}: appendonly yes, appendfsync {fsync}: a machine crash loses {cost}"
    return Finding("persistence", "ok", message)


def version(settings: ServerSettings, deployment: str) -> Finding:
    """The server's version and how it is deployed; Redis before 7 is a warning (the
    store is tested on 7, and its ACL check needs 7)."""
    where = settings.node
    mode = {"cluster": "Redis Cluster", "sentinel": "Sentinel-managed master"}.get(
        deployment, "standalone"
    )
    if settings.version is None:
        return Finding("server", "warning", f"{where}: {mode}, version unknown (INFO refused)")
    major = settings.version.split(".")[0]
    level: Level = "ok" if major.isdigit() and int(major) >= 7 else "warning"
    note = "" if level == "ok" else " (the store is tested on Redis >= 7)"
    return Finding("server", level, f"{where}: Redis {settings.version}, {mode}{note}")


def slot_coverage(ranges: list[tuple[int, int]], masters: int) -> Finding:
    """A cluster's CLUSTER SLOTS ranges: every one of the 16384 slots must be served."""
    covered = sum(end - start + 1 for start, end in ranges)
    if covered < 16384:
        return Finding(
            "cluster", "fatal",
            f"{16384 - covered} of 16384 slots are not served: the requests in them "
            "cannot be read or written; fix the cluster (redis-cli --cluster fix)",
        )  # fmt: skip
    return Finding("cluster", "ok", f"all 16384 slots served by {masters} masters")
