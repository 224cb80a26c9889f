"""v1 -> v2: a partition's ``per_label_seq_info`` becomes its publish-info hash.

Why: v1 knew one kind of published state, the KV cache, and kept it in the partition hash as
one msgpack field ``per_label_seq_info``: resource label -> tensor-parallel rank -> sequence
info (``{"seq_len", "latest_kv_transfer_info", "page_indices"}``). The serving system
replaced it with ``resource_publish_info``: resource label -> any registered
``PublishedInfo`` kind, each merging by its own ``update``. v2 keeps those in the separate
publish-info hash, one field per label holding an envelope ``[2, kind, payload]``, so that
two replicas merging different labels never rewrite each other's data.

The change: each label ``L`` of ``per_label_seq_info`` becomes field ``L`` of the
publish-info hash, a ``"kv"`` envelope of ``PublishedKVInfo(info={rank: {L: seq}},
world_size=highest rank + 1)`` (v1 stored ranks 0..n-1 of one tensor-parallel group, so the
highest rank tells the group's size). A label already in the publish-info hash is newer than
the v1 field and is kept. Every other field and every other record kind is unchanged, but
for the envelope versions, which follow the record's (see ``stamp_envelopes``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from store.migrations.record import RawRecord, RecordKind, encode_envelope, stamp_envelopes

VERSION = 2

_KV_KIND = "kv"  # the name PublishedKVInfo was registered under in v2


class _SequenceV1(msgspec.Struct):
    """One rank's sequence as v1 wrote it (frozen here: KVSequenceInfo may change)."""

    seq_len: int = 0
    latest_kv_transfer_info: Any = None
    page_indices: list[int] = []


_per_label = msgspec.msgpack.Decoder(dict[str, dict[int, _SequenceV1]])


def upgrade(record: RawRecord) -> RawRecord:
    """The v2 form of a v1 record."""
    if record.kind is not RecordKind.PARTITION:
        return stamp_envelopes(record, VERSION)
    fields = dict(record.fields)
    published = dict(record.published)
    raw = fields.pop("per_label_seq_info", None)
    if raw is not None:
        try:
            per_label = _per_label.decode(raw)
        except msgspec.MsgspecError as e:
            raise ValueError(f"per_label_seq_info does not decode: {e}") from e
        for label, ranks in per_label.items():
            if label in published:
                continue
            payload = {
                "info": {rank: {label: seq} for rank, seq in ranks.items()},
                "world_size": max(ranks, default=0) + 1,
            }
            published[label] = encode_envelope(VERSION, _KV_KIND, payload)
    return stamp_envelopes(RawRecord(record.kind, record.version, fields, published), VERSION)
