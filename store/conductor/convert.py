"""Between the engine's in-memory request (``RequestData``, ``DrainingRequest``) and the
store's ``ConductorRequest``: read by attribute, so that this module needs no engine.

The engine's values are taken as they are (the same classes where ``store.types`` is the
engine's): the store encodes them and a read gives equal values back.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from store.conductor.record import ConductorRequest, Teardown

HELD_FIELDS = (
    "persist_signals",
    "persist_signal_ref_cnt",
    "worker_graph_to_workers",
    "all_worker_graph_ids",
    "max_output_tokens",
    "random_seed",
    "resource_configs",
    "partition_states",
    "partition_definitions",
    "streaming_connections",
    "final_outputs",
    "conductor_ingest_time",
    "conductor_finish_time",
)
"""``RequestData``'s fields the store holds, by the engine's names."""
NOT_HELD_FIELDS = ("sharding_config", "graph_timings", "rx_info", "tx_info")
"""Derived (``sharding_config``, rebuilt from ``worker_graph_to_workers``) or profiling only."""


def from_request_data(
    request_id: str,
    data: Any,
    worker_graph_walks: Mapping[str, Set[str]],
    *,
    draining: Any = None,
    deadline: float = 0.0,
    early_reads_done: Set[str] = frozenset(),
) -> ConductorRequest:
    """The store's record of the engine's ``RequestData`` (and its ``DrainingRequest``).

    ``worker_graph_walks``: each worker graph's graph walks (the conductor's
    ``_all_worker_graph_ids_to_graph_walks``); only the request's worker graphs are kept.
    """
    held = {name: getattr(data, name) for name in HELD_FIELDS}
    teardown = None
    if draining is not None:
        teardown = Teardown(
            expected_acks=set(draining.expected_acks),
            participants=set(draining.participants),
            failure_error=draining.failure_error,
            failure_status=draining.failure_status,
            deadline=deadline,
        )
    return ConductorRequest(
        request_id=request_id,
        **held,
        worker_graph_walks={
            wg: set(worker_graph_walks.get(wg, ())) for wg in data.worker_graph_to_workers
        },
        teardown=teardown,
        early_reads_done=set(early_reads_done),
    )


def request_data_fields(request: ConductorRequest) -> dict[str, Any]:
    """``RequestData``'s held fields of ``request``, by name: what compares with the
    engine's (``{name: getattr(request_data, name) for name in HELD_FIELDS}``)."""
    return {name: getattr(request, name) for name in HELD_FIELDS}
