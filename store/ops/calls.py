"""Sending commands and scripts: redirects, reconnects and missing scripts, written once.

``send`` delivers commands to the server that owns a key and comes back with their replies,
following a cluster's MOVED and ASK redirects, pausing on transient refusals (TRYAGAIN,
LOADING, a failover in progress) and reconnecting after a lost connection, with backoff and
a fresh slot map, for a bounded time. A command sent again after a lost connection may have
been applied the first time: callers send only idempotent or guarded commands this way.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from store.backoff import RetryPolicy
from store.errors import (
    CorruptRecordError,
    StoreConnectionError,
    StoreError,
    StoreFullError,
    TransactionConflictError,
)
from store.ops.effects import (
    Command,
    Disconnected,
    ErrorReply,
    Op,
    RefreshSlots,
    Send,
    SendMany,
    Sleep,
)

Where = Mapping[str, "str | None"]


MIN_ATTEMPT_TIMEOUT = 0.5


@dataclass(frozen=True)
class Reconnect:
    """How long a call keeps trying to reach a server that fails or is in transition.

    ``give_up_after`` bounds the whole call: from its start, through every connect, read,
    pause and try, a call that meets an unreachable or silent server ends with
    ``StoreConnectionError`` within that many seconds. It does not start a try that could
    not end in time (it counts a try as long as the longest it has seen fail), so the
    bound holds as long as each try is itself bounded: ``from_url`` sets the client's
    connect and read timeouts to a third of it (``attempt_timeout``). Pauses grow from
    ``first_pause`` by doubling up to ``max_pause``. The default rides through a Sentinel or
    Cluster failover of a few seconds.
    """

    first_pause: float = 0.05
    max_pause: float = 1.0
    give_up_after: float = 6.0
    max_redirects: int = 16

    @property
    def attempt_timeout(self) -> float:
        """The connect and read timeouts ``from_url`` gives a client: two tries fit in the
        bound; never under half a second, so that a short bound (a test's, say) does not cut
        off a reply that is merely slow (the bound then holds from half a second up)."""
        return max(MIN_ATTEMPT_TIMEOUT, self.give_up_after / 3)

    def patience(self) -> Patience:
        """A fresh count of one call's pauses between its failed tries."""
        return Patience(self)


class Patience:
    """The pauses of one call between its failed tries (the only clock an operation reads)."""

    def __init__(self, policy: Reconnect) -> None:
        self.policy = policy
        self._first_failure: float | None = None
        self._pause = policy.first_pause
        self._origin: float | None = None  # when the call began, at the first failed try
        self._resumed = 0.0  # when the try failing now began (after the last pause)
        self._longest = 0.0
        self.tries = 0
        self.waited = 0.0

    def next_pause(self) -> float | None:
        """Seconds to wait before asking again, or None: give up (``give_up_after`` seconds
        after the first time it was asked). For waits on a server that answers (a refusal
        to retry, a busy claim); a failed try is ``after_failure``'s."""
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        left = self.policy.give_up_after - (now - self._first_failure)
        if left <= 0:
            return None
        pause = min(self._pause, left)
        self._pause = min(self.policy.max_pause, self._pause * 2)
        return pause

    def after_failure(self, failure: Disconnected) -> float | None:
        """Seconds to wait before trying again after ``failure``, or None: give up, since
        another try could not end within ``give_up_after`` of the call's start (the
        executor's ``failure.since``; the first failure, from an executor that does not
        say). ``tries`` and ``waited`` say what was done, for the error."""
        now = time.monotonic()
        self.tries += 1
        if self._origin is None:
            since = failure.since
            self._origin = since if since is not None and since <= now else now
            self._resumed = self._origin
        self._longest = max(self._longest, now - self._resumed)
        self.waited = now - self._origin
        left = self.policy.give_up_after - self.waited - self._longest
        if left <= 0:
            return None
        pause = min(self._pause, left)
        self._pause = min(self.policy.max_pause, self._pause * 2)
        self._resumed = now + pause
        return pause

    def gave_up(self, failure: Disconnected, **where: str | None) -> StoreConnectionError:
        """The error for a call that gave up: how long it waited, how often it tried, and
        what the last try met."""
        tries = f"{self.tries} tr{'y' if self.tries == 1 else 'ies'}"
        error = StoreConnectionError(
            f"Redis unreachable: gave up after {self.waited:.1f} s and {tries} (bound "
            f"{self.policy.give_up_after:g} s); last: {failure}",
            **where,
        )
        error.waited, error.tries = self.waited, self.tries
        return error


DEFAULT_RECONNECT = Reconnect()


# A write script's first line declares its flags for Redis 7 (see store/scripts/_lib.lua);
# a Lua that does not read that line (Redis before 7, fakeredis) fails to compile there.
_FLAG_LINE = re.compile(r"\A#!lua[^\n]*\n")
_FLAG_LINE_REFUSED = "unexpected symbol near '#'"


@dataclass
class Scripts:
    """The store's Lua scripts by name: their source and SHA1 (what EVALSHA names).

    ``written`` are the sources with their flag lines (``#!lua``): with them Redis 7 refuses
    a write script whole, before it runs, when used memory is over ``maxmemory``. A server
    that cannot compile that line (Redis before 7, fakeredis) says so at the first script
    it runs (``lacks_flags``), and from then on gets the scripts without it (``flagged``
    False), with the older rule: refused at the first write that may grow memory.
    """

    written: Mapping[str, str]
    flagged: bool = True
    _variants: tuple[dict[str, str], dict[str, str]] = field(init=False, repr=False)
    _shas: tuple[dict[str, str], dict[str, str]] = field(init=False, repr=False)
    _by_sha: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        plain = {name: _FLAG_LINE.sub("", src, count=1) for name, src in self.written.items()}
        self._variants = (dict(self.written), plain)
        self._shas = (_shas_of(self._variants[0]), _shas_of(plain))
        self._by_sha = {sha: name for shas in self._shas for name, sha in shas.items()}

    @property
    def sources(self) -> dict[str, str]:
        """The sources this server runs (with or without their flag lines)."""
        return self._variants[0 if self.flagged else 1]

    @property
    def shas(self) -> dict[str, str]:
        return self._shas[0 if self.flagged else 1]

    def loaded(self, command: Command) -> Command:
        """``command`` with its script's source in place of its SHA (EVAL for EVALSHA)."""
        if command[0] == "EVALSHA" and command[1] in self._by_sha:
            return ("EVAL", self.sources[self._by_sha[command[1]]], *command[2:])
        return command

    def lacks_flags(self, reply: Any) -> bool:
        """True when ``reply`` is a server's refusal to compile a flag line; the scripts go
        without flag lines from then on (the caller sends its script again, ``loaded``)."""
        if isinstance(reply, ErrorReply) and _FLAG_LINE_REFUSED in reply.message:
            self.flagged = False
            return True
        return False


def _shas_of(sources: Mapping[str, str]) -> dict[str, str]:
    return {
        name: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
        for name, src in sources.items()
    }


@dataclass(frozen=True)
class ScriptCall:
    """A script run by name: what ``script``'s ``alongside`` sends with another script."""

    name: str
    keys: Sequence[str]
    args: Sequence[Any]

    def command(self, scripts: Scripts, loaded: bool = False) -> Command:
        if loaded:
            return ("EVAL", scripts.sources[self.name], len(self.keys), *self.keys, *self.args)
        return ("EVALSHA", scripts.shas[self.name], len(self.keys), *self.keys, *self.args)


def send(
    key: str,
    commands: Sequence[Command],
    where: Where,
    reconnect: Reconnect = DEFAULT_RECONNECT,
) -> Op[list[Any]]:
    """The replies of ``commands`` sent in one write to ``key``'s server; see the module."""
    patience: Patience | None = None  # made at the first failure: most calls meet none
    redirects = 0
    node: tuple[str, int] | None = None
    asking = False
    while True:
        try:
            replies: list[Any] = yield Send(key, commands, node, asking)
        except Disconnected as e:
            patience = patience or reconnect.patience()
            pause = patience.after_failure(e)
            if pause is None:
                raise patience.gave_up(e, **where) from (e.__cause__ or e)
            yield Sleep(pause)
            yield RefreshSlots()  # a cluster node that died may have a promoted replica
            node, asking = None, False
            continue
        refusal = _redirect_or_pause(replies)
        if refusal is None:
            return replies
        redirects += 1
        if refusal.kind == "ASK":
            node, asking = refusal.node, True
        elif refusal.kind == "MOVED":
            node, asking = None, False
            yield RefreshSlots()
        else:  # transient: wait for the server or the cluster to settle
            patience = patience or reconnect.patience()
            pause = patience.next_pause()
            if pause is None:
                raise StoreConnectionError(
                    f"Redis kept refusing for {reconnect.give_up_after:g} s: {refusal.message}",
                    **where,
                )
            yield Sleep(pause)
            node, asking = None, False
            if refusal.kind in ("CLUSTERDOWN", "READONLY", "MASTERDOWN"):
                yield RefreshSlots()
            continue
        if redirects > reconnect.max_redirects:
            raise StoreError(f"the cluster kept redirecting: {refusal.message}", **where)


def needs_resend(replies: Sequence[Any]) -> bool:
    """The replies ask for the commands elsewhere or later (see ``send``)."""
    return _redirect_or_pause(replies) is not None


def _redirect_or_pause(replies: Sequence[Any]) -> ErrorReply | None:
    """The first reply that asks for the command elsewhere or later, if any."""
    for reply in replies:
        if isinstance(reply, ErrorReply):
            if reply.kind in ("MOVED", "ASK") or reply.transient:
                return reply
        elif type(reply) is list and reply and isinstance(reply[0], ErrorReply):
            # An EXEC's replies: a script that met a moved slot or a busy server fails there.
            found = _redirect_or_pause(reply)
            if found is not None:
                return found
    return None


def raise_error_replies(replies: Sequence[Any], where: Where) -> None:
    for reply in replies:
        if isinstance(reply, ErrorReply):
            raise error_for(reply, where)


# A script that stopped on a runtime error ("user_script:12: attempt to compare nil with
# number"; fakeredis: "Error running script"), or a command that met a value of the wrong
# type or form ("hash value is not an integer"): the store's scripts handle every value the
# store writes, so what they stopped on is damage.
_DAMAGE = re.compile(r"WRONGTYPE|user_script|Error running script|is not an integer")


def error_for(reply: ErrorReply, where: Where) -> StoreError:
    """The typed error of an error reply: ``StoreFullError`` at maxmemory,
    ``CorruptRecordError`` when the stored data is damaged, else ``StoreError``."""
    if reply.kind == "OOM":
        return StoreFullError(reply.message, **where)
    if reply.kind in ("ERR", "WRONGTYPE") and _DAMAGE.search(reply.message):
        return CorruptRecordError(f"the stored data is damaged: {reply.message}", **where)
    return StoreError(f"Redis refused a command: {reply.message}", **where)


def raise_wrong_type(commands: Sequence[Command], replies: Sequence[Any], where: Where) -> None:
    """Raise ``CorruptRecordError`` naming the key, where Redis answered a command (also one
    queued in a MULTI) that its key holds another type than the store keeps there."""
    queued: list[Command] = []
    for command, reply in zip(commands, replies, strict=False):
        if command[0] == "MULTI":
            queued = []
        elif command[0] == "EXEC" and type(reply) is list:
            raise_wrong_type(queued, reply, where)
        else:
            queued.append(command)
            if isinstance(reply, ErrorReply) and "WRONGTYPE" in reply.message:
                key = _key_of(command)
                said = reply.message
                raise CorruptRecordError(
                    f"the key holds another Redis type than the store keeps there ({said})",
                    **{**where, "key": key if key is not None else where.get("key")},
                )


def _key_of(command: Command) -> str | None:
    """The (first) key a command names, as text."""
    if command[0] in ("EVAL", "EVALSHA"):
        return _text(command[3]) if len(command) > 3 and int(command[2]) > 0 else None
    return _text(command[1]) if len(command) > 1 else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def script(
    scripts: Scripts,
    name: str,
    keys: Sequence[str],
    args: Sequence[Any],
    where: Where,
    reads: Sequence[Command] = (),
    reconnect: Reconnect = DEFAULT_RECONNECT,
    alongside: Sequence[ScriptCall] = (),
    wait: Command | None = None,
) -> Op[list[Any]]:
    """Run script ``name`` by EVALSHA (loading it if the server lacks it); its reply, then
    the replies of ``reads`` run right after it in the same MULTI..EXEC, atomically; then,
    with ``wait`` (a ``WAIT``, sent right after them in the same write), its reply.

    A read outside the script costs the server far less than the same read inside Lua.
    ``alongside`` are scripts sent in the same round trip as this one's first try, to
    whichever servers own their keys: idempotent writes (recovery hints) whose failure
    costs nothing but an early look, so they are not sent again after a failure (but a
    server that lacked one of them gets it loaded).
    """
    call: Command = ("EVALSHA", scripts.shas[name], len(keys), *keys, *args)
    # EVALSHA; EVAL where the server lacks the script; EVAL once more without the flag line
    # where the server cannot read it (see Scripts).
    for loaded in (False, True, True):
        if loaded:
            call = ("EVAL", scripts.sources[name], *call[2:])
        commands = [("MULTI",), call, *reads, ("EXEC",)] if reads else [call]
        if wait is not None:  # after EXEC: inside MULTI, WAIT does not wait
            commands.append(wait)
        if alongside and not loaded:
            sends = [Send(keys[0], commands)]
            sends += [Send(c.keys[0], [c.command(scripts)]) for c in alongside]
            replies, *others = yield SendMany(sends)
            if isinstance(replies, Disconnected) or _redirect_or_pause(replies) is not None:
                replies = yield from send(keys[0], commands, where, reconnect)
            again = [
                Send(other.keys[0], [other.command(scripts, loaded=isinstance(reply, list))])
                for other, reply in zip(alongside, others, strict=True)
                if not isinstance(reply, list)
                or _noscript(reply[0])
                or scripts.lacks_flags(reply[0])
                or needs_resend(reply)
            ]
            if again:  # once more, now that the server answers; still not waited on twice
                yield SendMany(again)
        else:
            replies = yield from send(keys[0], commands, where, reconnect)
        waited = None
        if wait is not None:
            replies, waited = replies[:-1], replies[-1]
        if reads:
            raise_error_replies(replies[:-1], where)  # a queueing error (wrong arity, say)
            results = replies[-1]
            if not isinstance(results, list):
                raise StoreError(f"MULTI..EXEC did not run: {results!r}", **where)
        else:
            results = list(replies)
        if _noscript(results[0]) or scripts.lacks_flags(results[0]):
            continue  # the server was restarted or flushed its script cache, or is older
        raise_error_replies(results, {**where, "key": where.get("key") or keys[0]})
        return results if wait is None else [*results, waited]
    raise StoreError(f"Redis does not keep script {name!r} after loading it", **where)


def _noscript(reply: Any) -> bool:
    return isinstance(reply, ErrorReply) and reply.kind == "NOSCRIPT"


def hash_reply(reply: Any) -> dict[bytes, bytes]:
    """A raw HGETALL reply as a dict: flat in RESP2, already paired in RESP3 (and fakeredis)."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


class BusyWait:
    """The waits of a server-side write that found an optimistic merge holding its partition.

    Bounded by time (``RetryPolicy.max_wait``), not by a count of tries: while starved merges
    take the partition in turn, a write steps in between them, however many there are. The
    time counts from when the claim last changed hands: a queue of merges taking it in turn
    is progress, one merge holding on (or a claim left to lapse) is a stall.
    """

    def __init__(self, retry: RetryPolicy, where: Where) -> None:
        self._retry = retry
        self._where = where
        self._waits = 0
        self._patience: Patience | None = None  # made at the first wait: most never wait
        self._holder: object = None

    def pause(self, busy: Sequence[Any]) -> Op[None]:
        """Wait before trying again; ``busy``: the script's reply ``{'BUSY', holder}``, which
        names the claim's holder as the script saw it."""
        holder = busy[1] if len(busy) > 1 else None
        self._waits += 1
        if self._patience is None or holder != self._holder:
            self._holder = holder
            self._patience = Reconnect(give_up_after=self._retry.max_wait).patience()
        if self._patience.next_pause() is None:
            raise TransactionConflictError(self._waits, **self._where)
        yield Sleep(self._retry.delay(self._waits))
