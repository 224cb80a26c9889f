"""How KV infos travel: sequences as short arrays, their page indices decoded on first read.

A partition's KV info holds thousands of page indices that most readers never look at
(they pass the info on, or read a sequence length), yet decoding one makes a Python int per
index, which costs more than the rest of the partition together. So a stored sequence keeps
its indices undecoded: reading one gives a ``LazyKVSequenceInfo``, a ``KVSequenceInfo`` whose
``page_indices`` (a plain ``list[int]``) are decoded the first time they are read, and which
is written back from its stored bytes if they never were.

Stored form (schema v5): the msgpack array ``[seq_len, latest_kv_transfer_info, pages]``
where ``pages`` is a msgpack bin holding the msgpack array of page indices, so that a reader
steps over them in one move instead of walking thousands of ints; fields added later go at
the end, with defaults. Older records and nested envelopes written before v5 hold the map
``{"seq_len": ..., "latest_kv_transfer_info": ..., "page_indices": [...]}``; both read the
same.

A whole ``PublishedKVInfo`` (in an envelope) is the map ``{"info": {rank: {cache label:
sequence}}, "world_size": n}``, as msgspec writes the dataclass; ``kv_info_to_wire`` and
``kv_info_from_wire`` build and read it in one step each, with its ranks and world size
checked against their domains, rather than through the codec's general converters. The read
takes every sequence in one msgspec pass when all are in the array form with a transfer info
too short to nest deeply (what v5 writes); any other goes sequence by sequence.

Damage is found as early as is cheap: the shape, ``seq_len``, the transfer info and that the
indices are an array are checked on read; the indices themselves when they are first read,
which raises ``CorruptRecordError`` naming the record and field they came from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from store.codec import bounds
from store.codec.bounds import MAX_DEPTH
from store.codec.domains import KV_RANK, SEQ_LEN, WORLD_SIZE, check_int
from store.codec.tagged import ext_hook, tag
from store.errors import CorruptRecordError, ValidationError
from store.types import KVSequenceInfo, PublishedKVInfo

Where = dict[str, "str | None"]

_PENDING = "_page_indices_undecoded"  # instance attribute: (the stored array, where)
_ARRAY_OPENERS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_OPENERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])

if TYPE_CHECKING:
    _SeqLen = int
    _Rank = int
    _WorldSize = int
else:  # msgspec checks the domains while it decodes
    _SeqLen = SEQ_LEN.annotated
    _Rank = KV_RANK.annotated
    _WorldSize = WORLD_SIZE.annotated


class _ArrayForm(msgspec.Struct, array_like=True):
    seq_len: _SeqLen
    latest_kv_transfer_info: msgspec.Raw
    page_indices: bytes  # the msgpack array, as a bin


class _ArrayFormPlain(msgspec.Struct, array_like=True):
    """The array form with the transfer info decoded in the same pass (see decode)."""

    seq_len: _SeqLen
    latest_kv_transfer_info: Any
    page_indices: bytes


class _MapForm(msgspec.Struct):
    """What v4 and older wrote. Every field was always written, so none has a default:
    a part that lacks one is damaged, not a sequence of defaults."""

    seq_len: _SeqLen
    latest_kv_transfer_info: msgspec.Raw
    page_indices: msgspec.Raw


_array_form = msgspec.msgpack.Decoder(_ArrayForm)
_array_form_plain = msgspec.msgpack.Decoder(_ArrayFormPlain, ext_hook=ext_hook)
_map_form = msgspec.msgpack.Decoder(_MapForm)
_any = msgspec.msgpack.Decoder(ext_hook=ext_hook)
_decode_any = _any.decode
_new = object.__new__
_pages = msgspec.msgpack.Decoder(list[int])
_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_SEQ_LEN_END = SEQ_LEN.high


class LazyKVSequenceInfo(KVSequenceInfo):
    """A stored ``KVSequenceInfo``; ``page_indices`` is decoded when first read.

    It is a ``KVSequenceInfo`` for every use: equal to one with the same fields, printed as
    one, encoded by msgspec by its fields, copied and pickled as a plain ``KVSequenceInfo``.
    Built with its fields (as ``dataclasses.replace`` does), it is an ordinary one.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not set yet: the indices before their first read.
        pending = self.__dict__.get(_PENDING) if name == "page_indices" else None
        if pending is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raw, where = pending
        try:
            pages = _pages.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise CorruptRecordError(f"stored page indices do not decode: {e}", **where) from e
        self.__dict__["page_indices"] = pages
        del self.__dict__[_PENDING]
        return pages

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "page_indices":  # the stored indices no longer say what this holds
            self.__dict__.pop(_PENDING, None)
        super().__setattr__(name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVSequenceInfo):
            return NotImplemented
        return _fields(self) == _fields(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass

    def __repr__(self) -> str:
        seq_len, transfer, pages = _fields(self)
        return (
            f"KVSequenceInfo(seq_len={seq_len!r}, latest_kv_transfer_info={transfer!r}, "
            f"page_indices={pages!r})"
        )

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return KVSequenceInfo, _fields(self)


def _fields(seq: KVSequenceInfo) -> tuple[Any, Any, Any]:
    return seq.seq_len, seq.latest_kv_transfer_info, seq.page_indices


def decode_sequence(data: bytes | msgspec.Raw, where: Where) -> LazyKVSequenceInfo:
    """A stored sequence (either form); any damage found now raises ``CorruptRecordError``."""
    try:
        # The array form (all that v5 writes) in one pass when the transfer info is too
        # short to nest deeply (the array holds at least 4 bytes besides it and the pages).
        plain = _array_form_plain.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _decode_other(data, where)
    pages = plain.page_indices
    if len(data) - len(pages) - 4 > MAX_DEPTH:
        return _decode_other(data, where)
    return _lazy(plain.seq_len, plain.latest_kv_transfer_info, pages, where)


def _decode_other(data: bytes | msgspec.Raw, where: Where) -> LazyKVSequenceInfo:
    """A sequence in the map form, one whose transfer info is long enough to be checked for
    depth first, or damage (named precisely)."""
    opener = (data if type(data) is bytes else memoryview(data))[:1]
    try:
        if opener and opener[0] in _ARRAY_OPENERS:
            wire = _array_form.decode(data)
            seq_len, pages = wire.seq_len, wire.page_indices
            bounds.check_stored_depth(wire.latest_kv_transfer_info, **where)
            transfer = _any.decode(wire.latest_kv_transfer_info)
        elif opener and opener[0] in _MAP_OPENERS:
            old = _map_form.decode(data)
            seq_len, pages = old.seq_len, bytes(old.page_indices)
            bounds.check_stored_depth(old.latest_kv_transfer_info, **where)
            transfer = _any.decode(old.latest_kv_transfer_info)
        else:
            raise CorruptRecordError("stored KVSequenceInfo is not an array or a map", **where)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptRecordError(
            f"stored value does not decode as KVSequenceInfo: {e}", **where
        ) from e
    except RecursionError as e:  # skipping a deep value recurses too
        raise CorruptRecordError("stored value is nested too deeply to decode", **where) from e
    return _lazy(seq_len, transfer, pages, where)


def _lazy(seq_len: int, transfer: Any, pages: bytes, where: Where) -> LazyKVSequenceInfo:
    """The sequence read, its page indices kept undecoded once they are seen to be an array."""
    if not pages or pages[0] not in _ARRAY_OPENERS:
        raise CorruptRecordError("stored page indices are not an array", **where)
    seq = _new(LazyKVSequenceInfo)
    held = seq.__dict__
    held["seq_len"] = seq_len
    held["latest_kv_transfer_info"] = transfer
    held[_PENDING] = (pages, where)
    return seq


def encode_sequence(seq: Any) -> bytes:
    """The stored form of ``seq``; an untouched lazy one reuses its stored indices.

    Page indices are checked for being a list, not item by item: that would cost more than
    encoding them. An index msgpack cannot hold fails here; one of another type fails when
    it is read back.
    """
    if not isinstance(seq, KVSequenceInfo):
        raise TypeError(f"expected KVSequenceInfo, got {type(seq).__name__}")
    held = seq.__dict__
    seq_len = held.get("seq_len")
    if type(seq_len) is not int or not 0 <= seq_len < _SEQ_LEN_END:
        seq_len = seq.seq_len
        check_int(seq_len, SEQ_LEN, what="seq_len")
    pending = held.get(_PENDING)
    if pending is not None and "page_indices" not in held:
        pages: bytes = pending[0]
    else:
        indices = seq.page_indices
        if type(indices) is not list:
            raise TypeError(f"page_indices must be a list, got {type(indices).__name__}")
        pages = _encode(indices)
    transfer = tag(seq.latest_kv_transfer_info)  # a transfer descriptor keeps its class
    data = _encode((seq_len, transfer, pages))
    # Besides the transfer info, the array holds at least 4 bytes (its header, seq_len, the
    # pages' bin header) and the pages: a transfer info in what is left cannot nest deeper.
    if len(data) - len(pages) - 4 > MAX_DEPTH:
        bounds.check_written_depth(_encode(transfer))
    return data


# -- a whole PublishedKVInfo ----------------------------------------------------------------


class _KVInfoWire(msgspec.Struct):
    """A ``PublishedKVInfo`` payload; a field it lacks takes the dataclass default."""

    info: dict[_Rank, dict[str, msgspec.Raw]] = {}
    world_size: _WorldSize = 1


class _KVInfoArrays(msgspec.Struct):
    """The same with every sequence in the array form (all that v5 writes): one pass."""

    info: dict[_Rank, dict[str, _ArrayForm]] = {}
    world_size: _WorldSize = 1


_kv_info_wire = msgspec.msgpack.Decoder(_KVInfoWire)
_kv_info_arrays = msgspec.msgpack.Decoder(_KVInfoArrays)


def kv_info_to_wire(info: PublishedKVInfo) -> dict[str, Any]:
    """What msgspec encodes for ``info``: its map, every sequence in its stored form."""
    world_size = info.world_size
    if type(world_size) is not int or not 0 <= world_size < WORLD_SIZE.high:
        check_int(world_size, WORLD_SIZE, what="PublishedKVInfo.world_size")
    ranks = info.info
    if not isinstance(ranks, dict):
        raise ValidationError(f"PublishedKVInfo.info must be a dict, got {type(ranks).__name__}")
    out: dict[int, dict[str, msgspec.Raw]] = {}
    for rank, labels in ranks.items():
        if type(rank) is not int or not 0 <= rank < KV_RANK.high:
            check_int(rank, KV_RANK, what="PublishedKVInfo.info key")
        if not isinstance(labels, dict):
            raise ValidationError(f"kv rank {rank} must map cache labels to sequences")
        held = out[rank] = {}
        for cache, seq in labels.items():
            if type(cache) is not str:
                raise ValidationError(f"kv cache labels must be str, got {cache!r}")
            held[cache] = msgspec.Raw(encode_sequence(seq))
    return {"info": out, "world_size": world_size}


def kv_info_from_wire(data: bytes | msgspec.Raw, where: Where) -> PublishedKVInfo:
    """A ``PublishedKVInfo`` payload: in one pass when every sequence is in the array form
    with a short transfer info, else sequence by sequence (older forms, long transfer infos
    checked for depth, and damage, named precisely)."""
    try:
        arrays = _kv_info_arrays.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        arrays = None
    info: dict[int, dict[str, KVSequenceInfo]]
    if arrays is not None:
        try:
            info = {
                rank: {cache: _from_array(seq, where) for cache, seq in labels.items()}
                for rank, labels in arrays.info.items()
            }
        except _PerSequence:
            pass
        else:
            return PublishedKVInfo(info=info, world_size=arrays.world_size)
    wire = _kv_info_wire.decode(data)
    info = {
        rank: {cache: decode_sequence(raw, where) for cache, raw in labels.items()}
        for rank, labels in wire.info.items()
    }
    return PublishedKVInfo(info=info, world_size=wire.world_size)


class _PerSequence(Exception):
    """A sequence the one-pass read leaves to ``decode_sequence``."""


def _from_array(stored: _ArrayForm, where: Where) -> LazyKVSequenceInfo:
    transfer = stored.latest_kv_transfer_info
    if len(transfer) > MAX_DEPTH:  # checked for depth first, on the way sequence by sequence
        raise _PerSequence
    try:
        decoded = _decode_any(transfer)
    except (msgspec.DecodeError, RecursionError) as e:  # named there
        raise _PerSequence from e
    return _lazy(stored.seq_len, decoded, stored.page_indices, where)
