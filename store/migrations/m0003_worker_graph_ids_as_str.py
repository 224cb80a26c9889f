"""v2 -> v3: worker-graph ids are strings, and the per-id attributes are flattened.

Why: v2 numbered worker graphs with ints and stored ``current_worker_graph_ids``,
``completed_worker_graph_ids`` (msgpack arrays of ints) and ``wg_rank_completions`` (msgpack
map int -> count) as one whole field each, so every report rewrote whole fields in Python.
The serving system now names worker graphs with strings, and v3 keeps one hash field per id
(``current_worker_graph_ids[<id>] = "1"``, ``wg_rank_completions[<id>] = "<count>"``), which a
server-side script updates with HSET/HINCRBY, so concurrent reports of different worker
graphs never conflict.

The change: each int id becomes its decimal string (``7`` -> ``"7"``, the same text the
report marks ``_reports[<rank>:<id>]`` already used, so those stay valid). Other fields and
record kinds are unchanged but for the envelope versions.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from store.migrations.record import RawRecord, RecordKind, stamp_envelopes

VERSION = 3

T = TypeVar("T")

_SETS = ("current_worker_graph_ids", "completed_worker_graph_ids")
_ids = msgspec.msgpack.Decoder(list[int])
_counts = msgspec.msgpack.Decoder(dict[int, int])


def upgrade(record: RawRecord) -> RawRecord:
    """The v3 form of a v2 record."""
    if record.kind is not RecordKind.PARTITION:
        return stamp_envelopes(record, VERSION)
    fields = dict(record.fields)
    for name in _SETS:
        for wg in _decode(fields.pop(name, None), _ids, name) or ():
            fields[f"{name}[{wg}]"] = b"1"
    counts = _decode(fields.pop("wg_rank_completions", None), _counts, "wg_rank_completions")
    for wg, count in (counts or {}).items():
        fields[f"wg_rank_completions[{wg}]"] = str(count).encode()
    upgraded = RawRecord(record.kind, record.version, fields, record.published)
    return stamp_envelopes(upgraded, VERSION)


def _decode(raw: bytes | None, decoder: msgspec.msgpack.Decoder[T], name: str) -> T | None:
    if raw is None:
        return None
    try:
        return decoder.decode(raw)
    except msgspec.MsgspecError as e:
        raise ValueError(f"{name} does not decode: {e}") from e
