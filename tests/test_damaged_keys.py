"""Any key of a live request of the wrong Redis type, or any field holding random bytes:
every public operation of ``RequestStore`` ends in a value or in one of the store's own
errors, and none hangs.

``tests/test_fuzz_records.py`` damages one field at a time and reads it back (what each
decoder does with bytes); this one damages whole keys too (a hash replaced by a string, a
list, a set, a sorted set or a stream; the index sorted sets given odd members) and runs
every operation, writers included, so the scripts and the replies they send back are
covered as well as the decoders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import CorruptRecordError, RequestStore, RetryPolicy, Step, StoreError
from store.ops.calls import Reconnect
from store.records import Lease, Report
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
)
from tests.conftest import Run, create_small_request, require_binaries
from tests.servers import RedisServer

NS = "dmg"
RID = "live-1"
CONN = "llm->codec"
META = CurrentForwardConductorMetadata("decode", False, ["text"], ["text"], {"t": 1})
STEP = Step(META, ("wg",))
TYPES = ("string", "list", "set", "zset", "hash", "stream")
ODD_VALUES = [
    b"", b"-1", b"1.5", b"nan", b"inf", b"1e400", b"99999999999999999999", b"abc", b"\xff\xfe",
    b"0x10", b" 7", b"llm", b"3:", b"9:abc", b"->", b"a->", b"\x00",
]  # fmt: skip


def make_store(client: Any) -> RequestStore:
    # Short waits: a damaged merging claim looks held, and a write waits it out.
    return RequestStore(
        client,
        namespace=NS,
        retry=RetryPolicy(max_attempts=3, max_wait=0.05),
        reconnect=Reconnect(give_up_after=0.2),
        lease_ttl=30.0,
    )


def live_request(store: RequestStore) -> Lease:
    """A request with two partitions, a connection, published infos, a report applied, a
    step taken, history, ops, and a live lease; returns the lease."""
    store.create_request(
        RID,
        partitions={
            "llm": PartitionState(
                "llm", META, current_worker_graph_ids={"wg"},
                resource_publish_info={"pos": PublishedPositionInfo({"a": 1})},
            ),
            "codec": PartitionState("codec", META, current_worker_graph_ids={"wg"}),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "text")},
        max_output_tokens=64,
    )  # fmt: skip
    store.merge_publish_info(RID, "llm", {"kv": PublishedKVInfo({}, world_size=2)})
    store.add_tokens(RID, CONN, 3)
    outcome = store.record_worker_report(
        RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1, new_tokens=2,
        replica_id="r", then_step=STEP, check_in=60.0,
    )  # fmt: skip
    assert outcome.pass_complete
    lease = store.claim_step(RID, "codec", "r")
    assert lease is not None
    return lease


def operations(lease: Lease) -> list[tuple[str, Callable[[RequestStore], Any]]]:
    """Every public operation of RequestStore on the damaged request (reads first)."""
    report = Report(
        request_id=RID, partition="llm", fwd_pass=1, worker_graph_id="wg", rank=0, num_ranks=1
    )
    return [
        ("list_requests", lambda s: s.list_requests()),
        ("request_exists", lambda s: s.request_exists(RID)),
        ("kept_until", lambda s: s.kept_until(RID)),
        ("load_request", lambda s: s.load_request(RID)),
        ("load_record", lambda s: s.load_record(RID)),
        ("load_partition", lambda s: s.load_partition(RID, "llm")),
        ("load_partitions", lambda s: s.load_partitions([(RID, "llm"), (RID, "codec")])),
        ("load_connection", lambda s: s.load_connection(RID, CONN)),
        ("topology", lambda s: s.topology(RID)),
        ("leases", lambda s: s.leases(RID)),
        ("due_steps", lambda s: s.due_steps()),
        ("check_server", lambda s: s.check_server()),
        ("check_eviction", lambda s: s.check_eviction()),
        ("update_partition",
         lambda s: s.update_partition(RID, "codec", fence=lease, is_done=False)),
        ("set_producer_done", lambda s: s.set_producer_done(RID, CONN)),
        ("set_final_output", lambda s: s.set_final_output(RID, "out", [1], fence=lease)),
        ("add_tokens", lambda s: s.add_tokens(RID, CONN, 1)),
        ("raise_consumed_count", lambda s: s.raise_consumed_count(RID, CONN, 2)),
        ("record_worker_report", lambda s: s.record_worker_report(
            RID, "llm", fwd_pass=1, worker_graph_id="wg", rank=0, num_ranks=1, new_tokens=1,
            replica_id="r", then_step=STEP,
            consumers=True)),
        ("record_worker_reports", lambda s: s.record_worker_reports([report], replica_id="r")),
        ("merge_publish_info(kv)", lambda s: s.merge_publish_info(
            RID, "llm", {"kv": PublishedKVInfo({}, world_size=3)})),
        ("merge_publish_info(pos)", lambda s: s.merge_publish_info(
            RID, "llm", {"pos": PublishedPositionInfo({"a": 4})})),
        ("advance_partition", lambda s: s.advance_partition(
            RID, "llm", from_pass=1, metadata=META, worker_graph_ids=["wg"])),
        ("claim_step", lambda s: s.claim_step(RID, "llm", "q")),
        ("renew_lease", lambda s: s.renew_lease(lease)),
        ("take_step", lambda s: s.take_step(lease, STEP)),
        ("take_steps", lambda s: s.take_steps([(lease, STEP, None)])),
        ("release_lease", lambda s: s.release_lease(lease)),
        ("schedule_check", lambda s: s.schedule_check(RID, "llm", 5)),
        ("finish_request(keep_for)", lambda s: s.finish_request(RID, keep_for=60, fence=lease)),
        ("create_request(again)", lambda s: s.create_request(
            RID, partitions={"llm": PartitionState("llm", META)}, max_output_tokens=1)),
        ("reap", lambda s: s.reap(max_age=0)),
        ("delete_request", lambda s: s.delete_request(RID)),
        ("force_delete_request", lambda s: s.force_delete_request(RID)),
    ]  # fmt: skip


def write_type(client: redis.Redis, key: bytes, kind: str, blobs: list[bytes]) -> None:
    """Replace ``key`` by a value of Redis type ``kind`` holding ``blobs``."""
    client.delete(key)
    blobs = blobs or [b"x"]
    if kind == "string":
        client.set(key, blobs[0])
    elif kind == "list":
        client.rpush(key, *blobs)
    elif kind == "set":
        client.sadd(key, *blobs)
    elif kind == "zset":
        client.zadd(key, {b: i for i, b in enumerate(blobs)})
    elif kind == "hash":
        client.hset(key, mapping={b: b for b in blobs})
    else:
        for blob in blobs:
            client.xadd(key, {b"f": blob})


blobs = st.lists(st.binary(max_size=24) | st.sampled_from(ODD_VALUES), min_size=1, max_size=3)


@st.composite
def damages(draw: st.DrawFn, keys: list[bytes]) -> list[tuple[Any, ...]]:
    """One to three damages: (key, 'type', kind, blobs) or (key, 'field', field, value)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()):
            out.append((key, "type", draw(st.sampled_from(TYPES)), draw(blobs)))
        else:
            value = draw(st.sampled_from(ODD_VALUES) | st.binary(max_size=24))
            out.append((key, "field", draw(st.integers(0, 10_000)), value))
    return out


def apply(client: redis.Redis, damage: list[tuple[Any, ...]]) -> None:
    for key, how, what, value in damage:
        kind = client.type(key)
        if how == "type":
            write_type(client, key, what, value)
        elif kind == b"hash":
            fields = sorted(client.hkeys(key)) or [b"f"]
            client.hset(key, fields[what % len(fields)], value)
        elif kind == b"zset":
            members = sorted(client.zrange(key, 0, -1)) or [value]
            client.zadd(key, {members[what % len(members)] if what % 2 else value: what})
        elif kind == b"stream":
            client.xadd(key, {b"op": value})
        else:
            write_type(client, key, "string", [value])


def run_every_operation(
    client: Any, damage: list[tuple[Any, ...]], named: set[str | None] | None = None
) -> list[str]:
    """The exceptions other than the store's own that the operations raised; ``named``
    collects the keys the ``CorruptRecordError``s named."""
    store = make_store(client)
    lease = live_request(store)
    apply(client, damage)
    escapes = []
    for name, op in operations(lease):
        fresh = make_store(client)  # no topology cached: every read goes to Redis
        for who in (store, fresh):
            try:
                op(who)
            except CorruptRecordError as e:
                assert e.request_id in (RID, None), (name, e)
                if named is not None:
                    named.add(e.key)
            except StoreError:
                pass
            except Exception as e:
                escapes.append(f"{name}: {type(e).__name__}: {e}")
    return escapes


KEYS = sorted(
    [f"{NS}:{{{RID}}}:{suffix}".encode() for suffix in (
        "meta", "part:llm", "part:codec", "pub:llm", "pub:codec", f"conn:{CONN}", "ops",
        "lease", "history", "merging:llm", "merging-queue:llm",
    )] + [f"{NS}:requests".encode(), f"{NS}:deadlines".encode()]
)  # fmt: skip


@pytest.mark.fake
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(damage=damages(KEYS))
def test_damaged_keys_give_the_stores_own_errors(damage: list[tuple[Any, ...]]) -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    escapes = run_every_operation(client, damage)
    assert not escapes, (damage, escapes)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_binaries()
    with RedisServer(tmp_path_factory.mktemp("damaged")) as server:
        yield server


@pytest.fixture(
    params=[
        pytest.param("fake", marks=pytest.mark.fake),
        pytest.param("real", marks=[pytest.mark.servers, pytest.mark.real]),
    ]
)
def empty_client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A client on an empty server: fakeredis, or a private redis-server (flushed: ours)."""
    if request.param == "fake":
        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    client = request.getfixturevalue("private_redis").client()
    client.flushall()
    yield client
    client.close()


@pytest.mark.parametrize("key", KEYS, ids=[k.decode().split(":", 2)[-1] for k in KEYS])
@pytest.mark.parametrize("kind", TYPES)
def test_every_key_of_every_type(empty_client: Any, key: bytes, kind: str) -> None:
    """Each key as each Redis type: a wrong type in a request's key is a store error
    (``CorruptRecordError`` naming the request and that key), wherever it is met."""
    named: set[str | None] = set()
    escapes = run_every_operation(empty_client, [(key, "type", kind, [b"7", b"x->y"])], named)
    assert not escapes, escapes
    assert named <= {key.decode()}, named  # the damaged key, and no other, is named


def test_ls_top_and_history_report_a_damaged_request_and_go_on(
    run: Run, client: redis.Redis, namespace: str
) -> None:
    store = RequestStore(client, namespace=namespace)
    for rid in ("good-1", "bad-1", "good-2"):
        create_small_request(store, rid)
    meta = store.keys.meta("bad-1")
    client.delete(meta)
    client.set(meta, b"not a hash")
    client.zadd(store.keys.deadlines, {b"bad-1 llm": 0, b"\xff\xfe llm": 0})
    client.set(store.keys.history("bad-1"), b"not a stream")

    listed = run("ls")
    assert listed.code == 0 and "Traceback" not in listed.err
    lines = {line.split()[0]: line for line in listed.out.splitlines()[1:]}
    assert set(lines) == {"good-1", "bad-1", "good-2"}
    assert "unreadable" in lines["bad-1"] and repr(meta) in lines["bad-1"]
    assert "pass 0" in lines["good-1"] and "pass 0" in lines["good-2"]

    top = run("top", "--once")
    assert top.code == 0 and "requests     3 in flight" in top.out

    damaged = run("history", "bad-1")
    assert damaged.code == 1 and damaged.out == ""
    assert damaged.err.count("\n") == 1 and repr(store.keys.history("bad-1")) in damaged.err
    assert run("history", "good-1").code == 0


@pytest.mark.fake
@pytest.mark.parametrize("held", [b"abc", b"", b"-5", b"1.5", b"9007199254740993", b"\xff"])
def test_a_stored_pass_out_of_its_domain_is_named_by_every_writer(held: bytes) -> None:
    """A partition's fwd_pass_number that is no pass number: the report, the advance and
    the step each raise ``CorruptRecordError`` naming the partition's key and the field."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    store = make_store(client)
    lease = live_request(store)  # the lease on codec, at pass 0
    key = store.keys.partition(RID, "codec")
    client.hset(key, "fwd_pass_number", held)
    writers: list[Callable[[], Any]] = [
        lambda: store.record_worker_report(
            RID, "codec", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1),
        lambda: store.advance_partition(RID, "codec", from_pass=0, metadata=META, fence=lease),
        lambda: store.take_step(lease, STEP),
    ]  # fmt: skip
    for write in writers:
        with pytest.raises(CorruptRecordError) as damaged:
            write()
        assert (damaged.value.key, damaged.value.field) == (key, "fwd_pass_number")
