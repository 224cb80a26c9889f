"""A deployment of the M* engine, as its conductors share it: its worker graph ids and its
epoch (``<ns>:deployment:<id>``).

The engine makes its worker graph ids afresh (``uuid4``) each time its conductor starts, and
its live workers hold the ids of the conductor that launched them: a conductor that attaches
to live workers takes the ids from here. Each start raises the epoch; a conductor whose epoch
is no longer the deployment's was replaced, and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from store.errors import CorruptRecordError, ValidationError
from store.keys import validate_name
from store.ops.core import Core
from store.ops.effects import Op

_IDS = msgspec.msgpack.Decoder(list[str])


@dataclass(frozen=True)
class Deployment:
    """One start of a deployment's conductor: its epoch and the worker graph ids in use."""

    name: str
    epoch: int
    worker_graph_ids: tuple[str, ...]


def _key(core: Core, name: str) -> str:
    return f"{core.keys.namespace}:deployment:{validate_name(name, what='deployment')}"


def start_deployment(core: Core, name: str, worker_graph_ids: list[str]) -> Op[Deployment]:
    """A conductor that launched its workers: record their worker graph ids; a new epoch."""
    key = _key(core, name)
    where = {"key": key}
    if not all(isinstance(i, str) for i in worker_graph_ids):
        raise ValidationError("worker graph ids must be text", key=key, field="worker_graphs")
    ids = msgspec.msgpack.encode(list(worker_graph_ids))
    replies = yield from core.send(
        key,
        [("MULTI",), ("HSET", key, "worker_graphs", ids), ("HINCRBY", key, "epoch", 1), ("EXEC",)],
        where,
    )
    epoch = replies[-1][1]
    return Deployment(name, int(epoch), tuple(worker_graph_ids))


def attach_deployment(core: Core, name: str) -> Op[Deployment]:
    """A conductor that attaches to the live workers of ``name``: their worker graph ids, and
    a new epoch that replaces the conductor before it."""
    key = _key(core, name)
    where = {"key": key}
    replies = yield from core.send(
        key,
        [("MULTI",), ("HINCRBY", key, "epoch", 1), ("HGET", key, "worker_graphs"), ("EXEC",)],
        where,
    )
    epoch, raw = replies[-1]
    if raw is None:
        raise CorruptRecordError(
            "no worker graphs recorded: start the deployment before attaching", key=key
        )
    try:
        ids = _IDS.decode(raw)
    except msgspec.DecodeError as e:
        raise CorruptRecordError(f"unreadable: {e}", key=key, field="worker_graphs") from e
    return Deployment(name, int(epoch), tuple(ids))


def deployment_epoch(core: Core, name: str) -> Op[int]:
    """The deployment's current epoch (0: never started)."""
    key = _key(core, name)
    (raw,) = yield from core.send(key, [("HGET", key, "epoch")], {"key": key})
    return int(raw or 0)
