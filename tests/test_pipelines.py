"""``Write`` / ``Collect``: writes whose replies are read later, and the streaming ``gather``.

The executors (sync and asyncio, fakeredis and a real Redis) must hand each ticket the
replies of its own sends, in the order written, on one connection per server; fail only
what was still to be read on a connection that broke; and never give back a connection
that holds replies unread. ``gather`` must write its first chunk before it has prepared
the last operation, and hand every operation exactly its own replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import redis

from store.errors import StoreError
from store.io.aio import AsyncExecutor
from store.io.sync import SyncExecutor
from store.ops import batch
from store.ops.batch import gather
from store.ops.effects import Collect, Disconnected, Op, Send, SendMany, Sleep, Write
from tests.stores import async_twin

Runner = Callable[[Op[Any]], Any]


@contextlib.contextmanager
def runner(kind: str, client: redis.Redis) -> Iterator[Runner]:
    """Runs operations on a fresh executor of ``kind``, on ``client``'s server."""
    if kind == "sync":
        yield SyncExecutor(client).run
        return
    aclient = async_twin(client)
    executor = AsyncExecutor(aclient)
    loop = asyncio.new_event_loop()
    try:
        yield lambda op: loop.run_until_complete(executor.run(op))
    finally:
        loop.run_until_complete(aclient.aclose())
        loop.close()


@pytest.fixture(params=["sync", "async"])
def run_op(request: pytest.FixtureRequest, client: redis.Redis) -> Iterator[Runner]:
    with runner(request.param, client) as run:
        yield run


def echo(key: str, *words: str) -> Send:
    return Send(key, [("ECHO", w) for w in words])


def test_tickets_get_their_own_replies_in_order(run_op: Runner, namespace: str) -> None:
    def op() -> Generator[Any, Any, Any]:
        first = yield Write([echo(f"{namespace}:a", "a1", "a2"), echo(f"{namespace}:b", "b1")])
        second = yield Write([echo(f"{namespace}:a", "a3")])
        one = yield Collect(first)
        two = yield Collect(second)
        alone = yield SendMany([echo(f"{namespace}:c", "c1")])
        return one, two, alone

    one, two, alone = run_op(op())
    assert one == [[b"a1", b"a2"], [b"b1"]]
    assert two == [[b"a3"]]
    assert alone == [[b"c1"]]


def test_a_ticket_collected_out_of_order_is_refused(run_op: Runner, namespace: str) -> None:
    def op() -> Generator[Any, Any, Any]:
        yield Write([echo(f"{namespace}:a", "x")])
        second = yield Write([echo(f"{namespace}:a", "y")])
        yield Collect(second)

    with pytest.raises(RuntimeError, match="out of order"):
        run_op(op())


def test_a_ticket_left_uncollected_does_not_leak_its_replies(
    run_op: Runner, namespace: str
) -> None:
    """The connection that holds unread replies is closed, not handed to the next call."""

    def abandon() -> Generator[Any, Any, Any]:
        yield Write([echo(f"{namespace}:a", "stale")])
        return "left"

    def ask() -> Generator[Any, Any, Any]:
        return (yield Send(f"{namespace}:a", [("ECHO", "fresh")]))

    assert run_op(abandon()) == "left"
    for _ in range(3):
        assert run_op(ask()) == [b"fresh"]


@pytest.mark.real
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_connection_killed_between_write_and_collect_fails_only_its_reads(
    real_client: redis.Redis, namespace: str, kind: str
) -> None:
    """A connection killed while its replies are due fails every ticket still to be read
    on it (the one the server was running and the one queued behind it); the next write
    to the server takes a new connection and gets its replies."""
    client = real_client
    name = f"{namespace}-victim".replace(":", "-")
    key = f"{{{namespace}}}:a"  # the hash tag keeps the BLPOP's key in the send's slot

    def op() -> Generator[Any, Any, Any]:
        blocked = [("CLIENT", "SETNAME", name), ("BLPOP", f"{{{namespace}}}:empty", "5")]
        first = yield Write([Send(key, blocked)])
        second = yield Write([echo(key, "2")])  # behind the BLPOP, on the same connection
        yield Sleep(0.2)
        killed = _kill(client, name)
        lost_first = yield Collect(first)
        lost_second = yield Collect(second)
        fresh = yield Write([echo(key, "3")])
        return killed, (lost_first, lost_second), (yield Collect(fresh))

    started = time.monotonic()
    with runner(kind, client) as run:
        killed, (first, second), fresh = run(op())
    assert killed == 1
    assert time.monotonic() - started < 4  # the kill ended the wait, not BLPOP's timeout
    assert isinstance(first[0], Disconnected)
    assert isinstance(second[0], Disconnected)
    assert fresh == [[b"3"]]


def _kill(client: redis.Redis, name: str) -> int:
    """Kill the connections named ``name`` on every server (a cluster's: on each node)."""
    if not isinstance(client, redis.RedisCluster):
        return _kill_on(client, name)
    killed = 0
    for node in client.get_nodes():
        with redis.Redis(host=node.host, port=node.port) as one:
            killed += _kill_on(one, name)
    return killed


def _kill_on(server: redis.Redis, name: str) -> int:
    victims = [c["id"] for c in server.client_list() if c.get("name") == name]
    for victim in victims:
        server.client_kill_filter(_id=victim)
    return len(victims)


# -- gather, with a scripted executor ------------------------------------------------------


class Scripted:
    """Performs Write/Collect/Send/Sleep in memory: the reply of ("ECHO", w) is w; keeps
    the order of what happened (effects, and the operations' own marks)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.tickets: dict[int, list[Any]] = {}
        self.written = 0

    def run(self, op: Op[Any]) -> Any:
        value: Any = None
        while True:
            try:
                effect = op.send(value)
            except StopIteration as stop:
                return stop.value
            if isinstance(effect, Write):
                number, self.written = self.written, self.written + 1
                self.tickets[number] = [self.replies(s) for s in effect.sends]
                self.log.append(f"write {len(effect.sends)}")
                value = number
            elif isinstance(effect, Collect):
                self.log.append(f"collect {effect.ticket}")
                value = self.tickets.pop(effect.ticket)
            elif isinstance(effect, Sleep):
                self.log.append("sleep")
                value = None
            else:
                raise AssertionError(f"gather yielded {effect!r}")

    @staticmethod
    def replies(send: Send) -> Any:
        if send.key == "down":
            return Disconnected("down")
        return [c[1] for c in send.commands]


def test_gather_writes_its_first_chunk_before_preparing_the_last_operation() -> None:
    executor = Scripted()
    n = 3 * batch.CHUNK + 2

    def op(i: int) -> Generator[Any, Any, Any]:
        executor.log.append(f"prepare {i}")
        first = yield Send(f"k{i}", [("ECHO", f"{i}")])
        if i % 5 == 0:  # some take a second round, and a sleep between
            yield Sleep(0.0)
            again = yield SendMany([Send(f"k{i}", [("ECHO", f"{i}+")])])
            return first + again[0]
        if i == 7:
            raise StoreError("no such thing", request_id=f"r{i}")
        return first

    results = executor.run(gather([op(i) for i in range(n)]))
    for i, result in enumerate(results):
        if i == 7:
            assert isinstance(result, StoreError)
        elif i % 5 == 0:
            assert result == [f"{i}", f"{i}+"]
        else:
            assert result == [f"{i}"]
    log = executor.log
    assert log.index("write 8") < log.index(f"prepare {n - 1}")
    collects = [int(entry.split()[1]) for entry in log if entry.startswith("collect")]
    assert collects == sorted(collects)  # in the order written
    assert log.count("sleep") == len(range(0, n, 5))


def test_gather_hands_a_broken_send_its_error_and_the_rest_their_replies() -> None:
    def op(key: str) -> Generator[Any, Any, Any]:
        try:
            return (yield Send(key, [("ECHO", key)]))
        except Disconnected:
            return "lost"

    keys = ["a", "down", "b", *(f"k{i}" for i in range(batch.CHUNK))]
    results = Scripted().run(gather([op(k) for k in keys]))
    assert results == [["a"], "lost", ["b"], *([f"k{i}"] for i in range(batch.CHUNK))]


def test_gather_on_a_real_executor_equals_one_at_a_time(run_op: Runner, namespace: str) -> None:
    """Many more sends than a chunk, over several keys (a cluster's several servers)."""

    def op(i: int) -> Generator[Any, Any, Any]:
        key = f"{namespace}:{{t{i % 5}}}"
        counted = yield Send(key, [("INCR", key)])
        again = yield Send(key, [("GET", key)])
        return counted[0], again[0]

    n = 4 * batch.CHUNK + 3
    started = time.monotonic()
    got = run_op(gather([op(i) for i in range(n)]))
    assert time.monotonic() - started < 30
    per_key: dict[int, list[int]] = {}
    for i, (counted, read) in enumerate(got):
        per_key.setdefault(i % 5, []).append(counted)
        assert int(read) >= counted
    for counts in per_key.values():
        assert counts == list(range(1, len(counts) + 1))  # in the order of the operations
