"""``mstar-store replicas``: the conductor replicas of a namespace and their last heartbeat."""

from __future__ import annotations

import argparse
import time
from typing import Any

from store.cli import main as cli
from store.cli.main import add_common_options
from store.replicas import ReplicaRegistry

DEFAULT_WITHIN = 5.0


def add_parser(subparsers: Any) -> None:
    parser = cli.add_command(
        subparsers,
        "replicas",
        summary="list the conductor replicas and the age of their last heartbeat",
        description="""List the conductor replicas of a namespace from their heartbeats
        (store.Replica beats while it runs), most recent first: those that beat within
        --within seconds are live; --all lists the silent ones too (stopped, crashed or cut
        off; their leases lapse and other replicas take their steps over).""",
        examples=[
            "mstar-store replicas  # the live replicas of namespace 'mstar'",
            "mstar-store replicas --all --within 10  # every replica seen, live within 10 s",
        ],
    )
    parser.add_argument(
        "--within",
        type=float,
        default=DEFAULT_WITHIN,
        metavar="SECONDS",
        help=f"a replica that beat within this many seconds is live (default {DEFAULT_WITHIN:g})",
    )
    parser.add_argument("--all", action="store_true", help="also list replicas that went silent")
    add_common_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    client = cli.make_client(args)
    try:
        registry = ReplicaRegistry(client, namespace=args.namespace, reconnect=cli.CLI_RECONNECT)
        beats = registry.last_beats()
    finally:
        client.close()
    now = time.time()
    live = {rid: at for rid, at in beats.items() if now - at <= args.within}
    silent = {rid: at for rid, at in beats.items() if rid not in live}
    print(
        f"{len(live)} live replica{'s' if len(live) != 1 else ''} in namespace "
        f"{args.namespace!r} (heartbeat within {args.within:g} s)"
        + (f", {len(silent)} silent" if silent else "")
    )
    shown = beats if args.all else live
    width = max((len(rid) for rid in shown), default=0)
    for rid, at in shown.items():  # most recent first
        status = "live" if rid in live else "silent"
        print(f"  {rid:<{width}}  {status:<6}  last heartbeat {_ago(now - at)} ago")
    return 0


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"
    return f"{int(seconds) // 3600}h{int(seconds) % 3600 // 60:02d}m"
