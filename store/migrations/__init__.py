"""Numbered, ordered steps that upgrade stored records from one schema version to the next.

Each step is a module ``mNNNN_<what>.py`` holding ``VERSION`` (the version it produces) and a
pure ``upgrade(record: RawRecord) -> RawRecord`` from the record at ``VERSION - 1``; its
docstring says what changed and why. Upgrading from version v applies the steps v+1 .. newest
in order. To add one: write the module, append it to ``_MODULES``, bump
``store.schema.SCHEMA_VERSION``, and commit frozen fixtures of the old version (see README).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

from store.migrations import (
    m0002_resource_publish_info,
    m0003_worker_graph_ids_as_str,
    m0004_split_published_parts,
    m0005_compact_kv_sequences,
)
from store.migrations.record import RawRecord, RecordKind

__all__ = ["FIRST_VERSION", "LATEST_VERSION", "STEPS", "RawRecord", "RecordKind", "Step", "upgrade"]

FIRST_VERSION = 1
"""The version of the first stored format; nothing older exists."""


@dataclass(frozen=True)
class Step:
    version: int  # the version the step produces, from version - 1
    name: str
    summary: str
    apply: Callable[[RawRecord], RawRecord]


_MODULES: tuple[ModuleType, ...] = (
    m0002_resource_publish_info,
    m0003_worker_graph_ids_as_str,
    m0004_split_published_parts,
    m0005_compact_kv_sequences,
)


def _registry(modules: tuple[ModuleType, ...]) -> tuple[Step, ...]:
    steps = []
    for expected, module in enumerate(modules, start=FIRST_VERSION + 1):
        if expected != module.VERSION:  # a gap or a step out of order would skip a change
            raise ImportError(f"{module.__name__} produces v{module.VERSION}, expected v{expected}")
        summary = (module.__doc__ or "").strip().splitlines()[0]
        steps.append(Step(expected, module.__name__.rpartition(".")[2], summary, module.upgrade))
    return tuple(steps)


STEPS: tuple[Step, ...] = _registry(_MODULES)
LATEST_VERSION = STEPS[-1].version if STEPS else FIRST_VERSION


def upgrade(record: RawRecord, to: int = LATEST_VERSION) -> RawRecord:
    """``record`` brought to version ``to`` by the steps after its own version, in order."""
    if not FIRST_VERSION <= record.version <= to <= LATEST_VERSION:
        raise ValueError(
            f"cannot upgrade a v{record.version} record to v{to} "
            f"(steps exist from v{FIRST_VERSION} to v{LATEST_VERSION})"
        )
    for step in STEPS[record.version - FIRST_VERSION : to - FIRST_VERSION]:
        record = replace(step.apply(record), version=step.version)
    return record
