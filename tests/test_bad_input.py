"""Bad input, in arguments and in Redis: every case raises a typed error that says where.

Stored data is written here with redis-py directly, as a buggy or hostile writer would.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fakeredis
import msgspec
import pytest
import redis

from store import (
    Codec,
    ConfigurationError,
    CorruptRecordError,
    PayloadTooLargeError,
    Reconnect,
    RequestStore,
    SchemaVersionError,
    StoreConnectionError,
    StoreError,
    UnknownKindError,
    UnknownStoredKindError,
    ValidationError,
)
from store.schema import SCHEMA_VERSION, VERSION_FIELD
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    PublishedInfo,
    PublishedPositionInfo,
    ResourceReqConfig,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests.servers import free_port, no_retry
from tests.stores import Stores

MD = CurrentForwardConductorMetadata("walk", True)
CONN = "llm->codec"
RID = "r1"
NEWER = SCHEMA_VERSION + 1
# 100000 nested one-element arrays around a nil: deeper than any recursion limit.
DEEP = b"\x91" * 100_000 + b"\xc0"


@dataclass
class UnregisteredInfo(PublishedInfo):
    n: int = 0

    def update(self, other: PublishedInfo) -> None:
        pass


@dataclass
class UnregisteredConfig(ResourceReqConfig):
    n: int = 0


def create(store: RequestStore, **partition_changes: Any) -> None:
    state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
    for name, value in partition_changes.items():
        setattr(state, name, value)
    store.create_request(
        RID,
        partitions={"llm": state, "codec": PartitionState("codec", MD)},
        connections={CONN: StreamingConnectionState("llm", "codec", "e")},
        max_output_tokens=10,
        resource_configs={"s": SamplingReqConfig()},
    )


@pytest.fixture
def store(client: redis.Redis, namespace: str, make_store: Stores) -> RequestStore:
    return make_store(client, namespace=namespace)  # type: ignore[no-any-return]


def keys_of(client: redis.Redis, namespace: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{namespace}:*"))


def assert_where(error: StoreError, key: str | None, field: str | None) -> None:
    assert error.request_id == RID
    assert error.key == key
    assert error.field == field
    assert f"request '{RID}'" in str(error)
    if key is not None:
        assert f"key '{key}'" in str(error)
    if field is not None:
        assert f"field '{field}'" in str(error)


def envelope(version: int, kind: str, payload: Any) -> bytes:
    return msgspec.msgpack.encode([version, kind, payload])


# -- invalid ids and names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rid", "message"),
    [
        ("", "request id is empty"),
        ("a b", "without spaces"),
        ("{r}", "'{' or '}'"),
        ("x" * 201, "over the limit"),
        (7, "must be a str, not int"),
    ],
)
def test_invalid_request_id(
    store: RequestStore, client: redis.Redis, namespace: str, rid: Any, message: str
) -> None:
    for call in (
        lambda: store.create_request(
            rid, partitions={"p": PartitionState("p", MD)}, max_output_tokens=1
        ),
        lambda: store.load_request(rid),
        lambda: store.delete_request(rid),
        lambda: store.add_tokens(rid, CONN, 1),
    ):
        with pytest.raises(ValidationError, match=message):
            call()
    assert keys_of(client, namespace) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "partition name is empty"),
        ("a->b", "no '->'"),
        ("a b", "may hold only"),
        ("{p}", "may hold only"),
        ("p" * 129, "over the limit"),
        (None, "must be a str, not NoneType"),
    ],
)
def test_invalid_partition_name(
    store: RequestStore, client: redis.Redis, namespace: str, name: Any, message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        store.create_request(RID, partitions={name: PartitionState(name, MD)}, max_output_tokens=1)
    assert info.value.request_id == RID
    with pytest.raises(ValidationError, match=message):
        store.load_partition(RID, name)
    with pytest.raises(ValidationError, match=message):
        store.merge_publish_info(RID, name, {"p": PublishedPositionInfo()})
    assert keys_of(client, namespace) == []


@pytest.mark.parametrize(
    ("connections", "message"),
    [
        (
            {"llm": StreamingConnectionState("llm", "codec", "e")},
            "'<from_partition>-><to_partition>'",
        ),
        ({"llm->tts": StreamingConnectionState("llm", "tts", "e")}, "names partition 'tts'"),
        ({CONN: StreamingConnectionState("codec", "llm", "e")}, "joins 'codec->llm'"),
        ({CONN: {"from_partition": "llm"}}, "must be a StreamingConnectionState"),
    ],
)
def test_invalid_topology(
    store: RequestStore, client: redis.Redis, namespace: str, connections: Any, message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        store.create_request(
            RID,
            partitions={"llm": PartitionState("llm", MD), "codec": PartitionState("codec", MD)},
            connections=connections,
            max_output_tokens=1,
        )
    assert info.value.request_id == RID
    assert keys_of(client, namespace) == []


def test_partition_named_otherwise_than_its_key(store: RequestStore) -> None:
    with pytest.raises(ValidationError, match="stored as 'llm' is named 'tts'") as info:
        store.create_request(
            RID, partitions={"llm": PartitionState("tts", MD)}, max_output_tokens=1
        )
    assert_where(info.value, None, "partition_name")


def test_request_without_partitions(store: RequestStore) -> None:
    with pytest.raises(ValidationError, match="at least one partition"):
        store.create_request(RID, partitions={}, max_output_tokens=1)


@pytest.mark.parametrize("namespace_value", ["", "a b", "{x}", None])
def test_invalid_namespace(client: redis.Redis, namespace_value: Any) -> None:
    with pytest.raises(ValidationError, match="namespace"):
        RequestStore(client, namespace=namespace_value)


# -- arguments of the wrong type ---------------------------------------------------------------


def report(store: RequestStore, **changes: Any) -> Any:
    args: dict[str, Any] = {
        "fwd_pass": 0, "worker_graph_id": "wg", "rank": 0, "num_ranks": 1,
    }  # fmt: skip
    args.update(changes)
    return store.record_worker_report(RID, "llm", **args)


BAD_ARGUMENTS: list[tuple[str, Callable[[RequestStore], Any], str]] = [
    ("fwd_pass str", lambda st: report(st, fwd_pass="0"), "fwd_pass must be an int >= 0.*got '0'"),
    ("fwd_pass float", lambda st: report(st, fwd_pass=0.0), "fwd_pass must be an int"),
    ("fwd_pass bool", lambda st: report(st, fwd_pass=False), "fwd_pass must be an int"),
    ("fwd_pass negative", lambda st: report(st, fwd_pass=-1), "fwd_pass must be an int >= 0"),
    ("fwd_pass None", lambda st: report(st, fwd_pass=None), "fwd_pass must be an int"),
    ("rank str", lambda st: report(st, rank="0"), "rank must be an int"),
    ("num_ranks zero", lambda st: report(st, num_ranks=0), "num_ranks must be an int >= 1"),
    ("rank too big", lambda st: report(st, rank=2, num_ranks=2), "rank 2 is outside"),
    ("new_tokens negative", lambda st: report(st, new_tokens=-1), "new_tokens must be an int"),
    ("worker graph empty", lambda st: report(st, worker_graph_id=""), "worker graph id"),
    ("worker graph int", lambda st: report(st, worker_graph_id=3), "worker graph id"),
    ("rank 1 tokens", lambda st: report(st, rank=1, num_ranks=2, new_tokens=1), "only the rank-0"),
    ("output names", lambda st: report(st, output_names=[1]), "output names must be str"),
    ("consumed unknown", lambda st: report(st, consumed={"x->llm": 1}), "not incoming"),
    (
        "consumed str",
        lambda st: st.record_worker_report(
            RID,
            "codec",
            fwd_pass=0,
            worker_graph_id="wg",
            rank=0,
            num_ranks=1,
            consumed={CONN: "1"},
        ),
        r"consumed\[llm->codec\] must be an int",
    ),
    ("add_tokens str", lambda st: st.add_tokens(RID, CONN, "1"), "count must be an int"),
    ("add_tokens neg", lambda st: st.add_tokens(RID, CONN, -1), "count must be an int >= 0"),
    ("raise neg", lambda st: st.raise_consumed_count(RID, CONN, -2), "count must be an int"),
    (
        "from_pass str",
        lambda st: st.advance_partition(RID, "llm", from_pass="0", metadata=MD),
        "from_pass must be an int",
    ),
    (
        "metadata dict",
        lambda st: st.advance_partition(RID, "llm", from_pass=0, metadata={"graph_walk": "w"}),
        "metadata must be a CurrentForwardConductorMetadata",
    ),
    (
        "worker graph ids of ints",
        lambda st: st.advance_partition(RID, "llm", from_pass=0, metadata=MD, worker_graph_ids=[1]),
        "keys and members must be str",
    ),
    (
        "label empty",
        lambda st: st.merge_publish_info(RID, "llm", {"": PublishedPositionInfo()}),
        "resource label",
    ),
    (
        "label int",
        lambda st: st.merge_publish_info(RID, "llm", {1: PublishedPositionInfo()}),
        "resource label",
    ),
    (
        "report label with '['",
        lambda st: report(st, published={"kv[0]": PublishedPositionInfo()}),
        "resource label",
    ),
    (
        "report label of the store's",
        lambda st: report(st, published={"_kv": PublishedPositionInfo({"a": 1})}),
        "resource label",
    ),
    (
        "update int field",
        lambda st: st.update_partition(RID, "llm", fwd_pass_number="2"),
        "expected int",
    ),
    (
        "update unknown",
        lambda st: st.update_partition(RID, "llm", nope=1),
        "no stored attribute 'nope'",
    ),
    ("final output name", lambda st: st.set_final_output(RID, "", 1), "output name"),
    (
        "connection name",
        lambda st: st.add_tokens(RID, "llm", 1),
        "'<from_partition>-><to_partition>'",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), [(c, m) for _, c, m in BAD_ARGUMENTS], ids=[i for i, _, _ in BAD_ARGUMENTS]
)
def test_bad_arguments_change_nothing(
    store: RequestStore, client: redis.Redis, namespace: str, call: Any, message: str
) -> None:
    create(store)
    before = {k: client.dump(k) for k in keys_of(client, namespace)}
    with pytest.raises(ValidationError, match=message) as info:
        call(store)
    assert info.value.request_id == RID
    assert {k: client.dump(k) for k in keys_of(client, namespace)} == before


def test_encoding_an_unsupported_value(store: RequestStore) -> None:
    create(store)
    with pytest.raises(StoreError, match="cannot encode") as info:
        store.set_final_output(RID, "out", object())
    assert_where(info.value, store.keys.meta(RID), "final_outputs")


# -- kinds -----------------------------------------------------------------------------------------


def test_unregistered_kind_on_create(
    store: RequestStore, client: redis.Redis, namespace: str
) -> None:
    with pytest.raises(UnknownKindError, match="UnregisteredInfo is not a registered kind") as info:
        create(store, resource_publish_info={"mine": UnregisteredInfo()})
    assert info.value.kind == f"{__name__}.UnregisteredInfo"
    assert_where(info.value, store.keys.publish_info(RID, "llm"), "mine")
    assert keys_of(client, namespace) == []


def test_unregistered_config_kind_on_create(
    store: RequestStore, client: redis.Redis, namespace: str
) -> None:
    with pytest.raises(UnknownKindError, match="UnregisteredConfig is not a registered") as info:
        store.create_request(
            RID,
            partitions={"llm": PartitionState("llm", MD)},
            max_output_tokens=1,
            resource_configs={"c": UnregisteredConfig()},
        )
    assert info.value.kind == f"{__name__}.UnregisteredConfig"
    assert_where(info.value, store.keys.meta(RID), "resource_configs")
    assert keys_of(client, namespace) == []


def test_unregistered_kind_on_merge(store: RequestStore) -> None:
    create(store)
    with pytest.raises(UnknownKindError, match="UnregisteredInfo") as info:
        store.merge_publish_info(
            RID, "llm", {"ok": PublishedPositionInfo({"a": 1}), "mine": UnregisteredInfo()}
        )
    assert_where(info.value, store.keys.publish_info(RID, "llm"), "mine")
    assert store.load_partition(RID, "llm").resource_publish_info == {}


def test_unknown_kind_on_read(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    pub = store.keys.publish_info(RID, "llm")
    client.hset(pub, "label", envelope(SCHEMA_VERSION, "nope", {"x": 1}))
    for call in (
        lambda: store.load_partition(RID, "llm"),
        lambda: store.load_request(RID),
        lambda: store.merge_publish_info(RID, "llm", {"label": PublishedPositionInfo()}),
    ):
        with pytest.raises(UnknownStoredKindError, match=r"kind 'nope'.*register_kind") as info:
            call()
        assert info.value.kind == "nope"
        assert isinstance(info.value, CorruptRecordError)
        assert_where(info.value, pub, "label")


def test_stored_kind_of_the_wrong_base(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    pub = store.keys.publish_info(RID, "llm")
    client.hset(pub, "label", envelope(SCHEMA_VERSION, "sampling", {}))
    with pytest.raises(CorruptRecordError, match="not a PublishedInfo") as info:
        store.load_partition(RID, "llm")
    assert_where(info.value, pub, "label")


# -- corrupt stored values ------------------------------------------------------------------------


def _valid_metadata() -> bytes:
    return Codec().encode(CurrentForwardConductorMetadata("walk", True, ["a"], ["b"], {"k": 1}))


def _deep_metadata() -> bytes:
    # {"graph_walk": "w", "is_prefill": true, "kwargs": {"k": <DEEP>}}
    return b"\x83\xaagraph_walk\xa1w\xaais_prefill\xc3\xa6kwargs\x81\xa1k" + DEEP


CORRUPT_PARTITION_FIELDS = [
    ("metadata", _valid_metadata()[:-3], "truncated"),
    ("metadata", b"\xc1\xc1\xc1", "garbage"),
    ("metadata", msgspec.msgpack.encode([1, 2]), "an array"),
    ("metadata", msgspec.msgpack.encode({"graph_walk": 5, "is_prefill": True}), "wrong field type"),
    ("metadata", _deep_metadata(), "deep"),
    ("fwd_pass_number", b"1e3", "not an int"),
    ("is_done", b"true", "not a flag"),
    ("curr_forward_outputs", b"2", "length without entries"),
]


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f, v, _ in CORRUPT_PARTITION_FIELDS],
    ids=[f"{f}-{why}" for f, _, why in CORRUPT_PARTITION_FIELDS],
)
def test_corrupt_partition_field(
    store: RequestStore, client: redis.Redis, field: str, value: bytes
) -> None:
    create(store)
    key = store.keys.partition(RID, "llm")
    client.hset(key, field, value)
    for call in (lambda: store.load_partition(RID, "llm"), lambda: store.load_request(RID)):
        with pytest.raises(CorruptRecordError) as info:
            call()
        assert type(info.value) is CorruptRecordError
        assert_where(info.value, key, field)


CORRUPT_PUB_VALUES = [
    (Codec().encode_kind(PublishedPositionInfo({"a": 1}))[:-2], "truncated"),
    (b"\xc1not msgpack", "garbage"),
    (msgspec.msgpack.encode("position"), "not an envelope"),
    (msgspec.msgpack.encode([SCHEMA_VERSION, "position"]), "short envelope"),
    (envelope(SCHEMA_VERSION, "position", [1, 2]), "payload of the wrong type"),
    (envelope(SCHEMA_VERSION, "position", {"counters": {"a": "x"}}), "wrong field type"),
    (envelope(SCHEMA_VERSION, "kv", {"info": {"zero": {}}}), "str rank"),
    (b"\x93\x01\xa8position" + DEEP, "deep"),
]


@pytest.mark.parametrize(
    "value", [v for v, _ in CORRUPT_PUB_VALUES], ids=[why for _, why in CORRUPT_PUB_VALUES]
)
def test_corrupt_publish_info(store: RequestStore, client: redis.Redis, value: bytes) -> None:
    create(store)
    pub = store.keys.publish_info(RID, "llm")
    client.hset(pub, "label", value)
    for call in (
        lambda: store.load_partition(RID, "llm"),
        lambda: store.merge_publish_info(RID, "llm", {"label": PublishedPositionInfo()}),
    ):
        with pytest.raises(CorruptRecordError) as info:
            call()
        assert type(info.value) is CorruptRecordError
        assert_where(info.value, pub, "label")
    assert client.hget(pub, "label") == value  # a failed merge wrote nothing


CORRUPT_META_FIELDS = [
    ("resource_configs[s]", b"\xc1", "resource_configs", "garbage config"),
    (
        "resource_configs[s]",
        envelope(SCHEMA_VERSION, "sampling", {"top_k": "x"}),
        "resource_configs",
        "wrong type",
    ),
    ("final_outputs[out]", DEEP, "final_outputs", "deep output"),
    ("final_outputs[out]", b"\x92\x01", "final_outputs", "truncated output"),
    ("max_output_tokens", b"ten", "max_output_tokens", "not an int"),
    (
        "partition_definitions[llm]",
        msgspec.msgpack.encode({"graph_walks": []}),
        "partition_definitions",
        "missing name",
    ),
]


@pytest.mark.parametrize(
    ("raw_field", "value", "field"),
    [(r, v, f) for r, v, f, _ in CORRUPT_META_FIELDS],
    ids=[why for *_, why in CORRUPT_META_FIELDS],
)
def test_corrupt_meta_field(
    store: RequestStore, client: redis.Redis, raw_field: str, value: bytes, field: str
) -> None:
    create(store)
    meta = store.keys.meta(RID)
    client.hset(meta, raw_field, value)
    with pytest.raises(CorruptRecordError) as info:
        store.load_record(RID)
    assert type(info.value) is CorruptRecordError
    assert_where(info.value, meta, field)
    fresh = RequestStore(client, namespace=store.keys.namespace)  # no cached topology
    with pytest.raises(CorruptRecordError):
        fresh.load_request(RID)


# -- what readers met in the issue: every reader ends in a typed error, at once ------------------

ISSUE_DAMAGE = [
    ("part:llm", "curr_forward_outputs", b"9" * 20, "curr_forward_outputs", "20-digit length"),
    ("part:llm", "curr_forward_outputs", b"1000000000", "curr_forward_outputs", "huge length"),
    ("meta", "partitions", str(2**53 - 1).encode(), "partitions", "huge partitions length"),
    ("part:llm", "fwd_pass_number", str(2**63).encode(), "fwd_pass_number", "int >= 2**63"),
    ("part:llm", "fwd_pass_number", b"-3", "fwd_pass_number", "negative pass"),
    ("part:llm", "fwd_pass_number", b"03", "fwd_pass_number", "non-canonical pass"),
    ("part:llm", "wg_rank_completions[wg]", b"-1", "wg_rank_completions", "negative counter"),
    ("conn:llm->codec", "consumed_count", str(2**53).encode(), "consumed_count", "huge count"),
    ("part:llm", "partition_name", b"\xff\xfe", "partition_name", "non-UTF-8 value"),
    ("part:llm", "current_worker_graph_ids[\xff]", b"1", "current_worker_graph_ids[\\xff]",
     "non-UTF-8 name"),
    ("part:llm", "partition_name", b"x" * (4 * 1024 * 1024 + 1), "partition_name", "5 MiB string"),
    ("pub:llm", "kv", envelope(SCHEMA_VERSION, "kv", None), "kv", "kv header without parts"),
    ("pub:llm", "label", b"\x93\x05\xa2kv\xdd\xff\xff\xff\xff", "label", "array of 4G items"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("suffix", "raw_field", "value", "field"),
    [(k, f, v, n) for k, f, v, n, _ in ISSUE_DAMAGE],
    ids=[why for *_, why in ISSUE_DAMAGE],
)
def test_damage_the_issue_met_is_a_typed_error_for_every_reader(
    store: RequestStore, client: redis.Redis, suffix: str, raw_field: str, value: bytes, field: str
) -> None:
    create(store)
    key = store.keys.request_prefix(RID) + suffix
    client.hset(key, raw_field.encode("latin-1"), value)
    reads: list[Callable[[], Any]] = [lambda: store.load_request(RID)]
    if suffix == "meta":
        reads.append(lambda: store.load_record(RID))
    elif suffix.startswith("conn:"):
        reads.append(lambda: store.load_connection(RID, CONN))
    else:
        reads.append(lambda: store.load_partition(RID, "llm"))
    too_large = len(value) > Codec().max_payload_bytes
    expected = PayloadTooLargeError if too_large else CorruptRecordError
    for read in reads:
        with pytest.raises(expected) as caught:
            read()
        assert (caught.value.request_id, caught.value.key, caught.value.field) == (RID, key, field)


def test_corrupt_connection_field(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    key = store.keys.connection(RID, CONN)
    client.hset(key, "token_count", b"lots")
    with pytest.raises(CorruptRecordError, match="token_count does not decode") as info:
        store.load_connection(RID, CONN)
    assert_where(info.value, key, "token_count")


def test_garbled_version_field(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    key = store.keys.partition(RID, "llm")
    client.hset(key, VERSION_FIELD, b"v1")
    with pytest.raises(CorruptRecordError, match="schema version b'v1' is not a number") as info:
        store.load_partition(RID, "llm")
    assert_where(info.value, key, VERSION_FIELD)


# -- newer schema versions ------------------------------------------------------------------------


def test_newer_record_version_on_read(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    part = store.keys.partition(RID, "llm")
    client.hset(part, VERSION_FIELD, str(NEWER))
    for call in (lambda: store.load_partition(RID, "llm"), lambda: store.load_request(RID)):
        with pytest.raises(SchemaVersionError, match="upgrade") as info:
            call()
        assert (info.value.found, info.value.known) == (NEWER, SCHEMA_VERSION)
        assert_where(info.value, part, None)


def test_newer_meta_version(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    client.hset(store.keys.meta(RID), VERSION_FIELD, str(NEWER))
    with pytest.raises(SchemaVersionError) as info:
        RequestStore(client, namespace=store.keys.namespace).load_request(RID)
    assert (info.value.found, info.value.known) == (NEWER, SCHEMA_VERSION)
    assert info.value.key == store.keys.meta(RID)


@pytest.mark.parametrize(
    "write",
    [
        lambda st: st.add_tokens(RID, CONN, 1),
        lambda st: st.raise_consumed_count(RID, CONN, 1),
        lambda st: st.set_producer_done(RID, CONN),
    ],
    ids=["add_tokens", "raise_consumed_count", "set_producer_done"],
)
def test_newer_record_version_refuses_writes(
    store: RequestStore, client: redis.Redis, write: Any
) -> None:
    create(store)
    key = store.keys.connection(RID, CONN)
    client.hset(key, VERSION_FIELD, str(NEWER))
    before = client.hgetall(key)
    with pytest.raises(SchemaVersionError) as info:
        write(store)
    assert (info.value.found, info.value.known) == (NEWER, SCHEMA_VERSION)
    assert_where(info.value, key, None)
    assert client.hgetall(key) == before


def test_newer_partition_version_refuses_report_and_advance(
    store: RequestStore, client: redis.Redis
) -> None:
    create(store)
    key = store.keys.partition(RID, "llm")
    client.hset(key, VERSION_FIELD, str(NEWER))
    before = client.hgetall(key)
    with pytest.raises(SchemaVersionError):
        report(store)
    with pytest.raises(SchemaVersionError):
        store.advance_partition(RID, "llm", from_pass=0, metadata=MD)
    with pytest.raises(SchemaVersionError):
        store.merge_publish_info(RID, "llm", {"p": PublishedPositionInfo()})
    assert client.hgetall(key) == before


def test_newer_envelope_version(store: RequestStore, client: redis.Redis) -> None:
    create(store)
    pub = store.keys.publish_info(RID, "llm")
    client.hset(pub, "label", envelope(NEWER, "position", {"counters": {}}))
    with pytest.raises(SchemaVersionError) as info:
        store.load_partition(RID, "llm")
    assert (info.value.found, info.value.known) == (NEWER, SCHEMA_VERSION)
    assert_where(info.value, pub, "label")


# -- size limits -----------------------------------------------------------------------------------


def test_payload_too_large_on_create(client: redis.Redis, namespace: str) -> None:
    small = RequestStore(client, namespace=namespace, codec=Codec(max_payload_bytes=200))
    big_md = CurrentForwardConductorMetadata("walk", True, kwargs={"prompt": "x" * 500})
    with pytest.raises(PayloadTooLargeError, match="over the limit of 200 bytes") as info:
        small.create_request(
            RID, partitions={"llm": PartitionState("llm", big_md)}, max_output_tokens=1
        )
    assert info.value.limit == 200
    assert info.value.size > 200
    assert_where(info.value, small.keys.partition(RID, "llm"), "metadata")
    assert keys_of(client, namespace) == []


def test_payload_too_large_on_merge(client: redis.Redis, namespace: str) -> None:
    small = RequestStore(client, namespace=namespace, codec=Codec(max_payload_bytes=200))
    create(small)
    big = PublishedPositionInfo({f"label-{i}": i for i in range(100)})
    with pytest.raises(PayloadTooLargeError) as info:
        small.merge_publish_info(RID, "llm", {"big": big})
    assert_where(info.value, small.keys.publish_info(RID, "llm"), "big")
    assert small.load_partition(RID, "llm").resource_publish_info == {}


def test_payload_too_large_on_update(client: redis.Redis, namespace: str) -> None:
    small = RequestStore(client, namespace=namespace, codec=Codec(max_payload_bytes=200))
    create(small)
    with pytest.raises(PayloadTooLargeError) as info:
        small.set_final_output(RID, "out", "y" * 300)
    assert_where(info.value, small.keys.meta(RID), "final_outputs")


@pytest.mark.parametrize(
    ("key_of", "field"),
    [
        (lambda st: st.keys.partition(RID, "llm"), "metadata"),
        (lambda st: st.keys.publish_info(RID, "llm"), "label"),
    ],
    ids=["partition field", "publish info"],
)
def test_payload_too_large_on_read(
    client: redis.Redis, namespace: str, key_of: Any, field: str
) -> None:
    writer = RequestStore(client, namespace=namespace)
    create(writer)
    key = key_of(writer)
    # Garbage: had it been decoded first, this would be a CorruptRecordError.
    client.hset(key, field, b"\xc1" * 1000)
    reader = RequestStore(client, namespace=namespace, codec=Codec(max_payload_bytes=500))
    with pytest.raises(PayloadTooLargeError) as info:
        reader.load_partition(RID, "llm")
    assert (info.value.size, info.value.limit) == (1000, 500)
    assert_where(info.value, key, field)


# -- clients --------------------------------------------------------------------------------------


def test_client_that_decodes_responses_is_refused(fake_server: fakeredis.FakeServer) -> None:
    for client in (
        fakeredis.FakeRedis(server=fake_server, decode_responses=True),
        redis.Redis(decode_responses=True),
    ):
        with pytest.raises(ConfigurationError, match="decode_responses=False"):
            RequestStore(client)
        client.close()
    with pytest.raises(ConfigurationError, match="decode_responses=False"):
        RequestStore.from_url("redis://127.0.0.1:1/0", decode_responses=True)


@pytest.mark.parametrize(
    ("option", "value"), [("dedupe_window", 0), ("dedupe_window", -1.0), ("lease_ttl", 0)]
)
def test_non_positive_windows_are_refused(client: redis.Redis, option: str, value: float) -> None:
    with pytest.raises(ConfigurationError, match="must be positive"):
        RequestStore(client, **{option: value})


def _closed_port() -> int:
    port = free_port()
    with socket.socket() as s:  # nothing listens there: connecting is refused at once
        assert s.connect_ex(("127.0.0.1", port)) != 0
    return port


BRIEF = Reconnect(give_up_after=0.3)  # a dead server on purpose: give up soon

UNREACHABLE_CALLS = [
    ("create", lambda st: create(st)),
    ("load_request", lambda st: st.load_request(RID)),
    ("list_requests", lambda st: st.list_requests()),
    ("add_tokens", lambda st: st.add_tokens(RID, CONN, 1)),
    ("merge", lambda st: st.merge_publish_info(RID, "llm", {"p": PublishedPositionInfo()})),
]


@pytest.mark.parametrize(
    "call", [c for _, c in UNREACHABLE_CALLS], ids=[i for i, _ in UNREACHABLE_CALLS]
)
def test_unreachable_redis(call: Any) -> None:
    client = redis.Redis(port=_closed_port(), socket_connect_timeout=0.2, retry=no_retry())
    store = RequestStore(client, namespace="t-unreachable", reconnect=BRIEF)
    with pytest.raises(StoreConnectionError, match="unreachable") as info:
        call(store)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    assert isinstance(info.value, ConnectionError)
    client.close()


def test_unreachable_redis_with_redis_py_default_retries() -> None:
    """redis-py retries connects on its own; the store still gives up, with its own error."""
    client = redis.Redis(port=_closed_port(), socket_connect_timeout=0.2)
    with pytest.raises(StoreConnectionError) as info:
        RequestStore(client, namespace="t-unreachable", reconnect=BRIEF).load_request(RID)
    assert info.value.request_id == RID
    client.close()
