"""A Redis at ``maxmemory`` (``noeviction``): every write refused whole, then work resumes.

A private ``redis-server`` holds a request in the middle of a pass, then is filled with
other keys until it refuses writes. Create, report (alone and with its step), merge
(server-side and optimistic), claim, partition update, final output, finish, and a lease's
take_step, renewal and release each raise ``StoreFullError`` and leave every key as it was;
single-record reads and deletes still work (a delete frees memory: it is one of the fixes
the error names). Once ``maxmemory`` is raised, the same writes succeed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import redis

from store import Codec, Lease, Step, StoreError, StoreFullError
from store.types import CurrentForwardConductorMetadata, PartitionState, PublishedPositionInfo
from tests.servers import RedisServer
from tests.stores import Stores
from tests.strategies import SumInfo, user_registry

pytestmark = [pytest.mark.servers, pytest.mark.real]

RID = "busy"
META = CurrentForwardConductorMetadata("decode", False, ["text"], ["text"])
FILLER = b"x" * 16_384


def create(store: Any, rid: str) -> None:
    store.create_request(
        rid,
        partitions={"llm": PartitionState("llm", META, current_worker_graph_ids={"wg"})},
        max_output_tokens=8,
    )


def report(store: Any, rank: int, **options: Any) -> Any:
    return store.record_worker_report(
        RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=3,
        replica_id="r", **options,
    )  # fmt: skip


def fill(client: redis.Redis) -> int:
    """Write filler keys (outside the store's namespace) until Redis refuses one; then set
    the limit 1 MB under what is used, so that the few kilobytes used memory moves by (a
    client's buffers) never take it back under the limit mid-test."""
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 4_000_000)
    for i in range(100_000):
        try:
            client.set(f"filler:{i}", FILLER)
        except redis.exceptions.OutOfMemoryError:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used - 1_000_000)
            return i
    raise AssertionError("Redis never refused a write")


def snapshot(client: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key but the filler, as DUMP serializes it (type, content and all)."""
    return {
        key: client.dump(key)
        for key in client.scan_iter(count=1000)
        if not key.startswith(b"filler:")
    }


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "full", None, "--maxmemory-policy", "noeviction") as started:
        yield started


Write = Callable[[Any], Any]
WRITES: list[tuple[str, Write]] = [
    ("create_request", lambda s: create(s, "new")),
    ("record_worker_report", lambda s: report(s, 1)),
    ("record_worker_report(then_step)", lambda s: report(s, 1, then_step=Step(META, ("wg",)))),
    ("merge_publish_info(server-side)",
     lambda s: s.merge_publish_info(RID, "llm", {"pos": PublishedPositionInfo({"a": 9})})),
    ("merge_publish_info(optimistic)",
     lambda s: s.merge_publish_info(RID, "llm", {"sum": SumInfo(2)})),
    ("claim_step", lambda s: s.claim_step(RID, "llm", "other")),
    ("set_final_output", lambda s: s.set_final_output(RID, "text", [1])),
    ("update_partition", lambda s: s.update_partition(RID, "llm", is_done=False)),
    ("finish_request(keep_for)", lambda s: s.finish_request(RID, keep_for=60)),
]  # fmt: skip
# Writes under a lease (on request "held", claimed before the server filled up).
LEASE_WRITES: list[tuple[str, Callable[[Any, Lease], Any]]] = [
    ("take_step", lambda s, lease: s.take_step(lease, Step(META, ("wg",)))),
    ("renew_lease", lambda s, lease: s.renew_lease(lease, 30.0)),
    ("release_lease", lambda s, lease: s.release_lease(lease)),
]


def test_a_full_server_refuses_every_write_whole_and_takes_them_once_freed(
    server: RedisServer, make_store: Stores
) -> None:
    client = server.client()
    store = make_store(client, namespace="full", codec=Codec(user_registry()), lease_ttl=0.2)
    create(store, RID)
    store.merge_publish_info(RID, "llm", {"sum": SumInfo(1)})
    report(store, 0)  # rank 0 of 3 reported: a report of rank 1 is pending, not the last
    stepped = report(store, 2, then_step=None)
    assert not stepped.pass_complete
    create(store, "doomed")
    create(store, "held")
    lease = store.renew_lease(store.claim_step("held", "llm", "me"), 30.0)
    fill(client)
    before = snapshot(client)

    refused = {}
    writes = [*WRITES, *((name, partial(w, lease=lease)) for name, w in LEASE_WRITES)]
    for name, write in writes:
        with pytest.raises(StoreFullError) as caught:
            write(store)
        refused[name] = caught.value
        assert snapshot(client) == before, f"{name} wrote under OOM"
    for error in refused.values():
        assert error.request_id in (RID, "new", "held")
        assert "maxmemory" in str(error) and "delete finished requests" in str(error)

    # Single-record reads still answer, and a delete (which frees memory) runs, from a
    # process that knows nothing of the request yet too.
    assert store.load_record(RID).partitions == ["llm"]
    operator = make_store(client, namespace="full")
    assert operator.delete_request("doomed") is True
    assert not operator.request_exists("doomed")

    client.config_set("maxmemory", 0)  # the operator raises the limit: work resumes
    create(store, "new")
    outcome = report(store, 1, then_step=Step(META, ("wg",)))
    assert outcome.pass_complete and outcome.lease is not None
    assert store.load_partition(RID, "llm").fwd_pass_number == 1
    merged = store.merge_publish_info(RID, "llm", {"sum": SumInfo(2)})
    assert merged["sum"] == SumInfo(3)
    time.sleep(0.3)  # the step's lease ends with the step; its check time comes
    store.schedule_check(RID, "llm", 0)
    assert store.claim_step(RID, "llm", "other") is not None
    store.release_lease(lease)
    assert "llm" not in store.leases("held")
    client.close()


def test_without_the_flag_line_a_create_writes_past_the_limit(
    server: RedisServer, make_store: Stores
) -> None:
    """Why the write scripts carry "#!lua": without it, Redis checks memory only at a
    script's first write that may grow memory, and create_request's first write is a DEL,
    which does not; every HSET after it lands. A store on a server that cannot read the
    line (fakeredis, Redis before 7) runs them so: this is what the line prevents."""
    client = server.client()
    store = make_store(client, namespace="full")
    create(store, "warm")  # the scripts are loaded before the server is full
    fill(client)
    with pytest.raises(StoreFullError):
        create(store, "flagged")
    assert not client.exists("full:{flagged}:meta")
    store._core.scripts.flagged = False  # as on a server that cannot read the line
    try:
        create(store, "unflagged")
    except StoreError:  # if Redis ever checks the whole script, the line is not needed
        pytest.fail("expected the old rule to let a flagless create through")
    assert client.exists("full:{unflagged}:meta")
    client.close()
