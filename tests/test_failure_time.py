"""How long a call waits on a Redis that does not answer, and what it says then.

One setting, ``Reconnect.give_up_after`` (default 6 s), bounds a call across connects,
reads, pauses and tries; the error says how long the call waited and how often it tried,
and the CLI prints that real time. Against a private redis-server that is SIGSTOPped (its
sockets still accept, nothing answers). Also the URL mistakes that used to cost the same
wait or pass silently: ``rediss://`` at a plain port, a database that is not a number.
"""

from __future__ import annotations

import contextlib
import io
import re
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store import Reconnect, StoreConnectionError
from store.cli import main as cli
from store.errors import ConfigurationError
from store.io.connect import parse_url, timeouts
from store.io.wire import TLS_HINT, io_failure
from store.ops import calls
from store.ops.calls import DEFAULT_RECONNECT, send
from store.ops.effects import Disconnected, Send, Sleep
from tests.conftest import require_binaries
from tests.servers import RedisServer
from tests.stores import Stores

RID = "silent-1"
SLACK = 0.6  # scheduling, a loaded CI machine: well below a try's timeout
SAID = re.compile(r"gave up after (\d+\.\d) s and (\d+) tr(?:y|ies) \(bound (\d+(?:\.\d+)?) s\)")


# -- the bound, on a clock of the test's own ------------------------------------------------


class Clock:
    """``time.monotonic`` for ``store.ops.calls``: it moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def drive(clock: Clock, policy: Reconnect, try_takes: float, since: float | None) -> Any:
    """Run ``send`` against a server whose every try fails after ``try_takes`` seconds;
    the error it ends with, the tries made and when each began."""
    op = send("k", [("GET", "k")], {}, policy)
    began = [clock.now]
    effect = next(op)
    while True:
        assert isinstance(effect, Send)
        clock.now += try_takes
        failure = Disconnected("127.0.0.1:1: TimeoutError: Timeout reading")
        failure.since = since
        try:
            effect = op.throw(failure)
            while not isinstance(effect, Send):  # the pause, a slot refresh
                if isinstance(effect, Sleep):
                    clock.now += effect.seconds
                effect = op.send(None)
            began.append(clock.now)
        except StoreConnectionError as e:
            return e, began


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(calls, "time", clock)
    return clock


@pytest.mark.fake
@pytest.mark.parametrize("try_takes", [0.0, 0.3, 2.0, 2.9])
def test_no_try_is_started_that_could_end_past_the_bound(clock: Clock, try_takes: float) -> None:
    started = clock.now
    error, began = drive(clock, DEFAULT_RECONNECT, try_takes, since=started)

    assert clock.now - started <= DEFAULT_RECONNECT.give_up_after + 1e-9
    assert error.waited == pytest.approx(clock.now - started)
    assert error.tries == len(began)
    # It gave up only when one more try (as long as the longest seen) could overrun.
    assert clock.now + try_takes >= started + 6.0 - 1e-9
    said = SAID.search(str(error))
    assert said is not None, str(error)
    assert float(said[1]) == pytest.approx(error.waited, abs=0.05)
    assert int(said[2]) == len(began) and said[3] == "6"


@pytest.mark.fake
def test_a_refused_connect_is_tried_for_most_of_the_bound(clock: Clock) -> None:
    """Fast failures (nothing listening, a failover in progress) are ridden out."""
    error, began = drive(clock, DEFAULT_RECONNECT, 0.0, since=clock.now)
    assert error.waited > 5.0 and len(began) > 5


@pytest.mark.fake
def test_the_bound_counts_from_the_calls_start(clock: Clock) -> None:
    """A call that spent 3 s before its first failure (the executor's ``since``) has 3 s
    left, not 6."""
    error, began = drive(clock, DEFAULT_RECONNECT, 1.0, since=clock.now - 3.0)
    assert error.waited <= 6.0
    assert len(began) == 1  # 3 s gone and a try of 1: another would end at 6.05


@pytest.mark.fake
def test_client_timeouts_fit_the_bound() -> None:
    assert timeouts(Reconnect(give_up_after=3.0)) == {
        "socket_connect_timeout": 1.0,
        "socket_timeout": 1.0,
    }
    assert timeouts(None)["socket_timeout"] == DEFAULT_RECONNECT.attempt_timeout == 2.0
    # A short bound does not cut off a reply that is merely slow.
    assert timeouts(Reconnect(give_up_after=0.3))["socket_timeout"] == 0.5


# -- URL mistakes --------------------------------------------------------------------------


@pytest.mark.fake
@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/x", "rediss://h:1/db1", "redis://h:1/0x"])
def test_a_database_that_is_not_a_number_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="the database must be a number"):
        parse_url(url)


@pytest.mark.fake
@pytest.mark.parametrize("url", ["redis://h:1/3", "redis://h:1/", "redis://h:1", "rediss://h/15"])
def test_a_numbered_or_default_database_is_taken(url: str) -> None:
    parse_url(url)


def _wrapped(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 (the context is what is looked at)
    except BaseException as e:
        return e


@pytest.mark.fake
def test_a_tls_handshake_that_times_out_is_named() -> None:
    import redis

    error = _wrapped(
        TimeoutError("_ssl.c:989: The handshake operation timed out"),
        redis.TimeoutError("Timeout connecting to server"),
    )
    failure = io_failure(error, "h:1")
    assert isinstance(failure, Disconnected)  # a silent TLS server looks the same: retried
    assert TLS_HINT in str(failure) and "h:1" in str(failure)


@pytest.mark.fake
def test_a_tls_handshake_answered_in_plain_text_is_a_configuration_error() -> None:
    import redis

    error = _wrapped(
        ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number"),
        redis.ConnectionError("Error 1 connecting to h:1."),
    )
    failure = io_failure(error, "h:1")
    assert isinstance(failure, ConfigurationError)
    assert TLS_HINT in str(failure)


@pytest.mark.fake
def test_a_certificate_refused_is_no_plain_server() -> None:
    import redis

    error = _wrapped(
        ssl.SSLCertVerificationError(1, "certificate verify failed"),
        redis.ConnectionError("Error 1 connecting to h:1."),
    )
    assert TLS_HINT not in str(io_failure(error, "h:1"))


# -- against a paused redis-server -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_binaries()
    with RedisServer(Path(tmp_path_factory.mktemp("silent"))) as server:
        yield server


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    server.pause()
    try:
        yield
    finally:
        server.resume()


def timed(call: Any) -> tuple[float, StoreConnectionError]:
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as failed:
        call()
    return time.monotonic() - started, failed.value


@pytest.mark.servers
def test_a_silent_server_fails_each_call_within_the_default_bound(
    server: RedisServer, namespace: str, make_store: Stores
) -> None:
    store = make_store.from_url(server.url, namespace=namespace)
    assert store.list_requests() == []  # connected: the pool holds a live connection
    fresh = make_store.from_url(server.url, namespace=namespace)  # its first call checks
    with paused(server):
        took = {
            "load_request": timed(lambda: store.load_request(RID)),
            "list_requests": timed(store.list_requests),
            "first call": timed(lambda: fresh.load_request(RID)),
        }
    for name, (seconds, error) in took.items():
        print(f"[{make_store.kind}] {name}: StoreConnectionError after {seconds:.2f} s: {error}")
        assert seconds <= DEFAULT_RECONNECT.give_up_after + SLACK, name
        assert error.waited is not None and abs(error.waited - seconds) < SLACK, name
        said = SAID.search(str(error))
        assert said is not None and said[3] == "6", str(error)
        assert "Timeout" in str(error), str(error)  # what the last try met
    assert store.list_requests() == []  # the same store works once the server answers


def cli_run(*argv: str) -> tuple[int, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, err.getvalue(), time.monotonic() - started


@pytest.mark.servers
@pytest.mark.parametrize("command", [["ls"], ["show", RID], ["history", RID]])
def test_the_cli_says_how_long_it_really_waited(
    server: RedisServer, namespace: str, command: list[str]
) -> None:
    with paused(server):
        code, err, seconds = cli_run(*command, "--redis-url", server.url, "--namespace", namespace)
    assert code == 1 and err.count("\n") == 1, err
    said = SAID.search(err)
    assert said is not None, err
    assert abs(float(said[1]) - seconds) < SLACK, (err, seconds)
    assert seconds <= cli.CLI_RECONNECT.give_up_after + SLACK
    assert f"is Redis up at {server.url}" in err


@pytest.mark.servers
def test_rediss_at_a_plain_port_says_tls(server: RedisServer, namespace: str) -> None:
    url = server.url.replace("redis://", "rediss://")
    code, err, seconds = cli_run("ls", "--redis-url", url, "--namespace", namespace)
    assert code == 1 and TLS_HINT in err, err
    assert seconds <= cli.CLI_RECONNECT.give_up_after + SLACK


@pytest.mark.servers
def test_rediss_at_a_plain_port_says_tls_from_both_stores(
    server: RedisServer, namespace: str, make_store: Stores
) -> None:
    url = server.url.replace("redis://", "rediss://")
    bound = Reconnect(give_up_after=1.5)
    store = make_store.from_url(url, namespace=namespace, reconnect=bound)
    seconds, error = timed(store.list_requests)
    assert TLS_HINT in str(error), str(error)
    assert seconds <= bound.give_up_after + SLACK


@pytest.mark.servers
def test_a_database_word_in_the_cli_url_is_refused_at_once(
    server: RedisServer, namespace: str
) -> None:
    code, err, seconds = cli_run("ls", "--redis-url", server.url[:-1] + "x")
    assert code == 1 and "the database must be a number" in err, err
    assert seconds < 1.0
