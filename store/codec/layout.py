"""Records as Redis hashes, one field per attribute, derived from the dataclass field types.

Scalars are stored the way Redis itself counts, so that counters and flags can be changed
server-side without reading them (HINCRBY, HSET) and two writers of different fields never
meet:

    int                  "<name>"        decimal                 ("fwd_pass_number" -> b"3")
    bool                 "<name>"        "0" or "1"
    str                  "<name>"        UTF-8
    dict[str, V]         "<name>[<key>]" one field per entry, V as above or msgpack
    set[str]             "<name>[<m>]"   one field per member, value "1"
    list[str]            "<name>"        the length, and "<name>[<i>]" per element
    anything else        "<name>"        msgpack of the declared type (see codec)

Fields whose names start with "_" belong to the store (schema version, dedupe marks) and are
not attributes.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from store.codec.values import Codec
from store.errors import CorruptRecordError, StoreError, ValidationError
from store.schema import SCHEMA_VERSION, VERSION_FIELD

R = TypeVar("R")

_INT = re.compile(rb"-?[0-9]{1,20}")


@dataclasses.dataclass(frozen=True)
class _Scalar:
    """How one value travels as a whole hash field value."""

    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


def _decode_int(raw: bytes) -> int:
    if not _INT.fullmatch(raw):
        raise ValueError(f"{raw[:40]!r} is not a decimal integer")
    return int(raw)


def _decode_bool(raw: bytes) -> bool:
    if raw == b"1":
        return True
    if raw == b"0":
        return False
    raise ValueError(f"{raw[:40]!r} is not a flag (0 or 1)")


def _encode_int(value: Any) -> bytes:
    if type(value) is not int:
        raise TypeError(f"expected int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:  # what Redis counts with (HINCRBY) and decode accepts
        raise ValueError(f"{value} is outside the 64-bit signed range")
    return str(value).encode()


def _encode_bool(value: Any) -> bytes:
    if type(value) is not bool:
        raise TypeError(f"expected bool, got {type(value).__name__}")
    return b"1" if value else b"0"


def _encode_str(value: Any) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return value.encode()


NATIVE: dict[Any, _Scalar] = {
    int: _Scalar(_encode_int, _decode_int),
    bool: _Scalar(_encode_bool, _decode_bool),
    str: _Scalar(_encode_str, lambda raw: raw.decode()),
}


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    shape: str  # "scalar", "map", "set" or "list"
    value: _Scalar
    required: bool


class RecordLayout(Generic[R]):
    """Turns one dataclass type into hash fields and back."""

    def __init__(self, cls: type[R], codec: Codec, *, exclude: Iterable[str] = ()) -> None:
        self.cls = cls
        self.codec = codec
        hints = typing.get_type_hints(cls)
        skip = set(exclude)
        self.fields: dict[str, _Field] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in skip or not f.init:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            self.fields[f.name] = self._field(f.name, hints[f.name], required)

    def _field(self, name: str, tp: Any, required: bool) -> _Field:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp in NATIVE:
            return _Field(name, "scalar", NATIVE[tp], required)
        if origin is dict and args and args[0] is str:
            return _Field(name, "map", self._value(args[1]), required)
        if origin is set and args == (str,):
            return _Field(name, "set", NATIVE[str], required)
        if origin is list and args == (str,):
            return _Field(name, "list", NATIVE[str], required)
        return _Field(name, "scalar", self._blob(tp), required)

    def _value(self, tp: Any) -> _Scalar:
        return NATIVE.get(tp) or self._blob(tp)

    def _blob(self, tp: Any) -> _Scalar:
        codec = self.codec
        return _Scalar(lambda v: codec.encode(v, tp), lambda raw: codec.decode(raw, tp))

    # -- encode ---------------------------------------------------------------------

    def encode(self, record: R, **where: str | None) -> dict[str, bytes]:
        """All hash fields of ``record``, the schema version included."""
        out: dict[str, bytes] = {VERSION_FIELD: str(SCHEMA_VERSION).encode()}
        for spec in self.fields.values():
            out.update(self.encode_field(spec.name, getattr(record, spec.name), **where))
        return out

    def encode_field(self, name: str, value: Any, **where: str | None) -> dict[str, bytes]:
        """The hash fields that hold attribute ``name`` with ``value``."""
        spec = self.fields.get(name)
        if spec is None:
            raise ValidationError(
                f"{self.cls.__name__} has no stored attribute {name!r}", **where, field=name
            )
        try:
            return self._encode(spec, value)
        except StoreError as e:  # the codec's own (an unregistered kind, a size limit): keep it
            e.locate(**{**where, "field": name})
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise ValidationError(
                f"{self.cls.__name__}.{name}: {e}", **{**where, "field": name}
            ) from e

    def _encode(self, spec: _Field, value: Any) -> dict[str, bytes]:
        enc, name = spec.value.encode, spec.name
        if spec.shape == "scalar":
            return {name: enc(value)}
        if spec.shape == "map":
            return {f"{name}[{_key(k)}]": enc(v) for k, v in value.items()}
        if spec.shape == "set":
            return {f"{name}[{_key(m)}]": b"1" for m in value}
        items = {f"{name}[{i}]": enc(v) for i, v in enumerate(value)}
        items[name] = str(len(value)).encode()
        return items

    # -- decode -----------------------------------------------------------------------

    def decode(
        self,
        raw: Mapping[bytes, bytes],
        *,
        extra: Mapping[str, Any] | None = None,
        **where: str | None,
    ) -> R:
        """Build the record from its hash fields; any bad field raises naming that field."""
        plain: dict[str, bytes] = {}
        entries: dict[str, dict[str, bytes]] = {}
        for raw_name, value in raw.items():
            name = raw_name.decode("utf-8", "replace")
            if name.startswith("_"):
                continue
            bracket = name.find("[")
            if bracket < 0:
                plain[name] = value
            elif name.endswith("]"):
                entries.setdefault(name[:bracket], {})[name[bracket + 1 : -1]] = value
            else:
                raise CorruptRecordError("malformed field name", **where, field=name)
        kwargs: dict[str, Any] = dict(extra or {})
        for spec in self.fields.values():
            try:
                present, value = self._decode(spec, plain, entries.get(spec.name, {}))
            except StoreError as e:  # the codec's own (corrupt, too large): keep it, say where
                e.locate(**{**where, "field": spec.name})
                raise
            except (ValueError, TypeError) as e:
                raise CorruptRecordError(
                    f"{self.cls.__name__}.{spec.name} does not decode: {e}",
                    **{**where, "field": spec.name},
                ) from e
            if present:
                kwargs[spec.name] = value
            elif spec.required:
                raise CorruptRecordError(
                    f"{self.cls.__name__}.{spec.name} is missing", **{**where, "field": spec.name}
                )
        return self.cls(**kwargs)

    def _decode(
        self, spec: _Field, plain: dict[str, bytes], entries: dict[str, bytes]
    ) -> tuple[bool, Any]:
        dec = spec.value.decode
        if spec.shape == "scalar":
            if spec.name not in plain:
                return False, None
            return True, dec(plain[spec.name])
        if spec.shape == "map":
            return bool(entries), {k: dec(v) for k, v in entries.items()}
        if spec.shape == "set":
            return bool(entries), set(entries)
        length = _decode_int(plain[spec.name]) if spec.name in plain else 0
        if sorted(entries) != sorted(str(i) for i in range(length)):
            raise ValueError(f"list holds entries {sorted(entries)[:10]} but length {length}")
        # The length field is written even for an empty list, so its presence is what counts.
        return spec.name in plain, [dec(entries[str(i)]) for i in range(length)]


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"keys and members must be str, got {type(key).__name__} {key!r}")
    return key
