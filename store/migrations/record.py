"""What a migration step works on: one stored record as undecoded hash fields.

A step must keep working for as long as records of its source version may exist, so it must
not depend on today's dataclasses or codec, which keep changing. It therefore reads and
writes raw fields with small decoders of its own, frozen with the step.

A record is one of three kinds. A partition is two hashes that always move together: its own
hash and the publish-info hash (resource label -> envelope) beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec


class RecordKind(enum.Enum):
    META = "meta"
    PARTITION = "partition"
    CONNECTION = "connection"


@dataclass(frozen=True)
class RawRecord:
    """One record at one schema version.

    ``fields`` is the record's own hash without the version field; ``published`` is the
    partition's publish-info hash (empty for the other kinds). Field names are str (UTF-8,
    with surrogate escapes so that any stored name survives the round trip), values bytes.
    """

    kind: RecordKind
    version: int
    fields: Mapping[str, bytes]
    published: Mapping[str, bytes] = field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])


def encode_envelope(version: int, kind: str, payload: object) -> bytes:
    """An envelope ``[version, kind, payload]`` as the codec writes it."""
    return _encoder.encode((version, kind, payload))


def stamp_envelope(data: bytes, version: int) -> bytes:
    """The same envelope stamped with ``version``; the payload is copied undecoded.

    A migration therefore never needs the kind registered: user kinds unknown to the
    migration tool pass through untouched.
    """
    try:
        _, kind, payload = _envelope.decode(data)
    except msgspec.MsgspecError as e:
        raise ValueError(f"not an envelope: {e}") from e
    return _encoder.encode((version, kind, payload))


def envelope_version(data: bytes) -> int:
    try:
        version, _, _ = _envelope.decode(data)
    except msgspec.MsgspecError as e:
        raise ValueError(f"not an envelope: {e}") from e
    return version


def map_entries(fields: Mapping[str, bytes], name: str) -> dict[str, bytes]:
    """The entries ``<name>[<key>]`` of a flattened map attribute, by key."""
    prefix = f"{name}["
    return {
        f[len(prefix) : -1]: value
        for f, value in fields.items()
        if f.startswith(prefix) and f.endswith("]")
    }


def stamp_envelopes(record: RawRecord, version: int) -> RawRecord:
    """``record`` with every envelope it holds at top level stamped ``version``.

    Envelopes sit in two places: the partition's publish-info hash and the request's
    ``resource_configs[<label>]`` fields.
    """
    fields = dict(record.fields)
    if record.kind is RecordKind.META:
        for label, data in map_entries(fields, "resource_configs").items():
            fields[f"resource_configs[{label}]"] = stamp_envelope(data, version)
    published = {label: stamp_envelope(data, version) for label, data in record.published.items()}
    return RawRecord(record.kind, record.version, fields, published)
