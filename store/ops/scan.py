"""Reads for the tools that walk a whole namespace: migrate, top, history.

None of these is on a conductor's path. They exist so that the tools reach Redis the way
the store does, through an executor: one server or a cluster, with the store's reconnects,
redirects and typed errors (``StoreConnectionError`` naming the server), never a redis-py
exception. A scan of keys runs on one server at a time (``node``: a cluster master's
address, or None for the only server), since a cluster has no keyspace-wide SCAN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from store.errors import StoreConnectionError
from store.ops.calls import Where, raise_error_replies
from store.ops.core import Core
from store.ops.effects import Command, Disconnected, ErrorReply, Op, Send, SendMany, Sleep

Node = tuple[str, int] | None


def index_size(core: Core, key: str) -> Op[int]:
    """ZCARD of a sorted set (the request index, the deadlines)."""
    (size,) = yield from core.send(key, [("ZCARD", key)], {"key": key})
    return int(size)


def zset_page(core: Core, key: str, cursor: int, count: int) -> Op[tuple[int, list[bytes]]]:
    """One ZSCAN page of a sorted set's members: (next cursor, members); 0 ends the scan."""
    ((cursor_raw, flat),) = yield from core.send(
        key, [("ZSCAN", key, cursor, "COUNT", count)], {"key": key}
    )
    return int(cursor_raw), list(flat[::2])


def key_page(
    core: Core, node: Node, cursor: int, match: str, count: int, kind: str | None = None
) -> Op[tuple[int, list[bytes]]]:
    """One SCAN page of the keys matching ``match`` (of Redis type ``kind``, if given) on
    one server: (next cursor, keys)."""
    command: Command = ("SCAN", cursor, "MATCH", match, "COUNT", count)
    if kind is not None:
        command += ("TYPE", kind)
    ((cursor_raw, keys),) = yield from send_to_node(core, node, [command], {"key": match})
    return int(cursor_raw), list(keys)


def read_many(
    core: Core, reads: Sequence[tuple[str, Sequence[Command]]], where: Where
) -> Op[list[list[Any]]]:
    """The replies of each (key, commands) pair, all written before any is read (one
    write per server). A pair whose server failed or redirected it is sent again on its
    own, with the store's reconnects and redirects; reads are safe to repeat."""
    if not reads:
        return []
    results = yield SendMany([Send(key, commands) for key, commands in reads])
    out: list[list[Any]] = []
    for (key, commands), result in zip(reads, results, strict=True):
        if isinstance(result, Disconnected) or any(isinstance(r, ErrorReply) for r in result):
            result = yield from core.send(key, commands, where)
        raise_error_replies(result, where)
        out.append(result)
    return out


def history_page(core: Core, key: str, start: str, count: int) -> Op[list[tuple[bytes, Any]]]:
    """Up to ``count`` entries of a stream from ``start`` on: (entry id, raw fields)."""
    (page,) = yield from core.send(key, [("XRANGE", key, start, "+", "COUNT", count)], {"key": key})
    return [(entry[0], entry[1]) for entry in page]


def server_info(core: Core, node: Node, sections: Sequence[str]) -> Op[dict[str, str]]:
    """One server's INFO ``sections`` as one dict, in one round trip; empty if the server
    refuses INFO (ACLs)."""
    commands: list[Command] = [("INFO", section) for section in sections]
    replies = yield from send_to_node(core, node, commands, {}, refused=True)
    if any(isinstance(reply, ErrorReply) for reply in replies):
        return {}
    return parse_info(replies)


def parse_info(replies: Sequence[Any]) -> dict[str, str]:
    """INFO replies as one dict (``redis_version`` -> ``7.0.15``); an error reply adds nothing."""
    info: dict[str, str] = {}
    for reply in replies:
        if isinstance(reply, ErrorReply):
            continue
        text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and not name.startswith("#"):
                info[name] = value.strip()
    return info


def send_to_node(
    core: Core, node: Node, commands: Sequence[Command], where: Where, *, refused: bool = False
) -> Op[list[Any]]:
    """``commands`` to one server (not routed by key), retried while it fails or loads.

    A refusal (an error reply) raises ``StoreError``, or comes back as a value with
    ``refused``. Unlike ``core.send`` it cannot follow the data elsewhere: a cluster
    master that stays down ends the call with ``StoreConnectionError``.
    """
    patience = core.reconnect.patience()
    while True:
        try:
            replies: list[Any] = yield Send("", commands, node)
        except Disconnected as e:
            pause = patience.after_failure(e)
            if pause is None:
                raise patience.gave_up(e, **where) from (e.__cause__ or e)
            yield Sleep(pause)
            continue
        transient = next((r for r in replies if isinstance(r, ErrorReply) and r.transient), None)
        if transient is None:
            if not refused:
                raise_error_replies(replies, where)
            return replies
        pause = patience.next_pause()
        if pause is None:
            raise StoreConnectionError(f"Redis kept refusing: {transient.message}", **where)
        yield Sleep(pause)
