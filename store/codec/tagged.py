"""The engine's values inside plain data, read back as their own classes.

A field declared ``Any`` (a KV sequence's ``latest_kv_transfer_info``, a request's final
outputs, a pass's kwargs) holds plain data, which msgpack writes as maps and arrays. The
engine puts its own classes there: KV transfer descriptors, which its KV manager compares
with ``==`` (a dict in their place changes what it does), their ``KVLayout`` enum, tuples,
loop indices. So inside plain data a value of a registered class is written as the msgpack
extension ``VALUE_EXT`` holding ``[name, fields]``, and a tuple as ``TUPLE_EXT`` holding its
items; a reader builds the class its name is registered for, never one a stored name could
import. A reader without the engine gets the bundled copy's class of the same name, so a
record reads back equal in either process.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import msgspec

from store.codec.bounds import MAX_DEPTH, too_deep
from store.codec.declared import holds_plain_data
from store.errors import ConfigurationError
from store.types import (
    CudaIpcKVTransferInfo,
    KVLayout,
    MooncakeKVTransferInfo,
    NestedLoopIndices,
    TensorPointerInfo,
)

VALUE_EXT = 1
TUPLE_EXT = 2
_SCALARS = frozenset([str, int, float, bool, bytes, type(None)])

_types: dict[str, type] = {}
_names: dict[type, str] = {}
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def register_value_kind(cls: type, name: str) -> type:
    """Keep ``cls`` (a dataclass of declared types, or an enum) as itself inside plain data,
    stored as ``name``."""
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise ConfigurationError(f"{cls.__qualname__} is neither a dataclass nor an enum")
    held = _types.get(name)
    if held is not None and held is not cls:
        raise ConfigurationError(f"value kind name {name!r} is taken by {held.__qualname__}")
    _types[name], _names[cls] = cls, name
    _decoders[cls] = msgspec.msgpack.Decoder(cls, ext_hook=ext_hook)
    return cls


_encoder = msgspec.msgpack.Encoder()
_plain_by_class: dict[type, frozenset[str] | None] = {}
_UNSEEN = frozenset(["<unseen>"])


def _plain_fields(cls: type) -> frozenset[str] | None:
    """The fields of dataclass ``cls`` that hold plain data (None: not a dataclass)."""
    plain = _plain_by_class.get(cls, _UNSEEN)
    if plain is not _UNSEEN:
        return plain
    plain = None
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        plain = frozenset(
            f.name for f in dataclasses.fields(cls) if holds_plain_data(hints[f.name], set())
        )
    _plain_by_class[cls] = plain
    return plain


def tag(value: Any) -> Any:
    """``value`` with every registered class and tuple in it made an extension.

    The common case, plain data only, is only looked through, and returned as it is.
    """
    return _tagged(value) if _needs_tags(value, 0) else value


def _needs_tags(value: Any, depth: int) -> bool:
    # Loops rather than any() over generators, and scalars tested inline: this runs on every
    # plain value the store writes (a pass's metadata, a KV sequence's transfer info).
    kind = type(value)
    if kind in _SCALARS or depth > MAX_DEPTH:  # too deep: the depth check refuses it
        return False
    if kind is dict:
        values: Any = value.values()
    elif kind is list:
        values = value
    elif kind is tuple or kind in _names:
        return True
    else:
        plain = _plain_fields(kind)
        if not plain:
            return False
        values = [getattr(value, n) for n in plain]
    for item in values:  # noqa: SIM110  (see above: any() over a generator costs more)
        if type(item) not in _SCALARS and _needs_tags(item, depth + 1):
            return True
    return False


def _tagged(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:  # keys stay as they are: msgpack's extensions are not hashable
        return {k: _tagged(v) for k, v in value.items()}
    if kind is list:
        return [_tagged(v) for v in value]
    if kind is tuple:
        return msgspec.msgpack.Ext(TUPLE_EXT, _encoder.encode([_tagged(v) for v in value]))
    name = _names.get(kind)
    if name is None:
        plain = _plain_fields(kind)
        if plain is None:
            return value  # msgspec writes it, or names it in its error
        # Another dataclass: its fields as msgspec would write them, those of plain data
        # tagged (a field of a declared type reads back as that type untagged).
        return {
            f.name: _tagged(getattr(value, f.name)) if f.name in plain else getattr(value, f.name)
            for f in dataclasses.fields(value)
        }
    # Its fields as msgspec writes them, and reads them back by their declared types.
    return msgspec.msgpack.Ext(VALUE_EXT, _encoder.encode([name, value]))


def ext_hook(code: int, data: memoryview) -> Any:
    """msgspec's hook for extensions: the tagged value, or ``ValidationError`` (damage)."""
    if len(data) > MAX_DEPTH and too_deep(data):
        raise msgspec.ValidationError("a tagged value is nested too deeply")
    try:
        if code == TUPLE_EXT:
            return tuple(_items.decode(data))
        if code != VALUE_EXT:
            raise msgspec.ValidationError(f"unknown msgpack extension {code}")
        name, fields = _header.decode(data)
        cls = _types.get(name)
        if cls is None:
            raise msgspec.ValidationError(f"unknown value kind {name!r}")
        return _decoders[cls].decode(fields)
    except RecursionError as e:
        raise msgspec.ValidationError("a tagged value is nested too deeply") from e


_items: msgspec.msgpack.Decoder[list[Any]] = msgspec.msgpack.Decoder(list[Any], ext_hook=ext_hook)
_header: msgspec.msgpack.Decoder[tuple[str, msgspec.Raw]] = msgspec.msgpack.Decoder(
    tuple[str, msgspec.Raw]
)

register_value_kind(KVLayout, "kv_layout")
register_value_kind(MooncakeKVTransferInfo, "kv_transfer.mooncake")
register_value_kind(CudaIpcKVTransferInfo, "kv_transfer.cuda_ipc")
register_value_kind(NestedLoopIndices, "loop_indices")
register_value_kind(TensorPointerInfo, "tensor_pointer")
