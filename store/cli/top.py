"""``mstar-store top``: a live view of one namespace, a frame a second, at a bounded cost.

A frame is two round trips and the INFO of each server, whatever the number of requests:
ZCARD of the request index, ZCOUNT and the first entry of the deadlines index, the live
replicas from the heartbeat registry, the two newest minute buckets of ``store.stats``, then
one HGETALL per live replica. No SCAN, nothing read per request. Every read goes through
the store's executor (``store.namespace``), so a failure is one of the store's typed errors.

Rates and "last minute" counts are estimated from the minute buckets (``stats.last_minute``),
which replicas fill with every heartbeat: they trail the truth by up to a heartbeat.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from store import stats
from store.cli import main as cli
from store.cli.main import add_common_options
from store.cli.view import age
from store.keys import KeySpace
from store.namespace import NamespaceReader
from store.ops.calls import hash_reply
from store.stats import ReplicaStats

DEFAULT_INTERVAL = 1.0
DEFAULT_WITHIN = stats.LIVE_WITHIN
NO_RICH_HINT = (
    "hint: `pip install 'mstar-conductor-store[top]'` (rich) for a live table; plain frames follow"
)


def add_parser(subparsers: Any) -> None:
    parser = cli.add_command(
        subparsers,
        "top",
        summary="a live view: requests, passes, due steps, replicas, Redis",
        description="""A live view of one namespace, redrawn every --interval seconds until
        Ctrl-C: requests in flight, forward passes and reports a second, steps due for
        recovery, live replicas and what each holds, and each Redis server's memory and load.
        A frame costs two round trips and an INFO per server, whatever the number of requests.
        With rich installed it draws a table, else plain text; --once prints one frame
        (--json: as JSON) and exits.""",
        examples=[
            "mstar-store top  # namespace 'mstar', a frame a second",
            "mstar-store top --once --json --namespace staging  # one frame, for a script",
        ],
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print it as JSON")
    parser.add_argument(
        "--interval", type=float, default=DEFAULT_INTERVAL, metavar="SECONDS",
        help=f"time between frames (default {DEFAULT_INTERVAL:g})",
    )  # fmt: skip
    parser.add_argument(
        "--within", type=float, default=DEFAULT_WITHIN, metavar="SECONDS",
        help=f"a replica that beat within this many seconds is alive "
        f"(default {DEFAULT_WITHIN:g})",
    )  # fmt: skip
    add_common_options(parser)
    parser.set_defaults(func=run)


def now() -> float:
    """The frame's clock (tests hold it still, to know which minute bucket is current)."""
    return time.time()


# -- one frame ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerStats:
    used_memory: int
    ops_per_sec: int
    nodes: int


@dataclass(frozen=True)
class Frame:
    namespace: str
    at: float
    in_flight: int
    steps_due: int
    oldest_due: float | None  # when the oldest due step fell due
    oldest_step: str | None  # which: "<request id> <partition>"
    replicas: list[ReplicaStats]  # alive, most recent beat first
    silent: int  # replicas in the registry that did not beat within the window
    last_minute: dict[str, float]
    server: ServerStats | None  # None when INFO is refused (ACLs, some servers)
    conducted: int = 0  # requests held by M* conductors (store.integrations.mstar)

    def per_second(self, counter: str) -> float:
        return self.last_minute[counter] / stats.SECONDS_PER_BUCKET


def sample(client: Any, keys: KeySpace, at: float, within: float) -> Frame:
    """Read one frame; its cost does not depend on how many requests are held."""
    reader = NamespaceReader(client, namespace=keys.namespace, reconnect=cli.CLI_RECONNECT)
    seen = stats.parse_overview(reader.read_many(stats.overview_reads(keys, at, within), {}), at)
    (conducted,), *hashes = reader.read_many(
        [
            (keys.conductor_index, [("ZCARD", keys.conductor_index)]),
            *[
                (keys.replica_stats(rid), [("HGETALL", keys.replica_stats(rid))])
                for rid, _ in seen.live
            ],
        ],
        {},
    )
    replica_hashes = [hash_reply(raw) for (raw,) in hashes]
    return Frame(
        namespace=keys.namespace,
        at=at,
        in_flight=seen.in_flight,
        steps_due=seen.steps_due,
        oldest_due=seen.oldest_due,
        oldest_step=seen.oldest_step,
        replicas=[
            stats.parse_replica(rid, beat, raw)
            for (rid, beat), raw in zip(seen.live, replica_hashes, strict=True)
        ],
        silent=seen.registered - len(seen.live),
        last_minute=stats.last_minute(seen.current, seen.previous, at),
        server=server_stats(reader),
        conducted=int(conducted),
    )


def server_stats(reader: NamespaceReader) -> ServerStats | None:
    """Used memory and ops/s, summed over a cluster's masters; None if INFO is refused."""
    infos = [reader.server_info(node, ["memory", "stats"]) for node in reader.nodes()]
    if not all(infos):
        return None
    return ServerStats(
        used_memory=sum(int(info.get("used_memory", 0)) for info in infos),
        ops_per_sec=sum(int(info.get("instantaneous_ops_per_sec", 0)) for info in infos),
        nodes=len(infos),
    )


def to_json(frame: Frame) -> dict[str, Any]:
    server = frame.server
    return {
        "namespace": frame.namespace,
        "time": frame.at,
        "requests": {
            "in_flight": frame.in_flight,
            "finished_per_s": frame.per_second("finished"),
            "held_by_m_star_conductors": frame.conducted,
        },
        "passes_per_s": frame.per_second("passes"),
        "reports_per_s": frame.per_second("reports"),
        "steps_due": {
            "count": frame.steps_due,
            "oldest_age_s": None if frame.oldest_due is None else frame.at - frame.oldest_due,
            "oldest": frame.oldest_step,
        },
        "replicas": [
            {
                "id": r.replica_id,
                "beat_age_s": frame.at - r.last_beat,
                "leases": r.leases,
                "requests": r.requests,
                "stats_age_s": None if r.flushed_at is None else frame.at - r.flushed_at,
            }
            for r in frame.replicas
        ],
        "silent_replicas": frame.silent,
        "last_minute": frame.last_minute,
        "redis": None
        if server is None
        else {
            "used_memory_bytes": server.used_memory,
            "ops_per_s": server.ops_per_sec,
            "nodes": server.nodes,
        },
    }


# -- drawing it ----------------------------------------------------------------------------


def summary_rows(frame: Frame, within: float) -> list[tuple[str, str]]:
    """(label, value) lines of a frame, shared by the rich table and the plain text."""
    last = frame.last_minute
    due = f"{frame.steps_due}"
    if frame.oldest_due is not None:
        due += f", the oldest due for {age(frame.at - frame.oldest_due)}"
        if frame.oldest_step:
            due += f" ({frame.oldest_step}: see `mstar-store history`)"
    server = frame.server
    redis_line = (
        "INFO not available"
        if server is None
        else f"used memory {_bytes(server.used_memory)}, {server.ops_per_sec} ops/s"
        + (f" over {server.nodes} masters" if server.nodes > 1 else "")
    )
    return [
        ("requests", f"{frame.in_flight} in flight, {frame.per_second('finished'):.1f} "
                     "finished/s"),
        ("M* requests", f"{frame.conducted} held by M* conductors (`mstar-store ls` lists them)"),
        ("passes", f"{frame.per_second('passes'):.1f}/s, "
                   f"reports {frame.per_second('reports'):.1f}/s"),
        ("steps due", due),
        ("last minute", ", ".join(
            f"{name} {round(last[name])}"
            for name in ("takeovers", "fenced", "duplicates", "retries", "conflicts")
        )),
        ("replicas", f"{len(frame.replicas)} alive (beat within {within:g} s)"
                     + (f", {frame.silent} silent" if frame.silent else "")),
        ("redis", redis_line),
    ]  # fmt: skip


REPLICA_COLUMNS = ("replica", "beat", "leases", "requests", "stats")


def replica_rows(frame: Frame) -> list[tuple[str, ...]]:
    def known(n: int | None) -> str:
        return "-" if n is None else str(n)

    return [
        (
            r.replica_id,
            f"{age(frame.at - r.last_beat)} ago",
            known(r.leases),
            known(r.requests),
            "none" if r.flushed_at is None else f"{age(frame.at - r.flushed_at)} ago",
        )
        for r in frame.replicas
    ]


def title(frame: Frame) -> str:
    when = datetime.fromtimestamp(frame.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"mstar-store top: namespace {frame.namespace!r}, {when}"


def plain_text(frame: Frame, within: float) -> str:
    lines = [title(frame)]
    lines += [f"  {label:<12} {value}" for label, value in summary_rows(frame, within)]
    rows = replica_rows(frame)
    if rows:
        table = [tuple(c.upper() for c in REPLICA_COLUMNS), *rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(REPLICA_COLUMNS))]
        lines += ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True))
                  for row in table]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)


def rich_renderable(frame: Frame, within: float) -> Any:
    from rich.console import Group
    from rich.table import Table

    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for label, value in summary_rows(frame, within):
        summary.add_row(label, value)
    replicas = Table(*REPLICA_COLUMNS, box=None, header_style="bold")
    for row in replica_rows(frame):
        replicas.add_row(*row)
    parts: list[Any] = [title(frame), summary]
    if frame.replicas:
        parts.append(replicas)
    return Group(*parts)


# -- the command ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.json and not args.once:
        print("error: --json prints one frame: use it with --once", file=sys.stderr)
        return 2
    if not args.interval > 0:
        print("error: --interval must be positive", file=sys.stderr)
        return 2
    keys = KeySpace(args.namespace)
    client = cli.make_client(args)
    try:
        if not args.once:
            return watch(lambda: sample(client, keys, now(), args.within), args)
        frame = sample(client, keys, now(), args.within)
        if args.json:
            encoded = msgspec.json.encode(to_json(frame))
            print(msgspec.json.format(encoded, indent=2).decode())
        else:
            draw_once(frame, args.within)
        return 0
    finally:  # Ctrl-C, the way out of the live view, is main's to report (exit 130)
        client.close()


def draw_once(frame: Frame, within: float) -> None:
    try:
        from rich.console import Console
    except ImportError:
        print(plain_text(frame, within))
        return
    Console(highlight=False).print(rich_renderable(frame, within))


def watch(next_frame: Callable[[], Frame], args: argparse.Namespace) -> int:
    """Redraw every ``args.interval`` seconds until interrupted (Ctrl-C exits 130)."""
    try:
        from rich.live import Live
    except ImportError:
        print(NO_RICH_HINT, file=sys.stderr)
        clear = "\033[H\033[J" if sys.stdout.isatty() else ""
        while True:
            print(clear + plain_text(next_frame(), args.within), end="\n\n", flush=True)
            time.sleep(args.interval)
    with Live(rich_renderable(next_frame(), args.within), auto_refresh=False) as live:
        while True:
            time.sleep(args.interval)
            live.update(rich_renderable(next_frame(), args.within), refresh=True)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
