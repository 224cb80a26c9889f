"""The forward pass: worker-graph rank reports (with their published infos), and advances.

A report and the infos its rank published go to the server in one script call: the
report's identity (pass, worker graph, rank) guards both, so a resend applies neither
twice. Only infos of a kind the server cannot merge (a user kind with its own ``update``)
take the optimistic path first, guarded by an op id derived from the report's identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store.codec import domains
from store.errors import (
    ConnectionNotFound,
    PartitionNotFound,
    StalePassError,
    StoreError,
    UnknownWorkerGraphError,
    ValidationError,
)
from store.keys import validate_name, validate_request_id
from store.ops.args import check_replica_id
from store.ops.batch import gather
from store.ops.core import VERSION, Core
from store.ops.damage import reading, stored_int
from store.ops.effects import Op
from store.ops.leases import check_in_arg, index_after_report, report_hint
from store.ops.merges import merge_publish_info
from store.records import Lease, Report, ReportOutcome, Step
from store.types import CurrentForwardConductorMetadata, PartitionState, PublishedInfo

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
    published: Mapping[str, PublishedInfo] | None = None,
    then_step: Step | None = None,
    check_in: float | None = None,
    consumers: bool = False,
) -> Op[ReportOutcome]:
    """Apply one worker-graph rank report, and the infos it published, once, in one call.

    The rank counts towards ``wg_rank_completions``; the rank-0 report also carries the
    new output tokens (added to the partition and to every outgoing connection), the
    consumed counts of incoming connections (raised, never lowered) and output names.
    ``published`` infos are merged as ``merge_publish_info`` would, in the same script for
    the kinds the server merges. A second delivery of the same (pass, worker graph, rank)
    changes nothing and says what the first did. The report that completes the pass, if it
    names ``replica_id``, comes back with that replica's lease on the next step and the
    partition as stored (``ReportOutcome.lease``, ``.partition``). With ``then_step``, that
    step is taken in the same call (advance, lease ended, next look in ``check_in``
    seconds; ``None``: never): a conductor that knows the next step ahead (a decode step
    like the last) saves the step's round trip. With ``consumers`` too, a step taken comes
    back with the partitions this one streams to as it left them
    (``ReportOutcome.consumers``): a conductor that nudges its streaming consumers saves
    reading them (one HGETALL each in the script, for every step taken).
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    prefix = core.keys.request_prefix(rid)
    key = prefix + "part:" + name
    if not (
        type(fwd_pass) is int and type(rank) is int and type(num_ranks) is int
        and type(new_tokens) is int and 0 <= rank < num_ranks < _EXACT
        and 0 <= fwd_pass < _EXACT and 0 <= new_tokens < _EXACT
    ):  # fmt: skip
        _refuse_numbers(rid, key, fwd_pass, num_ranks, rank, new_tokens)
    if (
        type(worker_graph_id) is not str
        or not 0 < len(worker_graph_id) <= MAX_WORKER_GRAPH_ID_LENGTH
    ):
        raise ValidationError(
            "worker graph id must be a str of 1 to 128 characters", request_id=rid, key=key
        )
    consumed = dict(consumed) if consumed else {}
    output_names = list(output_names) if output_names else []
    if consumed or output_names or (rank != 0 and new_tokens):
        _check_rank_zero_extras(rid, key, rank, consumed, output_names)
    holder = "" if replica_id is None else check_replica_id(replica_id, rid)
    step_args = (
        _NO_STEP if then_step is None else _step_args(core, rid, key, then_step, check_in, holder)
    )
    merge_args: list[Any] = []
    if published:
        published = dict(published)
        merge = core.published.server_merge(published, request_id=rid, key=prefix + "pub:" + name)
        if merge is None:  # a kind with its own update: the optimistic path, guarded
            yield from _merge_first(core, rid, name, published, fwd_pass, worker_graph_id, rank)
        else:
            merge_args = merge
    fixed_keys = [
        key, prefix + "lease", prefix + "pub:" + name, prefix + "merging:" + name,
        prefix + "history", core.index_key(rid),
    ]  # fmt: skip
    # The connections the script writes (tokens, consumed counts, a finishing step marks its
    # streams done), and the partitions it reads back after a step when asked for them.
    writes_connections = bool(new_tokens or consumed or (then_step is not None and then_step.done))
    reads_consumers = then_step is not None and consumers
    for attempt in range(2):
        outgoing: tuple[str, ...] = ()
        fed: list[str] = []
        streams: list[str] | None = None  # the consumers asked for
        script_keys = fixed_keys
        if writes_connections or reads_consumers:
            topology = yield from core.topology(rid)
            if writes_connections:
                outgoing, incoming = topology.outgoing(name), topology.incoming(name)
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
                fed = [c for c in incoming if c in consumed]
                script_keys = fixed_keys + [prefix + "conn:" + c for c in (*outgoing, *fed)]
            if reads_consumers:
                streams = topology.consumers(name)
                if streams:
                    script_keys = script_keys + [prefix + "part:" + c for c in streams]
        args: list[Any] = [
            VERSION, fwd_pass, worker_graph_id, rank, num_ranks, new_tokens,
            len(outgoing), len(fed), name, holder, core.lease_ttl, core.history_cap,
            len(output_names), merge_args[0] if merge_args else 0, *step_args.fixed,
        ]  # fmt: skip
        if fed:
            args += [consumed[c] for c in fed]
        args += output_names
        args += step_args.wgs
        if merge_args:
            args += merge_args[1:]
        try:
            reply = yield from _run_report(core, rid, script_keys, args, step_args)
        except ConnectionNotFound:
            if attempt:
                raise
            core.forget(rid)  # the cached topology was stale
            continue
        if reply[0] == b"KIND":  # a label holds another kind: the kind's own update decides
            assert published
            yield from _merge_first(core, rid, name, published, fwd_pass, worker_graph_id, rank)
            merge_args = []
            continue
        return _outcome(core, rid, name, key, fwd_pass, worker_graph_id, holder, reply, streams)
    raise AssertionError("unreachable")


_EXACT = domains.LUA_EXACT  # every number of a report is below it (see _refuse_numbers)


def _refuse_numbers(
    rid: str, key: str, fwd_pass: Any, num_ranks: Any, rank: Any, new_tokens: Any
) -> None:
    """Raise the ``ValidationError`` that a report's numbers call for."""
    where = {"request_id": rid, "key": key}
    check_int = domains.check_int
    check_int(fwd_pass, domains.PASS, what="fwd_pass", **where)
    check_int(num_ranks, domains.RANKS, what="num_ranks", **where)
    check_int(rank, domains.RANK, what="rank", **where)
    check_int(new_tokens, domains.TOKENS, what="new_tokens", **where)
    raise ValidationError(
        f"rank {rank} is outside a worker graph of {num_ranks} ranks", request_id=rid
    )


def _check_rank_zero_extras(
    rid: str, key: str, rank: int, consumed: dict[str, Any], output_names: list[Any]
) -> None:
    """Only rank 0 carries tokens, consumed counts and output names, each of its type."""
    if rank != 0:
        raise ValidationError(
            f"only the rank-0 report carries tokens, consumed counts and outputs (got rank {rank})",
            request_id=rid,
            key=key,
        )
    for output in output_names:
        if not isinstance(output, str):
            raise ValidationError("output names must be str", request_id=rid, key=key)
    for conn_name, count in consumed.items():
        domains.check_int(
            count, domains.TOKENS, what=f"consumed[{conn_name}]", request_id=rid, key=key
        )


class _StepArgs:
    """The script arguments of the step a report may take at once."""

    def __init__(self, fixed: list[Any], wgs: list[str]) -> None:
        self.fixed = fixed
        self.wgs = wgs


_NO_STEP = _StepArgs(["", "", "", "", 0], [])


def _step_args(
    core: Core, rid: str, key: str, step: Step, check_in: float | None, holder: str
) -> _StepArgs:
    if not holder:
        raise ValidationError("then_step needs replica_id: the step is taken under its lease")
    metadata, wgs = core.encode_step(rid, key, step.metadata, step.worker_graph_ids)
    fixed = ["1", metadata, "1" if step.done else "0", check_in_arg(check_in, rid), len(wgs)]
    return _StepArgs(fixed, wgs)


def _run_report(
    core: Core, rid: str, keys: list[str], args: list[Any], step: _StepArgs
) -> Op[list[Any]]:
    """The report script; BUSY (an optimistic merge holds the partition) waits and retries."""
    check = step.fixed[3] if step.fixed[0] == "1" else None
    partition, holder = args[8], args[9]
    indexing = holder and not core.scripts_write_index  # on a cluster: see store/ops/leases
    waiting = None
    while True:
        alongside = report_hint(core, rid, partition, holder, check) if indexing else ()
        reply: list[Any] = yield from core.run(
            rid, "report", keys, args, PartitionNotFound, alongside=alongside
        )
        if reply[0] != b"BUSY":
            if indexing:
                yield from index_after_report(core, rid, partition, reply, check)
            return reply
        waiting = waiting or core.busy_waiting(keys[2], request_id=rid)
        yield from waiting.pause(reply)  # an optimistic merge holds the partition: it goes first


def _merge_first(
    core: Core,
    rid: str,
    name: str,
    published: Mapping[str, PublishedInfo],
    fwd_pass: int,
    wg: str,
    rank: int,
) -> Op[None]:
    op_id = f"report:{rid}/{name}/{fwd_pass}/{wg}/{rank}"
    yield from merge_publish_info(core, rid, name, published, op_id=op_id, returning=False)


def _outcome(
    core: Core,
    rid: str,
    name: str,
    key: str,
    fwd_pass: int,
    wg: str,
    holder: str,
    reply: list[Any],
    streams: list[str] | None,
) -> ReportOutcome:
    with reading(request_id=rid, key=key):  # its numbers come from the request
        status = reply[0]
        if status == b"STALE":
            current = stored_int(
                reply[1], domains.PASS, request_id=rid, key=key, field="fwd_pass_number"
            )
            raise StalePassError(fwd_pass, current, request_id=rid, key=key)
        if status == b"NOWG":
            raise UnknownWorkerGraphError(
                f"worker graph {wg!r} is not in the current forward pass",
                request_id=rid,
                key=key,
                field="current_worker_graph_ids",
            )
        token = int(reply[4])
        lease = stored = stored_consumers = None
        stepped = int(reply[6]) or None
        core.instruments.count("reports" if status == b"OK" else "duplicates")
        if stepped is not None:
            core.instruments.count("passes")
        if token:
            lease = Lease(
                rid, name, holder, token, fwd_pass, float(reply[5]), int(reply[7]), float(reply[8])
            )
            if stepped is None:
                part, pub = reply[9], reply[10]

                def stored() -> PartitionState:
                    return core.decode_partition(rid, name, _pairs(part), _pairs(pub))

            elif streams is not None and len(reply) > 11:  # a step taken here, and asked
                held = reply[12] if streams else []

                def stored_consumers() -> dict[str, PartitionState]:
                    return {
                        consumer: core.decode_partition(rid, consumer, _pairs(fields), {})
                        for consumer, fields in zip(streams, held, strict=True)
                        if fields  # gone (the request went, or a stale topology): not here
                    }

        # Positional: matching keyword arguments costs this hot path's constructor a third more.
        return ReportOutcome(
            status == b"OK", int(reply[1]), bool(reply[2]), bool(reply[3]), lease, stepped, stored,
            stored_consumers,
        )  # fmt: skip


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def record_worker_reports(
    core: Core,
    reports: Sequence[Report],
    *,
    replica_id: str | None = None,
    then_steps: Sequence[Step | None] | None = None,
    check_in: float | Sequence[float | None] | None = None,
    consumers: bool = False,
) -> Op[list[ReportOutcome | StoreError]]:
    """Apply many reports (of any requests) at once: pipelined to each Redis server (see
    ``store.ops.batch``), each going on as ``record_worker_report`` would on its own.

    ``then_steps`` (one per report, or None) are the steps to take in the same call when a
    report completes its pass, as ``record_worker_report(then_step=...)`` does, with
    ``check_in`` (one for all, or one per report: a runtime spreads its deadlines) and
    ``consumers``. The result has one entry per report, in order: its outcome, or the
    ``StoreError`` it met (one bad report does not fail the others).
    """
    steps = list(then_steps) if then_steps is not None else [None] * len(reports)
    if len(steps) != len(reports):
        raise ValidationError(f"{len(steps)} then_steps for {len(reports)} reports")
    if check_in is None or isinstance(check_in, int | float):
        check_ins: list[float | None] = [check_in] * len(reports)
    else:
        check_ins = list(check_in)
    if len(check_ins) != len(reports):
        raise ValidationError(f"{len(check_ins)} check_in values for {len(reports)} reports")
    return (
        yield from gather(
            [
                record_worker_report(
                    core,
                    r.request_id,
                    r.partition,
                    fwd_pass=r.fwd_pass,
                    worker_graph_id=r.worker_graph_id,
                    rank=r.rank,
                    num_ranks=r.num_ranks,
                    new_tokens=r.new_tokens,
                    output_names=r.output_names,
                    consumed=r.consumed,
                    replica_id=replica_id,
                    published=r.published,
                    then_step=step,
                    check_in=each_check_in,
                    consumers=consumers,
                )
                for r, step, each_check_in in zip(reports, steps, check_ins, strict=True)
            ]
        )
    )


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
    ``from_pass`` is no longer current, and ``FencedError`` when ``fence`` was superseded
    or, without a fence, while a replica holds a live lease on the partition. The runtime
    takes steps with ``take_step``, which also ends the lease in the same call.
    """
    rid = validate_request_id(request_id)
    name = validate_name(partition_name, what="partition name", request_id=rid)
    key = core.keys.partition(rid, name)
    domains.check_int(from_pass, domains.PASS, what="from_pass", request_id=rid, key=key)
    encoded, wgs = core.encode_step(rid, key, metadata, worker_graph_ids)
    if fence is not None and fence.partition != name:
        raise ValidationError(
            f"a lease on partition {fence.partition!r} cannot fence {name!r}", request_id=rid
        )
    topology = yield from core.topology(rid)
    keys = core.keys
    script_keys = [key, keys.ops(rid), keys.lease(rid), keys.history(rid)]
    script_keys += [keys.connection(rid, c) for c in topology.outgoing(name)]
    op = f"advance:{op_id or core.new_op_id()}"
    args = [
        VERSION, from_pass, op, core.dedupe_window, encoded, "1" if done else "0", name,
        fence.token if fence else "", core.history_cap, *wgs,
    ]  # fmt: skip
    reply = yield from core.run(
        rid, "advance_partition", script_keys, args, PartitionNotFound, fence
    )
    if reply[0] == b"DUP":
        return from_pass + 1
    current = stored_int(reply[1], domains.PASS, request_id=rid, key=key, field="fwd_pass_number")
    if reply[0] == b"STALE":
        raise StalePassError(from_pass, current, request_id=rid, key=key)
    return current
