"""Several processes write one request held as the engine's Conductor keeps it
(``store.conductor``): every WorkerGraphsDone applies exactly once.

Each process (spawned: nothing shared but the Redis server) builds its own ``RequestStore``
from the URL, so each has a cache of its own and their writes race on the request's
version (the STALE path re-reads and redoes). Every op is sent three times with its op id:
once, then again from the (possibly stale) cache, then again after dropping the cache (a
lost reply). The totals must equal the sum of the ops: nothing lost, nothing doubled.
"""

from __future__ import annotations

import traceback
import uuid
from typing import Any

import pytest

from store import RequestStore
from store.conductor import ConductorRequest, WorkerGraphsDone
from store.conductor.layout import RECENT_OPS
from store.types import CurrentForwardConductorMetadata, PartitionState, TensorPointerInfo
from tests import backends
from tests.backends import delete_namespace, redis_url_for_tests
from tests.processes import run_workers

pytestmark = pytest.mark.exclusive  # processes contend: no other test's load beside them

RID = "conc-1"
PROCESSES = 4
OPS = 25
RANKS = 8  # wgA's workers: more reports than a pass needs never complete it twice
TIMEOUT = 60.0


def _tpi(uuid_: str) -> TensorPointerInfo:
    return TensorPointerInfo([1], "float16", 2, 0, [1], uuid_, "s", "worker_0")


def _request() -> ConductorRequest:
    meta = CurrentForwardConductorMetadata("decode", False)
    return ConductorRequest(
        request_id=RID,
        persist_signals={},
        persist_signal_ref_cnt={},
        worker_graph_to_workers={"wgA": [f"w{i}" for i in range(RANKS)], "wgB": ["b0"]},
        all_worker_graph_ids={"wgA", "wgB"},
        max_output_tokens=10**6,
        random_seed=1,
        resource_configs={},
        partition_states={"p0": PartitionState("p0", meta, current_worker_graph_ids={"wgA"})},
    )


def _tokens(worker: int, i: int) -> int:
    return (worker * 7 + i) % 5 + 1


def _message(worker: int, i: int) -> WorkerGraphsDone:
    return WorkerGraphsDone(
        RID,
        ["wgA", "wgB"] if i % 5 == 0 else ["wgA"],
        is_first_tp_rank=i % 2 == 0,  # odd ops: other ranks, whose tokens do not count
        new_token_counts={"text": _tokens(worker, i)},
        persist_signals={f"sig{worker % 2}": [_tpi(f"u{worker}-{i}")]},
        partition_name="p0",
    )


def _worker(worker: int, barrier: Any, results: Any, url: str, namespace: str) -> None:
    try:
        store = RequestStore.from_url(url, namespace=namespace)
        barrier.wait(TIMEOUT)
        for i in range(OPS):
            op_id = f"w{worker}-op{i}"
            first = store.apply_worker_graphs_done(_message(worker, i), op_id=op_id)
            assert store.apply_worker_graphs_done(_message(worker, i), op_id=op_id) == first
            store._core.conductor_records.drop(RID)  # a lost reply, sent again
            assert store.apply_worker_graphs_done(_message(worker, i), op_id=op_id) == first
        store.client.close()
        results.put({"worker": worker})
    except BaseException:
        barrier.abort()
        results.put({"worker": worker, "traceback": traceback.format_exc()})


@pytest.mark.real
@pytest.mark.slow
def test_processes_apply_every_report_once(real_redis_error: str | None) -> None:
    if real_redis_error:
        pytest.skip(real_redis_error)
    url = redis_url_for_tests()
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    store = RequestStore.from_url(url, namespace=namespace)
    try:
        store.ingest_request(_request())
        run_workers(_worker, PROCESSES, url, namespace)

        got = RequestStore.from_url(url, namespace=namespace).load_conductor_request(RID)
        p0 = got.partition_states["p0"]
        all_ops = [(w, i) for w in range(PROCESSES) for i in range(OPS)]
        assert p0.wg_rank_completions == {
            "wgA": len(all_ops),
            "wgB": sum(1 for _, i in all_ops if i % 5 == 0),
        }
        assert p0.completed_worker_graph_ids == {"wgA", "wgB"}
        assert p0.num_output_tokens == sum(_tokens(w, i) for w, i in all_ops if i % 2 == 0)
        for sig in ("sig0", "sig1"):
            held = sorted(info.uuid for info in got.persist_signals[sig])
            assert held == sorted(f"u{w}-{i}" for w, i in all_ops if f"sig{w % 2}" == sig)
        ops_kept = sum(
            1 for name in store.client.hkeys(store.keys.conductor(RID)) if name[:2] == b"o:"
        )
        assert ops_kept == min(RECENT_OPS, len(all_ops) + 1)  # the latest, each once
    finally:
        with backends.connect(url) as client:
            delete_namespace(client, namespace)
        store.client.close()
