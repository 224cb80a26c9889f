"""Writes of single attributes: partition fields, final outputs, token and consumed counts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from store.codec import domains
from store.codec.layout import RecordLayout
from store.errors import (
    ConnectionNotFound,
    PartitionNotFound,
    RequestNotFound,
    StoreError,
    ValidationError,
)
from store.keys import MAX_NAME_LENGTH, split_connection_name, validate_name, validate_request_id
from store.ops.args import fence_args, pairs
from store.ops.core import VERSION, Core
from store.ops.damage import stored_int
from store.ops.effects import Op
from store.records import Lease


def update_partition(
    core: Core,
    /,
    request_id: str,
    partition_name: str,
    *,
    fence: Lease | None = None,
    **attributes: Any,
) -> Op[None]:
    """Replace the given attributes of a stored partition; other fields are untouched.

    Use ``merge_publish_info`` for published info and ``take_step`` to move to the next
    forward pass. Refused (``FencedError``) while a replica holds a live lease on the
    partition, unless ``fence`` is that lease.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    key = core.keys.partition(rid, name)
    if "resource_publish_info" in attributes:
        raise ValidationError(
            "resource_publish_info is changed with merge_publish_info",
            request_id=rid,
            key=key,
            field="resource_publish_info",
        )
    yield from update_fields(
        core, rid, key, core.partition_layout, attributes, PartitionNotFound, fence,
        target=name, what="update",
    )  # fmt: skip


def set_producer_done(
    core: Core, request_id: str, connection: str, *, fence: Lease | None = None
) -> Op[None]:
    """Mark that the producer of a streaming connection will send no more tokens.

    The producer partition's step decides that, so the write is fenced by its lease:
    refused (``FencedError``) once ``fence`` was superseded, or without ``fence`` while a
    replica holds a live lease on the producer partition.
    """
    rid = validate_request_id(request_id)
    producer, _ = split_connection_name(connection, request_id=rid)
    key = core.keys.connection(rid, connection)
    yield from update_fields(
        core, rid, key, core.connection_layout, {"producer_done": True}, ConnectionNotFound,
        fence, target=producer, what="producer_done",
    )  # fmt: skip


def set_final_output(
    core: Core, request_id: str, name: str, value: Any, *, fence: Lease | None = None
) -> Op[None]:
    """Record one of the request's final outputs (plain data) under ``name``.

    With ``fence``, the write is rejected (``FencedError``) if that lease was superseded;
    without, while any replica holds a live lease on the request.
    """
    rid = validate_request_id(request_id)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ValidationError("output name must be a non-empty str", request_id=rid)
    key = core.keys.meta(rid)
    fields = core.record_layout.encode_field(
        "final_outputs", {name: value}, request_id=rid, key=key
    )
    keys = [key, core.keys.lease(rid), core.keys.history(rid)]
    args = [VERSION, *fence_args(fence, "*"), 0, core.history_cap, "final_output", *pairs(fields)]
    yield from core.run(rid, "update_fields", keys, args, RequestNotFound, fence)


def update_fields(
    core: Core,
    rid: str,
    key: str,
    layout: RecordLayout[Any],
    attributes: Mapping[str, Any],
    missing: type[StoreError],
    fence: Lease | None = None,
    *,
    target: str,
    what: str,
) -> Op[None]:
    """Replace ``attributes`` of the record at ``key`` in one script, under the fence check
    of ``target`` (see ``fence_args``); ``what`` names the write in the history."""
    replaced: list[str] = []
    fields: dict[str, bytes] = {}
    for attr, value in attributes.items():
        fields.update(layout.encode_field(attr, value, request_id=rid, key=key))
        if layout.fields[attr].shape != "scalar":
            replaced.append(attr)
    args = [
        VERSION, *fence_args(fence, target), len(replaced), *replaced, core.history_cap, what,
        *pairs(fields),
    ]  # fmt: skip
    keys = [key, core.keys.lease(rid), core.keys.history(rid)]
    yield from core.run(rid, "update_fields", keys, args, missing, fence)


def add_tokens(
    core: Core, request_id: str, connection: str, count: int, *, op_id: str | None = None
) -> Op[int]:
    """Add ``count`` tokens to a connection's ``token_count``; returns the new count."""
    rid = validate_request_id(request_id)
    split_connection_name(connection, request_id=rid)
    domains.check_int(count, domains.TOKENS, what="count", request_id=rid)
    keys = [core.keys.connection(rid, connection), core.keys.ops(rid)]
    args = [VERSION, count, f"tokens:{op_id or core.new_op_id()}", core.dedupe_window]
    reply = yield from core.run(rid, "add_tokens", keys, args, ConnectionNotFound)
    return stored_int(reply[1], domains.TOKENS, request_id=rid, key=keys[0], field="token_count")


def raise_consumed_count(core: Core, request_id: str, connection: str, count: int) -> Op[int]:
    """Raise ``consumed_count`` to ``count`` (never lowers it); returns the value held."""
    rid = validate_request_id(request_id)
    split_connection_name(connection, request_id=rid)
    domains.check_int(count, domains.TOKENS, what="count", request_id=rid)
    keys = [core.keys.connection(rid, connection)]
    args = [VERSION, "consumed_count", count]
    reply = yield from core.run(rid, "raise_field", keys, args, ConnectionNotFound)
    return stored_int(reply[1], domains.TOKENS, request_id=rid, key=keys[0], field="consumed_count")
