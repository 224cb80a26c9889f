"""v3 -> v4: KV and position infos are split into parts that the server merges itself.

Why: v3 held each resource label's published info whole, as one envelope field
``[3, kind, payload]``, and every merge was an optimistic transaction that read the field,
folded with the kind's ``update`` and wrote it back under WATCH. With 16 tensor-parallel
replicas merging their KV shards into one partition at once, all but one of them conflicted
and retried, round after round. The two kinds the serving system has today merge by rules a
Lua script can apply (a part per rank and cache label where the newer value wins, a max per
number), so v4 stores them in parts and merges them in one script, without WATCH or retry.

The change, for each field of the publish-info hash (see ``store/published.py``):

    kv        "<label>" = [3, "kv", {info: {rank: {cache label: seq}}, world_size}]  becomes
              "<label>" = [4, "kv", nil]
              "<label>[world_size]" = "<world_size>"
              "<label>[<rank>]" = ""                        for every rank
              "<label>[<rank>:<cache label>]" = msgpack {seq_len, latest_kv_transfer_info,
                                                          page_indices}
    position  "<label>" = [3, "position", {counters: {name: int}}]  becomes
              "<label>" = [4, "position", nil]
              "<label>[<name>]" = "<int>"

An info holding a number Lua cannot compare exactly (``abs >= 2**53``: world size or a
counter), or a rank beyond the signed 64-bit range, stays whole, re-stamped, as the store
keeps such infos. A label holding ``[`` cannot be told from a part in v4, so a record with
one cannot be upgraded. Every other envelope, and the meta's resource configs, are only
re-stamped; connections are unchanged.
"""

from __future__ import annotations

from typing import Any

import msgspec

from store.migrations.record import (
    RawRecord,
    RecordKind,
    encode_envelope,
    stamp_envelope,
    stamp_envelopes,
)

VERSION = 4

_LUA_EXACT = 2**53  # Lua numbers are doubles: integers beyond this do not compare exactly
_INT64 = 2**63  # a rank's part name must read back as a signed 64-bit int


class _SequenceV3(msgspec.Struct):
    """``KVSequenceInfo`` as v3 wrote it (frozen here: the dataclass may change)."""

    seq_len: int = 0
    latest_kv_transfer_info: Any = None
    page_indices: list[int] = []


class _KVV3(msgspec.Struct):
    info: dict[int, dict[str, _SequenceV3]] = {}
    world_size: int = 1


class _PositionV3(msgspec.Struct):
    counters: dict[str, int] = {}


_envelope = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
_kv = msgspec.msgpack.Decoder(_KVV3)
_position = msgspec.msgpack.Decoder(_PositionV3)
_encoder = msgspec.msgpack.Encoder()


def upgrade(record: RawRecord) -> RawRecord:
    """The v4 form of a v3 record."""
    if record.kind is not RecordKind.PARTITION:
        return stamp_envelopes(record, VERSION)
    published: dict[str, bytes] = {}
    for label, data in record.published.items():
        if "[" in label:
            raise ValueError(f"resource label {label!r} holds '[', which v4 cannot store")
        published.update(_split(label, data))
    return RawRecord(record.kind, record.version, record.fields, published)


def _split(label: str, data: bytes) -> dict[str, bytes]:
    """The v4 fields that hold the info of field ``label``."""
    try:
        _, kind, payload = _envelope.decode(data)
        if kind == "kv":
            parts = _kv_parts(_kv.decode(payload))
        elif kind == "position":
            parts = _position_parts(_position.decode(payload))
        else:
            parts = None
    except msgspec.MsgspecError as e:
        raise ValueError(f"publish-info field {label!r} does not decode: {e}") from e
    if parts is None:
        return {label: stamp_envelope(data, VERSION)}
    fields = {label: encode_envelope(VERSION, kind, None)}
    fields.update((f"{label}[{part}]", value) for part, value in parts.items())
    return fields


def _kv_parts(info: _KVV3) -> dict[str, bytes] | None:
    if abs(info.world_size) >= _LUA_EXACT or any(not -_INT64 <= r < _INT64 for r in info.info):
        return None
    parts = {"world_size": str(info.world_size).encode()}
    for rank, labels in info.info.items():
        parts[str(rank)] = b""
        for cache, seq in labels.items():
            parts[f"{rank}:{cache}"] = _encoder.encode(seq)
    return parts


def _position_parts(info: _PositionV3) -> dict[str, bytes] | None:
    if any(abs(v) >= _LUA_EXACT for v in info.counters.values()):
        return None
    return {name: str(v).encode() for name, v in info.counters.items()}
