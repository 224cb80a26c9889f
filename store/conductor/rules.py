"""What mstar-ai 0.2.1's ``Conductor`` does to one request's state, as functions of it.

Each function changes a ``ConductorRequest`` the way the named engine method changes its
``RequestData`` (and ``DrainingRequest``), and returns what the engine would send because
of it. They never call the model: where the engine asks the model (the next pass's
arguments), the caller passes the model's answer in. ``tests/engine/test_conductor_diff.py``
feeds the same messages to the engine's own ``Conductor`` and to the store and compares
the whole state after each, so these stay equal to the engine, not to a reading of it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from store.conductor.record import (
    PREPROCESS_WORKER,
    Conclusion,
    ConductorRequest,
    GraphsDoneOutcome,
    PassOutcome,
    PassResult,
    Teardown,
    TeardownOutcome,
    Unpersist,
    WorkerGraphsDone,
)
from store.errors import PartitionNotFound, UnknownWorkerGraphError
from store.types import TensorPointerInfo, merge_publish_info


def apply_worker_graphs_done(
    request: ConductorRequest, message: WorkerGraphsDone
) -> GraphsDoneOutcome:
    """``Conductor._process_worker_graphs_done`` (and the run loop's check before it).

    A worker graph the request was not assigned is refused before anything changes (the
    engine raises ``KeyError`` half way through, which its run loop logs, leaving the
    message half applied); an unknown partition is ignored after the final outputs were
    taken, as the engine does.
    """
    if request.teardown is not None:
        return GraphsDoneOutcome(ignored="draining")
    unknown = [wg for wg in message.worker_graph_ids if wg not in request.worker_graph_to_workers]
    if unknown:
        raise UnknownWorkerGraphError(
            f"worker graph {unknown[0]!r} is not assigned to this request",
            request_id=request.request_id, field="worker_graph_ids",
        )  # fmt: skip
    request.final_outputs.update(message.output_loop_indices)
    partition = message.partition_name
    pstate = request.partition_states.get(partition)
    if pstate is None:
        return GraphsDoneOutcome(ignored="unknown partition")
    for name, infos in message.persist_signals.items():
        request.persist_signals.setdefault(name, []).extend(infos)
    if message.is_first_tp_rank:  # replicated across TP ranks: rank 0's counts once
        merge_publish_info(pstate.resource_publish_info, message.resource_publish_info)
        connections = request.streaming_connections.values()
        for name, count in message.new_token_counts.items():
            pstate.num_output_tokens += count
            for conn in connections:
                if conn.from_partition == partition and conn.edge_name == name:
                    conn.token_count += count
        if message.stream_tokens_consumed:
            for conn in connections:
                if conn.from_partition != partition:
                    consumed = message.stream_tokens_consumed.get(conn.edge_name, 0)
                    conn.consumed_count = max(conn.consumed_count, consumed)
        request.final_outputs.update(message.output_loop_indices)
        if isinstance(message.output_signal_names, list):
            pstate.curr_forward_outputs += message.output_signal_names
    for wg in message.worker_graph_ids:
        count = pstate.wg_rank_completions.get(wg, 0) + 1
        pstate.wg_rank_completions[wg] = count
        if count >= len(request.worker_graph_to_workers[wg]):
            pstate.completed_worker_graph_ids.add(wg)
    if pstate.current_worker_graph_ids.issubset(pstate.completed_worker_graph_ids):
        return GraphsDoneOutcome(done_partitions=(partition,))
    return GraphsDoneOutcome()


def complete_pass(
    request: ConductorRequest,
    partition: str,
    result: PassResult,
    *,
    partition_done_from_worker: bool = False,
) -> PassOutcome:
    """``Conductor._process_done_forward`` after its call of the model (whose answer is
    ``result``): the partition's next metadata, the max-token stop, producer_done, the
    references of the inputs sent, unpersisting, and the reset to the next pass."""
    pstate = request.partition_states.get(partition)
    if pstate is None:
        raise PartitionNotFound(
            f"partition {partition!r} is not one of the request's",
            request_id=request.request_id, field="partition",
        )  # fmt: skip
    if request.teardown is not None:  # the run loop skips a request that began teardown
        return PassOutcome(partition, pstate.fwd_pass_number, ignored="draining")
    connections = request.streaming_connections.values()
    if partition_done_from_worker and any(c.to_partition == partition for c in connections):
        pstate.is_done = True
    metadata = copy.deepcopy(result.full_metadata)
    metadata.kwargs.update(result.step_metadata)
    pstate.metadata = metadata
    forced = pstate.num_output_tokens >= request.max_output_tokens
    request_done = result.request_done or forced
    fwd_index = pstate.fwd_pass_number
    producer_done: list[str] = []
    if request_done:
        pstate.is_done = True
        for conn in connections:
            if conn.from_partition == partition:
                conn.producer_done = True
                producer_done.append(conn.to_partition)
    else:
        add_references(request, result.sent_tensor_uuids)
    unpersist = unpersist_tensors(request, result.unpersist_tensors)
    pstate.completed_worker_graph_ids = set()
    pstate.wg_rank_completions = {}
    pstate.fwd_pass_number += 1
    pstate.current_worker_graph_ids = next_worker_graphs(request, metadata.graph_walk)
    return PassOutcome(
        partition=partition,
        fwd_index=fwd_index,
        request_done=all(ps.is_done for ps in request.partition_states.values()),
        partition_done=pstate.is_done,
        forced_by_max_tokens=forced,
        producer_done=tuple(producer_done),
        unpersist=unpersist,
        next_worker_graph_ids=frozenset(pstate.current_worker_graph_ids),
    )


def next_worker_graphs(request: ConductorRequest, graph_walk: str) -> set[str]:
    """``Conductor._set_partition_worker_graph_ids``: the request's worker graphs that run
    ``graph_walk``."""
    walks = request.worker_graph_walks
    return {wg for wg in request.all_worker_graph_ids if graph_walk in walks.get(wg, ())}


def add_references(request: ConductorRequest, uuids: Iterable[str]) -> None:
    """``Conductor._update_persist_ref_counts``: one reference per tensor sent to a worker."""
    counts = request.persist_signal_ref_cnt
    for uuid in uuids:
        counts[uuid] = counts.get(uuid, 0) + 1


def unpersist_tensors(request: ConductorRequest, infos: Iterable[TensorPointerInfo]) -> Unpersist:
    """``Conductor._un_persist_tensors``: each source entity's UnpersistTensors (uuid ->
    times sent; an entity appears even when all its tensors were skipped, as the engine
    sends it then), and the tensors forgotten."""
    messages: Unpersist = {}
    forgotten: set[str] = set()
    counts = request.persist_signal_ref_cnt
    for info in infos:
        held = messages.setdefault(info.source_entity, {})
        if info.uuid in held or info.uuid not in counts:
            continue  # a duplicate, or a tensor never sent (another partition's, say)
        held[info.uuid] = counts[info.uuid]
        forgotten.add(info.uuid)
    if forgotten:
        for name, kept in request.persist_signals.items():
            request.persist_signals[name] = [i for i in kept if i.uuid not in forgotten]
        for uuid in forgotten:
            del counts[uuid]
    return messages


def conclude(request: ConductorRequest, finish_time: float, deadline: float) -> Conclusion:
    """``Conductor._process_request_done``: what RequestComplete carries, the unpersisting
    of every tensor still held, and the teardown barrier that waits for the preprocess
    worker's reads."""
    request.conductor_finish_time = finish_time
    request.concluded = True
    final_outputs = dict(request.final_outputs)
    held = [info for infos in request.persist_signals.values() for info in infos]
    unpersist = unpersist_tensors(request, held) if held else {}
    participants = request.workers() | {PREPROCESS_WORKER}
    teardown = register_teardown(request, {PREPROCESS_WORKER}, participants, deadline)
    return Conclusion(
        final_outputs=final_outputs,
        conductor_ingest_time=request.conductor_ingest_time,
        conductor_finish_time=finish_time,
        unpersist=unpersist,
        teardown=teardown,
    )


def register_teardown(
    request: ConductorRequest,
    expected_acks: set[str],
    participants: set[str],
    deadline: float,
    failure: str | None = None,
) -> TeardownOutcome:
    """``Conductor._register_draining``: READS_DONE that came early count; a barrier with
    nothing to wait for finalizes at once."""
    waiting = set(expected_acks) - request.early_reads_done
    request.early_reads_done = set()
    request.teardown = Teardown(waiting, set(participants), failure, 500, deadline)
    if not waiting:
        return finalize(request)
    return TeardownOutcome()


def finalize(request: ConductorRequest) -> TeardownOutcome:
    """``Conductor._finalize_draining``: RemoveRequest to every participant, RequestFailed
    on the fail path; the caller deletes the request's state."""
    teardown = request.teardown
    assert teardown is not None
    request.teardown = None
    failure = None
    if teardown.failure_error is not None:
        failure = (teardown.failure_error, teardown.failure_status)
    return TeardownOutcome(remove=tuple(sorted(teardown.participants)), failure=failure)


def remove(
    request: ConductorRequest, deadline: float, failure: str | None = None
) -> TeardownOutcome:
    """``Conductor._abort_request`` / ``_fail_requests`` of a request held: drain every
    participant's reads first (``_remove_request``); ignored while already draining."""
    if request.teardown is not None:
        return TeardownOutcome(ignored="draining")
    participants = request.workers() | {PREPROCESS_WORKER}
    finalized = register_teardown(request, participants, participants, deadline, failure)
    return TeardownOutcome(
        drain=tuple(sorted(participants)),
        remove=finalized.remove,
        failure=finalized.failure,
    )


def reads_done(request: ConductorRequest, entity: str) -> TeardownOutcome:
    """``Conductor._handle_reads_done``: an ack to the barrier, or kept for a barrier not
    registered yet."""
    teardown = request.teardown
    if teardown is None:
        request.early_reads_done.add(entity)
        return TeardownOutcome(ignored="no barrier yet")
    teardown.expected_acks.discard(entity)
    if not teardown.expected_acks:
        return finalize(request)
    return TeardownOutcome()


def expire(request: ConductorRequest, now: float) -> TeardownOutcome:
    """``Conductor._sweep_expiry`` for one request: a barrier past its deadline is forced
    through (a participant that never acks cannot hold the request forever)."""
    if request.teardown is None or request.teardown.deadline > now:
        return TeardownOutcome(ignored="not due")
    return finalize(request)
