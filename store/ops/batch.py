"""Many operations at once: their sends batched into one round trip per server.

``gather`` advances each operation until it asks for something, sends every ``Send`` of
that round together (``SendMany``: the executor writes once per server and reads all the
replies), hands each operation its own reply, and repeats until all are done. An operation
that asks for anything else (a WATCH, a sleep) is served on its own, in order. Each
operation sees exactly the replies it would have seen alone, so results and errors are
those of running them one at a time; an operation that fails does not stop the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from store.errors import StoreError
from store.ops.effects import Disconnected, Effect, Op, Send, SendMany

T = TypeVar("T")

_PENDING = object()


def gather(ops: Sequence[Op[T]]) -> Op[list[T | StoreError]]:
    """The result of each operation in ``ops``, or the ``StoreError`` it raised."""
    results: list[Any] = [_PENDING] * len(ops)
    asks: dict[int, Effect] = {}
    for i in range(len(ops)):
        _advance(ops, i, results, asks, None, None)
    while asks:
        # Every Send of this round, and the Sends of every SendMany, in one SendMany.
        batched = [i for i, e in asks.items() if isinstance(e, (Send, SendMany))]
        others = [i for i in asks if i not in batched]
        replies: dict[int, Any] = {}
        if batched:
            sends: list[Send] = []
            spans = []
            for i in batched:
                effect = asks[i]
                if isinstance(effect, SendMany):
                    part = list(effect.sends)
                else:
                    assert isinstance(effect, Send)
                    part = [effect]
                spans.append((i, isinstance(effect, Send), len(sends), len(part)))
                sends.extend(part)
            batch = yield SendMany(sends)
            for i, single, start, n in spans:
                replies[i] = batch[start] if single else batch[start : start + n]
        for i in others:
            try:
                replies[i] = yield asks[i]
            except Disconnected as e:
                replies[i] = e
        asks.clear()
        for i, reply in replies.items():
            if isinstance(reply, Disconnected):  # a Send's own (a SendMany gets its list)
                _advance(ops, i, results, asks, None, reply)
            else:
                _advance(ops, i, results, asks, reply, None)
    return results


def _advance(
    ops: Sequence[Op[Any]],
    i: int,
    results: list[Any],
    asks: dict[int, Effect],
    value: Any,
    error: BaseException | None,
) -> None:
    """Run operation ``i`` to its next effect (kept in ``asks``) or to its end."""
    op = ops[i]
    try:
        asks[i] = op.send(value) if error is None else op.throw(error)
    except StopIteration as stop:
        results[i] = stop.value
    except StoreError as e:
        results[i] = e
