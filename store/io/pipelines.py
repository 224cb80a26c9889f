"""The bookkeeping of ``Write`` / ``Collect``: writes whose replies are read later.

Both executors keep one ``Pipelines`` per operation run and do the I/O themselves. Per
server there is one connection for the writes not collected yet (so one server's replies
come back in the order written); a ticket records which of its sends went on which
connection. A connection that broke (at a write or a read) fails every send still to be
read on it with the ``Disconnected`` it met, and the next write to that server takes a
fresh connection. A connection no pending ticket reads from goes back to its pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from store.ops.effects import Disconnected, Send

H = TypeVar("H")  # a held connection: (endpoint, connection)


@dataclass
class Ticket(Generic[H]):
    """One ``Write``: its sends, their results so far, and the connection of each group."""

    number: int
    sends: Sequence[Send]
    results: list[Any]
    parts: list[tuple[H, list[int]]] = field(default_factory=list)


class Pipelines(Generic[H]):
    """Open connections by server address, tickets in the order written, broken connections."""

    def __init__(self) -> None:
        self.open: dict[str, H] = {}
        self.tickets: deque[Ticket[H]] = deque()
        self.broken: dict[int, Disconnected] = {}  # id(connection) -> what it met
        self._numbers = 0

    def new_ticket(self, sends: Sequence[Send]) -> Ticket[H]:
        ticket: Ticket[H] = Ticket(self._numbers, sends, [None] * len(sends))
        self._numbers += 1
        self.tickets.append(ticket)
        return ticket

    def next_ticket(self, number: int) -> Ticket[H]:
        """The oldest ticket, which must be ``number``: tickets are collected in order."""
        if not self.tickets or self.tickets[0].number != number:
            oldest = self.tickets[0].number if self.tickets else None
            raise RuntimeError(f"Collect({number}) out of order: the oldest ticket is {oldest}")
        return self.tickets.popleft()

    def break_off(self, address: str, held: H, error: Disconnected) -> None:
        """``held`` broke: what is still to be read on it fails with ``error``."""
        self.broken[id(_conn(held))] = error
        if self.open.get(address) is held:
            del self.open[address]

    def failure(self, held: H) -> Disconnected | None:
        return self.broken.get(id(_conn(held)))

    def idle(self) -> list[H]:
        """Connections no pending ticket reads from: forgotten here, for the pool."""
        busy = {id(_conn(held)) for ticket in self.tickets for held, _ in ticket.parts}
        done = [held for held in self._known() if id(_conn(held)) not in busy]
        for held in done:
            self._forget(held)
        return done

    def abandoned(self) -> list[H]:
        """Every connection still known (the operation ended): forgotten here."""
        held_all = self._known()
        for held in held_all:
            self._forget(held)
        self.tickets.clear()
        return held_all

    def _known(self) -> list[H]:
        seen: dict[int, H] = {id(_conn(h)): h for h in self.open.values()}
        for ticket in self.tickets:
            for held, _ in ticket.parts:
                seen.setdefault(id(_conn(held)), held)
        return list(seen.values())

    def _forget(self, held: H) -> None:
        key = id(_conn(held))
        self.broken.pop(key, None)
        for address, open_held in list(self.open.items()):
            if id(_conn(open_held)) == key:
                del self.open[address]


def _conn(held: Any) -> Any:
    return held[1]
