"""What an operation asks its executor to do, and what comes back.

Every store operation is a generator that yields effects and receives their results: it
never touches a socket, a clock or a sleep itself. An executor (``store.io.sync`` on
redis-py, ``store.io.aio`` on ``redis.asyncio``) performs each effect and sends the result
back in, or throws ``Disconnected`` in when the server could not be reached. So the logic
of every operation, retries and redirects included, is written once for both worlds.

Error replies come back as ``ErrorReply`` values, classified by the executor, so that an
operation can tell a missing script from a moved slot without importing redis.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

Command = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``commands`` in one write to the server that owns ``key``; read every reply.

    The result is the list of replies, one per command, with error replies as
    ``ErrorReply`` (also inside the reply of an ``EXEC``). ``node`` sends to that server
    instead (a cluster's ASK redirect), after ``ASKING`` when ``asking`` is set.
    """

    key: str
    commands: Sequence[Command]
    node: tuple[str, int] | None = None
    asking: bool = False


@dataclass(frozen=True, slots=True)
class SendMany:
    """Several ``Send``s at once: one write per server, pipelined. The result is one entry
    per send, in order: its list of replies, or the ``Disconnected`` it met."""

    sends: Sequence[Send]


@dataclass(frozen=True, slots=True)
class Write:
    """Write ``sends`` as a ``SendMany`` would (one write per server), without waiting for
    their replies: the result is a ticket for ``Collect``. The server runs these while the
    operation prepares the next write or reads the replies of an earlier one.

    The executor keeps one connection per server for the writes not collected yet, so
    their replies come back in the order written; every ticket is collected once, in the
    order of its ``Write``. Tickets left uncollected when the operation ends close their
    connections (they may hold replies unread)."""

    sends: Sequence[Send]


@dataclass(frozen=True, slots=True)
class Collect:
    """The replies of the ``Write`` that gave ``ticket``, as a ``SendMany``'s result: one
    entry per send, its list of replies or the ``Disconnected`` its connection met (at the
    write, or at any read on that connection since)."""

    ticket: int


@dataclass(frozen=True, slots=True)
class Watch:
    """Take a connection to the server that owns ``key`` and keep it for a transaction;
    send ``commands`` (WATCH and the reads) on it. The result is their replies. The
    connection is held until the next ``Commit`` or ``Unwatch``."""

    key: str
    commands: Sequence[Command]


@dataclass(frozen=True, slots=True)
class Commit:
    """Send ``commands`` (MULTI .. EXEC) on the held connection and give it back."""

    commands: Sequence[Command]


@dataclass(frozen=True, slots=True)
class Unwatch:
    """Give the held connection back, unwatched."""


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class RefreshSlots:
    """Reload a cluster's slot map (a no-op on a single server)."""


Effect = Send | SendMany | Write | Collect | Watch | Commit | Unwatch | Sleep | RefreshSlots
Op = Generator[Effect, Any, T]
"""An operation: yields effects, receives their results, returns its own result."""


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error reply of the server, classified.

    ``kind`` is the reply's first word where it matters to the store (``NOSCRIPT``,
    ``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``, ``LOADING``, ``READONLY``,
    ``MASTERDOWN``, ``BUSY``, ``OOM``, ``NOPERM``, ``WRONGTYPE``), else ``ERR``. ``node``
    is the redirect target of a MOVED or ASK.
    """

    kind: str
    message: str
    node: tuple[str, int] | None = None

    @property
    def transient(self) -> bool:
        """Worth sending again after a pause: the server or the cluster is in transition."""
        return self.kind in _TRANSIENT


_TRANSIENT = frozenset({"TRYAGAIN", "CLUSTERDOWN", "LOADING", "READONLY", "MASTERDOWN", "BUSY"})


class Disconnected(Exception):
    """The server could not be reached, or the connection broke before every reply came.

    A command in flight may or may not have been applied; the operation decides whether
    to send it again (every store script is idempotent or guarded, see ``store.ops``).
    """

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        # When the call that met it began (``time.monotonic()``), set by the executor as it
        # throws it in: a call's patience counts from there (``Reconnect``).
        self.since: float | None = None
