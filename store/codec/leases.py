"""A request's lease hash read back as ``Lease`` objects, every field checked.

The hash (``<ns>:{<rid>}:lease``, written only by the lease scripts) holds the request's
fencing token ``token`` and, per partition ``p`` whose step a replica holds, ``holder[p]``,
``token[p]``, ``expires[p]`` (seconds) and ``pass[p]``; ``token[p]`` stays after a release,
as do ``sends[p]`` and ``sent[p]`` (how often and when p's current pass was sent).
A lease whose fields are missing, not UTF-8 or outside their domains is damage, reported as
``CorruptRecordError`` naming the field, never read as a default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from store.codec.bounds import parse_int
from store.codec.domains import (
    COUNT,
    FENCING_TOKEN,
    PASS,
    TIME,
    FloatDomain,
    IntDomain,
    check_stored,
)
from store.errors import CorruptRecordError
from store.keys import MAX_NAME_LENGTH
from store.records import Lease

# What Redis writes for a Lua number, and Python's str() for a float: no "inf", "nan", "_".
_DECIMAL = re.compile(rb"-?(?:0|[1-9][0-9]{0,20})(?:\.[0-9]{1,20})?(?:[eE][-+]?[0-9]{1,3})?")


def decode_leases(raw: Mapping[bytes, bytes], request_id: str, key: str) -> dict[str, Lease]:
    """The leases held in ``raw`` (the lease hash), by partition, sorted by name."""
    where: dict[str, str | None] = {"request_id": request_id, "key": key}
    fields: dict[str, bytes] = {}
    for raw_name, value in raw.items():
        fields[_text(raw_name, "lease field name", where, raw_name)] = value
    out: dict[str, Lease] = {}
    for name in sorted(fields):
        if not (name.startswith("holder[") and name.endswith("]")):
            continue
        partition = name[7:-1]
        holder = _text(fields[name], "lease holder", {**where, "field": name}, fields[name])
        if not 0 < len(holder) <= MAX_NAME_LENGTH:
            raise CorruptRecordError(f"lease holder {holder[:40]!r}", **where, field=name)
        out[partition] = Lease(
            request_id,
            partition,
            holder,
            _int(fields, f"token[{partition}]", FENCING_TOKEN, where),
            _int(fields, f"pass[{partition}]", PASS, where),
            _float(fields, f"expires[{partition}]", TIME, where),
            sends=_int(fields, f"sends[{partition}]", COUNT, where, missing=0),
            sent_at=_float(fields, f"sent[{partition}]", TIME, where, missing=0.0),
        )
    return out


def _held(fields: Mapping[str, bytes], name: str, where: dict[str, str | None]) -> bytes:
    value = fields.get(name)
    if value is None:
        raise CorruptRecordError("a held lease without this field", **where, field=name)
    return value


def _int(
    fields: Mapping[str, bytes],
    name: str,
    domain: IntDomain,
    where: dict[str, str | None],
    missing: int | None = None,
) -> int:
    if missing is not None and name not in fields:  # kept only once a pass was sent
        return missing
    raw = _held(fields, name, where)
    try:
        value = parse_int(raw)
    except ValueError as e:
        raise CorruptRecordError(f"lease {e}", **where, field=name) from None
    return check_stored(value, domain, what=f"lease {name}", **where, field=name)


def _float(
    fields: Mapping[str, bytes],
    name: str,
    domain: FloatDomain,
    where: dict[str, str | None],
    missing: float | None = None,
) -> float:
    if missing is not None and name not in fields:
        return missing
    raw = _held(fields, name, where)
    if not _DECIMAL.fullmatch(raw):
        raise CorruptRecordError(f"lease {raw[:40]!r} is not a number", **where, field=name)
    return check_stored(float(raw), domain, what=f"lease {name}", **where, field=name)


def _text(raw: bytes, what: str, where: dict[str, str | None], shown: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        field = where.get("field") or shown[:100].decode("utf-8", "backslashreplace")
        raise CorruptRecordError(f"{what} is not UTF-8", **{**where, "field": field}) from None
