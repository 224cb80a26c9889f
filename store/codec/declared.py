"""What a declared type says about the values it holds, for the codec's plans.

Whether it may hold plain data of any depth, where a numeric domain applies to it (the
value, map keys or values, items), the msgspec wire type that checks those bounds while
decoding, and a shallow check that a value conforms to it before it is written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from store.codec.bounds import check_written_depth
from store.codec.domains import Domain, IntDomain, check_number
from store.codec.kinds import MAX_KIND_NAME_LENGTH, POLYMORPHIC_BASES
from store.errors import ValidationError
from store.types import KVSequenceInfo

PLAIN_TYPES: tuple[Any, ...] = (Any, object, dict, list, set, frozenset, tuple)


def holds_plain_data(tp: Any, seen: set[Any]) -> bool:
    """Whether a value of type ``tp`` may hold plain data of any shape, hence of any depth."""
    if tp in PLAIN_TYPES:
        return True
    if tp in POLYMORPHIC_BASES or tp is KVSequenceInfo or tp in seen:
        return False  # their own plans check their plain data
    args = typing.get_args(tp)
    if args:
        return any(holds_plain_data(a, seen) for a in args if a is not Ellipsis)
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or issubclass(tp, msgspec.Struct)):
        seen.add(tp)
        return any(holds_plain_data(h, seen) for h in typing.get_type_hints(tp).values())
    return False


KindName = typing.Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KIND_NAME_LENGTH)]


def slot(tp: Any) -> str:
    """Where a domain applies in a field of type ``tp``: the value, map keys or values, items."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict and args and args[0] is int:
        return "keys"
    if origin is dict:
        return "values"
    if origin in (list, set, frozenset):
        return "items"
    return "value"


def domain_check(domain: Domain, slot: str, what: str) -> Callable[[Any], None]:
    """A check of the numbers in a field against ``domain`` (``ValidationError``).

    The common case, every number in range, costs one comparison per number; only a number
    out of it goes to ``check_number``, which says what is wrong.
    """
    fits: Callable[[Any], bool] = domain.__contains__
    if isinstance(domain, IntDomain):
        low, high = domain.low, domain.high

        def fits(n: Any) -> bool:
            return type(n) is int and low <= n < high

    def refuse(n: Any, part: str) -> None:
        check_number(n, domain, what=f"{what}{part}")

    def check_value(value: Any) -> None:
        if value is not None and not fits(value):  # None: an Optional number, not set
            refuse(value, "")

    def check_keys(value: Any) -> None:
        if isinstance(value, Mapping):  # any other type: msgspec names it as it encodes
            for key in value:
                if not fits(key):
                    refuse(key, " key")

    def check_values(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                if not fits(item):
                    refuse(item, " entry")

    def check_items(value: Any) -> None:
        for item in value:
            if not fits(item):
                refuse(item, " entry")

    return {"value": check_value, "keys": check_keys, "values": check_values}.get(slot, check_items)


def bounded(wire_type: Any, domain: Domain | None) -> Any:
    """``wire_type`` with ``domain`` on its numbers, so msgspec checks them as it decodes."""
    if domain is None:
        return wire_type
    number = int if isinstance(domain, IntDomain) else float
    if wire_type is number:
        return domain.annotated
    origin, args = typing.get_origin(wire_type), typing.get_args(wire_type)
    if origin is dict and args[0] is number:
        return types.GenericAlias(dict, (domain.annotated, args[1]))
    if origin is dict and args[1] is number:
        return types.GenericAlias(dict, (args[0], domain.annotated))
    if origin in (list, set, frozenset) and args[0] is number:
        return types.GenericAlias(origin, (domain.annotated,))
    if origin in (typing.Union, types.UnionType) and number in args:
        return typing.Union[tuple(domain.annotated if a is number else a for a in args)]  # noqa: UP007
    return wire_type


def conforms(value: Any, tp: Any) -> bool:
    """A shallow check of ``value`` against a declared type (classes only, not generics)."""
    if tp is Any:
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if isinstance(tp, type) and tp is not object:
        return isinstance(value, origin or tp)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


def refuse_too_deep(data: bytes) -> None:
    try:
        check_written_depth(data)
    except ValueError as e:
        raise ValidationError(str(e)) from e


def identity(value: Any) -> Any:
    return value


def pass_through(value: Any, context: Any) -> Any:
    return value


def type_name(tp: Any) -> str:
    return getattr(tp, "__qualname__", None) or str(tp)
