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
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from store.codec.bounds import decode_text, parse_int
from store.codec.domains import (
    LENGTH,
    Domain,
    IntDomain,
    check_number,
    check_stored,
    field_domains,
)
from store.codec.values import Codec
from store.errors import CorruptRecordError, StoreError, ValidationError
from store.schema import SCHEMA_VERSION, VERSION_FIELD

R = TypeVar("R")
Where = dict[str, "str | None"]
_Read = Callable[[dict[str, bytes], "dict[str, bytes] | None"], tuple[bool, Any]]

_CURRENT = str(SCHEMA_VERSION).encode()


@dataclasses.dataclass(frozen=True)
class _Scalar:
    """How one value travels as a whole hash field value."""

    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


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
    return value.encode()  # its size is checked by the layout, which knows the limit


NATIVE: dict[Any, _Scalar] = {
    int: _Scalar(_encode_int, parse_int),
    bool: _Scalar(_encode_bool, _decode_bool),
    str: _Scalar(_encode_str, decode_text),
}


def _within(scalar: _Scalar, domain: Domain, what: str) -> _Scalar:
    """``scalar`` with its numbers kept in ``domain``, both ways."""
    encode, decode = scalar.encode, scalar.decode
    if scalar is NATIVE[int] and isinstance(domain, IntDomain):
        return _int_within(domain, what)

    def checked_encode(value: Any) -> bytes:
        encoded = encode(value)  # a value of the wrong type is the encoder's to name
        check_number(value, domain, what=what)
        return encoded

    def checked_decode(raw: bytes) -> Any:
        return check_stored(decode(raw), domain, what=what)

    return _Scalar(checked_encode, checked_decode)


def _int_within(domain: IntDomain, what: str) -> _Scalar:
    """A decimal field in ``domain``: the common case (a number in range) in a few string
    operations, anything else through the general checks, which say what is wrong."""
    low, high = domain.low, domain.high  # within the signed 64-bit range

    def encode(value: Any) -> bytes:
        if type(value) is int and low <= value < high:
            return str(value).encode()
        _encode_int(value)  # the wrong type, or beyond 64 bits
        check_number(value, domain, what=what)
        raise AssertionError("unreachable: the value is out of its domain")

    def decode(raw: bytes) -> int:
        if raw.isdigit() and len(raw) <= 19 and (raw[0] != 0x30 or len(raw) == 1):
            value = int(raw)
            if low <= value < high:
                return value
        return check_stored(parse_int(raw), domain, what=what)

    return _Scalar(encode, decode)


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
        domains = field_domains(cls)
        skip = set(exclude)
        self.fields: dict[str, _Field] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in skip or not f.init:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            spec = self._field(f.name, hints[f.name], required)
            domain = domains.get(f.name)
            if domain is not None:
                what = f"{cls.__name__}.{f.name}"
                spec = dataclasses.replace(spec, value=_within(spec.value, domain, what))
            self.fields[f.name] = spec
        # The raw names of the attributes held in one field of their own (scalars, and a
        # list's length), so decoding finds them without parsing the name.
        self._names = {
            name.encode(): name
            for name, spec in self.fields.items()
            if spec.shape in ("scalar", "list")
        }
        # Per attribute, in order: its name, whether it must be there, and how it is read:
        # a scalar's value decoder (its one field, looked up inline), else a reader.
        self._readers = [
            (name, spec.required, spec.value.decode, None)
            if spec.shape == "scalar"
            else (name, spec.required, None, self._reader(spec))
            for name, spec in self.fields.items()
        ]

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
        out: dict[str, bytes] = {VERSION_FIELD: _CURRENT}
        for spec in self.fields.values():
            try:
                self._write(spec, getattr(record, spec.name), out)
            except StoreError as e:  # the codec's own (an unregistered kind, a limit)
                e.locate(**{**where, "field": spec.name})
                raise
            except (TypeError, ValueError, AttributeError) as e:
                raise self._invalid(e, spec.name, where) from e
        return out

    def encode_field(self, name: str, value: Any, **where: str | None) -> dict[str, bytes]:
        """The hash fields that hold attribute ``name`` with ``value``."""
        spec = self.fields.get(name)
        if spec is None:
            raise ValidationError(
                f"{self.cls.__name__} has no stored attribute {name!r}", **where, field=name
            )
        out: dict[str, bytes] = {}
        try:
            self._write(spec, value, out)
        except StoreError as e:
            e.locate(**{**where, "field": name})
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise self._invalid(e, name, where) from e
        return out

    def _invalid(self, error: Exception, name: str, where: Where) -> ValidationError:
        return ValidationError(f"{self.cls.__name__}.{name}: {error}", **where, field=name)

    def _write(self, spec: _Field, value: Any, out: dict[str, bytes]) -> None:
        enc, name, limit = spec.value.encode, spec.name, self.codec.max_payload_bytes
        shape = spec.shape
        if shape == "scalar":
            out[name] = data = enc(value)
            if len(data) > limit:  # text does not pass through the codec, which checks
                self.codec.check_size(data)
        elif shape == "map":
            for k, v in value.items():
                out[f"{name}[{_key(k)}]"] = data = enc(v)
                if len(data) > limit:
                    self.codec.check_size(data)
        elif shape == "set":
            for m in value:
                out[f"{name}[{_key(m)}]"] = b"1"
        else:
            for i, v in enumerate(value):
                out[f"{name}[{i}]"] = data = enc(v)
                if len(data) > limit:
                    self.codec.check_size(data)
            out[name] = str(len(value)).encode()

    # -- decode -----------------------------------------------------------------------

    def decode(
        self,
        raw: Mapping[bytes, bytes],
        *,
        extra: Mapping[str, Any] | None = None,
        **where: str | None,
    ) -> R:
        """Build the record from its hash fields; any bad field raises naming that field.

        Work and memory stay proportional to the bytes read: every field is held to the
        codec's payload limit, and a list's length must match the entries present before
        any list is built.
        """
        limit = self.codec.max_payload_bytes
        if raw and max(max(map(len, raw)), max(map(len, raw.values()))) > limit:
            self._too_large(raw, where)
        plain: dict[str, bytes] = {}
        entries: dict[str, dict[str, bytes]] = {}
        names = self._names
        for raw_name, value in raw.items():
            name = names.get(raw_name)
            if name is not None:  # an attribute's own field, the common case
                plain[name] = value
                continue
            if raw_name.startswith(b"_"):
                continue
            try:
                text = raw_name.decode()
            except UnicodeDecodeError:
                raise CorruptRecordError(
                    "field name is not UTF-8", **where, field=_shown(raw_name)
                ) from None
            bracket = text.find("[")
            if bracket < 0:
                plain[text] = value  # an attribute this code does not know: ignored
            elif text.endswith("]"):
                entries.setdefault(text[:bracket], {})[text[bracket + 1 : -1]] = value
            else:
                raise CorruptRecordError("malformed field name", **where, field=text)
        kwargs: dict[str, Any] = dict(extra) if extra else {}
        name = ""
        try:
            for name, required, scalar, read in self._readers:
                if scalar is not None:
                    raw_value = plain.get(name)
                    if raw_value is not None:
                        kwargs[name] = scalar(raw_value)
                        continue
                elif read is not None:
                    present, value = read(plain, entries.get(name))
                    if present:
                        kwargs[name] = value
                        continue
                if required:
                    raise CorruptRecordError(
                        f"{self.cls.__name__}.{name} is missing", **{**where, "field": name}
                    )
        except StoreError as e:  # the codec's own (corrupt, too large): say where
            e.locate(**{**where, "field": name})
            raise
        except (ValueError, TypeError) as e:
            raise CorruptRecordError(
                f"{self.cls.__name__}.{name} does not decode: {e}", **{**where, "field": name}
            ) from e
        return self.cls(**kwargs)

    def _too_large(self, raw: Mapping[bytes, bytes], where: Where) -> None:
        """Raise ``PayloadTooLargeError`` for the first field over the limit."""
        for raw_name, value in raw.items():
            shown = _shown(raw_name)
            self.codec.check_size(raw_name, **where, field=shown)
            self.codec.check_size(value, **where, field=shown.partition("[")[0])

    def _reader(self, spec: _Field) -> _Read:
        """How a map, set or list attribute is read from its fields: (whether present, its
        value). A scalar's one field is read inline by ``decode``."""
        dec, name = spec.value.decode, spec.name

        def mapping(plain: dict[str, bytes], entries: dict[str, bytes] | None) -> tuple[bool, Any]:
            return bool(entries), {k: dec(v) for k, v in (entries or {}).items()}

        def members(plain: dict[str, bytes], entries: dict[str, bytes] | None) -> tuple[bool, Any]:
            for member, flag in (entries or {}).items():
                if flag != b"1":
                    raise ValueError(f"member {member[:40]!r} holds {flag[:40]!r}, not b'1'")
            return bool(entries), set(entries or ())

        what = f"{self.cls.__name__}.{name} length"

        def items(plain: dict[str, bytes], entries: dict[str, bytes] | None) -> tuple[bool, Any]:
            # The length is written even for an empty list, so its presence is what counts.
            raw = plain.get(name)
            length = 0 if raw is None else parse_int(raw)
            check_stored(length, LENGTH, what=what)
            held = entries or {}
            if length != len(held):  # checked before anything of that length is built
                raise ValueError(f"list of length {length} holds {len(held)} entries")
            out: list[Any] = [None] * length
            for index, value in held.items():
                position = parse_int(index.encode())
                if not 0 <= position < length:  # as many distinct entries: each index once
                    raise ValueError(f"list of length {length} holds entry {index[:40]!r}")
                out[position] = dec(value)
            return raw is not None, out

        return {"map": mapping, "set": members, "list": items}[spec.shape]


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"keys and members must be str, got {type(key).__name__} {key!r}")
    return key


def _shown(raw_name: bytes) -> str:
    """A field name fit for a message: readable, and short."""
    return raw_name[:100].decode("utf-8", "backslashreplace")
