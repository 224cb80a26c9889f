"""How published infos sit in a partition's publish-info hash, one resource label at a time.

Most kinds are stored whole: field ``<label>`` holds the envelope ``[version, kind, payload]``
and a merge is an optimistic transaction that folds with the kind's own ``update``.

The two kinds the serving system has today merge by rules the server can apply itself, so
they are split into parts and merged in one script, with no WATCH and no retry however many
replicas merge at once:

    kv        "<label>" = [version, "kv", nil]         header: the label holds a kv info
              "<label>[world_size]" = "4"              the first one stays
              "<label>[<rank>]" = ""                   the rank is held (its labels may be none)
              "<label>[<rank>:<cache label>]" = KVSequenceInfo (see ``kv``)  other wins
    position  "<label>" = [version, "position", nil]
              "<label>[<counter label>]" = "17"        raised only (a new one from 0)

A label not held yet takes the info whole, parts as given, as the engine's
``merge_publish_info`` does.

The split applies to exactly ``PublishedKVInfo`` / ``PublishedPositionInfo`` (a subclass may
merge differently); it gives the same result as ``update``, which the tests check against
the generic path. Their numbers stay in their domains (``domains``): world sizes and
positions below 2**53, which Lua compares exactly, ranks and positions not negative. A
value outside them is refused on write and reported as corrupt on read; a part of the wrong
shape, or a missing world size, is corrupt too, never read as a default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec

from store.codec.bounds import parse_int
from store.codec.domains import KV_RANK, POSITION, WORLD_SIZE, IntDomain, check_int, check_stored
from store.codec.kv import decode_sequence, encode_sequence
from store.codec.values import Codec
from store.errors import (
    CorruptRecordError,
    PayloadTooLargeError,
    SchemaVersionError,
    StoreError,
    ValidationError,
)
from store.keys import MAX_NAME_LENGTH
from store.schema import SCHEMA_VERSION
from store.types import PublishedInfo, PublishedKVInfo, PublishedPositionInfo

SET, MAX, KEEP = "S", "M", "K"
_NIL = msgspec.msgpack.encode(None)

# An info's parts, flat as the merge script takes them: SET, MAX or KEEP, part name, value,
# ... A label not held yet takes every part as given (see check_merges in _lib.lua).
Parts = list[Any]
Where = dict[str, "str | None"]


def check_label(label: Any, **where: str | None) -> str:
    if (
        not isinstance(label, str)
        or not 0 < len(label) <= MAX_NAME_LENGTH
        or "[" in label
        or label.startswith("_")
    ):
        raise ValidationError(
            f"resource label {label!r} must be a str of 1 to {MAX_NAME_LENGTH} characters, "
            "without '[' and not starting with '_'",
            **where,
        )
    return label


def _stored_int(raw: bytes, domain: IntDomain, what: str, where: Where) -> int:
    """A part's number: canonical decimal, in ``domain``; else ``CorruptRecordError``."""
    # The common case in two bytes methods; the general one names what is wrong.
    if 0 < len(raw) <= 19 and raw.isdigit() and (raw[0] != 0x30 or raw == b"0"):
        value = int(raw)
        if domain.low <= value < domain.high:
            return value
    try:
        value = parse_int(raw)
    except ValueError as e:
        raise CorruptRecordError(f"{what}: {e}", **where) from None
    return check_stored(value, domain, what=what, **where)


def _text(raw: bytes, what: str, where: Where) -> str:
    """``raw`` as strict UTF-8; else ``CorruptRecordError`` (naming the field if unnamed)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        where = {**where, "field": where.get("field") or _shown(raw)}
        raise CorruptRecordError(f"{what} is not UTF-8", **where) from None


def _shown(raw: bytes) -> str:
    """A stored name fit for a message: readable, and short."""
    return raw[:100].decode("utf-8", "backslashreplace")


_WORLD_SIZES = (WORLD_SIZE.low, WORLD_SIZE.high)
_KV_RANKS = (KV_RANK.low, KV_RANK.high)


class _KVParts:
    kind = "kv"
    cls = PublishedKVInfo

    def parts(self, info: Any, where: Where) -> Parts:
        # The checks inline for the common case (plain dicts, numbers in their domains);
        # only a value that fails one goes to the check that says what is wrong.
        world_size = info.world_size
        low, high = _WORLD_SIZES
        if type(world_size) is not int or not low <= world_size < high:
            check_int(world_size, WORLD_SIZE, what="kv world_size", **where)
        out: Parts = [KEEP, "world_size", str(world_size).encode()]
        ranks = info.info
        low, high = _KV_RANKS
        for rank, labels in (
            ranks.items() if type(ranks) is dict else _items(ranks, "kv info", where)
        ):
            if type(rank) is not int or not low <= rank < high:
                check_int(rank, KV_RANK, what="kv rank", **where)
            rank_text = str(rank)
            out += [SET, rank_text, b""]
            for cache, seq in (
                labels.items() if type(labels) is dict else _items(labels, f"kv rank {rank}", where)
            ):
                if type(cache) is not str:
                    raise ValidationError(f"kv cache labels must be str, got {cache!r}", **where)
                try:
                    value = encode_sequence(seq)
                except (TypeError, ValueError, OverflowError, RecursionError) as e:
                    raise ValidationError(f"kv rank {rank} {cache!r}: {e}", **where) from e
                out += [SET, f"{rank_text}:{cache}", value]
        return out

    def assemble(self, parts: Mapping[bytes, bytes], where: Where) -> Any:
        info: dict[int, dict[str, Any]] = {}
        by_text: dict[bytes, dict[str, Any]] = {}  # each rank's labels, by its part name
        world_size = None
        for part, value in parts.items():
            if part == b"world_size":
                world_size = _stored_int(value, WORLD_SIZE, "kv world_size", where)
                continue
            rank_text, colon, cache = part.partition(b":")
            labels = by_text.get(rank_text)
            if labels is None:
                rank = _stored_int(rank_text, KV_RANK, "kv rank", where)
                labels = by_text[rank_text] = info.setdefault(rank, {})
            if colon:
                try:
                    name = cache.decode()
                except UnicodeDecodeError:
                    name = _text(cache, "kv cache label", where)  # raises, naming it
                labels[name] = decode_sequence(value, where)
            elif value:
                raise CorruptRecordError(
                    f"kv rank {_shown(rank_text)} marker holds {value[:40]!r}", **where
                )
        if world_size is None:
            raise CorruptRecordError("kv parts without their world_size", **where)
        return PublishedKVInfo(info=info, world_size=world_size)


class _PositionParts:
    kind = "position"
    cls = PublishedPositionInfo

    def parts(self, info: Any, where: Where) -> Parts:
        out: Parts = []
        for label, position in _items(info.counters, "position counters", where):
            if type(label) is not str:
                raise ValidationError(
                    f"position counter labels must be str, got {label!r}", **where
                )
            if position not in POSITION:
                check_int(position, POSITION, what=f"position {label!r}", **where)
            out += [MAX, label, str(position).encode()]
        return out

    def assemble(self, parts: Mapping[bytes, bytes], where: Where) -> Any:
        counters = {}
        for raw_label, value in parts.items():
            label = _text(raw_label, "position counter label", where)
            counters[label] = _stored_int(value, POSITION, f"position {label[:40]!r}", where)
        return PublishedPositionInfo(counters)


def _items(value: Any, what: str, where: Where) -> Iterable[tuple[Any, Any]]:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise ValidationError(f"{what} must be a dict, got {type(value).__name__}", **where)
    return value.items()


_SPLITS: dict[type, _KVParts | _PositionParts] = {
    PublishedKVInfo: _KVParts(),
    PublishedPositionInfo: _PositionParts(),
}
_SPLIT_KINDS = {s.kind: s for s in _SPLITS.values()}


class MergedInfos(Mapping[str, PublishedInfo]):
    """The merged infos a server-side merge read back, decoded on first access.

    The fields are the snapshot the merge script took right after it wrote, so the infos
    are exactly what this merge produced; a conductor that does not look at them (most
    don't) does not pay for decoding every rank's page indices.
    """

    def __init__(self, decode: Callable[[], dict[str, PublishedInfo]]) -> None:
        self._decode = decode
        self._infos: dict[str, PublishedInfo] | None = None

    def _held(self) -> dict[str, PublishedInfo]:
        if self._infos is None:
            self._infos = self._decode()
        return self._infos

    def __getitem__(self, label: str) -> PublishedInfo:
        return self._held()[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._held())

    def __len__(self) -> int:
        return len(self._held())

    def __repr__(self) -> str:
        return f"MergedInfos({self._held()!r})"


class PublishLayout:
    """Encodes published infos to publish-info hash fields and decodes them back."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._headers = {kind: self._header(kind) for kind in _SPLIT_KINDS}
        self._by_header = {header: _SPLIT_KINDS[kind] for kind, header in self._headers.items()}

    def _header(self, kind: str) -> bytes:
        return msgspec.msgpack.encode((SCHEMA_VERSION, kind, None))

    def _split(self, info: Any) -> _KVParts | _PositionParts | None:
        return _SPLITS.get(type(info))

    def _parts(self, split: _KVParts | _PositionParts, info: Any, where: Where) -> Parts:
        """``info``'s parts, within the payload limit an info stored whole would meet."""
        parts = split.parts(info, where)
        size = sum(map(len, parts[1::3])) + sum(map(len, parts[2::3]))
        if size > self.codec.max_payload_bytes:
            raise PayloadTooLargeError(size, self.codec.max_payload_bytes, **where)
        return parts

    def encode(self, label: str, info: Any, **where: str | None) -> dict[str, bytes]:
        """Every field that holds ``info`` under ``label``."""
        where = {**where, "field": label}
        split = self._split(info)
        if split is None:
            return {label: self.codec.encode_kind(info, **where)}
        fields = {label: self._headers[split.kind]}
        parts = self._parts(split, info, where)
        for part, value in zip(parts[1::3], parts[2::3], strict=True):
            fields[f"{label}[{part}]"] = value
        return fields

    def server_merge(
        self, other: Mapping[str, PublishedInfo], **where: str | None
    ) -> list[Any] | None:
        """The arguments of a server-side merge (``merge_parts.lua``, ``report.lua``): the
        number of labels, then per label its name, header, number of parts and the parts;
        None unless every info in ``other`` is a kind the server merges."""
        args: list[Any] = [len(other)]
        headers = self._headers
        for label, info in other.items():
            split = _SPLITS.get(type(info))
            if split is None:
                return None
            at = {**where, "field": label}
            check_label(label, **at)
            parts = self._parts(split, info, at)
            args += [label, headers[split.kind], len(parts) // 3]
            args += parts
        return args

    def decode(
        self,
        raw: Mapping[bytes, bytes],
        labels: Iterable[str] | None = None,
        **where: str | None,
    ) -> dict[str, PublishedInfo]:
        """The infos held in a publish-info hash (only ``labels``, when given)."""
        wanted = None if labels is None else {label.encode() for label in labels}
        heads: dict[bytes, bytes] = {}
        parts: dict[bytes, dict[bytes, bytes]] = {}
        for raw_name, value in raw.items():
            head_name, bracket, rest = raw_name.partition(b"[")
            if wanted is not None and head_name not in wanted:
                continue
            if not bracket:
                heads[head_name] = value
            elif rest.endswith(b"]"):
                held = parts.get(head_name)
                if held is None:
                    held = parts[head_name] = {}
                held[rest[:-1]] = value
            else:
                raise CorruptRecordError(
                    "malformed publish-info field name", **where, field=_shown(raw_name)
                )
        for orphan in parts.keys() - heads.keys():
            raise CorruptRecordError(
                "publish-info parts without their header", **where, field=_shown(orphan)
            )
        out: dict[str, PublishedInfo] = {}
        for raw_label, head in heads.items():
            try:
                label = raw_label.decode()
            except UnicodeDecodeError:
                label = _text(raw_label, "publish-info field name", where)  # raises, naming it
            out[label] = self._decode_one(head, parts.get(raw_label), {**where, "field": label})
        return out

    def _decode_one(
        self, head: bytes, parts: Mapping[bytes, bytes] | None, where: Where
    ) -> PublishedInfo:
        split = self._by_header.get(head) or self._split_header(head, where)
        if split is None:
            if parts:
                raise CorruptRecordError("a whole publish info with parts beside it", **where)
            info: PublishedInfo = self.codec.decode_kind(head, PublishedInfo, **where)
            return info
        parts = parts or {}
        size = sum(map(len, parts)) + sum(map(len, parts.values()))
        if size > self.codec.max_payload_bytes:
            raise PayloadTooLargeError(size, self.codec.max_payload_bytes, **where)
        try:
            assembled: PublishedInfo = split.assemble(parts, where)
        except StoreError as e:
            e.locate(**where)
            raise
        return assembled

    def _split_header(
        self, head: bytes, where: dict[str, str | None]
    ) -> _KVParts | _PositionParts | None:
        """The split kind a header names, or None for a whole envelope."""
        if not head.endswith(_NIL):
            return None
        try:
            version, kind, payload = self.codec.envelope(head)
        except CorruptRecordError:
            return None  # decode_kind reports it with its own message
        if bytes(payload) != _NIL or kind not in _SPLIT_KINDS:
            return None
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(version, SCHEMA_VERSION, **where)
        return _SPLIT_KINDS[kind]
