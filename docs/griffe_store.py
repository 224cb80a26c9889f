"""Griffe extensions for the API pages: what griffe's inspection gets wrong here.

**A store method as its caller sees it.**

A store's methods are made at import from the operations of ``store.ops``
(``store.facade.sync_method`` / ``async_method``), and griffe renders each as the
operation it wraps: ``core`` first and an ``Op[T]`` result. The caller passes no ``core``
(the store does) and gets ``T`` (awaited, on the async store), as ``store.facade._present``
says; ``StoreMethods`` shows that. The operations themselves are on no page of their own.

**No borrowed docstrings.** Inspected, a dataclass field or a module attribute gets the
docstring of its value's type (``str(object='') -> str ...`` under ``namespace``);
``NoTypeDocstrings`` drops those, so a field is described by its class's docstring.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe


class StoreMethods(griffe.Extension):
    """Drop ``core`` and unwrap ``Op[T]`` in the signatures of ``store.ops``'s operations."""

    def on_function_instance(
        self, *, node: Any, func: griffe.Function, agent: Any, **kwargs: Any
    ) -> None:
        if not func.path.startswith("store.ops.") or "core" not in func.parameters:
            return
        del func.parameters["core"]
        returns = str(func.returns) if func.returns is not None else ""
        if returns.startswith("Op[") and returns.endswith("]"):
            func.returns = returns[3:-1]


class NoTypeDocstrings(griffe.Extension):
    """Drop an attribute's docstring when it is only its value's type's docstring."""

    def on_attribute_instance(
        self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any
    ) -> None:
        value = getattr(node, "obj", None)
        borrowed = inspect.getdoc(type(value))
        if attr.docstring is not None and borrowed and attr.docstring.value == borrowed:
            attr.docstring = None
