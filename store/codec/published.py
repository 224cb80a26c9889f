"""How published infos sit in a partition's publish-info hash, one resource label at a time.

Most kinds are stored whole: field ``<label>`` holds the envelope ``[version, kind, payload]``
and a merge is an optimistic transaction that folds with the kind's own ``update``.

The two kinds the serving system has today merge by rules the server can apply itself, so
they are split into parts and merged in one script, with no WATCH and no retry however many
replicas merge at once:

    kv        "<label>" = [version, "kv", nil]         header: the label holds a kv info
              "<label>[world_size]" = "4"              max
              "<label>[<rank>]" = ""                   the rank is held (its labels may be none)
              "<label>[<rank>:<cache label>]" = msgpack KVSequenceInfo     other wins per label
    position  "<label>" = [version, "position", nil]
              "<label>[<counter label>]" = "17"        max

The split applies only to exactly ``PublishedKVInfo`` / ``PublishedPositionInfo`` (a subclass
may merge differently) whose numbers Lua compares exactly (below 2**53); it gives the same
result as ``update``, which the tests check against the generic path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from mstar.engine.resources import (
    KVSequenceInfo,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
)
from store.codec.values import Codec
from store.errors import (
    CorruptRecordError,
    PayloadTooLargeError,
    SchemaVersionError,
    ValidationError,
)
from store.keys import MAX_NAME_LENGTH
from store.schema import SCHEMA_VERSION

SET, MAX = "S", "M"
_LUA_EXACT = 2**53  # Lua numbers are doubles: integers beyond this do not compare exactly
_INT64 = 2**63  # a rank's part name must read back as a signed 64-bit int, like msgpack's
_NIL = msgspec.msgpack.encode(None)
_INT = re.compile(r"-?[0-9]{1,19}")

Part = tuple[str, str, bytes]  # (SET or MAX, part name, value)


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


def _int(text: str) -> int:
    if not _INT.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not an integer")
    return int(text)


class _KVParts:
    kind = "kv"
    cls = PublishedKVInfo

    def fits(self, info: Any) -> bool:
        # Not an int: parts() refuses it with a ValidationError rather than store it whole.
        return (type(info.world_size) is not int or abs(info.world_size) < _LUA_EXACT) and all(
            type(rank) is not int or -_INT64 <= rank < _INT64 for rank in info.info
        )

    def parts(self, info: Any, codec: Codec, where: dict[str, str | None]) -> list[Part]:
        if type(info.world_size) is not int:
            raise ValidationError(f"kv world_size must be int, got {info.world_size!r}", **where)
        out: list[Part] = [(MAX, "world_size", str(info.world_size).encode())]
        for rank, labels in info.info.items():
            if type(rank) is not int:
                raise ValidationError(f"kv ranks must be int, got {rank!r}", **where)
            out.append((SET, str(rank), b""))
            for cache, seq in labels.items():
                if not isinstance(cache, str):
                    raise ValidationError(f"kv cache labels must be str, got {cache!r}", **where)
                out.append((SET, f"{rank}:{cache}", codec.encode(seq, KVSequenceInfo, **where)))
        return out

    def assemble(self, parts: Mapping[str, bytes], codec: Codec, where: dict[str, Any]) -> Any:
        info: dict[int, dict[str, KVSequenceInfo]] = {}
        world_size = 1
        for part, value in parts.items():
            if part == "world_size":
                world_size = _int(value.decode())
            elif ":" in part:
                rank, cache = part.split(":", 1)
                info.setdefault(_int(rank), {})[cache] = codec.decode(
                    value, KVSequenceInfo, **where
                )
            else:
                info.setdefault(_int(part), {})
        return PublishedKVInfo(info=info, world_size=world_size)


class _PositionParts:
    kind = "position"
    cls = PublishedPositionInfo

    def fits(self, info: Any) -> bool:
        return all(type(v) is not int or abs(v) < _LUA_EXACT for v in info.counters.values())

    def parts(self, info: Any, codec: Codec, where: dict[str, str | None]) -> list[Part]:
        out: list[Part] = []
        for label, position in info.counters.items():
            if not isinstance(label, str) or type(position) is not int:
                raise ValidationError(
                    f"position counters map str to int, got {label!r}: {position!r}", **where
                )
            out.append((MAX, label, str(position).encode()))
        return out

    def assemble(self, parts: Mapping[str, bytes], codec: Codec, where: dict[str, Any]) -> Any:
        return PublishedPositionInfo({k: _int(v.decode()) for k, v in parts.items()})


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


@dataclass(frozen=True)
class ServerMerge:
    """Arguments of ``merge_parts.lua`` for a merge the server can apply by itself."""

    args: list[Any]


class PublishLayout:
    """Encodes published infos to publish-info hash fields and decodes them back."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._headers = {kind: self._header(kind) for kind in _SPLIT_KINDS}

    def _header(self, kind: str) -> bytes:
        return msgspec.msgpack.encode((SCHEMA_VERSION, kind, None))

    def _split(self, info: Any) -> _KVParts | _PositionParts | None:
        split = _SPLITS.get(type(info))
        return split if split is not None and split.fits(info) else None

    def _parts(
        self, split: _KVParts | _PositionParts, info: Any, where: dict[str, str | None]
    ) -> list[Part]:
        """``info``'s parts, within the payload limit an info stored whole would meet."""
        parts = split.parts(info, self.codec, where)
        size = sum(len(part) + len(value) for _, part, value in parts)
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
        for _, part, value in self._parts(split, info, where):
            fields[f"{label}[{part}]"] = value
        return fields

    def server_merge(
        self, other: Mapping[str, PublishedInfo], **where: str | None
    ) -> ServerMerge | None:
        """The script arguments when every info in ``other`` is a kind the server merges."""
        args: list[Any] = [len(other)]
        for label, info in other.items():
            split = self._split(info)
            if split is None:
                return None
            parts = self._parts(split, info, {**where, "field": label})
            args += [label, self._headers[split.kind], len(parts)]
            for op, part, value in parts:
                args += [op, part, value]
        return ServerMerge(args)

    def decode(
        self,
        raw: Mapping[bytes, bytes],
        labels: Iterable[str] | None = None,
        **where: str | None,
    ) -> dict[str, PublishedInfo]:
        """The infos held in a publish-info hash (only ``labels``, when given)."""
        wanted = None if labels is None else set(labels)
        heads: dict[str, bytes] = {}
        parts: dict[str, dict[str, bytes]] = {}
        for raw_name, value in raw.items():
            name = raw_name.decode("utf-8", "surrogateescape")
            label, bracket, rest = name.partition("[")
            if wanted is not None and label not in wanted:
                continue
            if not bracket:
                heads[label] = value
            elif rest.endswith("]"):
                parts.setdefault(label, {})[rest[:-1]] = value
            else:
                raise CorruptRecordError("malformed publish-info field name", **where, field=name)
        for label in parts.keys() - heads.keys():
            raise CorruptRecordError(
                "publish-info parts without their header", **where, field=label
            )
        return {
            label: self._decode_one(head, parts.get(label, {}), {**where, "field": label})
            for label, head in heads.items()
        }

    def _decode_one(
        self, head: bytes, parts: Mapping[str, bytes], where: dict[str, str | None]
    ) -> PublishedInfo:
        split = self._split_header(head, where)
        if split is None:
            info: PublishedInfo = self.codec.decode_kind(head, PublishedInfo, **where)
            return info
        try:
            assembled: PublishedInfo = split.assemble(parts, self.codec, where)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptRecordError(f"{split.kind} parts do not decode: {e}", **where) from e
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
