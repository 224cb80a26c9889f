"""Round trips counted at the executor: every effect that goes to Redis is one.

``CountingExecutor`` wraps a store's executor and counts, per effect, one round trip for
a ``Send``, a ``Watch`` or a ``Commit``, and one per server for a ``SendMany`` (one here:
these tests run on one server); pipelined ``Write``s cost one, at the first ``Collect``
that waits for them. Sleeps and slot refreshes cost none.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any

from store.ops.effects import Collect, Commit, Op, Send, SendMany, Watch, Write

_ROUND_TRIPS = (Send, SendMany, Watch, Commit)


class CountingExecutor:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.round_trips = 0

    def run(self, op: Op[Any]) -> Any:
        return self.inner.run(self._counted(op))

    def _counted(self, op: Op[Any]) -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        written = False  # Writes not waited for yet
        while True:
            try:
                effect = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            if isinstance(effect, _ROUND_TRIPS) or (isinstance(effect, Collect) and written):
                self.round_trips += 1
            written = isinstance(effect, Write) or (written and not isinstance(effect, Collect))
            value, error = None, None
            try:
                value = yield effect
            except BaseException as e:
                error = e


def count_round_trips(store: Any) -> CountingExecutor:
    """Install a counting executor on ``store`` (sync or async) and return it."""
    counting = CountingExecutor(store._executor)
    if inspect.iscoroutinefunction(store._executor.run):

        class Async(CountingExecutor):
            async def run(self, op: Op[Any]) -> Any:
                return await self.inner.run(self._counted(op))

        counting = Async(store._executor)
    store._executor = counting
    return counting
