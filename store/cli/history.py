"""``mstar-store history REQUEST_ID``: a request's timeline, from its capped history stream.

The store's scripts append one entry per operation to ``<ns>:{<rid>}:history``; the entry
format is in ``store.keys``. Entries are shown as they are stored: a field this code does
not know is shown by its name, a value that is not UTF-8 with backslash escapes, so that a
damaged entry reads as damaged rather than as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from store.cli import main as cli
from store.cli.main import add_common_options, open_store
from store.errors import RequestNotFound
from store.keys import validate_request_id
from store.namespace import NamespaceReader
from store.ops.calls import hash_reply

# The known fields, in the order they are shown; "detail" and "token" are optional.
COLUMNS = ("op", "partition", "pass", "rank", "wg", "replica", "outcome")
HEADERS = ("TIME (UTC)", "OP", "PARTITION", "PASS", "RANK", "WG", "REPLICA", "OUTCOME", "DETAIL")
KNOWN = (*COLUMNS, "detail", "token")
NUMBERS = ("pass", "rank", "token")
PAGE = 1000  # entries per XRANGE: the stream is capped, but not by this reader


def add_parser(subparsers: Any) -> None:
    parser = cli.add_command(
        subparsers,
        "history",
        summary="print one request's timeline of operations, oldest first",
        description="""Print one request's timeline, oldest first, from the capped stream the
        store's scripts append to: one line per operation (report, merge, advance, step,
        claim, release, renew, create, finish, delete) with its partition, pass, rank, worker
        graph, replica and outcome (applied, duplicate, stale, fenced or refused). It outlives
        the request until its keys expire. --json prints the entries as a JSON list.""",
        examples=[
            "mstar-store history req-42  # why did req-42 stall, and who drove it",
            "mstar-store history req-42 --json --namespace mstar-demo",
        ],
    )
    parser.add_argument("request_id", metavar="REQUEST_ID")
    parser.add_argument("--json", action="store_true", help="print a JSON list of entries")
    add_common_options(parser)
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class Entry:
    """One stream entry: its id (``<ms>-<seq>``) and its fields, decoded for display."""

    id: str
    fields: dict[str, str]

    @property
    def time(self) -> str:
        """The time it was written, from its id: ``2024-05-01 12:00:00.123``."""
        ms, _, _ = self.id.partition("-")
        if not ms.isdigit():
            return self.id
        at = datetime.fromtimestamp(int(ms) / 1000, UTC)
        return at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    @property
    def unknown(self) -> dict[str, str]:
        return {k: v for k, v in self.fields.items() if k not in KNOWN}


def _text(value: bytes) -> str:
    return value.decode(errors="backslashreplace")


def decode_entry(entry_id: bytes, fields: Mapping[bytes, bytes]) -> Entry:
    """An entry; an empty field is one that does not apply (the scripts write it so rather
    than build a shorter list on the hot path)."""
    return Entry(_text(entry_id), {_text(k): _text(v) for k, v in fields.items() if v != b""})


def read_history(reader: NamespaceReader, key: str) -> list[Entry]:
    """Every entry of the stream at ``key``, oldest first, a page per round trip."""
    entries: list[Entry] = []
    start = "-"
    while True:
        page = reader.history_page(key, start, PAGE)
        entries += [decode_entry(entry_id, hash_reply(fields)) for entry_id, fields in page]
        if len(page) < PAGE:
            return entries
        start = "(" + page[-1][0].decode()


def entry_line(entry: Entry) -> tuple[str, ...]:
    """The cells of one entry: time, the known columns ("-" when absent), then the rest."""
    rest = [entry.fields["detail"]] if "detail" in entry.fields else []
    rest += [f"{name}={value}" for name, value in entry.fields.items()
             if name == "token" or name not in KNOWN]  # fmt: skip
    return (entry.time, *(entry.fields.get(c, "-") for c in COLUMNS), " ".join(rest))


def table(entries: list[Entry]) -> list[str]:
    rows = [HEADERS, *(entry_line(e) for e in entries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS) - 1)]
    return [
        (
            "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        ).rstrip()
        for row in rows
    ]


def to_json(entry: Entry) -> dict[str, Any]:
    """Known fields by name (numbers as numbers when they parse), the rest under "other"."""
    data: dict[str, Any] = {"id": entry.id, "time": entry.time.replace(" ", "T") + "Z"}
    for name in KNOWN:
        if name in entry.fields:
            value = entry.fields[name]
            data[name] = int(value) if name in NUMBERS and _is_int(value) else value
    if entry.unknown:
        data["other"] = entry.unknown
    return data


def _is_int(value: str) -> bool:
    return value.isascii() and value.lstrip("-").isdigit()


def _conducted(store: Any, rid: str) -> bool:
    """Held as an M* conductor keeps it (``store.conductor``)."""
    try:
        store.load_conductor_request(rid)
    except RequestNotFound:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    rid = validate_request_id(args.request_id)
    with open_store(args) as store:
        reader = NamespaceReader(
            store.client, namespace=args.namespace, reconnect=cli.CLI_RECONNECT
        )
        entries = read_history(reader, store.keys.history(rid))
        held = store.request_exists(rid) or _conducted(store, rid)
        elsewhere = "" if entries or held else cli.held_elsewhere(args, rid, store.client)
    if args.json:
        encoded = msgspec.json.encode([to_json(e) for e in entries])
        print(msgspec.json.format(encoded, indent=2).decode())
        if not entries and not held:
            print(
                f"error: no request {rid!r} and no history of it in namespace "
                f"{args.namespace!r}{elsewhere}",
                file=sys.stderr,
            )
    elif not entries:
        what = "the request is held" if held else "and no such request is held"
        print(f"no history of request {rid!r} in namespace {args.namespace!r} ({what}){elsewhere}")
    else:
        count = f"{len(entries)} entr{'ies' if len(entries) != 1 else 'y'}"
        print(f"history of request {rid!r} in namespace {args.namespace!r}: {count}, "
              "oldest first" + ("" if held else " (the request is no longer held)"))  # fmt: skip
        print("\n".join(table(entries)))
    return 0 if entries or held else 1
