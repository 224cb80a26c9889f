"""Published infos split into parts (store/published.py) and merged by the server.

The server-side merge must give exactly what the domain's ``merge_publish_info`` gives, on
every backend; whatever it cannot merge (another kind under the label, numbers Lua cannot
compare exactly) falls back to the optimistic path and still merges correctly.
"""

from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Codec, CorruptRecordError, KindRegistry, RequestStore, ValidationError
from store.schema import SCHEMA_VERSION
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    merge_publish_info,
)
from tests.stores import Stores
from tests.strategies import STORE_SETTINGS, ScoreInfo, user_registry

PREFILL = CurrentForwardConductorMetadata("prefill", True)
EXACT = 2**53 - 1  # the largest number the server compares exactly
encode = msgspec.msgpack.encode


@dataclass
class TagInfo(PublishedInfo):
    """A user kind that, like the built-in ones, merges only with its own kind."""

    tags: list[str] = field(default_factory=list)

    def update(self, other: PublishedInfo) -> None:
        if not isinstance(other, TagInfo):
            raise TypeError(f"cannot fold {type(other).__name__} into TagInfo")
        self.tags += other.tags


@pytest.fixture
def store(client: redis.Redis, namespace: str, make_store: Stores) -> RequestStore:
    registry = user_registry()
    registry.register(TagInfo, "test.tag")
    return make_store(client, namespace=namespace, codec=Codec(registry))  # type: ignore[no-any-return]


def create(store: RequestStore, infos: dict[str, PublishedInfo] | None = None) -> str:
    rid = f"r-{uuid.uuid4().hex[:8]}"
    partition = PartitionState("p", PREFILL, resource_publish_info=infos or {})
    store.create_request(rid, partitions={"p": partition}, max_output_tokens=1)
    return rid


def raw_published(store: RequestStore, rid: str) -> dict[bytes, bytes]:
    held: dict[bytes, bytes] = store.client.hgetall(store.keys.publish_info(rid, "p"))
    return held


def header(kind: str) -> bytes:
    return encode([SCHEMA_VERSION, kind, None])


def seq(seq_len: int, transfer: Any = None, pages: list[int] | None = None) -> KVSequenceInfo:
    return KVSequenceInfo(seq_len, transfer, pages or [])


# -- (a) the server path folds exactly like the domain ------------------------------------

KV_LABELS = ("kv", "draft kv")
POSITION_LABELS = ("pos", "pos:2")
CACHE_LABELS = ("kv", "a:b", "x]", "", "ü")
big = st.integers(0, EXACT)
transfer_infos = (
    st.none()
    | st.fixed_dictionaries({"host": st.text(max_size=4), "port": st.integers(0, 65535)})
    | st.lists(st.integers(0, 9), max_size=2)
)

kv_infos = st.builds(
    PublishedKVInfo,
    info=st.dictionaries(
        # Mostly the same few ranks and cache labels, so merges overwrite each other.
        st.sampled_from((0, 1, 2, 2**63 - 1)),
        st.dictionaries(
            st.just("kv") | st.sampled_from(CACHE_LABELS),
            st.builds(
                KVSequenceInfo,
                seq_len=st.integers(0, 2**40),
                latest_kv_transfer_info=transfer_infos,
                page_indices=st.lists(st.integers(0, 2**31), max_size=3),
            ),
            max_size=2,
        ),
        max_size=3,
    ),
    world_size=st.integers(1, 16) | big,
)
position_infos = st.builds(
    PublishedPositionInfo,
    st.dictionaries(st.sampled_from(("a", "b", "c:d", "")), st.integers(0, 20) | big, max_size=3),
)
# One to four labels, KV among them: a KV merge sent again is the one that could undo a newer one.
merges = st.tuples(
    st.dictionaries(st.sampled_from(KV_LABELS), kv_infos, min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(POSITION_LABELS), position_infos, max_size=2),
).map(lambda parts: {**parts[0], **parts[1]})


@dataclass
class Merge:
    op_id: str
    other: dict[str, PublishedInfo]


@st.composite
def merge_sequences(draw: st.DrawFn) -> list[Merge]:
    """Merges with fresh op ids, some of them sent again (a retry after a lost reply)."""
    sequence: list[Merge] = []
    for i in range(draw(st.integers(1, 10))):
        if sequence and draw(st.booleans()):
            sequence.append(draw(st.sampled_from(sequence)))
        else:
            sequence.append(Merge(f"op{i}", draw(merges)))
    return sequence


@settings(STORE_SETTINGS, max_examples=40)
@given(sequence=merge_sequences())
def test_server_merges_fold_like_the_domain(store: RequestStore, sequence: list[Merge]) -> None:
    rid = create(store)
    expected: dict[str, PublishedInfo] = {}
    applied: set[str] = set()
    before = (store.stats.server_merges, store.stats.transactions)
    try:
        for merge in sequence:
            returned = store.merge_publish_info(rid, "p", merge.other, op_id=merge.op_id)
            if merge.op_id not in applied:
                applied.add(merge.op_id)
                merge_publish_info(expected, copy.deepcopy(merge.other))
            assert returned == {label: expected[label] for label in merge.other}
            assert store.load_partition(rid, "p").resource_publish_info == expected
        # Every merge ran in the script, none as an optimistic transaction.
        after = (store.stats.server_merges, store.stats.transactions)
        assert after == (before[0] + len(sequence), before[1])
    finally:
        store.delete_request(rid)


def test_a_merge_sent_again_after_a_newer_one_changes_nothing(store: RequestStore) -> None:
    rid = create(store)
    first = {"kv": PublishedKVInfo({0: {"kv": seq(1)}}), "pos": PublishedPositionInfo({"a": 1})}
    newer = {"kv": PublishedKVInfo({0: {"kv": seq(2)}}), "pos": PublishedPositionInfo({"a": 2})}
    store.merge_publish_info(rid, "p", first, op_id="first")
    store.merge_publish_info(rid, "p", newer, op_id="newer")

    assert store.merge_publish_info(rid, "p", first, op_id="first") == newer
    assert store.load_partition(rid, "p").resource_publish_info == newer


# -- (b) another kind under the label ------------------------------------------------------


@pytest.mark.parametrize(
    "held",
    [TagInfo(["x"]), PublishedPositionInfo({"a": 1})],
    ids=["user kind", "position"],
)
def test_a_kv_info_merged_into_another_kind_is_refused_naming_the_label(
    store: RequestStore, held: PublishedInfo
) -> None:
    rid = create(store)
    store.merge_publish_info(rid, "p", {"shared": held})
    before = raw_published(store, rid)

    with pytest.raises(ValidationError) as caught:
        store.merge_publish_info(rid, "p", {"shared": PublishedKVInfo({0: {"kv": seq(1)}})})

    assert caught.value.field == "shared" and "field 'shared'" in str(caught.value)
    assert caught.value.key == store.keys.publish_info(rid, "p")
    assert "cannot merge" in str(caught.value)
    assert raw_published(store, rid) == before


# -- (c) numbers outside their domains --------------------------------------------------


@pytest.mark.parametrize(
    ("info", "why"),
    [
        (PublishedKVInfo(world_size=2**53), "kv world_size must be an int >= 0 and < 2**53"),
        (PublishedKVInfo(world_size=-1), "kv world_size must be an int >= 0"),
        (PublishedKVInfo({-1: {}}), "kv rank must be an int >= 0 and < 2**63"),
        (PublishedKVInfo({2**63: {}}), "kv rank must be an int >= 0 and < 2**63"),
        (PublishedKVInfo({0: {"kv": seq(-1)}}), "seq_len must be an int >= 0"),
        (PublishedPositionInfo({"a": 2**53}), "position 'a' must be an int >= 0 and < 2**53"),
        (PublishedPositionInfo({"a": -1}), "position 'a' must be an int >= 0"),
    ],
    ids=["huge world", "negative world", "negative rank", "rank beyond int64", "negative seq_len",
         "huge position", "negative position"],
)  # fmt: skip
def test_numbers_outside_their_domains_are_refused_before_any_write(
    store: RequestStore, info: PublishedInfo, why: str
) -> None:
    """Lua compares world sizes and positions exactly only below 2**53, and none of these
    is negative: such a number is refused rather than stored where a script misreads it."""
    rid = create(store, {"held": PublishedPositionInfo({"a": 1})})
    before = raw_published(store, rid)
    for write in (
        lambda: store.merge_publish_info(rid, "p", {"x": info}),
        lambda: create(store, {"x": info}),
    ):
        with pytest.raises(ValidationError, match=re.escape(why)) as caught:
            write()
        assert caught.value.field == "x"
    assert raw_published(store, rid) == before


def test_a_kv_info_held_whole_is_read_and_merged_into_parts(store: RequestStore) -> None:
    """Older code kept some KV infos whole; they still read and merge, then sit in parts."""
    rid = create(store)
    held = PublishedKVInfo({0: {"kv": seq(1, None, [4])}}, world_size=2)
    store.client.hset(store.keys.publish_info(rid, "p"), "kv", store.codec.encode_kind(held))
    assert store.load_partition(rid, "p").resource_publish_info == {"kv": held}

    merged = store.merge_publish_info(rid, "p", {"kv": PublishedKVInfo({1: {"kv": seq(2)}})})

    expected = PublishedKVInfo({0: {"kv": seq(1, None, [4])}, 1: {"kv": seq(2)}}, world_size=2)
    assert merged == {"kv": expected}
    assert store.load_partition(rid, "p").resource_publish_info == {"kv": expected}
    assert raw_published(store, rid)[b"kv"] == header("kv")


@pytest.mark.parametrize(
    "held",
    [
        PublishedKVInfo({0: {}}, world_size=2**60),
        PublishedKVInfo({-5: {}}),
        PublishedPositionInfo({"a": -(2**60)}),
    ],
    ids=["huge world size", "negative rank", "negative position"],
)
def test_a_whole_info_outside_its_domains_is_corrupt(
    store: RequestStore, held: PublishedInfo
) -> None:
    """What older code kept whole because Lua could not compare it reads as damage now."""
    rid = create(store)
    pub = store.keys.publish_info(rid, "p")
    whole = msgspec.msgpack.encode(
        (SCHEMA_VERSION, store.codec.registry.name_of(type(held)), msgspec.to_builtins(held))
    )
    store.client.hset(pub, "x", whole)
    expected = r"Expected `int` (>= 0|<= 9007199254740991)"
    with pytest.raises(CorruptRecordError, match=expected) as caught:
        store.load_partition(rid, "p")
    assert (caught.value.key, caught.value.field) == (pub, "x")


@pytest.mark.parametrize(
    "info",
    [
        PublishedKVInfo(world_size="2"),
        PublishedKVInfo({True: {}}),
        PublishedPositionInfo({"a": 1.5}),
    ],
    ids=["str world_size", "bool rank", "float counter"],
)
def test_ill_typed_numbers_are_refused_before_any_write(
    store: RequestStore, info: PublishedInfo
) -> None:
    rid = create(store)
    with pytest.raises(ValidationError) as caught:
        store.merge_publish_info(rid, "p", {"x": info})
    assert caught.value.field == "x"
    assert raw_published(store, rid) == {}


# -- (d) the layout ------------------------------------------------------------------------


def test_kv_and_position_infos_are_written_in_parts(store: RequestStore) -> None:
    infos: dict[str, PublishedInfo] = {
        "kv": PublishedKVInfo({0: {"c": seq(3, None, [1])}, 1: {}}, world_size=2),
        "pos": PublishedPositionInfo({"a": 5, "b:c": 0}),
    }
    layout = {
        b"kv": header("kv"),
        b"kv[world_size]": b"2",
        b"kv[0]": b"",
        b"kv[0:c]": b"\x93\x03\xc0\xc4\x02\x91\x01",  # [seq_len, transfer, bin([1])]
        b"kv[1]": b"",
        b"pos": header("position"),
        b"pos[a]": b"5",
        b"pos[b:c]": b"0",
    }
    assert header("kv") == b"\x93" + bytes([SCHEMA_VERSION]) + b"\xa2kv\xc0"

    created = create(store, infos)
    merged = create(store)
    store.merge_publish_info(merged, "p", infos)

    assert raw_published(store, created) == layout
    assert raw_published(store, merged) == layout
    assert store.load_partition(merged, "p").resource_publish_info == infos


@pytest.mark.parametrize("label", ["a[b", "[", "a[0]", "_x", "_"])
def test_labels_that_would_read_as_parts_are_refused(store: RequestStore, label: str) -> None:
    rid = create(store)
    for attempt in (
        lambda: store.merge_publish_info(rid, "p", {label: PublishedPositionInfo({"a": 1})}),
        lambda: store.merge_publish_info(rid, "p", {label: ScoreInfo()}),
        lambda: create(store, {label: PublishedPositionInfo()}),
    ):
        with pytest.raises(ValidationError, match=r"without '\[' and not starting with '_'"):
            attempt()
    assert raw_published(store, rid) == {}


# -- (e) corrupt parts -----------------------------------------------------------------------


KV = {"kv": header("kv"), "kv[world_size]": b"2"}
POS = {"pos": header("position")}
DEEP_TRANSFER: Any = []
for _ in range(70):
    DEEP_TRANSFER = [DEEP_TRANSFER]


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"kv[0]": b"", "kv[world_size]": b"2"}, "kv", "parts without their header"),
        ({**KV, "kv[x]": b""}, "kv", "kv rank: b'x' is not a decimal integer"),
        ({**KV, "kv[-1]": b""}, "kv", "stored kv rank -1 is outside its domain"),
        ({**KV, "kv[01]": b""}, "kv", "b'01' is not a decimal integer"),
        ({**KV, "kv[0]": b"x"}, "kv", "kv rank 0 marker holds b'x'"),
        ({"kv": header("kv"), "kv[0]": b""}, "kv", "kv parts without their world_size"),
        ({"kv": header("kv"), "kv[world_size]": b"2.5"}, "kv", "b'2.5' is not a decimal"),
        ({"kv": header("kv"), "kv[world_size]": str(2**53).encode()}, "kv", "outside its domain"),
        ({"kv": header("kv"), "kv[world_size]": b"1" * 25}, "kv", "is not a decimal integer"),
        ({**KV, "kv[0:c]": b"\xc1"}, "kv", "KVSequenceInfo is not an array or a map"),
        ({**KV, "kv[0:c]": encode({})}, "kv", "missing required field `seq_len`"),
        ({**KV, "kv[0:c]": encode([1, None])}, "kv", "KVSequenceInfo"),
        ({**KV, "kv[0:c]": encode([-1, None, b"\x90"])}, "kv", "Expected `int` >= 0"),
        ({**KV, "kv[0:c]": encode([1, None, [1]])}, "kv", "Expected `bytes`, got `array`"),
        ({**KV, "kv[0:c]": encode([1, None, b"\xa1x"])}, "kv", "page indices are not an array"),
        ({**KV, "kv[0:c]": encode([1, None, b""])}, "kv", "page indices are not an array"),
        ({**KV, "kv[0:c]": encode({"seq_len": 1})}, "kv", "missing required field"),
        ({**KV, "kv[0:c]": encode([1, DEEP_TRANSFER, b"\x90"])}, "kv", "nested deeper than 64"),
        ({**POS, "pos[a]": b"x"}, "pos", "b'x' is not a decimal integer"),
        ({**POS, "pos[a]": b"-1"}, "pos", "stored position 'a' -1 is outside its domain"),
        ({**POS, "pos[a]": b"-0"}, "pos", "is not a decimal integer"),
        ({"kv": header("kv"), "kv[0": b""}, "kv[0", "malformed publish-info field name"),
        (
            {"x": Codec().encode_kind(PublishedPositionInfo({"a": 1})), "x[a]": b"1"},
            "x",
            "a whole publish info with parts beside it",
        ),
        ({b"k\xff": header("kv")}, "k\\xff", "publish-info field name is not UTF-8"),
    ],
)
def test_corrupt_parts_are_reported_by_key_and_field(
    store: RequestStore, client: redis.Redis, fields: dict[str, bytes], field: str, why: str
) -> None:
    rid = create(store)
    key = store.keys.publish_info(rid, "p")
    client.hset(key, mapping=fields)

    for read in (lambda: store.load_partition(rid, "p"), lambda: store.load_request(rid)):
        with pytest.raises(CorruptRecordError) as caught:
            read()
        assert (caught.value.key, caught.value.field) == (key, field)
        assert why in str(caught.value)


def test_returning_false_gives_an_empty_mapping_on_both_merge_paths(
    client: redis.Redis, namespace: str
) -> None:
    store = RequestStore(client, namespace=namespace, codec=Codec(_ret_registry()))
    store.create_request(
        "r", partitions={"p": PartitionState("p", CurrentForwardConductorMetadata("w", True))},
        max_output_tokens=1,
    )  # fmt: skip
    server = {"pos": PublishedPositionInfo({"a": 1})}
    optimistic = {"pos": PublishedPositionInfo({"a": 2}), "n": _Count(3)}
    assert store.merge_publish_info("r", "p", server, returning=False) == {}
    assert store.merge_publish_info("r", "p", optimistic, returning=False) == {}
    held = store.load_partition("r", "p").resource_publish_info
    assert held == {"pos": PublishedPositionInfo({"a": 2}), "n": _Count(3)}


@dataclass
class _Count(PublishedInfo):
    n: int = 0

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, _Count)
        self.n += other.n


def _ret_registry() -> KindRegistry:
    registry = KindRegistry()
    registry.register(PublishedPositionInfo, "position")
    registry.register(_Count, "count")
    return registry
