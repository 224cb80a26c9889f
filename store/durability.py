"""What a write's acknowledgement promises: applied on the master, or on replicas too.

Redis replicates asynchronously: a master acknowledges a write once it has applied it,
and sends it to its replicas after. A master that dies in between takes the write with
it, and the replica promoted in its place never had it (a step acknowledged to the
conductor, then gone). ``Durability("replicated", replicas=N, wait_ms=T)`` makes every
write that changes a request (create, report, step, server-side and optimistic merge,
claim, lease renewal, field write, finish, delete) send ``WAIT N T`` right after it, in
the same round trip to the same server (on a cluster, the master of the keys' shard), and
succeed only once N replicas acknowledged it. Fewer within T milliseconds raise
``ReplicationTimeoutError``: the write was applied on the master (``WAIT`` runs after
it), so a retry must be, and with the same op id is, idempotent.

``WAIT`` guarantees that N replicas received and applied the write, not that it survives
any failure (a replica's copy is in memory; a failover may promote another replica, one
that did not acknowledge, if there are more than N): see docs/guarantees.md for what each
mode promises, and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from store.errors import ConfigurationError, ReplicationTimeoutError, StoreError
from store.ops.effects import Command, ErrorReply

MODES = ("master", "replicated")
# Below the read timeout of the clients the store builds (a third of Reconnect.give_up_after:
# 2 s for from_url, 1 s for the CLI), many times what a healthy replica takes.
DEFAULT_WAIT_MS = 500
# URL query options that are the store's, not redis-py's: taken out before redis-py parses.
URL_OPTIONS = ("durability", "replicas", "wait_ms")


@dataclass(frozen=True)
class Durability:
    """When a write counts as done.

    ``"master"`` (the default): once the master applied it; nothing is waited for, and a
    failover before the replicas got it loses it. ``"replicated"``: once ``replicas``
    replicas acknowledged it too, waiting at most ``wait_ms`` milliseconds (keep that
    below the client's socket timeout, or the read times out first).
    """

    mode: str = "master"
    replicas: int = 1
    wait_ms: int = DEFAULT_WAIT_MS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(
                f"durability must be 'master' or 'replicated', not {self.mode!r}"
            )
        for name in ("replicas", "wait_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(f"{name} must be an int >= 1, not {value!r}")

    @property
    def replicated(self) -> bool:
        """True if writes wait for replicas (mode ``"replicated"``)."""
        return self.mode == "replicated"

    def wait_command(self) -> Command | None:
        """The command sent after each write: ``WAIT`` in replicated mode, else none."""
        return ("WAIT", self.replicas, self.wait_ms) if self.replicated else None

    def check(self, reply: Any, **where: str | None) -> None:
        """Raise unless ``reply`` (the ``WAIT``'s) counts enough replicas."""
        if isinstance(reply, ErrorReply):
            raise StoreError(f"Redis refused WAIT after the write: {reply.message}", **where)
        if reply < self.replicas:
            raise ReplicationTimeoutError(int(reply), self.replicas, self.wait_ms, **where)

    def check_client(self, client: Any) -> None:
        """Refuse a wait as long as the client's socket timeout: its read would time out
        first, and the write be sent again for nothing."""
        if not self.replicated:
            return
        kwargs: dict[str, Any] = getattr(client, "get_connection_kwargs", dict)()
        timeout = kwargs.get("socket_timeout")
        if timeout is not None and self.wait_ms >= timeout * 1000:
            raise ConfigurationError(
                f"wait_ms={self.wait_ms} is not below the client's socket timeout "
                f"({timeout:g} s): lower wait_ms, or raise the read timeout (socket_timeout=, "
                "or from_url's reconnect=Reconnect(give_up_after=S), a third of which it is)"
            )


MASTER = Durability()


def durability_of(
    durability: str | Durability, replicas: int | None = None, wait_ms: int | None = None
) -> Durability:
    """A store's ``durability=``, ``replicas=`` and ``wait_ms=`` arguments as one setting."""
    if isinstance(durability, Durability):
        if replicas is not None or wait_ms is not None:
            raise ConfigurationError("pass replicas and wait_ms in the Durability, not beside it")
        return durability
    if not isinstance(durability, str):
        raise ConfigurationError(
            f"durability must be 'master', 'replicated' or a Durability, not {durability!r}"
        )
    if durability == "master" and (replicas is not None or wait_ms is not None):
        raise ConfigurationError("replicas and wait_ms need durability='replicated'")
    return Durability(
        durability,
        1 if replicas is None else replicas,
        DEFAULT_WAIT_MS if wait_ms is None else wait_ms,
    )


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """``url`` without the store's query options, and those as ``durability_of``'s
    arguments: ``redis://host/0?durability=replicated&replicas=1&wait_ms=500``."""
    if not isinstance(url, str) or "?" not in url:
        return url, {}
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    options: dict[str, Any] = {}
    for name, value in query:
        if name in URL_OPTIONS:
            if name != "durability" and not value.isdigit():
                raise ConfigurationError(f"URL option {name}={value!r}: expected a number")
            options[name] = value if name == "durability" else int(value)
    if not options:
        return url, {}
    rest = urlencode([(k, v) for k, v in query if k not in URL_OPTIONS])
    return urlunsplit(parts._replace(query=rest)), options


def split_durability(url: str) -> tuple[str, Durability]:
    """``url`` without the store's query options, and the durability they ask for."""
    rest, options = split_url(url)
    return rest, durability_of(options.pop("durability", "master"), **options)


def with_durability(url: str, durability: Durability) -> str:
    """``url`` asking for ``durability`` in its query (for a process that gets only a URL)."""
    rest, _ = split_url(url)
    if not durability.replicated:
        return rest
    parts = urlsplit(rest)
    ours = urlencode(
        {"durability": durability.mode, "replicas": durability.replicas,
         "wait_ms": durability.wait_ms}
    )  # fmt: skip
    return urlunsplit(parts._replace(query=f"{parts.query}&{ours}" if parts.query else ours))
