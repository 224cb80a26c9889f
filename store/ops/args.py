"""Operation arguments: checks made before anything is sent, and the forms scripts take."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH
from store.records import Lease


def check_replica_id(replica_id: Any, rid: str | None) -> str:
    """``replica_id`` if it is a valid id, "" for None."""
    if replica_id is None:
        return ""
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
        raise ValidationError(
            f"replica id must be a str of 1 to {MAX_NAME_LENGTH} characters", request_id=rid
        )
    return replica_id


def check_int(value: Any, what: str, rid: str, *, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValidationError(f"{what} must be an int >= {minimum}, got {value!r}", request_id=rid)


def pairs(fields: Mapping[str, bytes]) -> list[Any]:
    """A hash's fields as the flat field, value, ... list HSET and the scripts take."""
    out: list[Any] = []
    for name, value in fields.items():
        out += [name, value]
    return out


def join_ids(ids: Sequence[str]) -> bytes:
    """Worker graph ids as the scripts keep them in one field: "<bytes>:<id>" each."""
    out = b""
    for id_ in ids:
        raw = id_.encode()
        out += b"%d:%s" % (len(raw), raw)
    return out


def deadline_member(rid: str, partition: str) -> str:
    # Request ids hold no spaces (validated), so the first space splits the member.
    return f"{rid} {partition}"


def fence_args(fence: Lease | None, target: str) -> list[Any]:
    """The (what, token) arguments of a write's fence check (see update_fields.lua):
    ``target`` is the partition the write belongs to, '*' for the request, '-' for none."""
    if fence is None:
        return [target, ""]
    return [fence.partition if target == "*" else target, fence.token]
