"""The forward pass: worker-graph rank reports, and the advance to the next pass."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from mstar.conductor.request_info import CurrentForwardConductorMetadata
from store.errors import (
    ConnectionNotFound,
    PartitionNotFound,
    StalePassError,
    UnknownWorkerGraphError,
    ValidationError,
)
from store.keys import validate_name, validate_request_id
from store.ops.args import check_int, check_replica_id
from store.ops.core import VERSION, Core, window
from store.ops.effects import Op
from store.ops.leases import schedule
from store.records import Lease, ReportOutcome

MAX_WORKER_GRAPH_ID_LENGTH = 128


def record_worker_report(
    core: Core,
    request_id: str,
    partition_name: str,
    *,
    fwd_pass: int,
    worker_graph_id: str,
    rank: int,
    num_ranks: int,
    new_tokens: int = 0,
    output_names: Sequence[str] = (),
    consumed: Mapping[str, int] | None = None,
    replica_id: str | None = None,
) -> Op[ReportOutcome]:
    """Apply one worker-graph rank report, once, in one round trip.

    The rank counts towards ``wg_rank_completions``; the rank-0 report also carries the
    new output tokens (added to the partition and to every outgoing connection), the
    consumed counts of incoming connections (raised, never lowered) and output names.
    A second delivery of the same (pass, worker graph, rank) changes nothing. The report
    that completes the pass, if it names ``replica_id``, comes back with that replica's
    lease on the next step (``ReportOutcome.lease``), granted in the same script.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    key = core.keys.partition(rid, name)
    check_int(fwd_pass, "fwd_pass", rid, minimum=0)
    check_int(num_ranks, "num_ranks", rid, minimum=1)
    check_int(rank, "rank", rid, minimum=0)
    check_int(new_tokens, "new_tokens", rid, minimum=0)
    if rank >= num_ranks:
        raise ValidationError(
            f"rank {rank} is outside a worker graph of {num_ranks} ranks", request_id=rid
        )
    if (
        not isinstance(worker_graph_id, str)
        or not 0 < len(worker_graph_id) <= MAX_WORKER_GRAPH_ID_LENGTH
    ):
        raise ValidationError(
            "worker graph id must be a str of 1 to 128 characters", request_id=rid, key=key
        )
    consumed = dict(consumed or {})
    output_names = list(output_names)
    if rank != 0 and (new_tokens or consumed or output_names):
        raise ValidationError(
            f"only the rank-0 report carries tokens, consumed counts and outputs (got rank {rank})",
            request_id=rid,
            key=key,
        )
    for output in output_names:
        if not isinstance(output, str):
            raise ValidationError("output names must be str", request_id=rid, key=key)
    holder = check_replica_id(replica_id, rid)
    for attempt in range(2):
        # Only tokens and consumed counts touch connections; other reports skip them.
        if new_tokens or consumed:
            topology = yield from core.topology(rid)
            outgoing, incoming = topology.outgoing(name), topology.incoming(name)
        else:
            outgoing = incoming = ()
        unknown = set(consumed) - set(incoming)
        if unknown and attempt == 0:
            core.forget(rid)
            continue
        if unknown:
            raise ValidationError(
                f"consumed counts name {sorted(unknown)}, which are not incoming "
                f"connections of {name!r}",
                request_id=rid,
                key=key,
            )
        for conn_name, count in consumed.items():
            check_int(count, f"consumed[{conn_name}]", rid, minimum=0)
        fed = [c for c in incoming if c in consumed]
        keys = [key, core.keys.lease(rid)]
        keys += [core.keys.connection(rid, c) for c in outgoing]
        keys += [core.keys.connection(rid, c) for c in fed]
        now = time.time()
        args: list[Any] = [
            VERSION, fwd_pass, worker_graph_id, rank, num_ranks, new_tokens,
            len(outgoing), len(fed), name, holder, now, core.lease_ttl,
            *(consumed[c] for c in fed), *output_names,
        ]  # fmt: skip
        try:
            reply = yield from core.run(rid, "apply_report", keys, args, PartitionNotFound)
        except ConnectionNotFound:
            if attempt:
                raise
            core.forget(rid)  # the cached topology was stale
            continue
        if reply[0] == b"STALE":
            raise StalePassError(fwd_pass, int(reply[1]), request_id=rid, key=key)
        if reply[0] == b"NOWG":
            raise UnknownWorkerGraphError(
                f"worker graph {worker_graph_id!r} is not in the current forward pass",
                request_id=rid,
                key=key,
                field="current_worker_graph_ids",
            )
        lease = None
        if int(reply[4]):
            lease = Lease(rid, name, holder, int(reply[4]), fwd_pass, now + core.lease_ttl)
            yield from schedule(core, rid, name, lease.expires_at)
        return ReportOutcome(
            applied=reply[0] == b"OK",
            rank_completions=int(reply[1]),
            worker_graph_complete=bool(reply[2]),
            pass_complete=bool(reply[3]),
            lease=lease,
        )
    raise AssertionError("unreachable")


def advance_partition(
    core: Core,
    request_id: str,
    partition_name: str,
    *,
    from_pass: int,
    metadata: CurrentForwardConductorMetadata,
    worker_graph_ids: Sequence[str] = (),
    done: bool = False,
    op_id: str | None = None,
    fence: Lease | None = None,
) -> Op[int]:
    """Move the partition from pass ``from_pass`` to the next; returns the new pass.

    Per-pass sets and counts reset, ``metadata`` replaces the old, ``fwd_pass_number`` and
    ``random_seed`` go up by one; ``done`` also sets ``is_done`` and ``producer_done`` on
    every outgoing connection. Raises ``StalePassError`` (changing nothing) when
    ``from_pass`` is no longer current, and ``FencedError`` when ``fence`` was superseded.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    key = core.keys.partition(rid, name)
    check_int(from_pass, "from_pass", rid, minimum=0)
    if not isinstance(metadata, CurrentForwardConductorMetadata):
        raise ValidationError(
            "metadata must be a CurrentForwardConductorMetadata",
            request_id=rid,
            key=key,
            field="metadata",
        )
    layout = core.partition_layout
    encoded = layout.encode_field("metadata", metadata, request_id=rid, key=key)
    wgs = list(worker_graph_ids)
    layout.encode_field("current_worker_graph_ids", set(wgs), request_id=rid, key=key)
    topology = yield from core.topology(rid)
    keys = [key, core.keys.ops(rid), core.keys.lease(rid)]
    keys += [core.keys.connection(rid, c) for c in topology.outgoing(name)]
    op = f"advance:{op_id or core.new_op_id()}"
    if fence is not None and fence.partition != name:
        raise ValidationError(
            f"a lease on partition {fence.partition!r} cannot fence {name!r}", request_id=rid
        )
    args = [
        VERSION, from_pass, op, *window(core), encoded["metadata"],
        "1" if done else "0", name, fence.token if fence else "", *wgs,
    ]  # fmt: skip
    reply = yield from core.run(rid, "advance_partition", keys, args, PartitionNotFound, fence)
    if reply[0] == b"STALE":
        raise StalePassError(from_pass, int(reply[1]), request_id=rid, key=key)
    return int(reply[1]) if reply[0] == b"OK" else from_pass + 1
