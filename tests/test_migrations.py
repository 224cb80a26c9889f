"""Schema versions and migrations: the steps, lazy upgrade on read and write, the runner.

The frozen fixtures in ``tests/fixtures`` hold one request as the code of every schema version
stored it; most tests write them raw with redis-py and then use the store or the runner on them.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis
from hypothesis import given

from store import CorruptRecordError, RequestStore, SchemaVersionError, migrations
from store.codec.layout import RecordLayout
from store.codec.published import PublishLayout
from store.codec.values import Codec
from store.keys import KeySpace
from store.migrate import MigrationReport, migrate_namespace
from store.migrations import RawRecord, RecordKind
from store.migrations import m0002_resource_publish_info as m0002
from store.migrations import m0003_worker_graph_ids_as_str as m0003
from store.migrations import m0004_split_published_parts as m0004
from store.migrations import m0005_compact_kv_sequences as m0005
from store.migrations.record import envelope_version, stamp_envelope
from store.records import RequestRecord, RequestState
from store.schema import SCHEMA_VERSION
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
)
from store.upgrade import from_hashes, to_hashes, upgrade_record
from tests import backends, fixtures
from tests import strategies as s
from tests.backends import redis_url_for_tests
from tests.fixtures import record_keys, snapshot, store_fixture, versions_held

RECORDS_PER_REQUEST = 4  # meta, partitions llm and codec, connection llm->codec
LATEST = fixtures.VERSIONS[-1]
OLD = fixtures.VERSIONS[:-1]

encode = msgspec.msgpack.encode


# -- the steps, pure --------------------------------------------------------------------


def partition_v1(fields: dict[str, bytes], published: dict[str, bytes] | None = None) -> RawRecord:
    return RawRecord(RecordKind.PARTITION, 1, {"partition_name": b"p", **fields}, published or {})


def test_m0002_turns_per_label_seq_info_into_kv_envelopes() -> None:
    per_label = {
        "kv": {
            0: {"seq_len": 5, "latest_kv_transfer_info": ["h", 1], "page_indices": [3]},
            2: {"seq_len": 5},
        },
        "draft": {0: {"seq_len": 1, "page_indices": [7, 8]}},
    }
    old = partition_v1({"per_label_seq_info": encode(per_label), "fwd_pass_number": b"2"})

    new = m0002.upgrade(old)

    assert "per_label_seq_info" not in new.fields
    assert new.fields["fwd_pass_number"] == b"2"
    codec = Codec()
    infos = {k: codec.decode_kind(v, PublishedInfo) for k, v in new.published.items()}
    assert infos == {
        "kv": PublishedKVInfo(
            info={0: {"kv": KVSequenceInfo(5, ["h", 1], [3])}, 2: {"kv": KVSequenceInfo(5, None)}},
            world_size=3,
        ),
        "draft": PublishedKVInfo(info={0: {"draft": KVSequenceInfo(1, None, [7, 8])}}),
    }
    assert {envelope_version(v) for v in new.published.values()} == {2}


def test_m0002_keeps_a_label_already_published_and_leaves_other_records_alone() -> None:
    codec = Codec()
    newer = codec.encode_kind(PublishedPositionInfo({"kv": 9}))
    old = partition_v1(
        {"per_label_seq_info": encode({"kv": {0: {"seq_len": 1}}, "other": {}})}, {"kv": newer}
    )
    new = m0002.upgrade(old)
    assert codec.decode_kind(new.published["kv"], PublishedInfo) == PublishedPositionInfo({"kv": 9})
    assert codec.decode_kind(new.published["other"], PublishedInfo) == PublishedKVInfo()

    conn = RawRecord(RecordKind.CONNECTION, 1, {"token_count": b"3"})
    assert m0002.upgrade(conn) == conn
    assert m0002.upgrade(partition_v1({})) == partition_v1({})


def test_m0002_refuses_a_garbled_field() -> None:
    with pytest.raises(ValueError, match="per_label_seq_info does not decode"):
        m0002.upgrade(partition_v1({"per_label_seq_info": b"\xc1garbage"}))


def test_m0003_turns_int_worker_graph_ids_into_str_fields() -> None:
    old = RawRecord(
        RecordKind.PARTITION,
        2,
        {
            "current_worker_graph_ids": encode([7, 9]),
            "completed_worker_graph_ids": encode([]),
            "wg_rank_completions": encode({7: 2, 9: 0}),
            "_reports[0:7]": b"1",
        },
    )
    new = m0003.upgrade(old)
    assert dict(new.fields) == {
        "current_worker_graph_ids[7]": b"1",
        "current_worker_graph_ids[9]": b"1",
        "wg_rank_completions[7]": b"2",
        "wg_rank_completions[9]": b"0",
        "_reports[0:7]": b"1",
    }


@pytest.mark.parametrize(
    "field", ["current_worker_graph_ids", "completed_worker_graph_ids", "wg_rank_completions"]
)
def test_m0003_refuses_a_garbled_field(field: str) -> None:
    old = RawRecord(RecordKind.PARTITION, 2, {field: encode(["not", "ints"])})
    with pytest.raises(ValueError, match=f"{field} does not decode"):
        m0003.upgrade(old)


def _seq(seq_len: int, transfer: Any = None, pages: list[int] | None = None) -> bytes:
    return encode(
        {"seq_len": seq_len, "latest_kv_transfer_info": transfer, "page_indices": pages or []}
    )


def test_m0004_splits_kv_and_position_infos_and_restamps_the_rest() -> None:
    kv = {
        "info": {
            0: {"kv": {"seq_len": 5, "latest_kv_transfer_info": ["h", 1], "page_indices": [3]}},
            1: {"kv": {"seq_len": 2}, "draft": {"page_indices": [7, 8]}},  # v3 defaults
            3: {},  # a rank held without labels
        },
        "world_size": 4,
    }
    big = {"info": {0: {"kv": {"seq_len": 1}}}, "world_size": 2**60}
    wide = {"info": {2**63: {"kv": {"seq_len": 1}}}, "world_size": 2}
    old = RawRecord(
        RecordKind.PARTITION,
        3,
        {"partition_name": b"p", "fwd_pass_number": b"2"},
        {
            "kv": encode((3, "kv", kv)),
            "pos": encode((3, "position", {"counters": {"a": 7, "b": -2}})),
            "empty": encode((3, "position", {"counters": {}})),
            "score": encode((3, "test.score", {"scores": {"x": 1.5}})),
            "big": encode((3, "kv", big)),
            "wide": encode((3, "kv", wide)),
            "far": encode((3, "position", {"counters": {"a": 1, "b": -(2**53)}})),
        },
    )

    new = m0004.upgrade(old)

    assert new.fields == old.fields
    assert dict(new.published) == {
        "kv": encode((4, "kv", None)),
        "kv[world_size]": b"4",
        "kv[0]": b"",
        "kv[0:kv]": _seq(5, ["h", 1], [3]),
        "kv[1]": b"",
        "kv[1:kv]": _seq(2),
        "kv[1:draft]": _seq(0, None, [7, 8]),
        "kv[3]": b"",
        "pos": encode((4, "position", None)),
        "pos[a]": b"7",
        "pos[b]": b"-2",
        "empty": encode((4, "position", None)),
        "score": encode((4, "test.score", {"scores": {"x": 1.5}})),
        "big": encode((4, "kv", big)),  # world_size beyond 2**53: kept whole
        "wide": encode((4, "kv", wide)),  # a rank beyond int64: kept whole
        "far": encode((4, "position", {"counters": {"a": 1, "b": -(2**53)}})),
    }
    # Read today through the next step; the other labels hold numbers outside today's
    # domains (negative, or beyond what Lua compares), which read as corrupt now.
    current = {k.encode(): v for k, v in m0005.upgrade(new).published.items()}
    decoded = PublishLayout(Codec(s.user_registry())).decode(current, ["kv"])
    assert decoded["kv"] == PublishedKVInfo(
        info={
            0: {"kv": KVSequenceInfo(5, ["h", 1], [3])},
            1: {"kv": KVSequenceInfo(2, None), "draft": KVSequenceInfo(0, None, [7, 8])},
            3: {},
        },
        world_size=4,
    )
    for label in ("pos", "big", "wide", "far"):
        with pytest.raises(CorruptRecordError, match=r"outside its domain|Expected `int`"):
            PublishLayout(Codec(s.user_registry())).decode(current, [label])


@pytest.mark.parametrize("step", [m0004, m0005], ids=["m0004", "m0005"])
def test_the_published_steps_only_restamp_the_other_records(step: Any) -> None:
    old = step.VERSION - 1
    config = encode((old, "sampling", {"seed": 7}))
    meta = RawRecord(RecordKind.META, old, {"resource_configs[s]": config, "seed": b"7"})
    assert step.upgrade(meta).fields == {
        "resource_configs[s]": encode((step.VERSION, "sampling", {"seed": 7})),
        "seed": b"7",
    }
    conn = RawRecord(RecordKind.CONNECTION, old, {"token_count": b"3"})
    assert step.upgrade(conn) == conn


@pytest.mark.parametrize(
    ("published", "why"),
    [
        ({"kv": encode((3, "kv", {"info": {"zero": {}}}))}, "'kv' does not decode"),
        ({"pos": encode((3, "position", [1]))}, "'pos' does not decode"),
        ({"x": b"\xc1"}, "'x' does not decode"),
        ({"a[b]": encode((3, "position", {}))}, "'a[b]' holds '['"),
    ],
)
def test_m0004_refuses_what_it_cannot_read_or_store(published: dict[str, bytes], why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        m0004.upgrade(RawRecord(RecordKind.PARTITION, 3, {}, published))


@s.CODEC_SETTINGS
@given(label=s.labels, info=s.flat_user_infos)
def test_m0004_writes_exactly_what_the_store_writes_today(label: str, info: PublishedInfo) -> None:
    """The step's frozen decoders and encoder agree byte for byte with today's codec."""
    codec = Codec(s.user_registry())
    v3 = stamp_envelope(_v4_encoding(codec, info), 3)

    new = migrations.upgrade(RawRecord(RecordKind.PARTITION, 3, {}, {label: v3}))

    assert dict(new.published) == PublishLayout(codec).encode(label, info)


def _v4_encoding(codec: Codec, info: PublishedInfo) -> bytes:
    """``info`` as the codec of v3 and v4 wrote it: a KV sequence was a map of its fields."""
    data = codec.encode_kind(info)
    if not isinstance(info, PublishedKVInfo):
        return data
    version, kind, _ = msgspec.msgpack.decode(data)
    return encode((version, kind, msgspec.to_builtins(info)))


def test_m0005_stores_kv_sequences_as_arrays_and_restamps_the_rest() -> None:
    whole = {"info": {0: {"kv": {"seq_len": 3}}}, "world_size": 2}  # v3 defaults, kept whole
    old = RawRecord(
        RecordKind.PARTITION,
        4,
        {"partition_name": b"p"},
        {
            "kv": encode((4, "kv", None)),
            "kv[world_size]": b"4",
            "kv[0]": b"",
            "kv[0:kv]": _seq(5, {"host": "h"}, [3, 70000]),
            "kv[0:a:b]": _seq(0),
            "pos": encode((4, "position", None)),
            "pos[0:x]": b"7",  # a position counter named like a kv part stays as it is
            "big": encode((4, "kv", whole)),
            "score": encode((4, "test.score", {"scores": {"x": 1.5}})),
        },
    )

    new = m0005.upgrade(old)

    assert new.fields == old.fields
    assert dict(new.published) == {
        "kv": encode((5, "kv", None)),
        "kv[world_size]": b"4",
        "kv[0]": b"",
        "kv[0:kv]": encode([5, {"host": "h"}, encode([3, 70000])]),
        "kv[0:a:b]": encode([0, None, encode([])]),
        "pos": encode((5, "position", None)),
        "pos[0:x]": b"7",
        "big": encode((5, "kv", {"info": {0: {"kv": [3, None, encode([])]}}, "world_size": 2})),
        "score": encode((5, "test.score", {"scores": {"x": 1.5}})),
    }
    decoded = PublishLayout(Codec(s.user_registry())).decode(
        {k.encode(): v for k, v in new.published.items()}
    )
    assert decoded["kv"] == PublishedKVInfo(
        {0: {"kv": KVSequenceInfo(5, {"host": "h"}, [3, 70000]), "a:b": KVSequenceInfo(0, None)}},
        world_size=4,
    )
    assert decoded["big"] == PublishedKVInfo({0: {"kv": KVSequenceInfo(3, None)}}, world_size=2)


@pytest.mark.parametrize(
    ("published", "why"),
    [
        ({"kv": encode((4, "kv", None)), "kv[0:c]": b"\xc1"}, "'kv[0:c]' does not decode"),
        ({"kv": encode((4, "kv", None)), "kv[0:c]": encode([1])}, "'kv[0:c]' does not decode"),
        ({"kv": encode((4, "kv", {"info": {"r": {}}}))}, "'kv' does not decode"),
        ({"x": b"\xc1"}, "'x' does not decode"),
    ],
)
def test_m0005_refuses_what_it_cannot_read(published: dict[str, bytes], why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        m0005.upgrade(RawRecord(RecordKind.PARTITION, 4, {}, published))


def test_the_registry_is_ordered_and_ends_at_the_schema_version() -> None:
    assert [s.version for s in migrations.STEPS] == list(range(2, SCHEMA_VERSION + 1))
    assert migrations.LATEST_VERSION == SCHEMA_VERSION
    for step in migrations.STEPS:
        assert re.fullmatch(r"m\d{4}_\w+", step.name) and int(step.name[1:5]) == step.version
        assert step.summary.startswith(f"v{step.version - 1} -> v{step.version}:")


def test_upgrade_applies_the_steps_after_the_records_version_only() -> None:
    old = partition_v1({"per_label_seq_info": encode({}), "current_worker_graph_ids": encode([4])})
    to_v2 = migrations.upgrade(old, 2)
    assert to_v2.version == 2 and "current_worker_graph_ids" in to_v2.fields
    assert migrations.upgrade(to_v2) == migrations.upgrade(old)
    assert migrations.upgrade(old).fields["current_worker_graph_ids[4]"] == b"1"
    with pytest.raises(ValueError, match="cannot upgrade a v3 record to v2"):
        migrations.upgrade(dataclasses.replace(old, version=3), 2)


# -- the frozen fixtures ------------------------------------------------------------------


def _upgraded_hashes(version: int) -> fixtures.Hashes:
    old = fixtures.hashes(version)
    kinds = {"meta": RecordKind.META, "part": RecordKind.PARTITION, "conn": RecordKind.CONNECTION}
    out: fixtures.Hashes = {}
    for suffix, raw in old.items():
        kind = kinds.get(suffix.split(":")[0])
        if kind is None:
            continue  # a publish-info hash travels with its partition
        pub = old.get(suffix.replace("part:", "pub:")) if kind is RecordKind.PARTITION else None
        fields, published = to_hashes(upgrade_record(from_hashes(kind, raw, pub)))
        out[suffix] = fields
        if kind is RecordKind.PARTITION:
            out[suffix.replace("part:", "pub:")] = published
    return out


def test_the_newest_fixture_is_the_current_version() -> None:
    assert LATEST == SCHEMA_VERSION
    assert fixtures.hashes(LATEST)["meta"][b"_v"] == str(SCHEMA_VERSION).encode()


@pytest.mark.parametrize("version", OLD)
def test_old_fixtures_upgrade_to_exactly_the_newest_fixture(version: int) -> None:
    assert _upgraded_hashes(version) == fixtures.hashes(LATEST)


def test_the_newest_fixture_is_what_the_code_writes() -> None:
    """Each frozen field must be encoded the same today; fields added since need defaults."""
    codec = Codec()
    published = PublishLayout(codec)
    state = fixtures.expected_state()
    frozen = fixtures.hashes(LATEST)
    written: fixtures.Hashes = {
        "meta": RecordLayout(RequestRecord, codec).encode(state.record),
        "conn:llm->codec": RecordLayout(type(state.connections["llm->codec"]), codec).encode(
            state.connections["llm->codec"]
        ),
    }
    layout = RecordLayout(PartitionState, codec, exclude=("resource_publish_info",))
    for name, part in state.partitions.items():
        written[f"part:{name}"] = layout.encode(part)
        written[f"pub:{name}"] = {
            field: value
            for label, info in part.resource_publish_info.items()
            for field, value in published.encode(label, info).items()
        }
    for suffix, fields in frozen.items():
        mine = {k: v for k, v in fields.items() if not k.startswith((b"_op", b"_reports"))}
        now = {k.encode(): v for k, v in written[suffix].items()}
        assert {k: now.get(k) for k in mine} == mine, suffix
        if suffix.startswith("pub:"):  # the store adds no fields of its own there
            assert now == fields, suffix


def _envelopes(held: fixtures.Hashes) -> list[bytes]:
    """The top-level envelopes: resource configs, and each label's whole info or header."""
    envelopes = [v for k, v in held["meta"].items() if k.startswith(b"resource_configs[")]
    for suffix, fields in held.items():
        if suffix.startswith("pub:"):
            envelopes += [v for k, v in fields.items() if b"[" not in k]  # not a v4 part
    return envelopes


@pytest.mark.parametrize("version", fixtures.VERSIONS)
def test_every_envelope_carries_its_records_version(version: int) -> None:
    held = _envelopes(fixtures.hashes(version))
    assert held and {envelope_version(e) for e in held} == {version}
    upgraded = _envelopes(_upgraded_hashes(version))
    assert len(upgraded) == 2 and {envelope_version(e) for e in upgraded} == {SCHEMA_VERSION}


# -- lazy upgrade on read -----------------------------------------------------------------


@pytest.mark.parametrize("version", fixtures.VERSIONS)
def test_reads_return_current_objects_from_records_of_any_version(
    client: redis.Redis, namespace: str, version: int
) -> None:
    store_fixture(client, namespace, {"r1": version})
    store = RequestStore(client, namespace=namespace)
    expected = fixtures.expected_state("r1")

    assert store.load_request("r1") == expected
    assert store.load_record("r1") == expected.record
    assert store.load_partition("r1", "llm") == expected.partitions["llm"]
    assert store.load_partition("r1", "codec") == expected.partitions["codec"]
    assert store.load_connection("r1", "llm->codec") == expected.connections["llm->codec"]
    # A read never writes: the records are still as they were stored.
    assert versions_held(client, namespace, "r1") == [str(version).encode()] * 4


# -- upgrade before a write ---------------------------------------------------------------


def _report(store: RequestStore, expected: RequestState) -> None:
    outcome = store.record_worker_report(
        "r1", "llm", fwd_pass=3, worker_graph_id="9", rank=1, num_ranks=2
    )
    assert outcome.applied and outcome.worker_graph_complete and outcome.pass_complete
    llm = expected.partitions["llm"]
    llm.wg_rank_completions["9"] = 2
    llm.completed_worker_graph_ids.add("9")


def _tokens(store: RequestStore, expected: RequestState) -> None:
    assert store.add_tokens("r1", "llm->codec", 5) == 17
    expected.connections["llm->codec"].token_count = 17


def _consumed(store: RequestStore, expected: RequestState) -> None:
    assert store.raise_consumed_count("r1", "llm->codec", 10) == 10
    expected.connections["llm->codec"].consumed_count = 10


def _advance(store: RequestStore, expected: RequestState) -> None:
    metadata = CurrentForwardConductorMetadata("decode", False)
    assert store.advance_partition("r1", "llm", from_pass=3, metadata=metadata) == 4
    expected.partitions["llm"] = dataclasses.replace(
        expected.partitions["llm"],
        metadata=metadata,
        fwd_pass_number=4,
        random_seed=1238,
        completed_worker_graph_ids=set(),
        current_worker_graph_ids=set(),
        wg_rank_completions={},
        curr_forward_outputs=[],
    )


def _merge(store: RequestStore, expected: RequestState) -> None:
    shard = PublishedKVInfo(info={2: {"kv_cache": KVSequenceInfo(12, None)}}, world_size=3)
    merged = store.merge_publish_info("r1", "llm", {"kv_cache": shard})
    info = expected.partitions["llm"].resource_publish_info["kv_cache"]
    info.update(shard)
    assert merged == {"kv_cache": info}


def _update(store: RequestStore, expected: RequestState) -> None:
    store.update_partition("r1", "codec", is_done=True, curr_forward_outputs=["a"])
    expected.partitions["codec"].is_done = True
    expected.partitions["codec"].curr_forward_outputs = ["a"]


def _final_output(store: RequestStore, expected: RequestState) -> None:
    store.set_final_output("r1", "audio", [1, 2])
    expected.record.final_outputs["audio"] = [1, 2]


WRITES: dict[str, tuple[Callable[[RequestStore, RequestState], None], list[int]]] = {
    # name: (the write, which of record_keys() it must leave at the current version)
    "report": (_report, [1]),  # a report without tokens touches no connection
    "add_tokens": (_tokens, [3]),
    "raise_consumed_count": (_consumed, [3]),
    "advance": (_advance, [1, 3]),
    "merge": (_merge, [1]),
    "update_partition": (_update, [2]),
    "set_final_output": (_final_output, [0]),
}


@pytest.mark.parametrize("version", OLD)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_on_an_old_record_upgrades_it_first(
    client: redis.Redis, namespace: str, version: int, write: str
) -> None:
    store_fixture(client, namespace, {"r1": version})
    store = RequestStore(client, namespace=namespace)
    expected = fixtures.expected_state("r1")
    apply, touched = WRITES[write]

    apply(store, expected)

    held = versions_held(client, namespace, "r1")
    current = str(SCHEMA_VERSION).encode()
    assert [held[i] for i in touched] == [current] * len(touched)
    assert store.load_request("r1") == expected
    for i in set(range(4)) - set(touched):  # records the write did not touch stay as they were
        assert held[i] == str(version).encode()


def test_a_record_newer_than_the_code_is_refused_and_left_alone(
    client: redis.Redis, namespace: str
) -> None:
    store_fixture(client, namespace, {"r1": LATEST})
    part, conn = record_keys(namespace, "r1")[1], record_keys(namespace, "r1")[3]
    newer = str(SCHEMA_VERSION + 1)
    client.hset(part, "_v", newer)
    client.hset(conn, "_v", newer)
    before = snapshot(client, namespace)
    store = RequestStore(client, namespace=namespace)

    attempts: list[Callable[[], Any]] = [
        lambda: store.load_partition("r1", "llm"),
        lambda: store.load_request("r1"),
        lambda: store.load_connection("r1", "llm->codec"),
        lambda: store.add_tokens("r1", "llm->codec", 1),
        lambda: store.merge_publish_info("r1", "llm", {"x": PublishedPositionInfo({"a": 1})}),
        lambda: store.update_partition("r1", "llm", is_done=True),
    ]
    for attempt in attempts:
        with pytest.raises(SchemaVersionError) as caught:
            attempt()
        assert (caught.value.found, caught.value.known) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
        assert f"schema version {newer}, newer than {SCHEMA_VERSION}" in str(caught.value)
        assert caught.value.key in (part, conn)
    assert snapshot(client, namespace) == before


@pytest.mark.parametrize("garbled", [b"", b"x", b"03", b"0", b"-1"])
def test_a_garbled_version_is_a_corrupt_record(
    client: redis.Redis, namespace: str, garbled: bytes
) -> None:
    store_fixture(client, namespace, {"r1": 1})
    part = record_keys(namespace, "r1")[1]
    client.hset(part, "_v", garbled)
    store = RequestStore(client, namespace=namespace)
    for attempt in (
        lambda: store.load_partition("r1", "llm"),
        lambda: store.advance_partition(
            "r1", "llm", from_pass=3, metadata=CurrentForwardConductorMetadata("d", False)
        ),
    ):
        with pytest.raises(CorruptRecordError) as caught:
            attempt()
        assert not isinstance(caught.value, SchemaVersionError)
        assert caught.value.key == part and caught.value.field == "_v"
    assert client.hget(part, "_v") == garbled


# -- the migration runner ---------------------------------------------------------------


def _mixed(n: int) -> dict[str, int]:
    return {f"r{i:05d}": fixtures.VERSIONS[i % len(fixtures.VERSIONS)] for i in range(n)}


def test_migrate_upgrades_every_record_and_a_second_run_changes_nothing(
    client: redis.Redis, namespace: str
) -> None:
    requests = _mixed(30)
    store_fixture(client, namespace, requests)
    old = sum(RECORDS_PER_REQUEST for v in requests.values() if v < SCHEMA_VERSION)
    calls: list[tuple[int, int]] = []

    report = migrate_namespace(
        client, namespace, batch=7, progress=lambda done, total, _: calls.append((done, total))
    )

    assert (report.requests, report.seen, report.upgraded, report.failed) == (30, 120, old, [])
    assert report.current == 120 - old and report.unindexed == []
    assert calls == [(7, 30), (14, 30), (21, 30), (28, 30), (30, 30)]
    store = RequestStore(client, namespace=namespace)
    for rid in requests:
        assert versions_held(client, namespace, rid) == [str(SCHEMA_VERSION).encode()] * 4
        assert store.load_request(rid) == fixtures.expected_state(rid)
    before = snapshot(client, namespace)

    again = migrate_namespace(client, namespace, batch=7)

    assert (again.seen, again.upgraded, again.current, again.failed) == (120, 0, 120, [])
    assert snapshot(client, namespace) == before


def test_dry_run_reports_what_would_change_and_changes_nothing(
    client: redis.Redis, namespace: str
) -> None:
    requests = _mixed(12)
    store_fixture(client, namespace, requests)
    client.hset(record_keys(namespace, "r00000")[1], "per_label_seq_info", b"\xc1")
    before = snapshot(client, namespace)

    report = migrate_namespace(client, namespace, dry_run=True)

    current = RECORDS_PER_REQUEST * sum(v == SCHEMA_VERSION for v in requests.values())
    assert snapshot(client, namespace) == before
    assert report.dry_run and report.seen == 48 and report.current == current
    assert report.upgraded == 48 - current - 1
    assert [key for key, _ in report.failed] == [record_keys(namespace, "r00000")[1]]


class _Stop(Exception):
    pass


def test_an_interrupted_migration_resumes_where_it_stopped(
    client: redis.Redis, namespace: str
) -> None:
    requests = {f"r{i:03d}": 1 for i in range(50)}
    store_fixture(client, namespace, requests)
    batches = 0

    def stop_after_two(done: int, total: int, report: MigrationReport) -> None:
        nonlocal batches
        batches += 1
        if batches == 2:
            raise _Stop

    with pytest.raises(_Stop):
        migrate_namespace(client, namespace, batch=10, progress=stop_after_two)
    held = [versions_held(client, namespace, rid) for rid in requests]
    current = [str(SCHEMA_VERSION).encode()] * 4
    assert sum(h == current for h in held) == 20
    assert sum(h == [b"1"] * 4 for h in held) == 30  # no request is left half upgraded

    resumed = migrate_namespace(client, namespace, batch=10)

    assert (resumed.seen, resumed.upgraded, resumed.current) == (200, 120, 80)
    assert all(versions_held(client, namespace, rid) == current for rid in requests)


def test_bad_records_are_reported_by_key_and_skipped(client: redis.Redis, namespace: str) -> None:
    requests = {f"r{i}": 1 for i in range(6)}
    store_fixture(client, namespace, requests)
    keys = KeySpace(namespace)
    bad = {
        keys.partition("r1", "llm"): ("per_label_seq_info", b"\xc1", "does not decode"),
        keys.connection("r2", "llm->codec"): ("_v", b"x", "is not a number"),
        keys.partition("r3", "codec"): ("_v", str(SCHEMA_VERSION + 1).encode(), "newer than"),
        keys.meta("r4"): ("partitions", b"two", "cannot read the request's topology"),
    }
    for key, (field, value, _) in bad.items():
        client.hset(key, field, value)

    report = migrate_namespace(client, namespace, batch=2)

    assert {key: why for key, why in report.failed}.keys() == bad.keys()
    for key, why in report.failed:
        assert bad[key][2] in why
    assert report.seen == 24 - 3  # r4's partitions and connection cannot be found
    assert report.upgraded == report.seen - 4
    for rid in ("r0", "r5"):
        assert versions_held(client, namespace, rid) == [str(SCHEMA_VERSION).encode()] * 4
    assert client.hget(keys.partition("r1", "llm"), "_v") == b"1"


def test_requests_missing_from_the_index_are_found_and_named(
    client: redis.Redis, namespace: str
) -> None:
    store_fixture(client, namespace, {"indexed": 1, "stray": 2})
    keys = KeySpace(namespace)
    client.zrem(keys.index, "stray")

    report = migrate_namespace(client, namespace)

    assert report.unindexed == ["stray"] and report.requests == 2 and report.upgraded == 8
    assert versions_held(client, namespace, "stray") == [str(SCHEMA_VERSION).encode()] * 4


# -- live migration of a large keyspace ----------------------------------------------------

N_REQUESTS = 2500  # x 4 records = 10,000 records
WRITERS = 2
WRITTEN_BY = 5  # writer k works on the requests with index % WRITTEN_BY == k


def _writer(url: str, namespace: str, k: int, ready: Any, go: Any) -> None:
    """Report worker-graph ranks and add tokens on its own share of the requests."""
    client = backends.connect(url)
    store = RequestStore(client, namespace=namespace)
    ready.set()
    go.wait(60)
    for i in range(k, N_REQUESTS, WRITTEN_BY):
        rid = f"r{i:05d}"
        outcome = store.record_worker_report(
            rid, "llm", fwd_pass=3, worker_graph_id="9", rank=1, num_ranks=2
        )
        assert outcome.applied and outcome.pass_complete
        store.add_tokens(rid, "llm->codec", 2, op_id=f"{rid}-a")
        store.add_tokens(rid, "llm->codec", 3, op_id=f"{rid}-b")
    client.close()


@pytest.mark.real
@pytest.mark.slow
def test_migrate_10k_records_while_conductors_write(
    real_client: redis.Redis, namespace: str
) -> None:
    requests = _mixed(N_REQUESTS)
    store_fixture(real_client, namespace, requests)
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(WRITERS)]
    go = ctx.Event()
    url = redis_url_for_tests()
    procs = [
        ctx.Process(target=_writer, args=(url, namespace, k, ready[k], go)) for k in range(WRITERS)
    ]
    for p in procs:
        p.start()
    try:
        for event in ready:
            assert event.wait(60)
        go.set()
        report = migrate_namespace(real_client, namespace, batch=500)
    finally:
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS

    assert report.failed == [] and report.requests == N_REQUESTS
    assert report.seen == RECORDS_PER_REQUEST * N_REQUESTS
    assert report.upgraded + report.current == report.seen
    # Writers upgraded some old records themselves; the runner upgraded all the others.
    old = sum(RECORDS_PER_REQUEST for v in requests.values() if v < SCHEMA_VERSION)
    assert report.upgraded <= old
    store = RequestStore(real_client, namespace=namespace)
    current = [str(SCHEMA_VERSION).encode()] * 4
    pipe = real_client.pipeline(transaction=False)
    for rid in requests:
        for key in record_keys(namespace, rid):
            pipe.hget(key, "_v")
    assert set(pipe.execute()) == {current[0]}
    for i, rid in enumerate(requests):
        expected = fixtures.expected_state(rid)
        if i % WRITTEN_BY < WRITERS:
            _report_applied(expected)
            expected.connections["llm->codec"].token_count += 5
        assert store.load_request(rid) == expected, rid
    again = migrate_namespace(real_client, namespace, batch=500)
    assert (again.upgraded, again.current) == (0, RECORDS_PER_REQUEST * N_REQUESTS)


def _report_applied(expected: RequestState) -> None:
    llm = expected.partitions["llm"]
    llm.wg_rank_completions["9"] = 2
    llm.completed_worker_graph_ids.add("9")


@pytest.mark.cluster
def test_lazy_upgrade_and_migrate_on_a_cluster(tmp_cluster: Any, namespace: str) -> None:
    client = tmp_cluster.client()
    try:
        requests = _mixed(30)
        store_fixture(client, namespace, requests)
        store = RequestStore(client, namespace=namespace)
        assert store.load_request("r00000") == fixtures.expected_state("r00000")
        assert store.add_tokens("r00001", "llm->codec", 1) == 13  # a v2 connection

        report = migrate_namespace(client, namespace, batch=8)

        old = sum(RECORDS_PER_REQUEST for v in requests.values() if v < SCHEMA_VERSION)
        assert (report.seen, report.upgraded, report.failed) == (120, old - 1, [])
        for rid in requests:
            assert versions_held(client, namespace, rid) == [str(SCHEMA_VERSION).encode()] * 4
    finally:
        client.close()
