"""The fault proxy of ``tests/proxy.py`` does what the fault tests rely on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from tests.proxy import FaultProxy, command, exec_with, parse_command, reply_end
from tests.servers import RedisServer, no_retry


@pytest.fixture
def proxy(tmp_redis: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy((tmp_redis.host, tmp_redis.port)) as proxy:
        yield proxy


@pytest.fixture
def through(proxy: FaultProxy) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(proxy.url, socket_timeout=5, retry=no_retry())
    yield client
    client.close()


@pytest.mark.servers
def test_a_dropped_reply_was_applied_and_the_client_hears_nothing(
    proxy: FaultProxy, through: redis.Redis, tmp_redis: RedisServer
) -> None:
    rule = proxy.drop_reply(command("INCRBY", "n"), nth=2)
    assert through.incr("n") == 1  # the first match passes
    with pytest.raises(redis.ConnectionError):
        through.incr("n")
    assert rule.fired.is_set() and [s.args[:2] for s in rule.hits] == [(b"INCRBY", b"n")]
    assert tmp_redis.client().get("n") == b"2"
    assert through.incr("n") == 3  # fired once: a new connection passes


@pytest.mark.servers
def test_a_reset_before_forwarding_applies_nothing(
    proxy: FaultProxy, through: redis.Redis, tmp_redis: RedisServer
) -> None:
    rule = proxy.reset_before(command("INCRBY"))
    with pytest.raises(redis.ConnectionError):
        through.incr("n")
    assert rule.fired.is_set()
    assert tmp_redis.client().get("n") is None


@pytest.mark.servers
def test_exec_rules_see_their_transaction(
    proxy: FaultProxy, through: redis.Redis, tmp_redis: RedisServer
) -> None:
    proxy.reset_before(exec_with(command("INCRBY", "m")))
    pipe = through.pipeline(transaction=True)
    pipe.incr("m").incr("m")
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    direct = tmp_redis.client()
    deadline = time.monotonic() + 5
    while len(direct.client_list()) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # until Redis has seen the proxy's connection end
    assert direct.get("m") is None  # MULTI was forwarded, EXEC not: discarded

    proxy.drop_reply(exec_with(command("INCRBY", "m")))
    with pytest.raises(redis.ConnectionError):
        pipe.incr("m").incr("m").execute()
    assert direct.get("m") == b"2"
    assert proxy.count(command("EXEC")) == 2


@pytest.mark.servers
def test_delayed_replies_arrive_late_and_whole(proxy: FaultProxy, through: redis.Redis) -> None:
    through.set("k", b"v")
    rule = proxy.delay_replies(0.2, command("GET"), times=2)
    started = time.monotonic()
    assert [through.get("k"), through.get("k"), through.get("k")] == [b"v"] * 3
    assert time.monotonic() - started >= 0.4
    assert len(rule.hits) == 2


@pytest.mark.servers
def test_resp3_replies_pass_whole(proxy: FaultProxy) -> None:
    with redis.Redis.from_url(proxy.url, protocol=3) as client:
        client.hset("h", mapping={"a": 1, "b": 2})
        client.sadd("s", "x")
        assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}
        assert client.smembers("s") == {b"x"}


def test_commands_and_replies_are_split_where_they_end() -> None:
    wire = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n"
    assert parse_command(wire) == ((b"GET", b"k"), 20)
    assert parse_command(wire[20:]) == ((b"PING",), 14)
    assert parse_command(wire[:19]) is None  # not all there yet
    assert parse_command(b"PING\r\n") == ((b"PING",), 6)  # inline
    for reply in (b"+OK\r\n", b"$-1\r\n", b"$3\r\nabc\r\n", b"*2\r\n:1\r\n$1\r\nx\r\n",
                  b"%1\r\n+a\r\n*1\r\n_\r\n", b"|1\r\n+k\r\n+v\r\n:7\r\n", b"*-1\r\n",
                  b"~1\r\n,1.5\r\n", b"-ERR no\r\n"):  # fmt: skip
        assert reply_end(reply + b"+next\r\n") == len(reply), reply
        assert reply_end(reply[:-1]) is None
