"""What callers pass to the operations on a request held as the engine's Conductor keeps
it, checked before anything is read: a wrong value is refused with ``ValidationError``
naming the request and field, never applied half, nor stored to fail every read after."""

from __future__ import annotations

import typing
from typing import Any

from store.codec.values import Codec
from store.conductor.record import ConductorRequest, WorkerGraphsDone
from store.errors import ValidationError
from store.keys import validate_request_id


def message_request_id(message: Any) -> str:
    rid = getattr(message, "request_id", None)
    if not isinstance(rid, str):
        raise ValidationError(
            f"expected a WorkerGraphsDone, got {type(message).__name__}", field="request_id"
        )
    return rid


MESSAGE_FIELDS: dict[str, Any] = {
    name: declared
    for name, declared in typing.get_type_hints(WorkerGraphsDone).items()
    if name != "request_id"
}


def checked_message(codec: Codec, message: Any, rid: str) -> WorkerGraphsDone:
    """The fields the rules take, from the engine's message or the store's, as values of
    their own (a redo must not see an earlier try's merges into them), each checked to its
    declared type, nested values too: a wrong one is refused naming it, never applied half
    or stored to fail every read after."""
    if message_request_id(message) != rid:
        raise ValidationError(
            f"message is about request {message.request_id!r}", request_id=rid, field="request_id"
        )
    values = {
        name: checked(codec, getattr(message, name, None), declared, rid, name)
        for name, declared in MESSAGE_FIELDS.items()
    }
    for name in ("new_token_counts", "stream_tokens_consumed"):
        for edge, count in values[name].items():
            if count < 0:
                raise ValidationError(
                    f"WorkerGraphsDone.{name} maps edge names to counts >= 0: {edge!r}: {count!r}",
                    request_id=rid, field=name,
                )  # fmt: skip
    return WorkerGraphsDone(request_id=rid, **values)


def checked(codec: Codec, value: Any, declared: Any, rid: str, name: str) -> Any:
    """``value`` through the codec as ``declared`` and back: a copy, or ``ValidationError``."""
    try:
        return codec.decode(codec.encode(value, declared), declared)
    except Exception as e:  # the codec's own, msgspec's, or a wrong nested value's
        raise ValidationError(
            f"{name}: not a valid {getattr(declared, '__name__', declared)}: {e}",
            request_id=rid, field=name,
        ) from e  # fmt: skip


def check_request(request: ConductorRequest) -> None:
    """A request to hold whole: its id, and no worker graph without workers (the engine
    counts a worker graph done after one report per worker)."""
    if not isinstance(request, ConductorRequest):
        raise ValidationError(f"expected a ConductorRequest, got {type(request).__name__}")
    rid = validate_request_id(request.request_id)
    for wg, workers in request.worker_graph_to_workers.items():
        if not workers:
            raise ValidationError(
                f"worker graph {wg!r} has no workers", request_id=rid,
                field="worker_graph_to_workers",
            )  # fmt: skip
    if not request.partition_states:
        raise ValidationError("a request has at least one partition", request_id=rid,
                              field="partition_states")  # fmt: skip
