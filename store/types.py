"""The engine's types, from the one place that works with and without the engine.

Import the classes a request's state holds from here (``from store.types import
PartitionState``). When the M* engine (``mstar-ai``) is importable they are the engine's own
classes, so the store and the engine's conductor share one set; otherwise they are the
reference copy bundled with the store (``store._mstar``), equal to mstar-ai 0.2.1 field for
field and behaviour for behaviour. Stored values name their kind, never a module, so a
record written with one set reads back equal with the other.

``MSTAR_STORE_TYPES`` chooses: ``auto`` (the default: the engine when importable),
``engine`` (fail when it is not) or ``bundled``. The engine's classes import torch (about
3 s and 0.8 GB): a process that only reads the store, such as the ``mstar-store`` CLI, can
use the bundled copy and still read and write every record the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Literal

from store.errors import ConfigurationError

SOURCE_VARIABLE = "MSTAR_STORE_TYPES"
BUNDLED_PACKAGE = "store._mstar"
ENGINE_PACKAGE = "mstar"

# Each name, and the module that defines it, relative to the package root (the engine's layout).
_MODULES: dict[str, str] = {
    "DEFAULT_PARTITION": "conductor.request_info",
    "CurrentForwardConductorMetadata": "conductor.request_info",
    "CurrentForwardPassInfo": "conductor.request_info",
    "PartitionDefinition": "conductor.request_info",
    "PartitionState": "conductor.request_info",
    "StreamingConnectionState": "conductor.request_info",
    "merge_publish_info": "conductor.request_info",
    "PublishedInfo": "engine.resources.base",
    "ResourceReqConfig": "engine.resources.spec",
    "KVLayout": "engine.resources.kv.config",
    "KVReqConfig": "engine.resources.kv.config",
    "KVSequenceInfo": "engine.resources.kv.manager",
    "PublishedKVInfo": "engine.resources.kv.manager",
    "MooncakeKVTransferInfo": "engine.resources.kv.transfer",
    "CudaIpcKVTransferInfo": "engine.resources.kv.transfer",
    "PublishedPositionInfo": "engine.resources.position.manager",
    "SamplingReqConfig": "engine.resources.sampler.config",
    "NestedLoopIndices": "graph.loop_indices",
    "TensorPointerInfo": "graph.base",
}


def engine_importable() -> bool:
    """Whether the installed M* engine can be imported, without importing it (nor torch).

    A checkout's ``mstar`` folder (a link to the reference copy, with no ``__init__.py``) is
    a namespace package, which never counts: only a regular ``mstar`` package is the engine.
    """
    try:
        spec = importlib.util.find_spec(ENGINE_PACKAGE)
        if spec is None or spec.origin is None:
            return False
        return importlib.util.find_spec(f"{ENGINE_PACKAGE}.conductor.request_info") is not None
    except (ImportError, ValueError):
        return False


def choose_source(setting: str | None = None) -> Literal["engine", "bundled"]:
    """Where the types come from under ``setting`` (default: ``$MSTAR_STORE_TYPES``)."""
    choice = (setting if setting is not None else os.environ.get(SOURCE_VARIABLE, "")) or "auto"
    if choice == "bundled":
        return "bundled"
    if choice == "engine":
        if not engine_importable():
            raise ConfigurationError(
                f"{SOURCE_VARIABLE}=engine, but the M* engine is not importable: "
                "pip install 'mstar-conductor-store[mstar]'"
            )
        return "engine"
    if choice == "auto":
        return "engine" if engine_importable() else "bundled"
    raise ConfigurationError(
        f"{SOURCE_VARIABLE}={choice!r}: expected 'auto', 'engine' or 'bundled'"
    )


SOURCE: Literal["engine", "bundled"] = choose_source()
"""Where this process's types come from: ``"engine"`` (mstar-ai) or ``"bundled"``."""

if TYPE_CHECKING:  # checked against the reference copy: the engine ships no type hints
    from store._mstar.conductor.request_info import (
        DEFAULT_PARTITION,
        CurrentForwardConductorMetadata,
        CurrentForwardPassInfo,
        PartitionDefinition,
        PartitionState,
        StreamingConnectionState,
        merge_publish_info,
    )
    from store._mstar.engine.resources.base import PublishedInfo
    from store._mstar.engine.resources.kv.config import KVLayout, KVReqConfig
    from store._mstar.engine.resources.kv.manager import KVSequenceInfo, PublishedKVInfo
    from store._mstar.engine.resources.kv.transfer import (
        CudaIpcKVTransferInfo,
        MooncakeKVTransferInfo,
    )
    from store._mstar.engine.resources.position.manager import PublishedPositionInfo
    from store._mstar.engine.resources.sampler.config import SamplingReqConfig
    from store._mstar.engine.resources.spec import ResourceReqConfig
    from store._mstar.graph.base import TensorPointerInfo
    from store._mstar.graph.loop_indices import NestedLoopIndices
else:  # the engine's classes when importable (see choose_source), else the same copy
    _root = ENGINE_PACKAGE if SOURCE == "engine" else BUNDLED_PACKAGE
    for _name, _module in _MODULES.items():
        globals()[_name] = getattr(importlib.import_module(f"{_root}.{_module}"), _name)
    del _name, _module, _root

__all__ = [
    "DEFAULT_PARTITION",
    "SOURCE",
    "CudaIpcKVTransferInfo",
    "CurrentForwardConductorMetadata",
    "CurrentForwardPassInfo",
    "KVLayout",
    "KVReqConfig",
    "KVSequenceInfo",
    "MooncakeKVTransferInfo",
    "NestedLoopIndices",
    "PartitionDefinition",
    "PartitionState",
    "PublishedInfo",
    "PublishedKVInfo",
    "PublishedPositionInfo",
    "ResourceReqConfig",
    "SamplingReqConfig",
    "StreamingConnectionState",
    "TensorPointerInfo",
    "merge_publish_info",
]
