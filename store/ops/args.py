"""Checks of operation arguments, made before anything is sent."""

from __future__ import annotations

from typing import Any

from store.errors import ValidationError
from store.keys import MAX_NAME_LENGTH


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
