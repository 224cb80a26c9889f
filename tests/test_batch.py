"""Batched reports and steps give exactly what one call at a time gives.

The same requests are created in two namespaces; one gets a batch, the other the same calls
one by one; outcomes (errors included) and every request's final state must be equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Report, ReportOutcome, Step, StoreError, ValidationError
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
)
from tests.stores import Stores
from tests.strategies import STORE_SETTINGS

MD = CurrentForwardConductorMetadata("decode", False)
RIDS = ("b0", "b1", "b2")


def create(store: Any) -> None:
    for rid in RIDS:
        store.create_request(
            rid,
            partitions={"p": PartitionState("p", MD, current_worker_graph_ids={"wg"})},
            max_output_tokens=1000,
        )


reports = st.builds(
    lambda rid, fwd_pass, rank, wg, kv, tokens: Report(
        request_id=rid,
        partition="p",
        fwd_pass=fwd_pass,
        worker_graph_id=wg,
        rank=rank,
        num_ranks=2,
        new_tokens=tokens if rank == 0 else 0,
        published={
            "kv": PublishedKVInfo({rank: {"p": KVSequenceInfo(3, None, [rank])}}, 2),
            "pos": PublishedPositionInfo({"p": fwd_pass}),
        }
        if kv
        else {},
    ),
    st.sampled_from([*RIDS, "missing", "bad id"]),
    st.sampled_from([0, 0, 1]),
    st.sampled_from([0, 1, 1, 2]),  # rank 2 of 2 ranks: a ValidationError
    st.sampled_from(["wg", "wg", "other"]),
    st.booleans(),
    st.integers(0, 3),
)


def outcome_of(result: ReportOutcome | StoreError) -> Any:
    if isinstance(result, StoreError):  # the same error, but for the namespace in its key
        return (type(result).__name__, result.reason, result.request_id, result.field)
    lease = result.lease
    return (
        result.applied, result.rank_completions, result.worker_graph_complete,
        result.pass_complete, lease and (lease.holder, lease.token, lease.pass_number),
        result.partition,
    )  # fmt: skip


def state_of(store: Any) -> list[Any]:
    out = []
    for rid in RIDS:
        state = store.load_request(rid)
        out.append((state.partitions, state.connections, state.record.final_outputs))
    return out


@settings(STORE_SETTINGS, max_examples=15)
@given(batch=st.lists(reports, min_size=1, max_size=30))
def test_batched_reports_equal_one_at_a_time(
    client: redis.Redis, namespace: str, make_store: Stores, batch: list[Report]
) -> None:
    one = make_store(client, namespace=f"{namespace}:one")
    many = make_store(client, namespace=f"{namespace}:many")
    for store in (one, many):
        for rid in RIDS:
            store.force_delete_request(rid)  # leases from the last example
        create(store)
    expected = []
    for r in batch:
        try:
            expected.append(
                one.record_worker_report(
                    r.request_id,
                    r.partition,
                    fwd_pass=r.fwd_pass,
                    worker_graph_id=r.worker_graph_id,
                    rank=r.rank,
                    num_ranks=r.num_ranks,
                    new_tokens=r.new_tokens,
                    published=r.published,
                    replica_id="me",
                )
            )
        except StoreError as e:
            expected.append(e)
    got = many.record_worker_reports(batch, replica_id="me")
    assert [outcome_of(g) for g in got] == [outcome_of(e) for e in expected]
    assert state_of(many) == state_of(one)


def test_batched_steps_equal_one_at_a_time(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    one = make_store(client, namespace=f"{namespace}:one")
    many = make_store(client, namespace=f"{namespace}:many")
    leases: dict[str, list[Any]] = {}
    for name, store in (("one", one), ("many", many)):
        create(store)
        leases[name] = []
        for rid in RIDS:
            outcome = store.record_worker_report(
                rid, "p", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, replica_id="me"
            )
            leases[name].append(outcome.lease)
    step = Step(MD, ("wg",))
    expected = [one.take_step(lease, step, check_in=30.0) for lease in leases["one"]]
    stale = leases["many"][0]
    got = many.take_steps([(lease, step, 30.0) for lease in leases["many"]] + [(stale, step, 30.0)])
    assert got[:3] == expected == [1, 1, 1]
    assert got[3] == 1  # the resent step is recognised, as one call would
    assert state_of(many) == state_of(one)


def test_batched_steps_in_the_reports_take_each_report_s_own_check_in(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    create(store)
    batch = [
        Report(request_id=rid, partition="p", fwd_pass=0, worker_graph_id="wg", rank=0,
               num_ranks=1)
        for rid in RIDS
    ]  # fmt: skip
    steps = [Step(MD, ("wg",))] * len(RIDS)
    with pytest.raises(ValidationError, match="2 check_in values for 3 reports"):
        store.record_worker_reports(batch, replica_id="me", then_steps=steps, check_in=[1, 2])
    before = float(client.time()[0])
    got = store.record_worker_reports(
        batch, replica_id="me", then_steps=steps, check_in=[100.0, 200.0, None]
    )
    assert [g.stepped_to for g in got] == [1, 1, 1]
    checks = [client.hget(store.keys.lease(rid), "check[p]") for rid in RIDS]
    assert checks[2] is None  # None: no check time, recovery never looks at it
    assert [round(float(c) - before, -2) for c in checks[:2]] == [100.0, 200.0]
