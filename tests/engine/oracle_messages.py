"""The oracle's messages: what a worker, the API server or the preprocess worker could send
the conductor next, built from the conductor's own current state."""

from __future__ import annotations

import random
import weakref
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from mstar.conductor.conductor import Conductor
from mstar.utils.ipc_format import (
    AbortRequest,
    ConductorMessage,
    ConductorMessageType,
    FailRequests,
    NewRequestConductor,
    ReadsDone,
    WorkerGraphsDone,
)

from mstar.engine.resources.kv.manager import KVSequenceInfo, PublishedKVInfo
from mstar.engine.resources.position.manager import PublishedPositionInfo
from mstar.graph.base import (
    TensorPointerInfo,
)
from mstar.graph.loop_indices import NestedLoopIndices
from tests.engine.oracle_model import (
    KV,
    PERSIST_NAMES,
    PREPROCESS_WORKER,
    SHARD_ROWS,
    SHARDED_SIGNAL,
    Shape,
)

# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def _msg(kind: ConductorMessageType, body: Any) -> ConductorMessage:
    return ConductorMessage(message_type=kind, body=body)


# Per conductor, a counter for fresh tensor uuids: deterministic for a fresh conductor fed
# the same calls, unique within it.
_UUID_COUNTERS: weakref.WeakKeyDictionary[Conductor, Iterator[int]] = weakref.WeakKeyDictionary()


def _fresh_uuid(conductor: Conductor, request_id: str) -> str:
    counter = _UUID_COUNTERS.setdefault(conductor, iter(range(1 << 62)))
    return f"{request_id}/t{next(counter)}"


def _tensor(
    uuid: str,
    name: str,
    entity: str,
    rank: int = 0,
    tp: int = 1,
    node: str | None = None,
    walk: str | None = None,
) -> TensorPointerInfo:
    dims = [SHARD_ROWS, 4] if name == SHARDED_SIGNAL else [3, 5]
    return TensorPointerInfo(
        dims=dims,
        dtype="bfloat16",
        nbytes=dims[0] * dims[1] * 2,
        address=0x1000,
        stride=[dims[1], 1],
        uuid=uuid,
        source_session_id=f"host:{entity}",
        source_entity=entity,
        source_tp_size=tp,
        source_tp_rank=rank,
        _source_node_name=node,
        _source_graph_walk=walk,
    )


def new_request_message(shape: Shape, request_id: str, choice: int) -> ConductorMessage:
    """A NEW_REQUEST with persisted initial signals from the preprocess worker and
    model_kwargs that sometimes pin the seed, cap the output tokens or skip a partition."""
    r = random.Random(choice)
    signals = {
        name: [
            _tensor(f"{request_id}/in{name}{i}", name, PREPROCESS_WORKER)
            for i in range(r.randint(1, 2))
        ]
        for name in r.sample(PERSIST_NAMES, r.randint(0, 2))
    }
    kwargs: dict[str, Any] = {}
    if r.random() < 0.4:
        kwargs["seed"] = r.randint(0, 2**31)
    if r.random() < 0.15:
        kwargs["max_output_tokens"] = r.randint(2, 30)
    if r.random() < 0.2:
        kwargs["temperature"] = r.choice([0.0, 1.0])
    if len(shape.partitions) > 1 and r.random() < 0.1:
        kwargs["skip_partition"] = r.choice(shape.partitions).name
    return _msg(
        ConductorMessageType.NEW_REQUEST,
        NewRequestConductor(
            request_id=request_id,
            initial_signals=signals,
            initial_input_modalities=["text"],
            initial_output_modalities=r.choice([["text"], ["audio"], ["text", "audio"]]),
            input_metadata={},
            model_kwargs=kwargs,
        ),
    )


def _first_rank_slot(wg_id: str, fwd_pass: int, n_ranks: int) -> int:
    """Which of a worker graph's reports in a pass comes from TP rank 0 (the one with
    ``is_first_tp_rank``): fixed per (wg, pass), so ranks interleave but only one is first."""
    return zlib.crc32(f"{wg_id}:{fwd_pass}".encode()) % n_ranks


def _pending_counts(pending: Sequence[Any], request_id: str, partition: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in pending:
        body = m.body
        if (
            m.message_type == ConductorMessageType.WORKER_GRAPHS_DONE
            and body.request_id == request_id
            and body.partition_name == partition
        ):
            for wg in body.worker_graph_ids:
                counts[wg] = counts.get(wg, 0) + 1
    return counts


def _open_wgs(
    conductor: Conductor, request_id: str, partition: str, pending: Sequence[Any]
) -> dict[str, int]:
    """Current worker graphs of the partition still owed reports -> reports received so far
    (the batch's pending messages included)."""
    data = conductor.requests[request_id]
    ps = data.partition_states[partition]
    extra = _pending_counts(pending, request_id, partition)
    counts = {}
    for wg in sorted(ps.current_worker_graph_ids):
        got = ps.wg_rank_completions.get(wg, 0) + extra.get(wg, 0)
        if got < len(data.worker_graph_to_workers[wg]):
            counts[wg] = got
    return counts


def _worker_graphs_done(
    conductor: Conductor,
    request_id: str,
    partition: str,
    wg_ids: list[str],
    counts: dict[str, int],
    first: bool,
    r: random.Random,
) -> ConductorMessage:
    """A plausible report: what the named worker graphs of one rank produced."""
    shape: Shape = conductor.model.shape
    data = conductor.requests[request_id]
    ps = data.partition_states[partition]
    walk = ps.metadata.graph_walk
    persist: dict[str, list[TensorPointerInfo]] = {}
    for wg in wg_ids:
        if r.random() < 0.5:
            continue
        workers = data.worker_graph_to_workers[wg]
        slot = _first_rank_slot(wg, ps.fwd_pass_number, len(workers))
        rank = (counts.get(wg, 0) - slot) % len(workers)  # the slot's report is rank 0's
        nodes = sorted(conductor.worker_graphs[wg].section.get_nodes())
        name = r.choice(PERSIST_NAMES)
        persist.setdefault(name, []).append(
            _tensor(
                _fresh_uuid(conductor, request_id),
                name,
                workers[rank],
                rank=rank,
                tp=len(workers),
                node=r.choice(nodes),
                walk=walk,
            )
        )
    body = WorkerGraphsDone(
        request_id=request_id,
        worker_graph_ids=wg_ids,
        is_first_tp_rank=first,
        persist_signals=persist,
        partition_name=partition,
    )
    out_edges = [c.edge_name for c in shape.outgoing(partition)]
    if r.random() < 0.7:
        names = [*out_edges, "text"] if r.random() < 0.8 else ["text"]
        body.new_token_counts = {n: r.randint(0, 2) for n in names}
    incoming = data.get_incoming_connections(partition)
    if incoming and r.random() < 0.7:
        body.stream_tokens_consumed = {
            c.edge_name: r.randint(c.consumed_count, max(c.consumed_count, c.token_count))
            for c in incoming
        }
        if r.random() < 0.2:
            # names that are not this partition's: unknown, or another connection's (the
            # engine applies a name to every connection this partition does not produce)
            other = sorted({c.edge_name for c in shape.connections} | {"elsewhere"})
            body.stream_tokens_consumed[r.choice(other)] = r.randint(0, 5)
    if r.random() < 0.5:
        world = max(len(data.worker_graph_to_workers[wg]) for wg in wg_ids)
        rank = r.randrange(world)
        body.resource_publish_info = {
            KV: PublishedKVInfo.build_for_rank(
                rank,
                world,
                {
                    "main": KVSequenceInfo(
                        seq_len=r.randint(1, 64),
                        latest_kv_transfer_info=None,
                        page_indices=sorted(r.sample(range(16), 2)),
                    ),
                },
            ),
        }
        if r.random() < 0.5:
            body.resource_publish_info["pos"] = PublishedPositionInfo(
                counters={"main": r.randint(0, 64)}
            )
    if r.random() < 0.4:
        body.output_loop_indices = {
            f"{partition}_out": NestedLoopIndices(
                loop_name_order=["outer"],
                loop_indices={"outer": r.randint(0, 4)},
                wg_fwd_pass_idx=ps.fwd_pass_number,
            ),
        }
    if r.random() < 0.3:
        body.output_signal_names = [f"{wg}_out" for wg in wg_ids]  # the list the loop keeps
    else:
        body.output_signal_names = r.randint(0, 2)  # the declared int, which it ignores
    if incoming and r.random() < 0.15:
        body.partition_done = True
    return _msg(ConductorMessageType.WORKER_GRAPHS_DONE, body)


def _valid_report(
    conductor: Conductor, request_id: str, r: random.Random, pending: Sequence[Any]
) -> ConductorMessage | None:
    data = conductor.requests[request_id]
    live = [p for p, ps in sorted(data.partition_states.items()) if not ps.is_done]
    r.shuffle(live)
    for partition in live:
        ps = data.partition_states[partition]
        open_wgs = _open_wgs(conductor, request_id, partition, pending)
        if not open_wgs:
            continue
        first = r.random() < 0.5
        for is_first in (first, not first):
            candidates = [
                wg
                for wg, got in open_wgs.items()
                if (
                    got
                    == _first_rank_slot(
                        wg, ps.fwd_pass_number, len(data.worker_graph_to_workers[wg])
                    )
                )
                == is_first
            ]
            if candidates:
                break
        else:
            continue
        chosen = sorted(r.sample(candidates, r.randint(1, len(candidates))))
        return _worker_graphs_done(conductor, request_id, partition, chosen, open_wgs, is_first, r)
    return None


def next_message(
    conductor: Conductor,
    request_id: str,
    choice: int,
    pending: Sequence[Any] = (),
) -> ConductorMessage:
    """A message for ``request_id`` built from the oracle's current state and ``choice``.

    Mostly a worker's valid report (one rank, 1..n of the partition's open worker graphs,
    ``is_first_tp_rank`` on exactly one report per graph and pass); else an abort, a
    worker's failure, READS_DONE from a participant (before or after the barrier), a late
    report, or one naming an unknown partition or worker graph (the engine's KeyError).
    ``pending``: messages already in the same batch, not yet applied.
    """
    r = random.Random(choice)
    shape: Shape = conductor.model.shape
    data = conductor.requests.get(request_id)
    live = data is not None and request_id not in conductor.draining
    if live and r.random() < 0.8:
        msg = _valid_report(conductor, request_id, r, pending)
        if msg is not None:
            return msg
    roll = r.random()
    if roll < 0.04:
        return _msg(ConductorMessageType.ABORT_REQUEST, AbortRequest(request_id=request_id))
    if roll < 0.08:
        return _msg(
            ConductorMessageType.FAIL_REQUESTS,
            FailRequests(
                errors={
                    request_id: "scripted failure",
                    **({"ghost": "x"} if r.random() < 0.3 else {}),
                }
            ),
        )
    if roll < 0.45:
        return _msg(
            ConductorMessageType.READS_DONE,
            ReadsDone(request_id=request_id, entity_id=_reader(conductor, request_id, r)),
        )
    # a report the conductor must tolerate: late, or naming what this request lacks
    partition = r.choice(shape.partitions).name
    wg_ids = sorted(conductor.worker_graphs)
    kind = r.random()
    if kind < 0.5:
        wgs = [r.choice(wg_ids)]
    elif kind < 0.8:
        partition = "no_such_partition"
        wgs = [r.choice(wg_ids)]
    else:
        wgs = [r.choice(wg_ids), "no_such_wg"]
    return _msg(
        ConductorMessageType.WORKER_GRAPHS_DONE,
        WorkerGraphsDone(
            request_id=request_id,
            worker_graph_ids=wgs,
            is_first_tp_rank=r.random() < 0.5,
            partition_name=partition,
            new_token_counts={"text": 1},
            output_loop_indices={"late": NestedLoopIndices(["outer"], {"outer": 0}, 0)},
        ),
    )


def _reader(conductor: Conductor, request_id: str, r: random.Random) -> str:
    drain = conductor.draining.get(request_id)
    if drain is not None and drain.expected_acks and r.random() < 0.8:
        return r.choice(sorted(drain.expected_acks))
    workers = [f"worker_{k}" for k in sorted(conductor.model.shape.workers())]
    return r.choice([PREPROCESS_WORKER, *workers])


def finishing_messages(conductor: Conductor, request_id: str) -> list[ConductorMessage]:
    """One batch that moves ``request_id`` towards its end: every rank's report for every
    open worker graph of one live partition (rank 0 first, producers first), or the
    READS_DONE the drain barrier waits for. Empty when the conductor holds nothing for it."""
    if request_id in conductor.draining:
        return [
            _msg(ConductorMessageType.READS_DONE, ReadsDone(request_id=request_id, entity_id=e))
            for e in sorted(conductor.draining[request_id].expected_acks)
        ]
    data = conductor.requests.get(request_id)
    if data is None:
        return []
    r = random.Random(0)
    for partition, ps in data.partition_states.items():  # producers come first
        if ps.is_done:
            continue
        open_wgs = _open_wgs(conductor, request_id, partition, ())
        if not open_wgs:
            # Every graph reported, yet the pass was never processed: an exception later in
            # that batch dropped it. Only another report moves the partition on.
            stuck = sorted(ps.current_worker_graph_ids)[:1]
            return (
                [_worker_graphs_done(conductor, request_id, partition, stuck, {}, first=False, r=r)]
                if stuck
                else []
            )
        out = []
        for wg, got in open_wgs.items():
            n = len(data.worker_graph_to_workers[wg])
            slot = _first_rank_slot(wg, ps.fwd_pass_number, n)
            for k in range(got, n):
                msg = _worker_graphs_done(
                    conductor, request_id, partition, [wg], {wg: k}, first=k == slot, r=r
                )
                msg.body.partition_done = False
                out.append(msg)
        return out
    return []
