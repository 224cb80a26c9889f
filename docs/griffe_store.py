"""A griffe extension for the API pages: a store method as its caller sees it.

A store's methods are made at import from the operations of ``store.ops``
(``store.facade.sync_method`` / ``async_method``), and griffe renders each as the
operation it wraps: ``core`` first and an ``Op[T]`` result. The caller passes no ``core``
(the store does) and gets ``T`` (awaited, on the async store), as ``store.facade._present``
says; this extension shows that. The operations themselves are on no page of their own.
"""

from __future__ import annotations

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
