"""Limits that keep reading a stored value as cheap as its bytes: digits, text, nesting.

A reader must never do more work or hold more memory than the bytes it was handed justify,
whatever they hold. msgspec already checks every length it reads against the input; this
module covers what sits around it: decimal integers in hash fields (a bounded number of
digits, in the one canonical form scripts compare), text (strict UTF-8), and the nesting of
plain-data values (``Any`` fields), capped at ``MAX_DEPTH`` so that a value that reads back
also prints, compares and copies without running out of stack.
"""

from __future__ import annotations

import re

from store.errors import CorruptRecordError

MAX_DEPTH = 64
"""The deepest nesting of containers a plain-data (``Any``) value may have."""

# The canonical decimal form, as Python's str(int) and Redis's HINCRBY write it: no sign on
# zero, no leading zeros, at most 19 digits (a signed 64-bit int has 19).
_DECIMAL = re.compile(rb"0|-?[1-9][0-9]{0,18}")
_INT64_END = 2**63


def parse_int(raw: bytes) -> int:
    """A signed 64-bit int written in canonical decimal; else ``ValueError``.

    A script compares pass numbers as text and Redis refuses to increment "03", so a
    non-canonical number is damage even though ``int()`` would read it.
    """
    if not _DECIMAL.fullmatch(raw):
        raise ValueError(f"{raw[:40]!r} is not a decimal integer")
    value = int(raw)
    if not -_INT64_END <= value < _INT64_END:
        raise ValueError(f"{raw[:40]!r} is outside the 64-bit signed range")
    return value


def decode_text(raw: bytes) -> str:
    """``raw`` as strict UTF-8; else ``ValueError`` (never a replacement character)."""
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"{raw[:40]!r} is not UTF-8 text ({e.reason} at byte {e.start})") from e


# -- nesting of msgpack values --------------------------------------------------------------

# Every container opens with one of these bytes (fixmap, fixarray, array16/32, map16/32).
_OPENERS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_OPENERS = bytes(b for b in range(256) if b not in _OPENERS)

# Bytes that follow a type byte: fixed sizes, and the width of a length prefix.
_FIXED = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin, str
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_ARRAYS = {0xDC: 2, 0xDD: 4}
_MAPS = {0xDE: 2, 0xDF: 4}


def check_written_depth(data: bytes) -> None:
    """Refuse (``ValueError``) to write a value that would read back as too deep."""
    if too_deep(data):
        raise ValueError(f"value is nested deeper than {MAX_DEPTH} levels")


def check_stored_depth(data: bytes | memoryview, **where: str | None) -> None:
    """A stored value nested deeper than ``MAX_DEPTH`` is corrupt, whatever it holds."""
    if too_deep(data):
        raise CorruptRecordError(f"stored value is nested deeper than {MAX_DEPTH} levels", **where)


def too_deep(data: bytes | memoryview, limit: int = MAX_DEPTH) -> bool:
    """Whether the msgpack value in ``data`` nests containers more than ``limit`` deep.

    Each level needs a byte of its own that opens a container, so most values are cleared by
    their length or by counting such bytes (in C); only the rest are walked token by token,
    which takes time proportional to their size. Malformed input is left to the decoder
    (False): it reports it with a better message.
    """
    if len(data) <= limit:
        return False
    data = bytes(data)
    if len(data.translate(None, _NOT_OPENERS)) <= limit:
        return False
    return _walk(data, limit)


def _walk(data: bytes, limit: int) -> bool:
    pending: list[int] = []  # items still to read in each open container, innermost last
    pos, end = 0, len(data)
    while pos < end:
        b = data[pos]
        pos += 1
        items = -1  # not a container
        if b <= 0x7F or b >= 0xE0:
            pass
        elif b <= 0x8F:
            items = (b & 0x0F) * 2
        elif b <= 0x9F:
            items = b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width = _SIZED[b]
            pos += width + int.from_bytes(data[pos : pos + width], "big")
        elif b in _EXT:
            width = _EXT[b]
            pos += width + 1 + int.from_bytes(data[pos : pos + width], "big")
        elif b in _ARRAYS or b in _MAPS:
            width = _ARRAYS.get(b) or _MAPS[b]
            items = int.from_bytes(data[pos : pos + width], "big") * (1 if b in _ARRAYS else 2)
            pos += width
        else:  # 0xc1 is never used
            return False
        if items >= 0 and len(pending) >= limit:
            return True  # a container inside ``limit`` open ones
        if items > 0:
            pending.append(items)
            continue
        while pending:  # an item is complete: so may be the containers around it
            pending[-1] -= 1
            if pending[-1]:
                break
            pending.pop()
        else:
            return False  # the whole value is read
    return False
