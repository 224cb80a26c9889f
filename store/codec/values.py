"""Encoding of values to bytes: msgspec MessagePack with typed decoding, no pickle.

Encoders and decoders are built once per type and reused. A field declared as the abstract
``PublishedInfo`` or ``ResourceReqConfig`` holds any registered kind; its value is written as
an envelope ``[schema_version, kind_name, payload]`` so that it decodes back to its own kind.

Decoding is bounded by the bytes: msgspec checks every length against its input, numbers of
the store's own types are checked against their domains (``domains``) while msgspec decodes,
plain data (``Any``) may nest ``bounds.MAX_DEPTH`` levels and kinds ``MAX_KIND_NESTING``, and
``KVSequenceInfo`` page indices are decoded only when read (``kv``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from store.codec.bounds import MAX_DEPTH, check_stored_depth
from store.codec.declared import (
    KindName,
    bounded,
    conforms,
    domain_check,
    holds_plain_data,
    identity,
    pass_through,
    refuse_too_deep,
    slot,
    type_name,
)
from store.codec.domains import VERSION, field_domains
from store.codec.kinds import (
    POLYMORPHIC_BASES,
    KindRegistry,
    default_registry,
)
from store.codec.kv import (
    decode_sequence,
    encode_sequence,
    kv_info_from_wire,
    kv_info_to_wire,
)
from store.codec.tagged import ext_hook, tag
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
from store.types import KVSequenceInfo, PublishedKVInfo

DEFAULT_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
MAX_KIND_NESTING = 32
"""How many envelopes a stored value may nest (a kind holding kinds holding kinds...)."""
_NIL = msgspec.msgpack.encode(None)

Where = dict[str, "str | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Context:
    """What a decoder needs besides the value: where it was stored, how deep in kinds."""

    where: Where
    kinds: int = 0

    def nested(self) -> _Context:
        return _Context(self.where, self.kinds + 1)


_ToWire = Callable[[Any], Any]
_FromWire = Callable[[Any, _Context], Any]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one declared type travels: the type msgspec sees, and converters (None: as is)."""

    wire_type: Any
    to_wire: _ToWire | None = None
    from_wire: _FromWire | None = None
    # For a value whose depth is checked on its own bytes: the decoder of its own type, which
    # a value decoded on its own (not as a part of another) uses after the check.
    checked: msgspec.msgpack.Decoder[Any] | None = None


class Codec:
    """Encodes and decodes values; holds the kind registry and the payload size limit."""

    def __init__(
        self,
        registry: KindRegistry | None = None,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if type(max_payload_bytes) is not int or max_payload_bytes <= 0:
            raise ConfigurationError("max_payload_bytes must be positive")
        self.registry = registry or default_registry
        self.max_payload_bytes = max_payload_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(
            tuple[VERSION.annotated, KindName, msgspec.Raw]  # type: ignore[name-defined]
        )
        self._plans: dict[Any, _Plan] = {}
        self._inners: dict[Any, _Plan] = {}
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    # -- values of a declared type -------------------------------------------------------

    def encode(self, value: Any, type_: Any = None, **where: str | None) -> bytes:
        """Encode ``value`` declared as ``type_`` (default: its own class).

        msgspec encodes by the value's own type, so a value of another type than declared is
        refused here: it would be written fine and then fail every read.
        """
        if type_ is None:
            type_ = type(value)
        elif type(value) is not type_ and not conforms(value, type_):  # the class: conforms
            raise EncodeError(f"expected {type_name(type_)}, got {type(value).__name__}", **where)
        return self._encode(value, self._plans.get(type_) or self._plan(type_), (), where)

    def _encode(
        self, value: Any, plan: _Plan, header: tuple[Any, ...], where: dict[str, str | None]
    ) -> bytes:
        """``value`` through its plan, behind ``header`` items when given; size checked."""
        try:
            if plan.checked is not None and not header:  # on its own: written once
                data = self._encoder.encode(tag(value))
                if len(data) > MAX_DEPTH:
                    refuse_too_deep(data)
                self.check_size(data, **where)
                return data
            payload = plan.to_wire(value) if plan.to_wire else value
            data = self._encoder.encode((*header, payload) if header else payload)
        except StoreError as e:  # a nested value's own error (an unregistered kind): keep it
            e.locate(**where)
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise EncodeError(f"cannot encode {type(value).__name__}: {e}", **where) from e
        except RecursionError as e:
            raise EncodeError(
                f"cannot encode {type(value).__name__}: it is nested too deeply", **where
            ) from e
        self.check_size(data, **where)
        return data

    def decode(self, data: bytes, type_: Any, **where: str | None) -> Any:
        """Decode ``data`` as ``type_``; any failure is a ``CorruptRecordError`` naming where."""
        return self._decode(data, type_, _Context(where))

    def _decode(self, data: bytes | msgspec.Raw, type_: Any, context: _Context) -> Any:
        where = context.where
        self.check_size(data, **where)
        plan = self._plans.get(type_) or self._plan(type_)
        try:
            if plan.checked is not None:
                if len(data) > MAX_DEPTH:
                    check_stored_depth(data, **where)
                return plan.checked.decode(data)
            if plan.wire_type is msgspec.Raw and plan.from_wire:  # it decodes the bytes itself
                return plan.from_wire(data, context)
            value = self._decoder(plan.wire_type).decode(data)
            return plan.from_wire(value, context) if plan.from_wire else value
        except StoreError as e:  # a nested kind's own error (an unknown kind): keep it
            e.locate(**where)
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise CorruptRecordError(
                f"stored value does not decode as {type_name(type_)}: {e}", **where
            ) from e
        except RecursionError as e:
            raise CorruptRecordError("stored value is nested too deeply to decode", **where) from e

    def check_size(self, data: bytes | msgspec.Raw, **where: str | None) -> None:
        """Raise ``PayloadTooLargeError`` (naming ``where``) if ``data`` is larger than
        ``max_payload_bytes``."""
        size = len(data)
        if size > self.max_payload_bytes:
            raise PayloadTooLargeError(size, self.max_payload_bytes, **where)

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
        return self._decode_kind(data, base, _Context(where))

    def _decode_kind(self, data: bytes | msgspec.Raw, base: type, context: _Context) -> Any:
        where = context.where
        if context.kinds >= MAX_KIND_NESTING:
            raise CorruptRecordError(
                f"stored value nests kinds more than {MAX_KIND_NESTING} deep", **where
            )
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
        return self._decode(payload, cls, context)

    def envelope(
        self, data: bytes | msgspec.Raw, base: type = object, **where: str | None
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
            decoder = self._decoders[wire_type] = msgspec.msgpack.Decoder(
                wire_type, ext_hook=ext_hook
            )
        return decoder

    def _plan(self, tp: Any) -> _Plan:
        """How a value of ``tp`` travels on its own (or as a converted part of another)."""
        plan = self._plans.get(tp)
        if plan is None:
            plan = self._inner(tp)
            if plan.to_wire is None and holds_plain_data(tp, set()):
                plan = self._depth_checked(plan)
            self._plans[tp] = plan
        return plan

    def _inner(self, tp: Any) -> _Plan:
        """``tp``'s plan inside a value msgspec decodes whole: the outermost value that holds
        plain data checks its depth once, rather than each part of it."""
        plan = self._inners.get(tp)
        if plan is None:
            plan = self._inners[tp] = self._make_plan(tp)
        return plan

    def _make_plan(self, tp: Any) -> _Plan:
        if tp in POLYMORPHIC_BASES:
            base = tp
            return _Plan(
                msgspec.Raw,
                lambda value: msgspec.Raw(self.encode_kind(value)),
                lambda raw, context: self._decode_kind(raw, base, context.nested()),
            )
        if tp is PublishedKVInfo:  # exactly: a subclass may hold more, and goes as any other
            return _Plan(  # read by kv_info_from_wire from its bytes: see there
                msgspec.Raw,
                kv_info_to_wire,
                lambda raw, context: kv_info_from_wire(raw, context.where),
            )
        if tp is KVSequenceInfo:
            return _Plan(
                msgspec.Raw,
                lambda seq: msgspec.Raw(encode_sequence(seq)),
                lambda raw, context: decode_sequence(raw, context.where),
            )
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is dict and len(args) == 2:
            if self._inner(args[1]).to_wire is None:
                return _Plan(tp)
            inner = self._plan(args[1])
            to_v, from_v = inner.to_wire, inner.from_wire
            assert to_v is not None and from_v is not None
            return _Plan(
                types.GenericAlias(dict, (args[0], inner.wire_type)),
                lambda d: {k: to_v(v) for k, v in d.items()},
                lambda d, c: {k: from_v(v, c) for k, v in d.items()},
            )
        if origin in (list, set, frozenset) and len(args) == 1:
            if self._inner(args[0]).to_wire is None:
                return _Plan(tp)
            inner = self._plan(args[0])
            to_i, from_i, make = inner.to_wire, inner.from_wire, origin
            assert to_i is not None and from_i is not None
            return _Plan(
                types.GenericAlias(list, (inner.wire_type,)),
                lambda xs: [to_i(x) for x in xs],
                lambda xs, c: make(from_i(x, c) for x in xs),
            )
        if origin in (typing.Union, types.UnionType):
            return self._optional_plan(tp, args)
        if tuple in (tp, origin):
            return self._tuple_plan(tp, args)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self._dataclass_plan(tp)
        return _Plan(tp)

    def _depth_checked(self, plan: _Plan) -> _Plan:
        """``plan`` for a value that holds plain data (``Any``), whose nesting is capped and
        whose engine values keep their classes (``tagged``).

        msgspec decodes such a value only after its depth was checked on its own bytes
        (cheaply, see ``bounds.too_deep``); it is encoded on its own too, so that what is
        written is checked the same way and never reads back as corrupt.
        """
        decoder, encoder = self._decoder(plan.wire_type), self._encoder

        def to_wire(value: Any) -> msgspec.Raw:
            data = encoder.encode(tag(value))
            if len(data) > MAX_DEPTH:
                refuse_too_deep(data)
            return msgspec.Raw(data)

        def from_wire(raw: msgspec.Raw, context: _Context) -> Any:
            if len(raw) > MAX_DEPTH:
                check_stored_depth(raw, **context.where)
            return decoder.decode(raw)

        return _Plan(msgspec.Raw, to_wire, from_wire, decoder)

    def _optional_plan(self, tp: Any, args: tuple[Any, ...]) -> _Plan:
        if all(self._inner(a).to_wire is None for a in args):
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
                lambda v, c: None if bytes(v) == _NIL else from_x(v, c),
            )
        return _Plan(
            inner.wire_type | None,
            lambda v: None if v is None else to_x(v),
            lambda v, c: None if v is None else from_x(v, c),
        )

    def _tuple_plan(self, tp: Any, args: tuple[Any, ...]) -> _Plan:
        if not args or Ellipsis in args:
            return _Plan(tp)
        if all(self._inner(a).to_wire is None for a in args):
            return _Plan(tp)
        plans = [self._plan(a) for a in args]
        tos = [p.to_wire or identity for p in plans]
        froms = [p.from_wire or pass_through for p in plans]
        return _Plan(
            types.GenericAlias(tuple, tuple(p.wire_type for p in plans)),
            lambda t: tuple(f(x) for f, x in zip(tos, t, strict=True)),
            lambda t, c: tuple(f(x, c) for f, x in zip(froms, t, strict=True)),
        )

    def _dataclass_plan(self, cls: type) -> _Plan:
        """A dataclass through a wire Struct when a field needs converting or a domain."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        domains = {n: d for n, d in field_domains(cls).items() if n in names}
        # A private field travels under its public name (SamplingReqConfig's ``_seed`` as
        # ``seed``, as records held it before the engine made it private).
        public = {n: n[1:] for n in names if n.startswith("_") and n[1:] not in names}
        # An int in a float field (the engine's ``top_p: float = 1``) is written as the float
        # it reads back as: what is written once reads back and is written again the same.
        floats = frozenset(n for n in names if hints[n] is float)
        if not (domains or public or floats) and all(
            self._inner(hints[n]).to_wire is None for n in names
        ):
            return _Plan(cls)
        plans = {name: self._plan(hints[name]) for name in names}
        wire = msgspec.defstruct(
            f"{cls.__name__}Wire",
            [
                (n, bounded(plans[n].wire_type, domains.get(n)) | msgspec.UnsetType, msgspec.UNSET)
                for n in names
            ],
            rename=public or None,
        )
        converters = [
            (n, public.get(n, n), _as_float if n in floats else plans[n].to_wire) for n in names
        ]
        back = [(n, p.from_wire) for n, p in plans.items() if p.from_wire is not None]
        unset, asdict = msgspec.UNSET, msgspec.structs.asdict
        checks = [
            (n, domain_check(d, slot(hints[n]), f"{cls.__name__}.{n}")) for n, d in domains.items()
        ]

        def to_wire(value: Any) -> dict[str, Any]:
            for name, check in checks:
                check(getattr(value, name))
            return {
                w: getattr(value, n) if f is None else f(getattr(value, n))
                for n, w, f in converters
            }

        def from_wire(value: Any, context: _Context) -> Any:
            kwargs = asdict(value)
            # A field the record lacks takes its default. Tested before converting: decoded
            # values only (builtins, Raw, domain dataclasses) meet UNSET's ``==``.
            if unset in kwargs.values():
                kwargs = {n: v for n, v in kwargs.items() if v is not unset}
            for n, convert in back:
                if n in kwargs:
                    kwargs[n] = convert(kwargs[n], context)
            try:
                return cls(**kwargs)
            except TypeError as e:  # a required field is missing
                raise msgspec.ValidationError(f"{cls.__name__}: {e}") from e

        return _Plan(wire, to_wire, from_wire)


def _as_float(value: Any) -> Any:
    return float(value) if type(value) is int else value
