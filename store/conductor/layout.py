"""How a ``ConductorRequest`` is held in Redis: one hash per request, a field per part.

``<ns>:{<rid>}:conductor``: ``head`` (the request-level fields, msgspec-encoded),
``p:<partition>`` (a ``PartitionState``), ``c:<from>-><to>`` (a ``StreamingConnectionState``),
``order`` (partition and connection names in the engine's order), ``ver`` (the version every
write raises), ``_f`` (the format), ``ops`` and ``nops`` (the latest op ids, one per line,
kept by the script) and ``o:<op id>`` (each one's result, so that a retried op returns what
it did). A pass rewrites only the fields it changed. Before its request, the hash may hold
only ``early`` (an abort or READS_DONE that came first); after teardown only ``state`` =
``gone`` and the results, until it expires.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from store.codec.values import Codec
from store.conductor.record import (
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    IngestOutcome,
    PassOutcome,
    TeardownOutcome,
)
from store.errors import CorruptRecordError, SchemaVersionError
from store.types import PartitionState, StreamingConnectionState

FORMAT = b"1"
"""The layout's version; a reader refuses another (``SchemaVersionError``)."""
RECENT_OPS = 64
"""How many of a request's latest op ids keep their result: a retry within them applies
once (a lost reply is retried within seconds; a pass writes one op, or one per message and
pass unbatched). Each kept result costs memory: about 170 bytes of the hash's."""

_OUTCOMES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GraphsDoneOutcome, PassOutcome, TeardownOutcome, Conclusion, IngestOutcome)
}
_ORDER = msgspec.msgpack.Decoder(tuple[list[str], list[str]])
_EARLY = msgspec.msgpack.Decoder(tuple[bool, list[str]])
_RESULT = msgspec.msgpack.Decoder(list[tuple[str, msgspec.Raw]])
_encode = msgspec.msgpack.encode


@dataclass
class Early:
    """What came before the request: an abort (a tombstone), READS_DONE from entities."""

    aborted: bool = False
    reads_done: set[str] = field(default_factory=set)


@dataclass
class Stored:
    """One read of the hash: its version, its fields as bytes (``raw``, the results of the
    latest ops apart, in ``results``: op id -> result, oldest first), and what they hold."""

    version: int
    raw: dict[str, bytes]
    results: dict[str, bytes] = field(default_factory=dict)
    request: ConductorRequest | None = None
    early: Early | None = None
    gone: bool = False

    @property
    def holds_request(self) -> bool:
        """A request is held (decoded or not)."""
        return "head" in self.raw and not self.gone


def encode_request(codec: Codec, key: str, request: ConductorRequest) -> dict[str, bytes]:
    """The fields that hold ``request`` at ``key`` (not the version, ops or results)."""
    rid = request.request_id
    head = dataclasses.replace(request, partition_states={}, streaming_connections={})
    fields = {
        "head": codec.encode(head, ConductorRequest, request_id=rid, key=key, field="head"),
        "order": _encode((list(request.partition_states), list(request.streaming_connections))),
    }
    for name, pstate in request.partition_states.items():
        fields[f"p:{name}"] = codec.encode(
            pstate, PartitionState, request_id=rid, key=key, field=f"p:{name}"
        )
    for name, conn in request.streaming_connections.items():
        fields[f"c:{name}"] = codec.encode(
            conn, StreamingConnectionState, request_id=rid, key=key, field=f"c:{name}"
        )
    return fields


def split_results(flat: dict[str, bytes]) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """A hash read whole, as (its fields, the op results by op id)."""
    raw, results = {}, {}
    for name, value in flat.items():
        if name[:2] == "o:":
            results[name[2:]] = value
        else:
            raw[name] = value
    return raw, results


def decode_stored(
    codec: Codec,
    rid: str,
    key: str,
    raw: dict[str, bytes],
    *,
    request: bool = True,
    results: dict[str, bytes] | None = None,
) -> Stored:
    """The hash read whole (``HGETALL``, field names as text); raises
    ``CorruptRecordError`` naming the field. ``request=False``: the request's own fields
    are left undecoded (``Stored.holds_request`` still says whether it holds one)."""
    where: dict[str, str | None] = {"request_id": rid, "key": key}
    found = raw.get("_f")
    if found is not None and found != FORMAT:
        raise SchemaVersionError(_int(found, where, "_f"), int(FORMAT), **where)
    version = _int(raw.get("ver", b"0"), where, "ver")
    stored = Stored(version=version, raw=raw, results=results or {})
    if raw.get("state") == b"gone":
        stored.gone = True
    elif "early" in raw:
        aborted, entities = _decoded(_EARLY, raw["early"], where, "early")
        stored.early = Early(aborted, set(entities))
    elif "head" in raw and request:
        stored.request = _decode_request(codec, raw, where)
    return stored


def _decode_request(codec: Codec, raw: dict[str, bytes], where: dict[str, str | None]) -> Any:
    request = codec.decode(raw["head"], ConductorRequest, **where, field="head")
    partitions, connections = _decoded(_ORDER, raw.get("order", b""), where, "order")
    for name in partitions:
        request.partition_states[name] = codec.decode(
            _field(raw, f"p:{name}", where), PartitionState, **where, field=f"p:{name}"
        )
    for name in connections:
        request.streaming_connections[name] = codec.decode(
            _field(raw, f"c:{name}", where), StreamingConnectionState, **where, field=f"c:{name}"
        )
    return request


def encode_result(codec: Codec, outcomes: list[Any]) -> bytes:
    """An op's outcomes (one per step, each with its class), so that its retry returns
    them."""
    return _encode([(type(o).__name__, msgspec.Raw(codec.encode(o, type(o)))) for o in outcomes])


def decode_result(codec: Codec, data: bytes, **where: str | None) -> list[Any]:
    outcomes = []
    for kind, part in _decoded(_RESULT, data, where, "o:"):
        cls = _OUTCOMES.get(kind)
        if cls is None:
            raise CorruptRecordError(f"unknown outcome {kind!r}", **where)
        outcomes.append(codec.decode(bytes(part), cls, **where))
    return outcomes


def encode_early(early: Early) -> bytes:
    return _encode((early.aborted, sorted(early.reads_done)))


def _field(raw: dict[str, bytes], name: str, where: dict[str, str | None]) -> bytes:
    value = raw.get(name)
    if value is None:
        raise CorruptRecordError("field missing (named in 'order')", **where, field=name)
    return value


def _decoded(decoder: Any, data: bytes, where: dict[str, str | None], name: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise CorruptRecordError(f"unreadable: {e}", **where, field=name) from e


def _int(data: bytes, where: dict[str, str | None], name: str) -> int:
    if not data.isdigit() or len(data) > 18:
        raise CorruptRecordError(f"not a version: {data[:40]!r}", **where, field=name)
    return int(data)


class StoredCache:
    """The latest version this client wrote or read of each request, so that an op needs no
    read first: the conductor that drives a request is its only writer, and a write made on
    an older version is refused (``STALE``) and made again on a fresh read."""

    def __init__(self, size: int = 4096) -> None:
        self._held: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            stored = self._held.get(rid)
            if stored is not None:
                self._held.move_to_end(rid)
            return stored

    def put(self, rid: str, stored: Stored) -> None:
        with self._lock:
            self._held[rid] = stored
            self._held.move_to_end(rid)
            while len(self._held) > self.size:
                self._held.popitem(last=False)

    def drop(self, rid: str) -> None:
        with self._lock:
            self._held.pop(rid, None)
