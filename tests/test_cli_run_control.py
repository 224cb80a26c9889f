"""What the command line does around the work: Ctrl-C, progress output, evicting servers.

Ctrl-C ends any command with exit status 130 and one line (no traceback, from the command
or from `simulate`'s replica processes); a progress bar redraws in place only on a
terminal (plain lines in a log or a pipe); every command that writes says first when the
server may evict what it writes, as ``RequestStore.from_url`` does.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from store.cli import main as cli
from store.cli.progress import Progress
from store.cli.simulate.fleet import Fleet
from tests.cli_run import no_env_defaults, run  # noqa: F401 (a fixture)
from tests.conftest import require_binaries
from tests.servers import RedisServer
from tests.test_cli_failures import COMMANDS as EVERY_COMMAND

ROOT = Path(__file__).resolve().parent.parent
# Every command (as the failure tests run them), simulate aside: it has tests of its own.
COMMANDS = {name: argv for name, argv in EVERY_COMMAND.items() if name != "simulate"}
COMMANDS["doctor"] = ["doctor"]


pytestmark = pytest.mark.usefixtures("no_env_defaults")


# -- Ctrl-C --------------------------------------------------------------------------------


def interrupted_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "interrupted" in line]


@pytest.mark.fake
@pytest.mark.parametrize("command", list(COMMANDS))
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(
    command: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "make_client", interrupted)
    code, out, err = run(*COMMANDS[command], "--namespace", namespace)
    assert code == 130, (out, err)
    assert len(interrupted_lines(out + err)) == 1, (out, err)
    assert "Traceback" not in out + err


@pytest.mark.fake
def test_ctrl_c_mid_simulation_stops_the_replicas_and_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stepped: list[Fleet] = []
    step = Fleet.step

    def step_then_interrupt(fleet: Fleet) -> bool:
        stepped.append(fleet)
        if len(stepped) == 20:
            raise KeyboardInterrupt
        return step(fleet)

    monkeypatch.setattr(Fleet, "step", step_then_interrupt)
    code, out, err = run("simulate", "--requests", "2", "--replicas", "1", "--kill", "0")
    assert code == 130, (out, err)
    assert interrupted_lines(err) == ["interrupted: mstar-store simulate stopped"], err
    assert "Traceback" not in out + err
    fleet = stepped[0]
    assert all(r.process.poll() is not None for r in fleet.replicas.values())  # none left


@pytest.mark.servers
@pytest.mark.timeout(120)
def test_sigint_to_a_simulation_and_its_replicas_is_one_line_and_exit_130() -> None:
    """A terminal's Ctrl-C: SIGINT to the whole process group, the replicas included."""
    pytest.importorskip("lupa")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MSTAR_REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "store", "simulate", "--requests", "40", "--replicas", "2",
         "--kill", "0", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # its own process group, as a shell gives a job
    )  # fmt: skip
    try:
        assert process.stderr is not None
        first = process.stderr.readline()  # the first progress line: the replicas run
        assert "finished" in first, first + process.stderr.read()
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        out, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    err = first + rest
    assert process.returncode == 130, (out, err)
    assert interrupted_lines(err) == ["interrupted: mstar-store simulate stopped"], err
    assert "Traceback" not in out + err
    assert "\r" not in err  # stderr is a pipe: plain progress lines


# -- progress --------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.fake
def test_progress_redraws_in_place_only_on_a_terminal() -> None:
    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        bar = Progress(stream, 3, every=0.0)
        for done in range(4):
            bar.update(done, "kills 0/0", 1.0 * done, force=True)
        bar.close()
    assert terminal.getvalue().count("\r") == 4 and "[" in terminal.getvalue()
    assert "\r" not in log.getvalue() and "[" not in log.getvalue()
    assert log.getvalue().splitlines() == [
        f"{n}/3 finished  kills 0/0    {n:.1f}s" for n in range(4)
    ]


@pytest.mark.fake
def test_plain_progress_is_a_line_now_and_then_and_the_last_state() -> None:
    log = io.StringIO()
    bar = Progress(log, 100, label="requests")  # a line every 5 s at most
    for done in range(101):
        bar.update(done, force=done == 100)
    assert log.getvalue().splitlines() == ["  0/100 requests", "100/100 requests"]


@pytest.mark.fake
def test_migrate_writes_no_frames_into_a_log(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = fakeredis.FakeServer()
    monkeypatch.setattr(cli, "make_client", lambda args: fakeredis.FakeRedis(server=server))
    assert run("demo", "--requests", "2", "--keep", "--namespace", namespace)[0] == 0
    code, out, err = run("migrate", "--namespace", namespace, "--batch", "1")
    assert code == 0, (out, err)
    assert "\r" not in err and "2/2 requests" in err


# -- evicting servers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evicting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_binaries()
    workdir = Path(tmp_path_factory.mktemp("evicting"))
    with RedisServer(workdir, None, "--maxmemory-policy", "allkeys-lru") as server:
        yield server


WRITERS = {
    "demo": ["demo", "--requests", "1"],
    "migrate": ["migrate"],
    "simulate": ["simulate", "--requests", "1", "--replicas", "1", "--kill", "0"],
}
READERS = {"ls": ["ls"], "migrate --dry-run": ["migrate", "--dry-run"]}


@pytest.mark.servers
@pytest.mark.parametrize("command", list(WRITERS))
def test_a_command_that_writes_warns_of_an_evicting_server(
    command: str, evicting: RedisServer, namespace: str
) -> None:
    argv = [*WRITERS[command], "--redis-url", evicting.url]
    if command != "simulate":  # it makes a namespace of its own, and deletes it
        argv += ["--namespace", namespace]
    code, out, err = run(*argv)
    assert code == 0, (out, err)
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, err
    assert "maxmemory-policy is allkeys-lru" in warnings[0]
    assert "mstar-store doctor" in warnings[0]


@pytest.mark.servers
@pytest.mark.parametrize("command", list(READERS))
def test_a_command_that_only_reads_does_not(
    command: str, evicting: RedisServer, namespace: str
) -> None:
    code, out, err = run(*READERS[command], "--redis-url", evicting.url, "--namespace", namespace)
    assert code == 0, (out, err)
    assert "warning" not in err
