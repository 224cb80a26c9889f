"""v4 -> v5: a KV sequence is stored as the array [seq_len, transfer info, packed pages].

Why: a partition's KV info is most of what a conductor reads and writes, and v4 stored each
``KVSequenceInfo`` as a map that spelled out its three field names, 45 bytes per sequence
per rank, which made the stored partition larger than pickle's; and a reader had to walk
every page index, even to skip it. v5 stores the same values as a msgpack array in field
order (a field added later goes at the end, with a default), with the page indices' msgpack
array inside a bin, which a reader steps over at once and decodes only when the indices are
read (``store/codec/kv.py``).

The change, in the publish-info hash of a partition (see ``store/codec/published.py``):

    "<label>[<rank>:<cache label>]" = {"seq_len": 5, "latest_kv_transfer_info": t,
                                       "page_indices": [...]}            becomes
    "<label>[<rank>:<cache label>]" = [5, t, bin([...])]

under a ``kv`` header; the values inside are copied byte for byte. A ``kv`` info stored
whole has its sequences rewritten the same way. Every top-level envelope is re-stamped;
envelopes nested inside other kinds keep their version and form, which readers accept.
Connections are unchanged.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from store.migrations.record import RawRecord, RecordKind, stamp_envelope, stamp_envelopes

VERSION = 5

T = TypeVar("T")

_NIL = msgspec.msgpack.encode(None)
_EMPTY = msgspec.msgpack.encode([])


class _SequenceV4(msgspec.Struct):
    """``KVSequenceInfo`` as v4 wrote it; the defaults are those of v3 and older."""

    seq_len: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\x00"))
    latest_kv_transfer_info: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(_NIL))
    page_indices: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(_EMPTY))


_envelope = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
_sequence = msgspec.msgpack.Decoder(_SequenceV4)
_kv_payload = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_kv_info = msgspec.msgpack.Decoder(dict[int, dict[str, _SequenceV4]])
_encoder = msgspec.msgpack.Encoder()


def upgrade(record: RawRecord) -> RawRecord:
    """The v5 form of a v4 record."""
    if record.kind is not RecordKind.PARTITION:
        return stamp_envelopes(record, VERSION)
    kv_labels: set[str] = set()
    published: dict[str, bytes] = {}
    for name, data in record.published.items():
        if "[" in name:
            continue
        kind, payload = _kind(name, data)
        if kind == "kv" and payload == _NIL:
            kv_labels.add(name)
        elif kind == "kv":
            published[name] = _encoder.encode(
                (VERSION, kind, msgspec.Raw(_compact_kv(name, payload)))
            )
            continue
        published[name] = stamp_envelope(data, VERSION)
    for name, data in record.published.items():
        label, bracket, part = name.partition("[")
        if not bracket:
            continue
        if label in kv_labels and ":" in part:
            data = _compact(_decode(_sequence, data, name))
        published[name] = data
    return RawRecord(record.kind, record.version, record.fields, published)


def _kind(name: str, data: bytes) -> tuple[str, bytes]:
    try:
        _, kind, payload = _envelope.decode(data)
    except msgspec.MsgspecError as e:
        raise ValueError(f"publish-info field {name!r} does not decode: {e}") from e
    return kind, bytes(payload)


def _compact_kv(name: str, payload: bytes) -> bytes:
    """A whole kv payload ``{info, world_size}`` with its sequences in the v5 form."""
    fields = _decode(_kv_payload, payload, name)
    if "info" in fields:
        info = _decode(_kv_info, fields["info"], name)
        fields["info"] = msgspec.Raw(
            _encoder.encode(
                {
                    rank: {cache: msgspec.Raw(_compact(seq)) for cache, seq in labels.items()}
                    for rank, labels in info.items()
                }
            )
        )
    return _encoder.encode(fields)


def _compact(seq: _SequenceV4) -> bytes:
    return _encoder.encode((seq.seq_len, seq.latest_kv_transfer_info, bytes(seq.page_indices)))


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, name: str) -> T:
    try:
        return decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise ValueError(f"publish-info field {name!r} does not decode: {e}") from e
