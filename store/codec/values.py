"""Encoding of values to bytes: msgspec MessagePack with typed decoding, no pickle.

Encoders and decoders are built once per type and reused. A field declared as the abstract
``PublishedInfo`` or ``ResourceReqConfig`` holds any registered kind; its value is written as
an envelope ``[schema_version, kind_name, payload]`` so that it decodes back to its own kind.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from store.codec.kinds import POLYMORPHIC_BASES, KindRegistry, default_registry
from store.errors import (
    ConfigurationError,
    CorruptRecordError,
    EncodeError,
    PayloadTooLargeError,
    SchemaVersionError,
    StoreError,
    UnknownKindError,
    UnknownStoredKindError,
)
from store.schema import SCHEMA_VERSION

DEFAULT_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
_NIL = msgspec.msgpack.encode(None)

Where = dict[str, "str | None"]
_Convert = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one declared type travels: the type msgspec sees, and converters (None: as is)."""

    wire_type: Any
    to_wire: _Convert | None = None
    from_wire: _Convert | None = None


class Codec:
    """Encodes and decodes values; holds the kind registry and the payload size limit."""

    def __init__(
        self,
        registry: KindRegistry | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if max_payload_bytes <= 0:
            raise ConfigurationError("max_payload_bytes must be positive")
        self.registry = registry or default_registry
        self.max_payload_bytes = max_payload_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(tuple[int, str, msgspec.Raw])
        self._plans: dict[Any, _Plan] = {}
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    # -- values of a declared type -------------------------------------------------------

    def encode(self, value: Any, type_: Any = None, **where: str | None) -> bytes:
        """Encode ``value`` declared as ``type_`` (default: its own class).

        msgspec encodes by the value's own type, so a value of another type than declared is
        refused here: it would be written fine and then fail every read.
        """
        if type_ is not None and not _conforms(value, type_):
            raise EncodeError(f"expected {_type_name(type_)}, got {type(value).__name__}", **where)
        return self._encode(value, self._plan(type(value) if type_ is None else type_), (), where)

    def _encode(
        self, value: Any, plan: _Plan, header: tuple[Any, ...], where: dict[str, str | None]
    ) -> bytes:
        """``value`` through its plan, behind ``header`` items when given; size checked."""
        try:
            payload = plan.to_wire(value) if plan.to_wire else value
            data = self._encoder.encode((*header, payload) if header else payload)
        except StoreError as e:  # a nested value's own error (an unregistered kind): keep it
            e.locate(**where)
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodeError(f"cannot encode {type(value).__name__}: {e}", **where) from e
        self.check_size(data, **where)
        return data

    def decode(self, data: bytes, type_: Any, **where: str | None) -> Any:
        """Decode ``data`` as ``type_``; any failure is a ``CorruptRecordError`` naming where."""
        self.check_size(data, **where)
        plan = self._plan(type_)
        try:
            value = self._decoder(plan.wire_type).decode(data)
            return plan.from_wire(value) if plan.from_wire else value
        except StoreError as e:  # a nested kind's own error (an unknown kind): keep it
            e.locate(**where)
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise CorruptRecordError(
                f"stored value does not decode as {_type_name(type_)}: {e}", **where
            ) from e
        except RecursionError as e:
            raise CorruptRecordError("stored value is nested too deeply to decode", **where) from e

    def check_size(self, data: bytes, **where: str | None) -> None:
        if len(data) > self.max_payload_bytes:
            raise PayloadTooLargeError(len(data), self.max_payload_bytes, **where)

    # -- kind-tagged envelopes ---------------------------------------------------------

    def encode_kind(self, value: Any, **where: str | None) -> bytes:
        """Encode a registered ``PublishedInfo``/``ResourceReqConfig`` with its kind name."""
        cls = type(value)
        name = self.registry.name_of(cls)
        if name is None:
            raise UnknownKindError(
                f"{cls.__module__}.{cls.__qualname__}",
                f"{cls.__qualname__} is not a registered kind; register it with "
                "store.register_kind before storing it",
                **where,
            )
        return self._encode(value, self._plan(cls), (SCHEMA_VERSION, name), where)

    def decode_kind(self, data: bytes, base: type, **where: str | None) -> Any:
        """Decode an envelope into the registered kind it names, which must subclass ``base``."""
        version, name, payload = self.envelope(data, base, **where)
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(version, SCHEMA_VERSION, **where)
        cls = self.registry.type_of(name)
        if cls is None:
            raise UnknownStoredKindError(name, **where)
        if not issubclass(cls, base):
            raise CorruptRecordError(
                f"stored kind {name!r} is a {cls.__qualname__}, not a {base.__name__}", **where
            )
        return self.decode(payload, cls, **where)

    def envelope(
        self, data: bytes, base: type = object, **where: str | None
    ) -> tuple[int, str, msgspec.Raw]:
        """An envelope's version, kind name and undecoded payload."""
        self.check_size(data, **where)
        try:
            version, name, payload = self._envelope.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            what = "" if base is object else f"{base.__name__} "
            raise CorruptRecordError(f"stored value is not a {what}envelope: {e}", **where) from e
        except RecursionError as e:  # skipping the payload recurses too
            raise CorruptRecordError("stored value is nested too deeply to decode", **where) from e
        return version, name, payload

    # -- plans ---------------------------------------------------------------------------

    def _decoder(self, wire_type: Any) -> msgspec.msgpack.Decoder[Any]:
        decoder = self._decoders.get(wire_type)
        if decoder is None:
            decoder = self._decoders[wire_type] = msgspec.msgpack.Decoder(wire_type)
        return decoder

    def _plan(self, tp: Any) -> _Plan:
        plan = self._plans.get(tp)
        if plan is None:
            plan = self._plans[tp] = self._make_plan(tp)
        return plan

    def _make_plan(self, tp: Any) -> _Plan:
        if tp in POLYMORPHIC_BASES:
            base = tp
            return _Plan(
                msgspec.Raw,
                lambda value: msgspec.Raw(self.encode_kind(value)),
                lambda raw: self.decode_kind(bytes(raw), base),
            )
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is dict and len(args) == 2:
            inner = self._plan(args[1])
            if inner.to_wire is None:
                return _Plan(tp)
            to_v, from_v = inner.to_wire, inner.from_wire
            assert from_v is not None
            return _Plan(
                types.GenericAlias(dict, (args[0], inner.wire_type)),
                lambda d: {k: to_v(v) for k, v in d.items()},
                lambda d: {k: from_v(v) for k, v in d.items()},
            )
        if origin in (list, set, frozenset) and len(args) == 1:
            inner = self._plan(args[0])
            if inner.to_wire is None:
                return _Plan(tp)
            to_i, from_i, make = inner.to_wire, inner.from_wire, origin
            assert from_i is not None
            return _Plan(
                types.GenericAlias(list, (inner.wire_type,)),
                lambda xs: [to_i(x) for x in xs],
                lambda xs: make(from_i(x) for x in xs),
            )
        if origin in (typing.Union, types.UnionType):
            return self._optional_plan(tp, args)
        if tuple in (tp, origin):
            return self._tuple_plan(tp, args)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self._dataclass_plan(tp)
        return _Plan(tp)

    def _optional_plan(self, tp: Any, args: tuple[Any, ...]) -> _Plan:
        plans = [self._plan(a) for a in args]
        if all(p.to_wire is None for p in plans):
            return _Plan(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise ConfigurationError(
                f"{tp}: a union may hold a PublishedInfo or ResourceReqConfig only as Optional"
            )
        inner = self._plan(rest[0])
        to_x, from_x = inner.to_wire, inner.from_wire
        assert to_x is not None and from_x is not None
        if inner.wire_type is msgspec.Raw:
            # msgspec decodes ``Raw | None`` as null only; a bare Raw takes nil as well.
            return _Plan(
                msgspec.Raw,
                lambda v: None if v is None else to_x(v),
                lambda v: None if bytes(v) == _NIL else from_x(v),
            )
        return _Plan(
            inner.wire_type | None,
            lambda v: None if v is None else to_x(v),
            lambda v: None if v is None else from_x(v),
        )

    def _tuple_plan(self, tp: Any, args: tuple[Any, ...]) -> _Plan:
        if not args or Ellipsis in args:
            return _Plan(tp)
        plans = [self._plan(a) for a in args]
        if all(p.to_wire is None for p in plans):
            return _Plan(tp)
        ident = _identity
        tos = [p.to_wire or ident for p in plans]
        froms = [p.from_wire or ident for p in plans]
        return _Plan(
            types.GenericAlias(tuple, tuple(p.wire_type for p in plans)),
            lambda t: tuple(f(x) for f, x in zip(tos, t, strict=True)),
            lambda t: tuple(f(x) for f, x in zip(froms, t, strict=True)),
        )

    def _dataclass_plan(self, cls: type) -> _Plan:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        plans = {name: self._plan(hints[name]) for name in names}
        if all(p.to_wire is None for p in plans.values()):
            return _Plan(cls)
        wire = msgspec.defstruct(
            f"{cls.__name__}Wire",
            [(n, plans[n].wire_type | msgspec.UnsetType, msgspec.UNSET) for n in names],
        )
        ident = _identity
        to = {n: p.to_wire or ident for n, p in plans.items()}
        back = {n: p.from_wire or ident for n, p in plans.items()}

        def to_wire(value: Any) -> dict[str, Any]:
            return {n: to[n](getattr(value, n)) for n in names}

        def from_wire(value: Any) -> Any:
            kwargs = {}
            for n in names:
                v = getattr(value, n)
                if v is not msgspec.UNSET:
                    kwargs[n] = back[n](v)
            try:
                return cls(**kwargs)
            except TypeError as e:  # a required field is missing
                raise msgspec.ValidationError(f"{cls.__name__}: {e}") from e

        return _Plan(wire, to_wire, from_wire)


def _conforms(value: Any, tp: Any) -> bool:
    """A shallow check of ``value`` against a declared type (classes only, not generics)."""
    if tp is Any:
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if isinstance(tp, type) and tp is not object:
        return isinstance(value, origin or tp)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


def _identity(value: Any) -> Any:
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__qualname__", None) or str(tp)
