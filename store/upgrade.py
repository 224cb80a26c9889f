"""Records written by older code: upgraded in memory on read, and in Redis before a write.

A read never writes: it upgrades what it read in memory and decodes the current form, so a
fleet can read old records the moment it runs new code. A write must not leave a record half
in one version and half in another, so before a script touches an old record the store
rewrites that record whole at the current version (``upgrade_stored``), in an optimistic
transaction that aborts and retries if the record changed under it; ``store.migrate`` uses
the same transaction for every record of a namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from store import migrations
from store.backoff import RetryPolicy
from store.errors import ConfigurationError, CorruptRecordError, SchemaVersionError, StoreError
from store.keys import KeySpace
from store.migrations import RawRecord, RecordKind
from store.ops.calls import DEFAULT_RECONNECT, Reconnect, hash_reply
from store.ops.effects import Command, Op
from store.ops.transaction import Plan, optimistic
from store.schema import SCHEMA_VERSION, VERSION_FIELD

log = logging.getLogger(__name__)

if migrations.LATEST_VERSION != SCHEMA_VERSION:  # a bump without its step, or the reverse
    raise ConfigurationError(
        f"store.schema.SCHEMA_VERSION is {SCHEMA_VERSION} but the migration steps end at "
        f"v{migrations.LATEST_VERSION}"
    )

CURRENT = str(SCHEMA_VERSION).encode()
_VERSION_KEY = VERSION_FIELD.encode()

Hash = dict[bytes, bytes]


class RecordOutdated(StoreError):
    """A record is older than the code: the store upgrades it in Redis and tries again."""

    def __init__(self, found: int, **where: str | None) -> None:
        self.found = found
        super().__init__(f"record has schema version {found}, older than {SCHEMA_VERSION}", **where)


def parse_version(raw: bytes | None, **where: str | None) -> int:
    """The version a record holds; a missing or garbled one is corrupt, a newer one refused."""
    try:
        found = int(raw or b"")
    except ValueError:
        raise CorruptRecordError(
            f"schema version {raw!r} is not a number", **{**where, "field": VERSION_FIELD}
        ) from None
    if str(found).encode() != raw:  # "03" or " 3": not what any version of the store writes
        raise CorruptRecordError(
            f"schema version {raw!r} is not canonical", **{**where, "field": VERSION_FIELD}
        )
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(found, SCHEMA_VERSION, **where)
    if found < migrations.FIRST_VERSION:
        raise CorruptRecordError(
            f"schema version {found} never existed", **{**where, "field": VERSION_FIELD}
        )
    return found


def to_current(
    kind: RecordKind, raw: Hash, published: Hash | None = None, **where: str | None
) -> tuple[Hash, Hash]:
    """The record's hashes (own, publish-info) in the current version, upgraded in memory."""
    if raw.get(_VERSION_KEY) == CURRENT:
        return raw, published or {}
    return to_hashes(upgrade_record(from_hashes(kind, raw, published, **where), **where))


def from_hashes(
    kind: RecordKind, raw: Mapping[bytes, bytes], published: Mapping[bytes, bytes] | None,
    **where: str | None,
) -> RawRecord:  # fmt: skip
    version = parse_version(raw.get(_VERSION_KEY), **where)
    fields = {_name(k): v for k, v in raw.items() if k != _VERSION_KEY}
    pub = {_name(k): v for k, v in (published or {}).items()}
    return RawRecord(kind, version, fields, pub)


def to_hashes(record: RawRecord) -> tuple[Hash, Hash]:
    fields = {_VERSION_KEY: str(record.version).encode()}
    fields.update((_field(k), v) for k, v in record.fields.items())
    return fields, {_field(k): v for k, v in record.published.items()}


def upgrade_record(record: RawRecord, **where: str | None) -> RawRecord:
    """``record`` at the current version; a step that cannot read it makes it corrupt."""
    try:
        return migrations.upgrade(record, SCHEMA_VERSION)
    except (ValueError, TypeError) as e:
        raise CorruptRecordError(
            f"v{record.version} record cannot be upgraded to v{SCHEMA_VERSION}: {e}", **where
        ) from e


def record_kind(keys: KeySpace, request_id: str, key: str) -> RecordKind | None:
    """The kind of record at ``key`` of the request, None for a key that is no record."""
    rest = key.removeprefix(keys.request_prefix(request_id))
    if rest == key:
        return None
    if rest == "meta":
        return RecordKind.META
    if rest.startswith("part:"):
        return RecordKind.PARTITION
    if rest.startswith("conn:"):
        return RecordKind.CONNECTION
    return None


@dataclass
class UpgradeOutcome:
    """What one upgrade transaction found, by record key."""

    upgraded: list[str] = field(default_factory=list)  # or, in a dry run, would be
    current: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def upgrade_stored(
    keys: KeySpace,
    request_id: str,
    record_keys: Sequence[str],
    policy: RetryPolicy,
    *,
    dry_run: bool = False,
    reconnect: Reconnect = DEFAULT_RECONNECT,
) -> Op[UpgradeOutcome]:
    """Rewrite each outdated record among ``record_keys`` whole at the current version.

    One optimistic transaction over all of them (they are one request's, in one slot): it
    WATCHes each record (a partition with its publish-info hash), reads it, upgrades it in
    memory and replaces its hashes in MULTI/EXEC, and starts again if any changed in between.
    Current and missing records are left alone; keys that are no record (the ops set) are
    ignored. Raises ``CorruptRecordError`` / ``SchemaVersionError`` naming the record that
    cannot be upgraded; then nothing was written.
    """
    targets: list[tuple[str, RecordKind, str | None]] = []
    for key in dict.fromkeys(record_keys):
        kind = record_kind(keys, request_id, key)
        if kind is None:
            continue
        pub = None
        if kind is RecordKind.PARTITION:
            pub = keys.publish_info(request_id, key.rpartition(":part:")[2])
        targets.append((key, kind, pub))
    if not targets:
        return UpgradeOutcome()
    watch = [k for key, _, pub in targets for k in (key, pub) if k is not None]
    reads: list[Command] = [("HGETALL", k) for k in watch]

    def body(replies: list[Any]) -> Plan[UpgradeOutcome]:
        hashes = dict(zip(watch, (hash_reply(r) for r in replies), strict=True))
        outcome = UpgradeOutcome()
        writes: list[Command] = []
        for key, kind, pub in targets:
            raw = hashes[key]
            if not raw:
                outcome.missing.append(key)
                continue
            where: dict[str, str | None] = {"request_id": request_id, "key": key}
            if parse_version(raw.get(_VERSION_KEY), **where) == SCHEMA_VERSION:
                outcome.current.append(key)
                continue
            record = from_hashes(kind, raw, hashes[pub] if pub else None, **where)
            fields, published = to_hashes(upgrade_record(record, **where))
            outcome.upgraded.append(key)
            writes += [("DEL", key), ("HSET", key, *_flat(fields))]
            if pub is not None:
                writes.append(("DEL", pub))
                if published:
                    writes.append(("HSET", pub, *_flat(published)))
        return Plan([] if dry_run else writes, outcome)

    where = {"request_id": request_id}
    result = yield from optimistic(watch, reads, body, policy, where, reconnect=reconnect)
    assert result.result is not None
    if result.result.upgraded and not dry_run:
        log.info("upgraded %s to schema v%d", ", ".join(result.result.upgraded), SCHEMA_VERSION)
    return result.result


def _flat(fields: Mapping[bytes, bytes]) -> list[bytes]:
    out: list[bytes] = []
    for name, value in fields.items():
        out += [name, value]
    return out


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _field(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")
