"""``mstar-store``: a thin command line over the library; it parses arguments and calls it.

Each subcommand lives in a module of its own that exposes ``add_parser(subparsers)``; that
function adds its parser (with ``add_common_options``) and sets ``func(args) -> int``. A new
subcommand is one module plus one entry in ``COMMAND_MODULES``. Commands reach Redis only
through ``open_store`` / ``make_client``, so tests replace ``make_client`` to inject a client.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import shlex
import sys
import textwrap
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from store.durability import MODES, Durability, durability_of, split_url
from store.errors import ConfigurationError, RequestNotFound, StoreConnectionError, StoreError
from store.io.connect import client_from_url, parse_url, redacted, timeouts
from store.io.wire import io_failure
from store.namespace import NamespaceReader
from store.ops.calls import Reconnect
from store.ops.effects import Disconnected
from store.schema import SCHEMA_VERSION
from store.store import RequestStore

# Imported by name when the parser is built, so that command modules can import this one.
COMMAND_MODULES = (
    "store.cli.demo",
    "store.cli.view",
    "store.cli.migrate",
    "store.cli.replicas",
    "store.cli.top",
    "store.cli.history",
    "store.cli.doctor",
    "store.cli.simulate.command",
)

DISTRIBUTION = "mstar-conductor-store"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "mstar"
# Someone waits at the terminal: say within 3 s that Redis is down or silent, not after the
# library's 6 (connects and reads time out after 1 s each, see ``connect``).
CLI_RECONNECT = Reconnect(give_up_after=3.0)
_NO_EMBEDDED = (
    "the embedded Redis needs {missing}, which is not installed: "
    "`pip install 'mstar-conductor-store[demo]'` (or '[test]'), or pass --redis-url"
)


def add_common_options(
    parser: argparse.ArgumentParser, *, embedded: bool = False, namespace: str | None = None
) -> None:
    """Add --redis-url and --namespace (defaults: $MSTAR_REDIS_URL, $MSTAR_NAMESPACE).

    A command that writes throwaway data (the demo) passes ``embedded`` (no URL means an
    in-process Redis) and a ``namespace`` of its own. It then ignores the environment on
    purpose: that names the deployment's live store, which only an explicit flag may touch.
    """
    url_help = "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL"
    if embedded:
        url, url_help = None, f"{url_help} (default: an embedded in-process fakeredis)"
    else:
        url = os.environ.get("MSTAR_REDIS_URL") or DEFAULT_REDIS_URL
        url_help += f" (default: $MSTAR_REDIS_URL, else {DEFAULT_REDIS_URL})"
    if namespace is None:
        namespace = os.environ.get("MSTAR_NAMESPACE") or DEFAULT_NAMESPACE
        ns_help = f"key prefix (default: $MSTAR_NAMESPACE, else {DEFAULT_NAMESPACE!r})"
    else:
        ns_help = f"key prefix (default {namespace!r})"
    parser.add_argument("--redis-url", default=url, help=url_help)
    parser.add_argument("--namespace", default=namespace, help=ns_help)


def add_durability_options(parser: argparse.ArgumentParser) -> None:
    """Add --durability, --wait-replicas and --wait-ms, for a command that writes requests
    (the URL's ``?durability=replicated&replicas=N&wait_ms=T`` sets them too)."""
    group = parser.add_argument_group("durability (docs/guarantees.md)")
    group.add_argument(
        "--durability",
        choices=MODES,
        help="'replicated': each write waits for replicas to acknowledge it (default master)",
    )
    group.add_argument(
        "--wait-replicas", type=int, metavar="N", help="replicas to wait for (default 1)"
    )
    group.add_argument(
        "--wait-ms", type=int, metavar="MS", help="longest wait per write (default 500)"
    )


def durability_from(args: argparse.Namespace) -> Durability:
    """The durability the URL's query and the options ask for (an option wins)."""
    url: str | None = getattr(args, "redis_url", None)
    wanted = split_url(url)[1] if url else {}  # checked, and defaults filled, below
    for name, option in (("durability", "durability"), ("replicas", "wait_replicas"),
                         ("wait_ms", "wait_ms")):  # fmt: skip
        if getattr(args, option, None) is not None:
            wanted[name] = getattr(args, option)
    durability = durability_of(wanted.pop("durability", "master"), **wanted)
    if durability.replicated and url is None:
        raise ConfigurationError(
            "durability 'replicated' needs --redis-url: a Redis with replicas (the embedded "
            "fakeredis has none)"
        )
    return durability


def embedded_client() -> Any:
    """A client on a private in-process fakeredis server (with Lua, which the store needs)."""
    try:
        import fakeredis
    except ImportError as e:
        raise ConfigurationError(_NO_EMBEDDED.format(missing="fakeredis")) from e
    if importlib.util.find_spec("lupa") is None:  # fakeredis runs Lua only with lupa
        raise ConfigurationError(_NO_EMBEDDED.format(missing="lupa (fakeredis[lua])"))
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def make_client(args: argparse.Namespace) -> Any:
    """The Redis client a command works on. Tests replace this function to inject their own."""
    url: str | None = args.redis_url
    if url is None:
        return embedded_client()
    return connect(url)


def connect(url: str) -> Any:
    """A redis-py client for ``url`` (without the store's own query options, which are not
    redis-py's); a failure while it is built (a cluster client connects then) is the store
    error it stands for."""
    try:
        return client_from_url(split_url(url)[0], **timeouts(CLI_RECONNECT))
    except (redis.RedisError, RedisClusterException) as e:
        raise as_store_error(e, url) from e


def as_store_error(error: BaseException, url: str | None) -> StoreError:
    """What a redis-py error that escaped the library stands for, mapped as the library
    maps the errors it meets (``store.io.wire.io_failure``)."""
    where = redacted(url) if url else "the embedded Redis"
    if "cluster mode is not enabled" in str(error).lower():
        return ConfigurationError(
            f"{where} is no Redis Cluster (cluster mode is not enabled on that node); "
            "use redis:// for a single server"
        )
    failure = io_failure(error, where)
    if isinstance(failure, Disconnected):  # its message names the server
        return StoreConnectionError(f"Redis unreachable: {failure}")
    if isinstance(failure, StoreError):
        return failure
    return StoreError(f"Redis at {where}: {type(error).__name__}: {error}")


@contextmanager
def open_store(args: argparse.Namespace, *, writes: bool = False) -> Iterator[RequestStore]:
    """A store on ``make_client(args)`` in ``args.namespace``; the client is closed after.
    A command that ``writes`` is told first if the server may evict what it writes."""
    client = make_client(args)
    try:
        store = RequestStore(
            client,
            namespace=args.namespace,
            reconnect=CLI_RECONNECT,
            durability=durability_from(args),
        )
        if writes:
            warn_if_evicting(store)
        yield store
    finally:
        client.close()


def warn_if_evicting(store: RequestStore) -> None:
    """Say on stderr that the server may evict the store's keys, as ``from_url``'s first
    call logs it: the command goes on (a demo on a cache is fine), the user knows."""
    for finding in store.check_eviction():
        if finding.level == "fatal":
            print(f"warning: {finding.message}; or see `mstar-store doctor`", file=sys.stderr)


def same_place(args: argparse.Namespace) -> str:
    """The options another command needs to reach ``args``'s namespace and server, beyond
    what it assumes by default ($MSTAR_NAMESPACE and $MSTAR_REDIS_URL, else 'mstar' and the
    local Redis): "" or " --namespace NS --redis-url URL" (its password hidden)."""
    options = ""
    if args.namespace != (os.environ.get("MSTAR_NAMESPACE") or DEFAULT_NAMESPACE):
        options += f" --namespace {shlex.quote(args.namespace)}"
    url: str | None = args.redis_url
    if url is not None and url != (os.environ.get("MSTAR_REDIS_URL") or DEFAULT_REDIS_URL):
        options += f" --redis-url {shlex.quote(redacted(url))}"
    return options


def describe(error: StoreError, url: str | None) -> str:
    """The error as one line; for an unreachable server, with what to check."""
    message = " ".join(str(error).split())
    if isinstance(error, StoreConnectionError):
        return message.rstrip(".") + reach_hint(url)
    return message


def held_elsewhere(
    args: argparse.Namespace, request_id: str | None = None, client: Any = None
) -> str:
    """Where to look instead, for a request not held (or a namespace holding none) in
    ``args.namespace``: "; namespace 'x' holds it: pass --namespace x", or the namespaces
    that hold requests; "" when none does (or the server cannot say). On ``client``, else
    on one of its own."""
    own = make_client(args) if client is None else None
    try:
        reader = NamespaceReader(client or own, namespace=args.namespace, reconnect=CLI_RECONNECT)
        held = reader.namespaces_holding(request_id)
    except StoreError:  # a hint only: the error being reported is the one that counts
        return ""
    finally:
        if own is not None:
            own.close()
    holding = [name for name, _, has in held if has]
    if holding:
        more = f" (and {', '.join(map(repr, holding[1:]))})" if len(holding) > 1 else ""
        return f"; namespace {holding[0]!r}{more} holds it: pass --namespace {holding[0]}"
    if not held:
        return ""
    shown = ", ".join(f"{name!r} ({count})" for name, count, _ in held[:5])
    more = f" and {len(held) - 5} more" if len(held) > 5 else ""
    plural = "s" if len(held) > 1 else ""
    return f"; requests are held in namespace{plural} {shown}{more} (pass --namespace NAME)"


def reach_hint(url: str | None) -> str:
    """What to check when the server at ``url`` cannot be reached (empty: embedded)."""
    if url is None:
        return ""
    spec = parse_url(url)
    hosts = ",".join(f"{host}:{port}" for host, port in spec.hosts)
    if spec.scheme == "redis+sentinel":
        return f"; is a Sentinel up at {hosts}, and does it monitor {spec.service!r}?"
    if spec.scheme == "redis+cluster":
        return f"; are the cluster's nodes up at {hosts}?"
    return f"; is Redis up at {redacted(url)}?"


def version() -> str:
    """``mstar-store 0.1.0 (schema v5)``: the package and the schema version it writes.

    The package's version is its installed metadata's; run from a source tree that is not
    installed, the version its pyproject.toml declares, said so.
    """
    try:
        package = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        package = _source_version()
    return f"mstar-store {package} (schema v{SCHEMA_VERSION})"


def _source_version() -> str:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return "(version unknown: not installed)"
    if project.get("name") != DISTRIBUTION or "version" not in project:
        return "(version unknown: not installed)"
    return f"{project['version']} (source tree, not installed)"


def add_command(
    subparsers: Any, name: str, *, summary: str, description: str, examples: Sequence[str]
) -> argparse.ArgumentParser:
    """A subcommand's parser: ``summary`` for the list of commands; for its ``--help``, a
    paragraph of ``description`` and ``examples``, each a command line and (after ``#``)
    what it does."""
    lines = ["examples:"]
    for example in examples:
        command, _, what = example.partition("  # ")
        lines.append(f"  {command}")
        lines += [f"      {line}" for line in textwrap.wrap(what, 74)]
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=textwrap.fill(" ".join(description.split()), 80),
        epilog="\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstar-store",
        description="Inspect and exercise the M* conductor's request store. "
        "`mstar-store COMMAND --help` describes a command, with examples.",
    )
    parser.add_argument("--version", action="version", version=version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a store error prints ``error: <message>`` (one line) and returns 1."""
    args = build_parser().parse_args(argv)
    url: str | None = getattr(args, "redis_url", None)
    try:
        code: int = args.func(args)
    except RequestNotFound as e:
        hint = held_elsewhere(args, e.request_id)
        print(f"error: {describe(e, url)} in namespace {args.namespace!r}{hint}", file=sys.stderr)
        return 1
    except StoreError as e:
        print(f"error: {describe(e, url)}", file=sys.stderr)
        return 1
    except (redis.RedisError, RedisClusterException) as e:
        # The library types every failure it meets; this is the net under code that reads
        # Redis without it (the simulation's own lists), so that no user sees a traceback.
        print(f"error: {describe(as_store_error(e, url), url)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: one line, and the shell's exit status for SIGINT (128 + 2).
        print(f"interrupted: mstar-store {args.command} stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`mstar-store ls | head`): stop quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
