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
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from store.errors import ConfigurationError, StoreError
from store.io.connect import client_from_url
from store.ops.calls import Reconnect
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
    "store.cli.simulate.command",
)

DISTRIBUTION = "mstar-conductor-store"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NAMESPACE = "mstar"
CONNECT_TIMEOUT = 5.0
# Someone waits at the terminal: say that Redis is down after a second, not after five.
CLI_RECONNECT = Reconnect(give_up_after=1.0)
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
    return client_from_url(url, socket_connect_timeout=CONNECT_TIMEOUT)


@contextmanager
def open_store(args: argparse.Namespace) -> Iterator[RequestStore]:
    """A store on ``make_client(args)`` in ``args.namespace``; the client is closed after."""
    client = make_client(args)
    try:
        yield RequestStore(client, namespace=args.namespace, reconnect=CLI_RECONNECT)
    finally:
        client.close()


def version() -> str:
    """``mstar-store 0.1.0 (schema v4)``: the installed package and the records it writes."""
    try:
        package = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        package = "(not installed)"
    return f"mstar-store {package} (schema v{SCHEMA_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mstar-store", description="Inspect and exercise the M* conductor's request store."
    )
    parser.add_argument("--version", action="version", version=version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a store error prints ``error: <message>`` and returns 1."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`mstar-store ls | head`): stop quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
