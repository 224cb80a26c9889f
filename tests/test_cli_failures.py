"""Every command, against every server a user can point it at by mistake: one line, exit 1.

The failures met on day one: nothing listening, a scheme the store does not take, a cluster
URL at a single server (or at nothing), a Sentinel that knows no such service (or is no
Sentinel), a server that is not Redis, a server that wants a password that was not given
(or was wrong). Each command must print exactly one line ``error: <message>`` naming the
server (redacted) and what to check, exit 1, and print no traceback and no client repr.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from store.cli import main as cli
from store.ops.calls import Reconnect
from tests.conftest import require_binaries
from tests.proxy import GarbageServer
from tests.servers import PasswordRedisServer, RedisSentinel, RedisServer, free_port

pytestmark = pytest.mark.servers

PASSWORD = "s3cret-pw"
COMMANDS = {
    "demo": ["demo", "--requests", "1"],
    "ls": ["ls"],
    "show": ["show", "r1"],
    "migrate": ["migrate"],
    "replicas": ["replicas"],
    "top": ["top", "--once"],
    "history": ["history", "r1"],
    "simulate": ["simulate", "--requests", "1", "--replicas", "1", "--kill", "0"],
}


@dataclass(frozen=True)
class Servers:
    plain: RedisServer
    locked: PasswordRedisServer
    sentinel: RedisSentinel
    garbage: GarbageServer
    dead: int  # a port nothing listens on


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    require_binaries()
    workdir = Path(tmp_path_factory.mktemp("cli-failures"))
    with (
        RedisServer(workdir / "plain") as plain,
        PasswordRedisServer(workdir / "locked", PASSWORD) as locked,
        RedisSentinel(None, workdir / "sentinel") as sentinel,
        GarbageServer() as garbage,
    ):
        yield Servers(plain, locked, sentinel, garbage, free_port())


@dataclass(frozen=True)
class Failure:
    name: str
    url: Callable[[Servers], str]
    says: str  # a part of the message that says what is wrong or what to check
    server: Callable[[Servers], str]  # how the message names the server
    gap: str = ""  # why the library's message does not say it yet (an xfail)


FAILURES = [
    Failure("nothing listening", lambda s: f"redis://127.0.0.1:{s.dead}/0",
            "is Redis up at", lambda s: f"127.0.0.1:{s.dead}"),
    Failure("wrong scheme", lambda s: f"http://127.0.0.1:{s.plain.port}",
            "unsupported scheme 'http'", lambda s: f"127.0.0.1:{s.plain.port}"),
    Failure("cluster URL at a single server", lambda s: f"redis+cluster://127.0.0.1:{s.plain.port}",
            "use redis:// for a single server", lambda s: f"127.0.0.1:{s.plain.port}"),
    Failure("cluster URL at nothing", lambda s: f"redis+cluster://127.0.0.1:{s.dead}",
            "are the cluster's nodes up", lambda s: f"127.0.0.1:{s.dead}"),
    Failure("unknown sentinel service", lambda s: f"redis+sentinel://127.0.0.1:{s.sentinel.port}/nosuch",
            "does it monitor 'nosuch'", lambda s: f"127.0.0.1:{s.sentinel.port}"),
    Failure("sentinel URL at a plain server",
            lambda s: f"redis+sentinel://127.0.0.1:{s.plain.port}/mymaster",
            "is no Sentinel", lambda s: f"127.0.0.1:{s.plain.port}"),
    Failure("not Redis", lambda s: f"redis://127.0.0.1:{s.garbage.port}/0",
            "is that address a Redis server", lambda s: f"127.0.0.1:{s.garbage.port}"),
    Failure("password missing", lambda s: f"redis://127.0.0.1:{s.locked.port}/0",
            "check the password", lambda s: f"127.0.0.1:{s.locked.port}"),
    Failure("password wrong", lambda s: f"redis://:wrong-{PASSWORD}@127.0.0.1:{s.locked.port}/0",
            "check the password", lambda s: f"127.0.0.1:{s.locked.port}"),
]  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


_ran: dict[tuple[str, str], Outcome] = {}


@pytest.fixture
def run(servers: Servers, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Runs a command against a failure once per module; both tests look at the outcome."""
    # The CLI gives up on an unreachable server after a second; a fifth will do here.
    monkeypatch.setattr(cli, "CLI_RECONNECT", Reconnect(give_up_after=0.2))
    monkeypatch.delenv("MSTAR_REDIS_URL", raising=False)
    monkeypatch.delenv("MSTAR_NAMESPACE", raising=False)

    def run(command: str, failure: Failure) -> Outcome:
        if (command, failure.name) not in _ran:
            argv = [*COMMANDS[command], "--redis-url", failure.url(servers)]
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main([*argv, "--namespace", namespace])
            _ran[command, failure.name] = Outcome(code, out.getvalue(), err.getvalue())
        return _ran[command, failure.name]

    return run


Run = Callable[[str, Failure], Outcome]


@pytest.mark.parametrize("failure", FAILURES, ids=[f.name for f in FAILURES])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_failure_is_one_line_and_exit_1(command: str, failure: Failure, run: Run) -> None:
    ran = run(command, failure)
    out, err = ran.out, ran.err
    assert ran.code == 1, (out, err)
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert PASSWORD not in err and PASSWORD not in out  # redacted
    assert len(err) < 400, err  # a message, not a dump
    for leak in ("Traceback", "object at 0x", "ConnectionPool", "Redis<", "RedisCluster<"):
        assert leak not in out + err, out + err


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=f.gap) if f.gap else ())
        for f in FAILURES
    ],
    ids=[f.name for f in FAILURES],
)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_line_names_the_server_and_what_to_check(
    command: str, failure: Failure, run: Run, servers: Servers
) -> None:
    err = run(command, failure).err
    assert failure.server(servers) in err, err
    assert failure.says in err, err
