"""The numbers the store holds: one domain per stored numeric field and per script argument.

Python ints have no bounds, Redis counts in signed 64-bit ints and Lua compares in doubles,
which are exact only below 2**53. So every number the store writes has a domain, checked
before it is sent (``check_int``: a ``ValidationError``) and again when it is read back
(``check_stored``: a ``CorruptRecordError``), so that a value the store wrote always reads back
and a damaged one never reads back as something else.

``FIELDS`` gives the domain of each numeric field of each stored type: of the field's own
value, of its map values (``wg_rank_completions``), or of its int map keys
(``PublishedKVInfo.info``). A field left out holds any signed 64-bit int; the tests check
that every numeric field of every stored type is listed, so a new one is a decision.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from store.errors import CorruptRecordError, ValidationError
from store.records import Lease, RequestRecord
from store.types import (
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)

T = TypeVar("T")

LUA_EXACT = 2**53  # Lua numbers are doubles: integers from here on do not compare exactly
INT64_END = 2**63


def _bound(n: float) -> str:
    """``2**53`` rather than ``9007199254740992``: the bounds people recognise."""
    if isinstance(n, int) and abs(n) >= 2**16 and abs(n) & (abs(n) - 1) == 0:
        return f"{'-' if n < 0 else ''}2**{abs(n).bit_length() - 1}"
    return str(n)


@dataclasses.dataclass(frozen=True)
class IntDomain:
    """The ints ``low <= n < high`` (``bool`` is never one)."""

    name: str
    low: int
    high: int

    def __contains__(self, value: object) -> bool:
        return type(value) is int and self.low <= value < self.high

    def describe(self) -> str:
        return f"an int >= {_bound(self.low)} and < {_bound(self.high)}"

    @property
    def annotated(self) -> Any:
        """The type msgspec checks while it decodes (its bounds are inclusive)."""
        return Annotated[int, msgspec.Meta(ge=self.low, le=self.high - 1)]


@dataclasses.dataclass(frozen=True)
class FloatDomain:
    """Finite numbers ``low <= x < high``; an int is taken as the float it equals."""

    name: str
    low: float
    high: float

    def __contains__(self, value: object) -> bool:
        if type(value) is int:
            return self.low <= value < self.high
        return type(value) is float and math.isfinite(value) and self.low <= value < self.high

    def describe(self) -> str:
        return f"a finite number >= {_bound(self.low)} and < {_bound(self.high)}"

    @property
    def annotated(self) -> Any:
        return Annotated[float, msgspec.Meta(ge=self.low, lt=self.high)]


Domain = IntDomain | FloatDomain

# -- named domains -------------------------------------------------------------------------

INT64 = IntDomain("a signed 64-bit int", -INT64_END, INT64_END)
SEED = IntDomain("a seed", -INT64_END, INT64_END)
# A partition's seed goes up by one per pass (HINCRBY), and passes stay below 2**53: held
# this far below the 64-bit end, the increment can never overflow half way through a script.
PARTITION_SEED = IntDomain("a partition's seed", -INT64_END, INT64_END - LUA_EXACT)
PASS = IntDomain("a forward pass number", 0, LUA_EXACT)
TOKENS = IntDomain("a token count", 0, LUA_EXACT)
COUNT = IntDomain("a count", 0, LUA_EXACT)
RANK = IntDomain("a rank", 0, LUA_EXACT)  # of a report: below its number of ranks
RANKS = IntDomain("a number of ranks", 1, LUA_EXACT)
KV_RANK = IntDomain("a KV rank", 0, INT64_END)  # a part name, never compared by a script
WORLD_SIZE = IntDomain("a world size", 0, LUA_EXACT)
POSITION = IntDomain("a position", 0, LUA_EXACT)
SEQ_LEN = IntDomain("a sequence length", 0, INT64_END)
FENCING_TOKEN = IntDomain("a fencing token", 0, LUA_EXACT)
VERSION = IntDomain("a schema version", 1, LUA_EXACT)
LENGTH = IntDomain("a list length", 0, LUA_EXACT)
LIMIT = IntDomain("a limit", 1, 2**31)  # how many items one call returns (due steps, reap)
TIME = FloatDomain("a time in seconds since the epoch", 0.0, float(LUA_EXACT))
DURATION = FloatDomain("a duration in seconds", 0.0, float(LUA_EXACT))

# Page indices are not compared by any script and hold whatever msgpack holds, so they need
# no check of their own: msgspec reads and writes the same ints (-2**63 to 2**64 - 1).

FIELDS: Mapping[type, Mapping[str, Domain]] = {
    RequestRecord: {
        "max_output_tokens": TOKENS,
        "seed": SEED,
        "created_at": TIME,
        "finished_at": TIME,
    },
    PartitionState: {
        "fwd_pass_number": PASS,
        "random_seed": PARTITION_SEED,
        "wg_rank_completions": COUNT,
        "num_output_tokens": TOKENS,
    },
    StreamingConnectionState: {"token_count": TOKENS, "consumed_count": TOKENS},
    KVSequenceInfo: {"seq_len": SEQ_LEN},
    PublishedKVInfo: {"info": KV_RANK, "world_size": WORLD_SIZE},
    PublishedPositionInfo: {"counters": POSITION},
    Lease: {
        "token": FENCING_TOKEN,
        "pass_number": PASS,
        "expires_at": TIME,
        "sends": COUNT,
        "sent_at": TIME,
    },
}
"""Stored type -> field -> the domain of the numbers the field holds."""

# Fields that hold any number msgpack holds, on purpose; listed so that the completeness test
# can tell them from a field nobody thought about. No script reads them, and the store does
# not interpret them: they are the sampler's or the KV cache's business.
UNBOUNDED: Mapping[type, frozenset[str]] = {
    KVSequenceInfo: frozenset({"page_indices"}),
    SamplingReqConfig: frozenset({"temperature", "top_k", "top_p", "repetition_penalty", "_seed"}),
}


def field_domains(cls: type) -> dict[str, Domain]:
    """The domains of ``cls``'s fields, inherited ones included (a subclass keeps them)."""
    out: dict[str, Domain] = {}
    for base in reversed(cls.__mro__):
        out.update(FIELDS.get(base, {}))
    return out


def numeric_fields(cls: type) -> list[str]:
    """The dataclass fields of ``cls`` whose type holds an int or a float somewhere."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if _holds_number(hints[f.name])]


def _holds_number(tp: Any) -> bool:
    if tp in (int, float):
        return True
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType, dict, list, set, tuple):
        return any(_holds_number(a) for a in args)
    return False


# -- checks ------------------------------------------------------------------------------


def check_int(value: Any, domain: IntDomain, *, what: str, **where: str | None) -> int:
    """``value`` if it is in ``domain``; else a ``ValidationError`` naming ``what`` and where.

    For the arguments of store operations, before anything is sent.
    """
    if type(value) is int and domain.low <= value < domain.high:  # the common case, inline
        return value
    raise ValidationError(f"{what} must be {domain.describe()}, got {_short(value)}", **where)


def check_float(value: Any, domain: FloatDomain, *, what: str, **where: str | None) -> float:
    """``value`` as a float if it is in ``domain``; else a ``ValidationError``."""
    if value in domain:
        return float(value)
    raise ValidationError(f"{what} must be {domain.describe()}, got {_short(value)}", **where)


def check_stored(value: T, domain: Domain, *, what: str, **where: str | None) -> T:
    """``value`` read from Redis if it is in ``domain``; else a ``CorruptRecordError``."""
    if value in domain:
        return value
    raise CorruptRecordError(
        f"stored {what} {_short(value)} is outside its domain ({domain.describe()})", **where
    )


def check_number(value: Any, domain: Domain, *, what: str, **where: str | None) -> Any:
    """``check_int`` or ``check_float``, whichever ``domain`` is for."""
    if isinstance(domain, IntDomain):
        return check_int(value, domain, what=what, **where)
    return check_float(value, domain, what=what, **where)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
