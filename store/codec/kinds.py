"""The registry of ``PublishedInfo`` and ``ResourceReqConfig`` kinds the store can hold.

A stored value names its kind, never a Python import path, so a reader can only ever build
the types registered here: data in Redis cannot make a reader run code. Users add their own
kinds with ``register_kind``; nothing in the store changes for them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TypeVar, overload

import msgspec

from store.errors import ConfigurationError
from store.types import (
    KVReqConfig,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    ResourceReqConfig,
    SamplingReqConfig,
)

POLYMORPHIC_BASES: tuple[type, ...] = (PublishedInfo, ResourceReqConfig)
MAX_KIND_NAME_LENGTH = 100

T = TypeVar("T", bound=type)


class KindRegistry:
    """Maps kind names to classes and back."""

    def __init__(self) -> None:
        self._types: dict[str, type] = {}
        self._names: dict[type, str] = {}

    def register(self, cls: type, name: str | None = None) -> type:
        """Make ``cls`` storable under ``name`` (default: its qualified class name)."""
        if not (inspect.isclass(cls) and issubclass(cls, POLYMORPHIC_BASES)):
            raise ConfigurationError(
                f"{cls!r} is not a PublishedInfo or ResourceReqConfig subclass"
            )
        if inspect.isabstract(cls):
            raise ConfigurationError(f"{cls.__qualname__} is abstract; register a concrete kind")
        name = name or f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(name, str) or not 0 < len(name) <= MAX_KIND_NAME_LENGTH:
            raise ConfigurationError(f"kind name {name!r} must be 1 to 100 characters")
        held = self._types.get(name)
        if held is not None and held is not cls:
            raise ConfigurationError(
                f"kind name {name!r} is taken by {held.__module__}.{held.__qualname__}"
            )
        try:
            # msgspec accepts any class here (as a custom type for a dec_hook), so a plain
            # class would register and then fail on every write: require a shape it encodes.
            if not (dataclasses.is_dataclass(cls) or issubclass(cls, msgspec.Struct)):
                raise TypeError("it is neither a dataclass nor a msgspec Struct")
            msgspec.msgpack.Decoder(cls)
        except TypeError as e:
            raise ConfigurationError(
                f"{cls.__qualname__} cannot be encoded with msgspec: {e}; use dataclasses or "
                "msgspec Structs of plain types"
            ) from e
        self._types[name] = cls
        self._names[cls] = name
        return cls

    def name_of(self, cls: type) -> str | None:
        """The stored name of kind ``cls``, or None if it was not registered."""
        return self._names.get(cls)

    def type_of(self, name: str) -> type | None:
        """The kind registered under ``name``, or None."""
        return self._types.get(name)

    def names(self) -> dict[str, type]:
        """Every registered kind, by stored name (a copy)."""
        return dict(self._types)


default_registry = KindRegistry()
default_registry.register(PublishedKVInfo, "kv")
default_registry.register(PublishedPositionInfo, "position")
default_registry.register(SamplingReqConfig, "sampling")
default_registry.register(KVReqConfig, "kv_request")


@overload
def register_kind(
    cls: T, *, name: str | None = None, registry: KindRegistry | None = None
) -> T: ...


@overload
def register_kind(
    cls: None = None, *, name: str | None = None, registry: KindRegistry | None = None
) -> Callable[[T], T]: ...


def register_kind(
    cls: T | None = None, *, name: str | None = None, registry: KindRegistry | None = None
) -> T | Callable[[T], T]:
    """Register a kind; use as ``register_kind(MyInfo)`` or as ``@register_kind(name=...)``."""
    target = registry or default_registry

    def decorate(kind: T) -> T:
        target.register(kind, name)
        return kind

    return decorate(cls) if cls is not None else decorate
