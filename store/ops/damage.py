"""Damage in a request's stored data, found and named: which key, and which field.

The store's scripts handle every value the store writes; a script that stops on a runtime
error, or a command answered WRONGTYPE, met damage (a key of another Redis type, a value
out of its domain). ``locate`` finds where, so that the ``CorruptRecordError`` names the
key and, where a record's decoder can tell, the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from store.codec.domains import IntDomain, check_stored
from store.codec.leases import decode_leases
from store.errors import CorruptRecordError, StoreError
from store.ops.effects import Op

if TYPE_CHECKING:
    from store.ops.core import Core


def stored_int(raw: Any, domain: IntDomain, **where: str | None) -> int:
    """An integer a script read from the request and replied with; damage if it is not
    one, or is outside ``domain``."""
    try:
        value = int(raw)
    except (TypeError, ValueError) as e:
        raise CorruptRecordError(f"stored value {raw!r} is not an integer", **where) from e
    return check_stored(value, domain, what=domain.name, **where)


def stored_float(raw: Any, **where: str | None) -> float:
    """A number (a time) a script read from the request and replied with."""
    try:
        value = float(raw)
    except (TypeError, ValueError) as e:
        raise CorruptRecordError(f"stored value {raw!r} is not a number", **where) from e
    if value != value or value in (float("inf"), float("-inf")):
        raise CorruptRecordError(f"stored value {raw!r} is not a finite number", **where)
    return value


def refused_value(field: bytes, **where: str | None) -> CorruptRecordError:
    """What a script's ``{'CORRUPT', field}`` says: the value held at ``field`` is none the
    store writes (nothing was written)."""
    name = field.decode(errors="replace")
    return CorruptRecordError(f"stored {name} is not a value the store writes", **where, field=name)


@contextmanager
def reading(**where: str | None) -> Iterator[None]:
    """Parse a script's reply, which echoes values of the request: one that does not parse
    as the number it stands for is damage (the store's own errors pass through)."""
    try:
        yield
    except StoreError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as e:
        raise CorruptRecordError(f"a stored value does not read: {e}", **where) from e


def locate(core: Core, rid: str, keys: Sequence[str]) -> Op[CorruptRecordError | None]:
    """The damage a script stopped on, named by key (and field where a record's decoder
    finds it): a key of another Redis type than the store keeps there, else a record
    among ``keys`` that does not decode; None if neither is found."""
    if not keys:
        return None
    # A script's keys share one slot (the index is one of them on a single server only).
    replies = yield from core.send(keys[0], [("TYPE", k) for k in keys], {"request_id": rid})
    for key, found in zip(keys, replies, strict=True):
        kind = found.decode() if isinstance(found, bytes) else str(found)
        expected = core.keys.redis_type(key)
        if kind not in ("none", expected):
            return CorruptRecordError(
                f"the key holds a Redis {kind}, where the store keeps a {expected}",
                request_id=rid,
                key=key,
            )
    mine = [k for k in keys if k.startswith(core.keys.request_prefix(rid))]
    hashes = [k for k in mine if core.keys.redis_type(k) == "hash"]
    if not hashes:
        return None
    raws = yield from core.load_hashes(rid, hashes)
    for key, raw in zip(hashes, raws, strict=True):
        try:
            decode_key(core, rid, key, raw)
        except CorruptRecordError as e:
            return e
        except StoreError:
            continue
    return None


def decode_key(core: Core, rid: str, key: str, raw: dict[bytes, bytes]) -> None:
    """Decode the hash at ``key`` as the record the store keeps there (the check of
    ``locate``); raises what its decoder raises."""
    tail = key[len(core.keys.request_prefix(rid)) :]
    if not raw:
        return
    if tail == "meta":
        core.decode_record(rid, raw)
    elif tail.startswith("part:"):
        core.decode_partition(rid, tail[5:], raw, {})
    elif tail.startswith("pub:"):
        core.published.decode(raw, request_id=rid, key=key)
    elif tail.startswith("conn:"):
        core.decode_connection(rid, tail[5:], raw)
    elif tail == "lease":
        decode_leases(raw, rid, key)
