"""``ls`` and ``show``: the live state of held requests, for people or as JSON.

Partitions, connections and records are rendered from their dataclass fields, so a field
added to a type shows up here without a change; published infos and resource configs are
named by their registered kind, the name they are stored under.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

from store.cli.main import (
    add_command,
    add_common_options,
    held_elsewhere,
    open_store,
    same_place,
)
from store.codec.kinds import POLYMORPHIC_BASES, KindRegistry
from store.errors import RequestNotFound, StoreError
from store.records import Lease, RequestState
from store.types import (
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
)

# Shown in the request's header or as sections of their own, not as record fields.
_RECORD_HEADER_FIELDS = ("request_id", "partitions", "connections", "created_at")


def add_parser(subparsers: Any) -> None:
    ls = add_command(
        subparsers,
        "ls",
        summary="list the requests held, one line each",
        description="""List the requests held in a namespace, one line each: its age, each
        partition's forward pass and tokens ([done] once finished), each streaming
        connection's tokens sent/consumed, and the replica driving each partition with its
        lease's time left. A request that finished and expired, or one that does not read, is
        said so on its line and the list goes on. In an empty namespace it names the
        namespaces that do hold requests.""",
        examples=[
            "mstar-store ls  # namespace 'mstar' on $MSTAR_REDIS_URL, else the local Redis",
            "mstar-store ls --namespace mstar-demo --redis-url redis://10.0.0.5:6379/0"
            "  # what `demo --keep` kept on that server",
        ],
    )
    add_common_options(ls)
    ls.set_defaults(func=run_ls)
    show = add_command(
        subparsers,
        "show",
        summary="print one request's whole state",
        description="""Print every field of one request as the store holds it: the request's
        record, each partition and each streaming connection, with published infos and
        resource configs named by the kind they are stored under. --json prints the same as
        JSON, for scripts. A request that is not held is an error (exit 1) naming the namespace
        looked in and any namespaces that hold that id; a damaged one names its key and
        field.""",
        examples=[
            "mstar-store show req-42  # in namespace 'mstar'",
            "mstar-store show req-42 --json --namespace staging | jq .partitions",
        ],
    )
    show.add_argument("request_id", metavar="REQUEST_ID")
    show.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_common_options(show)
    show.set_defaults(func=run_show)


def run_ls(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        ids = store.list_requests()
        conducted = store.list_conductor_requests()
        if not ids and not conducted:
            hint = held_elsewhere(args, client=store.client)
            print(f"no requests in namespace {args.namespace!r}{hint}")
            return 0
        now = time.time()
        if ids:
            print(f"{_count(ids)} in namespace {args.namespace!r}")
            width = max(len(rid) for rid in ids)
            for rid in ids:
                print(f"{rid:<{width}}  {_request_line(store, rid, now)}")
        if conducted:
            print(f"{_count(conducted)} held by M* conductors in namespace {args.namespace!r}")
            width = max(len(rid) for rid in conducted)
            for rid in conducted:
                print(f"{rid:<{width}}  {_conducted_line(store, rid)}")
    return 0


def _count(ids: list[str]) -> str:
    return f"{len(ids)} request{'s' if len(ids) != 1 else ''}"


def _request_line(store: Any, rid: str, now: float) -> str:
    try:
        return summary_line(store.load_request(rid), now) + driver_summary(store.leases(rid), now)
    except RequestNotFound:
        return gone(store.kept_until(rid), now)
    except StoreError as e:  # one damaged request must not hide the others
        return unreadable(e)
    except ValueError as e:  # an error the library has not typed: still one line
        return f"unreadable: {type(e).__name__}: {e}"


def _conducted_line(store: Any, rid: str) -> str:
    """One request as an M* conductor holds it: its deployment, each partition's pass and
    tokens, each connection's, and its teardown."""
    try:
        held = store.load_conductor_request(rid)
    except RequestNotFound:
        return "torn down"
    except StoreError as e:
        return unreadable(e)
    parts = [f"deployment {held.owner or '-'}"]
    parts += [partition_progress(n, p) for n, p in held.partition_states.items()]
    parts += [connection_progress(n, c) for n, c in held.streaming_connections.items()]
    if held.teardown is not None:
        waits = ", ".join(sorted(held.teardown.expected_acks)) or "nothing"
        parts.append(f"tearing down (waits for {waits})")
    return "  ".join(parts)


def gone(kept_until: float | None, now: float) -> str:
    """Why an indexed request is not held: it finished and its keys expired as planned
    (``reap`` drops the entry), or its create or delete was interrupted."""
    if kept_until is not None and kept_until <= now:
        until = datetime.fromtimestamp(kept_until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"expired (finished, kept until {until}); reap drops its index entry"
    return "not held: its create or delete was interrupted (stale index entry)"


def unreadable(error: StoreError) -> str:
    """``unreadable: key '<key>', field '<field>': <why>`` for a request that does not read."""
    where = ", ".join(
        f"{name} {value!r}" for name, value in (("key", error.key), ("field", error.field)) if value
    )
    return f"unreadable: {where + ': ' if where else ''}{error.reason}"


def run_show(args: argparse.Namespace) -> int:
    """Print one request; a damaged one is an error (one line, exit 1), from ``main``.

    Page indices are decoded as they are printed, so damage to them shows up here too,
    before anything is printed: the lines are built first.
    """
    with open_store(args) as store:
        state = store.load_request(args.request_id)
        registry = store.codec.registry
    if args.json:
        data = {"namespace": args.namespace, **to_builtins(state, registry)}
        encoded = msgspec.json.encode(data, enc_hook=repr, order="deterministic")
        print(msgspec.json.format(encoded, indent=2).decode())
    else:
        print("\n".join(describe(state, registry, args.namespace, time.time())))
        print(f"history: mstar-store history {args.request_id}{same_place(args)}")
    return 0


# -- one-line summaries ------------------------------------------------------------------


def age(seconds: float) -> str:
    """``42s``, ``3m04s``, ``2h05m``, ``3d04h``: short and still precise enough to compare."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def partition_progress(name: str, part: PartitionState) -> str:
    """``llm: pass 12 tokens 40 [done]``."""
    done = " [done]" if part.is_done else ""
    return f"{name}: pass {part.fwd_pass_number} tokens {part.num_output_tokens}{done}"


def connection_progress(name: str, conn: StreamingConnectionState) -> str:
    """``llm->codec 40/38 done``: tokens sent / consumed, and whether the producer finished."""
    done = " done" if conn.producer_done else ""
    return f"{name} {conn.token_count}/{conn.consumed_count}{done}"


def summary_line(state: RequestState, now: float) -> str:
    parts = [f"age {age(now - state.record.created_at)}"]
    parts += [partition_progress(n, p) for n, p in state.partitions.items()]
    parts += [connection_progress(n, c) for n, c in state.connections.items()]
    return "  ".join(parts)


def driver_summary(leases: Mapping[str, Lease], now: float) -> str:
    """``  driver llm: replica-2 (lease 4s left)`` per leased partition; "" when none is.

    A lease records its expiry, not its grant, so its age shows as time left or lapsed.
    """
    parts = []
    for name, lease in sorted(leases.items()):
        left = lease.expires_at - now
        when = f"{age(left)} left" if left >= 0 else f"lapsed {age(-left)} ago"
        parts.append(f"  driver {name}: {lease.holder} (lease {when})")
    return "".join(parts)


def kind_name(value: Any, registry: KindRegistry) -> str:
    cls = type(value)
    return registry.name_of(cls) or cls.__qualname__


def summarize_info(value: Any, registry: KindRegistry) -> str:
    """Published info in a line: KV ranks and labels with lengths and pages, counters."""
    kind = kind_name(value, registry)
    if isinstance(value, PublishedKVInfo):
        ranks = "; ".join(
            f"rank {rank}: "
            + ", ".join(
                f"{label} seq_len {seq.seq_len} pages {len(seq.page_indices)}"
                for label, seq in sorted(labels.items())
            )
            for rank, labels in sorted(value.info.items())
        )
        return f"{kind} (world size {value.world_size}) {ranks or 'no ranks'}"
    if isinstance(value, PublishedPositionInfo):
        counters = ", ".join(f"{k}={v}" for k, v in sorted(value.counters.items()))
        return f"{kind} {counters or 'no counters'}"
    return f"{kind} {_inline(value, registry)}"


# -- show: the whole request --------------------------------------------------------------


def describe(state: RequestState, registry: KindRegistry, namespace: str, now: float) -> list[str]:
    """Every field of the record, each partition and each connection, one per line."""
    record = state.record
    created = datetime.fromtimestamp(record.created_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"request {record.request_id} in namespace {namespace!r} "
        f"(created {created}, {age(now - record.created_at)} ago)"
    ]
    lines += _fields(record, registry, skip=_RECORD_HEADER_FIELDS)
    for name, part in state.partitions.items():
        lines.append(f"partition {name}")
        lines += _fields(part, registry, skip=("partition_name",))
    for name, conn in state.connections.items():
        lines.append(f"connection {name}")
        lines += _fields(conn, registry, skip=())
    return lines


def _fields(obj: Any, registry: KindRegistry, skip: tuple[str, ...]) -> list[str]:
    names = [f.name for f in dataclasses.fields(obj) if f.name not in skip]
    width = max((len(n) for n in names), default=0)
    lines = []
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, Mapping) and value and any(map(_is_structured, value.values())):
            # A mapping of records reads better as one entry per line.
            lines.append(f"  {name}")
            key_width = max(len(str(k)) for k in value)
            lines += [
                f"    {k!s:<{key_width}}  {_inline(v, registry)}"
                for k, v in sorted(value.items(), key=lambda item: str(item[0]))
            ]
        else:
            lines.append(f"  {name:<{width}}  {_inline(value, registry)}")
    return lines


def _is_structured(value: Any) -> bool:
    return dataclasses.is_dataclass(value) or isinstance(value, POLYMORPHIC_BASES)


def _inline(value: Any, registry: KindRegistry) -> str:
    if isinstance(value, POLYMORPHIC_BASES) and not isinstance(value, type):
        if isinstance(value, (PublishedKVInfo, PublishedPositionInfo)):
            return summarize_info(value, registry)
        return f"{kind_name(value, registry)} {_inline_fields(value, registry)}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _inline_fields(value, registry)
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(str, value))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_inline(v, registry) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_inline(v, registry)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, str | bytes) else str(value)


def _inline_fields(value: Any, registry: KindRegistry) -> str:
    if not dataclasses.is_dataclass(value):
        return repr(value)
    return " ".join(
        f"{f.name}={_inline(getattr(value, f.name), registry)}" for f in dataclasses.fields(value)
    )


# -- show --json -----------------------------------------------------------------------------


def to_builtins(state: RequestState, registry: KindRegistry) -> dict[str, Any]:
    """The request as plain data; each published info or config as ``{kind, value}``."""
    return {
        "record": _plain(state.record, registry),
        "partitions": {n: _plain(p, registry) for n, p in state.partitions.items()},
        "connections": {n: _plain(c, registry) for n, c in state.connections.items()},
    }


def _plain(value: Any, registry: KindRegistry) -> Any:
    if isinstance(value, POLYMORPHIC_BASES) and not isinstance(value, type):
        # A dataclass kind field by field, so that a key JSON cannot hold (KVReqConfig's
        # (node, walk) tuples) is shown as text; any other kind as msgspec makes it plain.
        fields = (
            _plain_fields(value, registry)
            if dataclasses.is_dataclass(value)
            else msgspec.to_builtins(value, str_keys=True, enc_hook=repr, order="deterministic")
        )
        return {"kind": kind_name(value, registry), "value": fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain_fields(value, registry)
    if isinstance(value, Mapping):  # JSON object keys are strings
        return {str(k): _plain(v, registry) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, registry) for v in value]
    return value  # scalars; sets are sorted by msgspec's deterministic order


def _plain_fields(value: Any, registry: KindRegistry) -> dict[str, Any]:
    return {f.name: _plain(getattr(value, f.name), registry) for f in dataclasses.fields(value)}
