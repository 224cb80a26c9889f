"""The history the store writes: one entry per state-changing operation, in the same script.

(`tests/test_history.py` checks the reader, `mstar-store history`, on entries written by hand.)
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from store import FencedError, Step
from store.cli.history import decode_entry
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.stores import Stores

MD = CurrentForwardConductorMetadata("decode", False)


def timeline(client: redis.Redis, store: Any, rid: str) -> list[dict[str, str]]:
    entries = client.xrange(store.keys.history(rid))
    return [decode_entry(i, f).fields for i, f in entries]


def test_every_state_change_appends_one_entry(
    client: redis.Redis, namespace: str, make_store: Stores
) -> None:
    store = make_store(client, namespace=namespace)
    store.create_request(
        "h", partitions={"p": PartitionState("p", MD, current_worker_graph_ids={"wg"})},
        max_output_tokens=10,
    )  # fmt: skip
    first = store.record_worker_report(
        "h", "p", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, replica_id="a"
    )
    store.record_worker_report(
        "h", "p", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, replica_id="b"
    )  # a resend
    with pytest.raises(FencedError):  # a live lease covers p: an unfenced write is refused
        store.update_partition("h", "p", num_output_tokens=3)
    store.take_step(first.lease, Step(MD, ("wg",)), check_in=5.0)
    store.finish_request("h", keep_for=60.0)

    got = [(e["op"], e.get("outcome"), e.get("pass"), e.get("replica")) for e in
           timeline(client, store, "h")]  # fmt: skip
    assert got == [
        ("create", "applied", None, None),
        ("report", "applied", "0", "a"),
        ("report", "duplicate", "0", "b"),
        ("update", "fenced", None, None),
        ("step", "applied", "1", "a"),
        ("finish", "applied", None, None),
    ]


def test_history_can_be_turned_off(client: redis.Redis, namespace: str, make_store: Stores) -> None:
    store = make_store(client, namespace=namespace, history_cap=0)
    store.create_request(
        "quiet", partitions={"p": PartitionState("p", MD, current_worker_graph_ids={"wg"})},
        max_output_tokens=10,
    )  # fmt: skip
    store.record_worker_report("quiet", "p", fwd_pass=0, worker_graph_id="wg", rank=0,
                               num_ranks=1)  # fmt: skip
    assert not client.exists(store.keys.history("quiet"))
