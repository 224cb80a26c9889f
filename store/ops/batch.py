"""Many operations at once: their sends pipelined, the server working while the client does.

``gather`` advances each operation until it asks for something. Sends (a ``Send``, or the
sends of a ``SendMany``) are written in chunks of ``CHUNK`` as soon as they are ready
(``Write``), so the server runs the first chunk while the next operations are still being
prepared; then the replies are read chunk by chunk, in the order written (``Collect``), and
each operation is handed its own reply at once, so decoding one chunk's replies overlaps
the server's work on the later ones. An operation's next send joins the chunk being built
and is written when that chunk is full or nothing else is left to read. An operation that
asks for anything else (a WATCH, a sleep) is served on its own, in order, once no write is
pending. Each operation sees exactly the replies it would have seen alone, so results and
errors are those of running them one at a time; an operation that fails does not stop the
others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

from store.errors import StoreError
from store.ops.effects import Collect, Disconnected, Effect, Op, Send, SendMany, Write

T = TypeVar("T")

CHUNK = 8
"""Sends per write: small enough that the server starts early, large enough that a write
(a system call) carries many."""

_PENDING = object()

# Where a send's reply goes: (operation, whether it asked with a single Send, first send, n).
_Span = tuple[int, bool, int, int]


def gather(ops: Sequence[Op[T]]) -> Op[list[T | StoreError]]:
    """The result of each operation in ``ops``, or the ``StoreError`` it raised."""
    results: list[Any] = [_PENDING] * len(ops)
    ready: deque[tuple[int, Any, BaseException | None]] = deque(
        (i, None, None) for i in range(len(ops))
    )
    chunk: list[Send] = []
    spans: list[_Span] = []
    written: deque[tuple[int, list[_Span]]] = deque()  # tickets not collected, oldest first
    others: list[tuple[int, Effect]] = []
    while True:
        while ready:
            i, value, error = ready.popleft()
            effect = _advance(ops[i], i, results, value, error)
            if isinstance(effect, (Send, SendMany)):
                part = [effect] if isinstance(effect, Send) else list(effect.sends)
                spans.append((i, isinstance(effect, Send), len(chunk), len(part)))
                chunk.extend(part)
                if len(chunk) >= CHUNK:
                    written.append(((yield Write(chunk)), spans))
                    chunk, spans = [], []
            elif effect is not None:
                others.append((i, effect))
        if written:
            ticket, done = written.popleft()
            batch = yield Collect(ticket)
            for i, single, start, n in done:
                reply = batch[start] if single else batch[start : start + n]
                if isinstance(reply, Disconnected):  # a Send's own (a SendMany gets its list)
                    ready.append((i, None, reply))
                else:
                    ready.append((i, reply, None))
        elif chunk:
            written.append(((yield Write(chunk)), spans))
            chunk, spans = [], []
        elif others:
            for i, effect in others:
                try:
                    ready.append((i, (yield effect), None))
                except Disconnected as e:
                    ready.append((i, None, e))
            others = []
        else:
            return results


def _advance(
    op: Op[Any], i: int, results: list[Any], value: Any, error: BaseException | None
) -> Effect | None:
    """Run operation ``i`` to its next effect, or to its end (its result kept)."""
    try:
        return op.send(value) if error is None else op.throw(error)
    except StopIteration as stop:
        results[i] = stop.value
    except StoreError as e:
        results[i] = e
    return None
