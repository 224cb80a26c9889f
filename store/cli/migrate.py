"""``migrate``: upgrade every record of a namespace to the current schema version.

Safe to run while conductors write, idempotent and resumable (see ``store.migrate``). Exits 1
if any record could not be upgraded, after going through all the others.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from store.cli import main as cli
from store.cli.progress import Progress
from store.migrate import MigrationReport, migrate_namespace
from store.schema import SCHEMA_VERSION
from store.store import RequestStore


def add_parser(subparsers: Any) -> None:
    parser = cli.add_command(
        subparsers,
        "migrate",
        summary=f"upgrade every record of a namespace to schema version {SCHEMA_VERSION}",
        description=f"""Upgrade every record of a namespace to schema version
        {SCHEMA_VERSION}, in place, each record in a transaction of its own: safe while
        conductors write, idempotent (a second run writes nothing) and resumable (Ctrl-C, then
        run it again). Records are found through the request index, then by a SCAN for
        requests missing from it. A record that cannot be upgraded is reported by key and
        skipped (exit 1 at the end); --dry-run writes nothing and says what would change.""",
        examples=[
            "mstar-store migrate --dry-run  # what would be upgraded in namespace 'mstar'",
            "mstar-store migrate --namespace prod --batch 200 --redis-url redis://10.0.0.5/0",
        ],
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="change nothing; report what would change"
    )
    parser.add_argument(
        "--batch", type=_positive, default=500, metavar="N", help="requests per batch (500)"
    )
    cli.add_common_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    client = cli.make_client(args)
    bar = ProgressBar(sys.stderr)
    try:
        if not args.dry_run:
            store = RequestStore(client, namespace=args.namespace, reconnect=cli.CLI_RECONNECT)
            cli.warn_if_evicting(store)
        report = migrate_namespace(
            client, args.namespace, batch=args.batch, dry_run=args.dry_run,
            progress=bar.update, reconnect=cli.CLI_RECONNECT,
        )  # fmt: skip
    except KeyboardInterrupt:
        bar.finish()
        print("interrupted: records upgraded so far stay upgraded; run again to resume")
        return 130
    finally:
        client.close()
    bar.finish()
    print("\n".join(summary(report, args.namespace)))
    return 1 if report.failed else 0


def summary(report: MigrationReport, namespace: str) -> list[str]:
    """The final counts, then one line per record that failed."""
    upgraded = "would upgrade" if report.dry_run else "upgraded"
    lines = [
        f"{'dry run: ' if report.dry_run else ''}namespace {namespace!r}, "
        f"schema version {SCHEMA_VERSION}: {report.requests} requests, "
        f"{report.seen} records seen, {report.upgraded} {upgraded}, "
        f"{report.current} already current, {len(report.failed)} failed"
    ]
    if report.unindexed:
        shown = ", ".join(report.unindexed[:10])
        more = f" and {len(report.unindexed) - 10} more" if len(report.unindexed) > 10 else ""
        lines.append(
            f"{len(report.unindexed)} requests are missing from the index (found by SCAN): "
            f"{shown}{more}"
        )
    lines += [f"failed: {key}: {why}" for key, why in report.failed]
    return lines


class ProgressBar:
    """``migrate_namespace``'s progress, shown as a ``Progress`` of requests."""

    def __init__(self, stream: TextIO) -> None:
        self.bar = Progress(stream, label="requests")

    def update(self, done: int, total: int, report: MigrationReport) -> None:
        failed = len(report.failed)
        detail = f"{report.upgraded} upgraded  {report.current} current  {failed} failed"
        self.bar.update(done, detail, total=total, force=done == total)

    def finish(self) -> None:
        self.bar.close()


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
