"""``mstar-store simulate``: replicas, random delivery and SIGKILLs, checked against a reference."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from store.cli.main import (
    add_command,
    add_common_options,
    add_durability_options,
    durability_from,
)
from store.cli.simulate.harness import SimulationConfig, default_namespace, simulate, summary_lines
from store.cli.simulate.reference import SimulationError
from store.durability import with_durability
from store.io.connect import redacted


def add_parser(subparsers: Any) -> None:
    parser = add_command(
        subparsers,
        "simulate",
        summary="run conductor replica processes over one Redis, kill some, check the final states",
        description="""Run N conductor replica processes over one shared Redis, drive M
        requests through an LLM -> codec model (TP 2) and a single-partition model, deliver
        worker reports at random with duplicates, SIGKILL K replicas (or drain D of them) at
        random instants and restart them under new ids; then compare every request's final
        state with a crash-free reference run of the same seed. Exits 1 if any request
        differs, applied a step or report twice, or did not finish. Without --redis-url it
        runs on an embedded fakeredis server; it writes a fresh namespace and deletes it.""",
        examples=[
            "mstar-store simulate  # 3 replicas, 6 requests, 1 SIGKILL, on the embedded fakeredis",
            "mstar-store simulate --replicas 4 --requests 50 --kill 3 --drain 1 --seed 7"
            " --redis-url redis://127.0.0.1:6379/0  # on a real Redis, one of the stops a drain",
        ],
    )
    parser.add_argument(
        "--replicas", type=_count(1), default=3, metavar="N", help="replica processes (default 3)"
    )
    parser.add_argument(
        "--requests", type=_count(1), default=6, metavar="M", help="requests to run (default 6)"
    )
    parser.add_argument(
        "--kill",
        type=_count(0),
        default=1,
        metavar="K",
        help="replicas to SIGKILL and restart (default 1)",
    )
    parser.add_argument(
        "--drain",
        type=_count(0),
        default=0,
        metavar="D",
        help="of the K replicas stopped, drain D gracefully (drain(): hand their steps "
        "over) instead of SIGKILLing them (default 0)",
    )
    parser.add_argument(
        "--async",
        dest="aio",
        action="store_true",
        help="run the replicas on store.AsyncReplica (asyncio) instead of store.Replica",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the requests, the delivery and the kills (default 0)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up (exit 1) after this long (default 120)",
    )
    add_common_options(parser, embedded=True)
    add_durability_options(parser)
    # A fresh namespace by default: the run deletes its namespace when it is done.
    parser.set_defaults(func=run, namespace=None)  # fmt: skip


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    if args.drain > args.kill:
        print(
            f"error: --drain {args.drain} exceeds --kill {args.kill}: it drains that many "
            "of the replicas stopped instead of killing them",
            file=sys.stderr,
        )
        return 2
    durability = durability_from(args)  # the replicas' processes get it in the URL
    config = SimulationConfig(
        replicas=args.replicas,
        requests=args.requests,
        kills=args.kill,
        drains=args.drain,
        aio=args.aio,
        seed=args.seed,
        redis_url=args.redis_url and with_durability(args.redis_url, durability),
        namespace=args.namespace or default_namespace(),
        timeout=args.timeout,
    )
    where = "an embedded fakeredis" if config.redis_url is None else redacted(config.redis_url)
    stops = f"{config.kills - config.drains} kills"
    if config.drains:
        stops += f", {config.drains} drains"
    kind = "AsyncReplica" if config.aio else "Replica"
    print(
        f"mstar-store simulate: {config.replicas} replicas ({kind}), {config.requests} "
        f"requests, {stops}, seed {config.seed}, on {where}, namespace {config.namespace!r}"
    )
    try:
        result = simulate(config, out=sys.stdout, err=sys.stderr)
    except SimulationError as e:
        print(f"error: the simulation could not run: {e}", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(result)))
    return 0 if result.ok else 1
