"""What a store sends: the commands on the wire, the writes (round trips), the effects.

Two independent counts of a store call's round trips, so that each checks the other:

- on the wire, for any tree (the legacy one too): ``recording_client`` keeps every write a
  redis-py connection makes and the commands in it, and counts the rounds: a write that
  follows a read (or is the first) starts one; writes pipelined before any read (a
  batch's chunks) share it;
- in the protocol, for a store built on ``store.ops`` effects: ``tap_effects`` wraps the
  store's executor and keeps every effect its operations yield; ``round_trips`` counts them
  (a ``SendMany`` is one round trip per server it reaches, and so are the ``Write``s
  before a ``Collect``).

``top_level`` tells the commands a client sent itself from those queued inside a
MULTI..EXEC, which the server runs (and counts in ``INFO commandstats``) under the EXEC,
as it does a script's calls under its EVALSHA (see benchmarks.server).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

Command = list[bytes]


def parse_commands(data: bytes) -> list[Command]:
    """The commands of a RESP request: arrays of bulk strings, as redis-py writes them."""
    commands = []
    i = 0
    while i < len(data):
        if data[i : i + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {i}: {data[i : i + 20]!r}")
        end = data.index(b"\r\n", i)
        count = int(data[i + 1 : end])
        i = end + 2
        command = []
        for _ in range(count):
            end = data.index(b"\r\n", i)
            size = int(data[i + 1 : end])
            command.append(data[end + 2 : end + 2 + size])
            i = end + 2 + size + 2
        commands.append(command)
    return commands


def _joined(packed: Any) -> bytes:
    if isinstance(packed, (bytes, bytearray, memoryview)):
        return bytes(packed)
    return b"".join(bytes(chunk) for chunk in packed)


@dataclass
class Recorded:
    """What a recording client wrote: the commands of each write, in order, and the rounds
    (writes that waited for a read before them)."""

    writes: list[list[Command]] = field(default_factory=list)
    rounds: int = 0
    read_since: bool = True  # a read since the last write: the next write starts a round

    @property
    def commands(self) -> list[Command]:
        return [command for write in self.writes for command in write]

    def clear(self) -> None:
        self.writes.clear()
        self.rounds, self.read_since = 0, True


def recording_client(url: str) -> tuple[redis.Redis, Recorded]:
    """A sync client that keeps every write it makes (whatever path the store sends by).

    Parsing each write costs client CPU: use it to learn what a call sends, not in a
    timed loop.
    """
    recorded = Recorded()

    class Recording(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            recorded.writes.append(parse_commands(_joined(command)))
            if recorded.read_since:
                recorded.rounds, recorded.read_since = recorded.rounds + 1, False
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            recorded.read_since = True
            return super().read_response(*args, **kwargs)

    pool = redis.ConnectionPool.from_url(url, connection_class=Recording)
    return redis.Redis(connection_pool=pool), recorded


def top_level(commands: Iterable[Command]) -> Counter[str]:
    """How often each command was sent by the client itself, by lower-case name: every
    command outside a MULTI..EXEC, and the MULTI and EXEC (or DISCARD) themselves."""
    counts: Counter[str] = Counter()
    queued = False
    for command in commands:
        name = command[0].decode(errors="replace").lower()
        if name == "multi":
            queued = True
        elif name in ("exec", "discard"):
            queued = False
        elif queued:
            continue
        counts[name] += 1
    return counts


# -- effects: the protocol's own count ---------------------------------------------------


def round_trips(effects: Iterable[Any], server_of: Callable[[Any], object] | None = None) -> int:
    """Round trips the ``effects`` of ``store.ops.effects`` cost: a ``Send``, ``Watch``,
    ``Commit`` or ``Unwatch`` one each; a ``SendMany`` one per server its sends reach
    (``server_of(send)``; default: the send's redirect node, else one server for all), and
    so do the ``Write``s pipelined before a ``Collect`` (counted at the first ``Collect``);
    ``Sleep`` and ``RefreshSlots`` none (a slot refresh is a no-op on a single server)."""
    counter = TripCounter(server_of)
    for effect in effects:
        counter.add(effect)
    return counter.trips


class TripCounter:
    """``round_trips``, one effect at a time (the ``Write``s not waited for are its state)."""

    def __init__(self, server_of: Callable[[Any], object] | None = None) -> None:
        self.server_of = server_of or _node_or_single
        self.trips = 0
        self._written: set[object] = set()  # servers of the Writes not waited for yet

    def add(self, effect: Any) -> None:
        kind = type(effect).__name__
        if kind == "SendMany":
            self.trips += len({self.server_of(send) for send in effect.sends})
        elif kind == "Write":
            self._written |= {self.server_of(send) for send in effect.sends}
        elif kind == "Collect":
            self.trips += len(self._written)
            self._written = set()
        elif kind in ("Send", "Watch", "Commit", "Unwatch"):
            self.trips += 1


def _node_or_single(send: Any) -> object:
    return send.node


class EffectTap:
    """A store's executor, counting the round trips of its operations' effects
    (``trips``) and, with ``keep``, keeping the effects themselves (``effects``)."""

    def __init__(self, inner: Any, *, keep: bool = True) -> None:
        self.inner = inner
        self.keep = keep
        self.effects: list[Any] = []
        self._counter = TripCounter()

    @property
    def trips(self) -> int:
        return self._counter.trips

    def run(self, op: Any) -> Any:
        return self.inner.run(_tapped(op, self._seen))

    def _seen(self, effect: Any) -> None:
        self._counter.add(effect)
        if self.keep:
            self.effects.append(effect)


def _tapped(op: Any, seen: Callable[[Any], None]) -> Generator[Any, Any, Any]:
    """``op``, unchanged, with ``seen`` called on each effect it yields."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = op.send(value) if error is None else op.throw(error)
        except StopIteration as stop:
            return stop.value
        seen(effect)
        try:
            value, error = (yield effect), None
        except GeneratorExit:
            op.close()
            raise
        except BaseException as e:  # the executor throws what the effect met
            value, error = None, e


def tap_effects(store: Any, *, keep: bool = True) -> EffectTap | None:
    """Wrap the store's executor (``store._executor``, not public) to count (and with
    ``keep``, keep) its effects; None when the store has none (a tree before the sans-IO
    refactor)."""
    inner = getattr(store, "_executor", None)
    if inner is None or not hasattr(inner, "run"):
        return None
    tap = EffectTap(inner, keep=keep)
    store._executor = tap
    return tap
