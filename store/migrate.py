"""Upgrade every record of a namespace to the current schema version, in place and live.

The records are found through the request index (O(requests), never a walk of the whole
keyspace), then through a SCAN for request metas missing from the index (left by a create
interrupted between its two writes, or by hand), which the report names. Each outdated
record is rewritten whole in its own optimistic transaction (``store.upgrade``), so:

- it is safe while conductors write: a record that changes under the rewrite aborts it and
  the rewrite starts again from what is now stored; a conductor that meets an old record
  upgrades it itself, with the same transaction;
- it is idempotent: a second run finds every record current and writes nothing;
- it is resumable: it keeps no state of its own, so a run stopped at any point leaves each
  record either old or upgraded, and the next run picks up whatever is still old.

A record that cannot be upgraded (garbled, or newer than this code) is reported by key and
skipped; the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from store.backoff import RetryPolicy
from store.errors import StoreConnectionError, StoreError, ValidationError
from store.keys import validate_request_id
from store.namespace import NamespaceReader
from store.ops.calls import Reconnect, hash_reply
from store.ops.effects import Command
from store.schema import SCHEMA_VERSION, VERSION_FIELD
from store.upgrade import parse_version, upgrade_stored


@dataclass
class MigrationReport:
    """Counts of records (meta, partition with its publish info, connection) of one run."""

    seen: int = 0
    upgraded: int = 0  # in a dry run: how many would be
    current: int = 0  # already at the current version (or upgraded meanwhile by a conductor)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    requests: int = 0
    unindexed: list[str] = field(default_factory=list)  # request ids found only by the SCAN
    dry_run: bool = False


Progress = Callable[[int, int, MigrationReport], None]
"""Called after each batch with (requests done, requests known so far, the counts so far)."""


def migrate_namespace(
    client: Any,
    namespace: str,
    *,
    batch: int = 500,
    dry_run: bool = False,
    progress: Progress | None = None,
    retry: RetryPolicy | None = None,
    reconnect: Reconnect | None = None,
) -> MigrationReport:
    """Upgrade every record of ``namespace`` to ``SCHEMA_VERSION``; see the module docstring.

    ``batch`` requests are read per round trip. ``dry_run`` reads and upgrades in memory
    only, so it reports what would be upgraded and what would fail, and writes nothing. An
    exception from ``progress`` stops the run (what was upgraded stays upgraded). Only an
    unreachable Redis ends the run early, with ``StoreConnectionError`` (after ``reconnect``
    ran out; every other failure is a ``StoreError`` too).
    """
    if batch < 1:
        raise ValidationError("batch must be at least 1")
    reader = NamespaceReader(client, namespace=namespace, reconnect=reconnect)
    policy = retry or RetryPolicy()
    report = MigrationReport(dry_run=dry_run)
    done: set[str] = set()
    total = reader.index_size(reader.keys.index)

    def run(ids: Iterator[str]) -> None:
        nonlocal total
        pending: list[str] = []
        for rid in ids:
            if rid in done:  # ZSCAN may return an id twice
                continue
            done.add(rid)
            pending.append(rid)
            if len(pending) >= batch:
                _migrate_batch(reader, pending, report, policy, dry_run)
                pending = []
                total = max(total, len(done))
                if progress:
                    progress(len(done), total, report)
        if pending:
            _migrate_batch(reader, pending, report, policy, dry_run)
            total = max(total, len(done))
            if progress:
                progress(len(done), total, report)

    run(_indexed(reader, batch))
    run(_unindexed(reader, batch, done, report))
    report.requests = len(done)
    return report


def _indexed(reader: NamespaceReader, batch: int) -> Iterator[str]:
    # ZSCAN, not ZRANGE by rank: requests deleted meanwhile would shift ranks and skip others.
    cursor = None
    while cursor != 0:
        cursor, members = reader.zset_page(reader.keys.index, cursor or 0, batch)
        for member in members:
            yield member.decode()


def _unindexed(
    reader: NamespaceReader, batch: int, done: set[str], report: MigrationReport
) -> Iterator[str]:
    keys = reader.keys
    prefix, suffix = f"{keys.namespace}:{{", "}:meta"
    match = f"{prefix}*{suffix}"  # a namespace holds no glob character (KeySpace checks)
    found: list[str] = []
    for node in reader.nodes():  # a cluster's keys are SCANned master by master
        cursor = None
        while cursor != 0:
            cursor, page = reader.key_page(node, cursor or 0, match, max(batch, 100))
            for key in page:
                rid = key.decode("utf-8", "replace")[len(prefix) : -len(suffix)]
                if rid not in done and _is_request_id(rid):
                    found.append(rid)
    if not found:
        return
    # Requests created during the run are in the index by now; only the others are strays.
    scores = reader.read_many([(keys.index, [("ZSCORE", keys.index, rid)]) for rid in found], {})
    for rid, (score,) in zip(found, scores, strict=True):
        if score is None:
            report.unindexed.append(rid)
        yield rid


def _is_request_id(rid: str) -> bool:
    try:
        validate_request_id(rid)
    except ValidationError:
        return False
    return True


def _migrate_batch(
    reader: NamespaceReader,
    rids: list[str],
    report: MigrationReport,
    policy: RetryPolicy,
    dry_run: bool,
) -> None:
    """Read the versions of every record of ``rids`` in two round trips; upgrade the old."""
    keys = reader.keys
    replies = reader.read_many(
        [(keys.meta(rid), [("HGETALL", keys.meta(rid))]) for rid in rids], {}
    )
    records: list[tuple[str, str]] = []  # (request id, record key), version read below
    for rid, (meta_reply,) in zip(rids, replies, strict=True):
        meta = hash_reply(meta_reply)
        if not meta:  # deleted meanwhile, or an index entry of an interrupted create
            continue
        records.append((rid, keys.meta(rid)))
        try:
            partitions, connections = _topology(meta)
        except ValueError as e:  # without the topology its other records cannot be found
            report.failed.append((keys.meta(rid), f"cannot read the request's topology: {e}"))
            report.seen += 1
            records.pop()
            continue
        records += [(rid, keys.partition(rid, p)) for p in partitions]
        records += [(rid, keys.connection(rid, c)) for c in connections]
    reads: list[tuple[str, list[Command]]] = [
        (key, [("HGET", key, VERSION_FIELD)]) for _, key in records
    ]
    versions = reader.read_many(reads, {})
    for (rid, key), (raw,) in zip(records, versions, strict=True):
        if raw is None:
            meta_key = keys.meta(rid)
            ((held,),) = reader.read_many([(meta_key, [("EXISTS", meta_key)])], {})
            if held:
                report.seen += 1
                report.failed.append((key, "record is missing from its request"))
            continue
        report.seen += 1
        try:
            if parse_version(raw, request_id=rid, key=key) == SCHEMA_VERSION:
                report.current += 1
                continue
            outcome = reader.run(
                upgrade_stored(
                    keys, rid, [key], policy, dry_run=dry_run, reconnect=reader.reconnect
                )
            )
        except StoreConnectionError:
            raise
        except StoreError as e:  # corrupt, newer than this code, or kept changing
            report.failed.append((key, str(e)))
            continue
        report.upgraded += len(outcome.upgraded)
        report.current += len(outcome.current)
        report.seen -= len(outcome.missing)  # deleted between the two reads


def _topology(meta: Mapping[bytes, bytes]) -> tuple[list[str], list[str]]:
    """The partition and connection names of a request meta, of any version.

    Read straight from the fields, not through ``RequestRecord``: the migration must not
    need the request's resource-config kinds registered. The two list attributes have had
    the same layout since v1 (``name`` = length, ``name[i]`` = element).
    """
    return _str_list(meta, "partitions"), _str_list(meta, "connections")


def _str_list(meta: Mapping[bytes, bytes], name: str) -> list[str]:
    raw = meta.get(name.encode(), b"0")
    if not raw.isdigit() or len(raw) > 9 or int(raw) > len(meta):
        # More elements than the hash has fields cannot be right: never count that far.
        raise ValueError(f"{name} length {raw[:20]!r} is not a number of the fields held")
    out = []
    for i in range(int(raw)):
        item = meta.get(f"{name}[{i}]".encode())
        if item is None:
            raise ValueError(f"{name}[{i}] is missing")
        out.append(item.decode("utf-8", "replace"))
    return out
