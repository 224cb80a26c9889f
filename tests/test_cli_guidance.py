"""What the command line tells a newcomer: help with examples, the version, where to look.

Every subcommand's ``--help`` has a paragraph and examples that parse; ``--version`` is the
package's, from every parser and from ``python -m store``; ``demo --keep`` prints the exact
commands that find what it kept, and a legend of its pass lines; a request not found names
the namespace looked in and the namespaces that do hold it (or hold requests).
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import fakeredis
import pytest

from store.cli import main as cli
from store.cli.demo import LEGEND_ROWS
from store.schema import SCHEMA_VERSION
from tests.cli_run import no_env_defaults, run  # noqa: F401 (a fixture)
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ["demo", "ls", "show", "migrate", "replicas", "top", "history", "doctor", "simulate"]


pytestmark = pytest.mark.usefixtures("no_env_defaults")


@pytest.fixture
def on_fake(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeServer:
    """Every command of the test on one fakeredis server."""
    server = fakeredis.FakeServer()
    monkeypatch.setattr(cli, "make_client", lambda args: fakeredis.FakeRedis(server=server))
    return server


# -- --help --------------------------------------------------------------------------------


def test_every_command_module_is_covered() -> None:
    assert sorted(SUBCOMMANDS) == sorted(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


@pytest.mark.fake
@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_has_a_paragraph_and_examples_that_parse(command: str) -> None:
    code, out, _ = run(command, "--help")
    assert code == 0
    _, after_usage = out.split("\n\n", 1)
    description = after_usage.split("\n\n", 1)[0]
    assert len(description) > 150 and not description.startswith("options"), description
    examples = out.split("\nexamples:\n", 1)[1].splitlines()
    commands = [line.strip() for line in examples if line.startswith("  mstar-store ")]
    assert commands, out
    for example in commands:
        argv = shlex.split(example.split(" | ", 1)[0])[1:]
        assert argv[0] == command
        cli.build_parser().parse_args(argv)  # exits 2 on an option that does not exist


# -- --version -------------------------------------------------------------------------------


def expected_version() -> str:
    package = importlib.metadata.version(cli.DISTRIBUTION)
    return f"mstar-store {package} (schema v{SCHEMA_VERSION})\n"


@pytest.mark.fake
@pytest.mark.parametrize("where", [[], *([c] for c in SUBCOMMANDS)], ids=["main", *SUBCOMMANDS])
def test_version_from_every_parser(where: list[str]) -> None:
    code, out, _ = run(*where, "--version")
    assert (code, out) == (0, expected_version())


@pytest.mark.fake
def test_version_of_a_source_tree_that_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.version() == (
        f"mstar-store {declared} (source tree, not installed) (schema v{SCHEMA_VERSION})"
    )


@pytest.mark.fake
def test_python_dash_m_store_runs_the_cli() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "store", "--version"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert (ran.returncode, ran.stdout) == (0, expected_version()), ran.stderr


# -- demo: the legend and the next command ----------------------------------------------------


@pytest.mark.fake
def test_the_legend_follows_the_pass_lines_and_names_what_they_show() -> None:
    code, out, _ = run("demo", "--requests", "1")
    assert code == 0
    lines = out.splitlines()
    legend = lines.index(next(line for line in lines if line.startswith("legend")))
    last_pass = max(i for i, line in enumerate(lines) if " pass " in line and "ranks" in line)
    assert last_pass < legend < lines.index("summary")
    explained = "\n".join(lines[legend : lines.index("summary")])
    for term in ("pass N", "ranks R/N", "llm->codec S/C", "-> done"):
        assert f"  {term} " in explained
    assert len(LEGEND_ROWS) == len(lines[legend + 1 : lines.index("summary")])
    assert re.search(r"^  done +\(after S/C\)", explained, re.MULTILINE)


@pytest.mark.fake
def test_demo_keep_on_the_embedded_redis_says_it_ends_with_the_process() -> None:
    code, out, _ = run("demo", "--requests", "1", "--keep")
    assert code == 0
    assert "embedded Redis, which ends with this process" in out
    assert "mstar-store demo --keep --redis-url redis://" in out


@pytest.mark.servers
def test_demo_keep_prints_the_commands_that_find_what_it_kept(tmp_redis: RedisServer) -> None:
    code, out, _ = run("demo", "--requests", "2", "--keep", "--redis-url", tmp_redis.url)
    assert code == 0
    printed = [line.strip() for line in out.splitlines() if line.startswith("  mstar-store ")]
    assert [shlex.split(c)[1] for c in printed] == ["ls", "show"]
    code, listed, _ = run(*shlex.split(printed[0])[1:])
    assert code == 0 and listed.startswith("2 requests in namespace 'mstar-demo'"), listed
    code, shown, err = run(*shlex.split(printed[1])[1:])
    assert code == 0 and "in namespace 'mstar-demo'" in shown, err


# -- a request not found ---------------------------------------------------------------------


@pytest.mark.fake
def test_a_missing_request_names_the_namespace_that_holds_it(on_fake: object) -> None:
    assert run("demo", "--requests", "1", "--keep", "--namespace", "elsewhere")[0] == 0
    code, listed, _ = run("ls", "--namespace", "elsewhere")
    rid = listed.splitlines()[1].split()[0]

    code, out, err = run("show", rid)
    assert (code, out) == (1, "")
    assert err == (
        f"error: no such request (request {rid!r}) in namespace 'mstar'; namespace "
        "'elsewhere' holds it: pass --namespace elsewhere\n"
    )
    code, _, err = run("history", rid, "--json")
    assert code == 1 and "namespace 'elsewhere' holds it" in err


@pytest.mark.fake
def test_a_missing_request_names_the_namespaces_holding_requests(on_fake: object) -> None:
    for namespace in ("a-ns", "b-ns"):
        assert run("demo", "--requests", "2", "--keep", "--namespace", namespace)[0] == 0

    code, _, err = run("show", "nope", "--namespace", "a-ns")
    assert code == 1
    assert err == (
        "error: no such request (request 'nope') in namespace 'a-ns'; requests are held in "
        "namespace 'b-ns' (2) (pass --namespace NAME)\n"
    )
    code, out, _ = run("ls")
    assert code == 0
    assert out == (
        "no requests in namespace 'mstar'; requests are held in namespaces 'a-ns' (2), "
        "'b-ns' (2) (pass --namespace NAME)\n"
    )


@pytest.mark.fake
def test_nothing_held_anywhere_names_only_the_namespace(on_fake: object) -> None:
    assert run("show", "nope") == (
        1, "", "error: no such request (request 'nope') in namespace 'mstar'\n"
    )  # fmt: skip
    assert run("ls") == (0, "no requests in namespace 'mstar'\n", "")


@pytest.mark.fake
def test_show_points_to_a_history_command_that_finds_it(on_fake: object) -> None:
    assert run("demo", "--requests", "1", "--keep", "--namespace", "elsewhere")[0] == 0
    rid = run("ls", "--namespace", "elsewhere")[1].splitlines()[1].split()[0]

    last = run("show", rid, "--namespace", "elsewhere")[1].splitlines()[-1]
    assert last == f"history: mstar-store history {rid} --namespace elsewhere"
    code, out, err = run(*shlex.split(last.removeprefix("history: "))[1:])
    assert code == 0 and out.startswith(f"history of request {rid!r}"), out + err

    assert run("demo", "--requests", "1", "--keep", "--namespace", "mstar")[0] == 0
    rid = run("ls")[1].splitlines()[1].split()[0]
    assert run("show", rid)[1].splitlines()[-1] == f"history: mstar-store history {rid}"
