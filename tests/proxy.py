"""A TCP proxy between Redis clients and one server that breaks connections on command.

The store's guarantees for a lost reply (``README.md``, "Guarantees") are only worth what
a test that loses a reply shows. This proxy forwards every byte between its clients and one
``redis-server``, parses both directions (RESP2 and RESP3) so that it knows which reply
answers which command, and applies rules armed by the test:

- ``drop_reply(match)``: forward the matching command, wait for Redis's reply (so the
  command surely ran), then close the client's connection instead of passing it on;
- ``reset_before(match)``: reset both connections when the matching command arrives,
  before it is forwarded (nothing of it runs; a MULTI already forwarded is discarded);
- ``delay_replies(seconds, match)``: hold matching replies back for ``seconds``.

Triggers are deterministic: a rule fires on the ``nth`` command that matches it, counted
over every connection in the order the proxy reads them, and only once (``times`` for more).
A match is a predicate on the command's arguments (``command``, ``script``, ``exec_with``).
No pytest dependency; one thread per direction of each connection.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from store import scripts as script_files

HOST = "127.0.0.1"
CHUNK = 1 << 16


@dataclass(frozen=True)
class Seen:
    """A command as the proxy read it, with the MULTI block it closes if it is an EXEC."""

    args: tuple[bytes, ...]
    transaction: tuple[tuple[bytes, ...], ...] = ()

    @property
    def name(self) -> str:
        return self.args[0].decode(errors="replace").upper() if self.args else ""


Match = Callable[[Seen], bool]


def command(name: str, *prefix: str | bytes) -> Match:
    """Commands called ``name`` (any case) whose first arguments are ``prefix``."""
    wanted = tuple(p.encode() if isinstance(p, str) else p for p in prefix)

    def match(seen: Seen) -> bool:
        return seen.name == name.upper() and seen.args[1 : 1 + len(wanted)] == wanted

    return match


def script(name: str) -> Match:
    """The store's script ``name``, sent by EVALSHA or (after NOSCRIPT) by EVAL."""
    source = script_files.source(name)
    sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
    return any_of(command("EVALSHA", sha), command("EVAL", source))


def exec_with(inner: Match) -> Match:
    """An EXEC whose MULTI block holds a command matching ``inner``."""

    def match(seen: Seen) -> bool:
        return seen.name == "EXEC" and any(inner(Seen(c)) for c in seen.transaction)

    return match


def any_of(*matches: Match) -> Match:
    return lambda seen: any(m(seen) for m in matches)


@dataclass
class Rule:
    """One armed fault; ``fired`` is set once it happened, ``hits`` lists what it hit."""

    action: str  # "drop", "reset" or "delay"
    match: Match
    nth: int = 1
    times: int = 1
    delay: float = 0.0
    on_fire: Callable[[], object] | None = None  # run as it fires, before the client hears
    matched: int = 0
    hits: list[Seen] = field(default_factory=list)
    fired: threading.Event = field(default_factory=threading.Event)

    def claim(self, seen: Seen) -> bool:
        """Count ``seen`` if it matches; True if this rule acts on it."""
        if len(self.hits) >= self.times or not self.match(seen):
            return False
        self.matched += 1
        if self.matched < self.nth:
            return False
        self.hits.append(seen)
        return True

    def fire(self) -> None:
        """Run ``on_fire`` and say it fired: both before the client can see the fault."""
        try:
            if self.on_fire is not None:
                self.on_fire()
        finally:
            self.fired.set()

    def wait(self, timeout: float = 10.0) -> bool:
        return self.fired.wait(timeout)


class _Listener:
    """A TCP server on a free port of 127.0.0.1; ``handle`` gets each connection accepted."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self.port = 0

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        name = f"{type(self).__name__}-accept"
        threading.Thread(target=self._accept, name=name, daemon=True).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError


class FaultProxy(_Listener):
    """Listens on a free port of 127.0.0.1 and forwards to ``upstream`` (see the module)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self.log: list[Seen] = []  # every command read from a client, in order

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    # -- rules --------------------------------------------------------------------------

    def drop_reply(
        self,
        match: Match,
        nth: int = 1,
        times: int = 1,
        on_fire: Callable[[], object] | None = None,
    ) -> Rule:
        """Let Redis run the ``nth`` matching command, then close the client's connection
        before its reply reaches the client. ``on_fire`` runs in between (another
        client's write, say), so its order with the dropped command is known."""
        return self._arm(Rule("drop", match, nth, times, on_fire=on_fire))

    def reset_before(
        self,
        match: Match,
        nth: int = 1,
        times: int = 1,
        on_fire: Callable[[], object] | None = None,
    ) -> Rule:
        """Reset the connection when the ``nth`` matching command arrives, unforwarded;
        ``on_fire`` runs first, while the client waits for its reply."""
        return self._arm(Rule("reset", match, nth, times, on_fire=on_fire))

    def delay_replies(
        self, seconds: float, match: Match = lambda seen: True, nth: int = 1, times: int = 1
    ) -> Rule:
        """Hold the replies of matching commands back for ``seconds`` each."""
        return self._arm(Rule("delay", match, nth, times, delay=seconds))

    def clear(self) -> None:
        """Disarm every rule and forget the log."""
        with self._lock:
            self._rules.clear()
            self.log.clear()

    def count(self, match: Match) -> int:
        """How many commands read so far match ``match``."""
        with self._lock:
            return sum(1 for seen in self.log if match(seen))

    def _arm(self, rule: Rule) -> Rule:
        if rule.nth < 1 or rule.times < 1:
            raise ValueError("nth and times must be at least 1")
        with self._lock:
            self._rules.append(rule)
        return rule

    def _fate(self, seen: Seen) -> Rule | None:
        """The rule that acts on ``seen`` (the first armed that claims it), logged."""
        with self._lock:
            self.log.append(seen)
            for rule in self._rules:
                if rule.claim(seen):
                    return rule
        return None

    # -- life -----------------------------------------------------------------------------

    def stop(self) -> None:
        super().stop()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def handle(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _close(client, reset=True)  # as if the server were down
            return
        server.settimeout(None)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(self, client, server)
        with self._lock:
            self._links.add(link)
        link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)


class _Link:
    """One client connection and its connection to the server, pumped by two threads."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.pending: deque[Rule | None] = deque()  # the rule (if any) of each reply due
        self.lock = threading.Lock()
        self.closed = False
        self.multi: list[tuple[bytes, ...]] | None = None  # commands since MULTI

    def start(self) -> None:
        threading.Thread(target=self._requests, name="proxy-requests", daemon=True).start()
        threading.Thread(target=self._replies, name="proxy-replies", daemon=True).start()

    def close(self, reset: bool = False) -> None:
        """Close both connections; ``reset`` resets the client's. The server's is always
        shut down in order, so every byte forwarded reaches Redis before its end."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _close(self.client, reset)
        _close(self.server)
        self.proxy._forget(self)

    def _requests(self) -> None:
        """Client to server: split commands, decide each one's fate, forward."""
        buffer = b""
        try:
            while chunk := self.client.recv(CHUNK):
                buffer += chunk
                out = bytearray()
                while (parsed := parse_command(buffer)) is not None:
                    args, end = parsed
                    raw, buffer = buffer[:end], buffer[end:]
                    rule = self.proxy._fate(self._seen(args))
                    if rule is not None and rule.action == "reset":
                        self.server.sendall(out)  # what came before it got through
                        rule.fire()
                        self.close(reset=True)
                        return
                    with self.lock:
                        self.pending.append(rule)
                    out += raw
                if out:
                    self.server.sendall(out)
        except OSError:
            pass
        self.close()

    def _seen(self, args: tuple[bytes, ...]) -> Seen:
        name = args[0].upper() if args else b""
        if name == b"MULTI":
            self.multi = []
            return Seen(args)
        if name in (b"EXEC", b"DISCARD"):
            block, self.multi = tuple(self.multi or ()), None
            return Seen(args, block)
        if self.multi is not None:
            self.multi.append(args)
        return Seen(args)

    def _replies(self) -> None:
        """Server to client: split replies, apply the fate of the command each answers."""
        buffer = b""
        try:
            while chunk := self.server.recv(CHUNK):
                buffer += chunk
                out = bytearray()
                while (end := reply_end(buffer)) is not None:
                    raw, buffer = buffer[:end], buffer[end:]
                    if raw[:1] == b">":  # a push message answers no command
                        out += raw
                        continue
                    with self.lock:
                        rule = self.pending.popleft() if self.pending else None
                    if rule is None:
                        out += raw
                    elif rule.action == "drop":
                        self.client.sendall(out)
                        rule.fire()
                        self.close()  # Redis ran it; the client never hears so
                        return
                    else:  # delay
                        self.client.sendall(out)
                        out = bytearray()
                        time.sleep(rule.delay)
                        rule.fire()
                        self.client.sendall(raw)
                if out:
                    self.client.sendall(out)
        except OSError:
            pass
        self.close()


class GarbageServer(_Listener):
    """A TCP server that answers whatever it is sent with an HTTP error: not Redis."""

    ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            while conn.recv(CHUNK):
                conn.sendall(self.ANSWER)
        except OSError:
            pass
        finally:
            _close(conn)


def _close(sock: socket.socket, reset: bool = False) -> None:
    try:
        if reset:  # RST instead of FIN: the peer sees "connection reset"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# -- RESP -----------------------------------------------------------------------------------


def parse_command(buffer: bytes) -> tuple[tuple[bytes, ...], int] | None:
    """The first complete command in ``buffer`` and where it ends, or None.

    Clients send arrays of bulk strings (``*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n``);
    an inline command (a plain line, as telnet sends) is split on spaces.
    """
    if not buffer:
        return None
    if buffer[:1] != b"*":
        line_end = buffer.find(b"\r\n")
        if line_end < 0:
            return None
        return tuple(buffer[:line_end].split()), line_end + 2
    line_end = buffer.find(b"\r\n")
    if line_end < 0:
        return None
    count = int(buffer[1:line_end])
    pos = line_end + 2
    args: list[bytes] = []
    for _ in range(max(count, 0)):
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return None
        if buffer[pos : pos + 1] != b"$":
            raise ValueError(f"not a bulk string in a command: {buffer[pos:line_end]!r}")
        size = int(buffer[pos + 1 : line_end])
        start = line_end + 2
        if len(buffer) < start + size + 2:
            return None
        args.append(buffer[start : start + size])
        pos = start + size + 2
    return tuple(args), pos


_LINE = {b"+", b"-", b":", b"_", b",", b"#", b"("}  # one line
_BULK = {b"$", b"!", b"="}  # length-prefixed payload
_AGGREGATE = {b"*": 1, b"~": 1, b">": 1, b"%": 2, b"|": 2}  # elements per count


def reply_end(buffer: bytes, pos: int = 0) -> int | None:
    """Where the reply starting at ``pos`` ends, or None if it is not all there yet."""
    line_end = buffer.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buffer[pos : pos + 1]
    after = line_end + 2
    if kind in _LINE:
        return after
    if kind in _BULK:
        size = int(buffer[pos + 1 : line_end])
        if size < 0:
            return after
        end = after + size + 2
        return end if len(buffer) >= end else None
    if kind in _AGGREGATE:
        count = int(buffer[pos + 1 : line_end])
        for _ in range(max(count, 0) * _AGGREGATE[kind]):
            found = reply_end(buffer, after)
            if found is None:
                return None
            after = found
        if kind == b"|":  # an attribute map comes before the reply it describes
            return reply_end(buffer, after)
        return after
    raise ValueError(f"not a RESP reply: {buffer[pos:line_end]!r}")


def matching(log: Sequence[Seen], match: Match) -> list[Seen]:
    """The commands of ``log`` that match."""
    return [seen for seen in log if match(seen)]
