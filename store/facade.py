"""How a store method is one operation of ``store.ops`` run by the store's executor.

An operation is written once, as a generator of effects taking the store's ``Core`` first.
``sync_method(op)`` makes it a method of a sync store (it returns the result) and
``async_method(op)`` a method of an async store (it returns an awaitable): same name,
arguments, docstring, result and errors, so the two stores cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from types import MethodType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from store.ops.core import Core
from store.ops.effects import Op
from store.ops.server import warn_if_evicting

P = ParamSpec("P")
T = TypeVar("T")


def checked_first(core: Core, op: Op[T]) -> Op[T]:
    """``op`` after the eviction check of a store's first call, in one run: a server that
    does not answer costs the call one bound (``Reconnect``), not the check's try more."""
    yield from warn_if_evicting(core)
    return (yield from op)


class Facade:
    """A store: its ``Core`` and the executor that runs its operations."""

    _core: Core
    _executor: Any


def _request_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The request an operation is about, for its span: its first argument (an id or a
    lease), or ``request_id=``."""
    first = args[0] if args else kwargs.get("request_id") or kwargs.get("lease")
    if isinstance(first, str):
        return first
    return getattr(first, "request_id", None)


def _present(function: Callable[..., Any], op: Callable[..., Any]) -> None:
    """Give ``function`` the operation's name and docs, and its signature with ``self``
    (the store) in place of ``core``."""
    functools.update_wrapper(function, op)
    signature = inspect.signature(op)
    parameters = list(signature.parameters.values())
    parameters[0] = parameters[0].replace(name="self", annotation=inspect.Parameter.empty)
    returns = signature.return_annotation
    if isinstance(returns, str) and returns.startswith("Op[") and returns.endswith("]"):
        returns = returns[3:-1]  # what the caller gets: the operation's result
    function.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters, return_annotation=returns
    )


class sync_method(Generic[P, T]):
    """A sync store's method running operation ``op``; binds like any method."""

    def __init__(self, op: Callable[Concatenate[Core, P], Op[T]]) -> None:
        name = op.__name__

        def function(store: Facade, /, *args: P.args, **kwargs: P.kwargs) -> T:
            run: Callable[[Op[T]], T] = store._executor.run
            core = store._core
            ran = op(core, *args, **kwargs)
            if core.open_check_pending and core.take_open_check():
                ran = checked_first(core, ran)
            instruments = core.instruments
            if not instruments.recording():
                return run(ran)
            with instruments.operation(name, _request_id(args, kwargs)):
                return run(ran)

        _present(function, op)
        self.function = function
        _present(self, op)

    @overload
    def __get__(self, store: None, owner: type) -> sync_method[P, T]: ...

    @overload
    def __get__(self, store: Facade, owner: type) -> Callable[P, T]: ...

    def __get__(self, store: Facade | None, owner: type) -> Any:
        if store is None:
            return self
        return MethodType(self.function, store)

    def __call__(self, store: Facade, /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``RequestStore.method(store, ...)``, as for any method."""
        return self.function(store, *args, **kwargs)


class async_method(Generic[P, T]):
    """An async store's method running operation ``op``; binds like any method."""

    def __init__(self, op: Callable[Concatenate[Core, P], Op[T]]) -> None:
        name = op.__name__

        async def function(store: Facade, /, *args: P.args, **kwargs: P.kwargs) -> T:
            run: Callable[[Op[T]], Coroutine[Any, Any, T]] = store._executor.run
            core = store._core
            ran = op(core, *args, **kwargs)
            if core.open_check_pending and core.take_open_check():
                ran = checked_first(core, ran)
            instruments = core.instruments
            if not instruments.recording():
                return await run(ran)
            with instruments.operation(name, _request_id(args, kwargs)):
                return await run(ran)

        _present(function, op)
        self.function = function
        _present(self, op)

    @overload
    def __get__(self, store: None, owner: type) -> async_method[P, T]: ...

    @overload
    def __get__(self, store: Facade, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, store: Facade | None, owner: type) -> Any:
        if store is None:
            return self
        return MethodType(self.function, store)

    def __call__(
        self, store: Facade, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]:
        """``AsyncRequestStore.method(store, ...)``, as for any method."""
        return self.function(store, *args, **kwargs)
