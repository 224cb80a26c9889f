"""Stored KV sequences: page indices decoded when read, and the lazy value is the real thing.

A reader gets ``LazyKVSequenceInfo`` objects; whatever a caller does with one (compare, print,
copy, pickle, encode with msgspec, replace a field, write it back) must give what the
``KVSequenceInfo`` it stands for gives, and damage must surface as ``CorruptRecordError``
naming where it was stored, whenever the indices are first read.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import given

from store import Codec, CorruptRecordError, ValidationError
from store.codec.kv import LazyKVSequenceInfo, decode_sequence, encode_sequence
from store.codec.published import PublishLayout
from store.schema import SCHEMA_VERSION
from store.types import KVSequenceInfo, PublishedInfo, PublishedKVInfo
from tests import strategies as s

WHERE: dict[str, str | None] = {"request_id": "r1", "key": "ns:{r1}:pub:llm", "field": "kv"}
TRANSFER = {"host": "10.0.3.17", "port": 18515}


def stored(seq: KVSequenceInfo) -> LazyKVSequenceInfo:
    return decode_sequence(encode_sequence(seq), WHERE)


def test_page_indices_are_decoded_only_when_read() -> None:
    lazy = stored(KVSequenceInfo(7, TRANSFER, [3, 1, 2]))

    assert "page_indices" not in vars(lazy)
    assert (lazy.seq_len, lazy.latest_kv_transfer_info) == (7, TRANSFER)
    assert "page_indices" not in vars(lazy)
    assert lazy.page_indices == [3, 1, 2]
    assert type(lazy.page_indices) is list
    assert lazy.page_indices is lazy.page_indices  # decoded once, then an ordinary attribute


@pytest.mark.parametrize("touched", [False, True], ids=["untouched", "read"])
def test_a_lazy_sequence_behaves_as_the_real_one(touched: bool) -> None:
    real = KVSequenceInfo(7, TRANSFER, [3, 1, 2])
    lazy = stored(real)
    if touched:
        assert lazy.page_indices == [3, 1, 2]

    assert isinstance(lazy, KVSequenceInfo)
    assert lazy == real and real == lazy
    assert not lazy != real  # noqa: SIM202 - __ne__ too
    assert lazy != KVSequenceInfo(7, TRANSFER, [3, 1]) and lazy != "other"
    assert repr(lazy) == repr(real)
    assert msgspec.to_builtins(lazy) == msgspec.to_builtins(real)
    assert msgspec.msgpack.encode(lazy) == msgspec.msgpack.encode(real)
    assert msgspec.json.encode(lazy) == msgspec.json.encode(real)
    assert dataclasses.asdict(lazy) == dataclasses.asdict(real)
    assert dataclasses.astuple(lazy) == dataclasses.astuple(real)
    for twin in (copy.copy(lazy), copy.deepcopy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert type(twin) is KVSequenceInfo and twin == real
    assert copy.deepcopy(lazy).page_indices is not lazy.page_indices
    replaced = dataclasses.replace(lazy, seq_len=8)
    assert replaced == KVSequenceInfo(8, TRANSFER, [3, 1, 2])
    assert encode_sequence(lazy) == encode_sequence(real)
    with pytest.raises(TypeError, match="unhashable"):
        hash(lazy)


def test_a_lazy_sequence_changed_by_its_caller_is_written_as_changed() -> None:
    lazy = stored(KVSequenceInfo(7, None, [3]))
    lazy.page_indices.append(4)
    lazy.seq_len = 9
    assert stored(lazy) == KVSequenceInfo(9, None, [3, 4])

    replaced = stored(KVSequenceInfo(7, None, [3]))
    replaced.page_indices = [5]
    assert stored(replaced) == KVSequenceInfo(7, None, [5])


def test_an_untouched_lazy_sequence_is_written_back_from_its_stored_bytes() -> None:
    data = encode_sequence(KVSequenceInfo(7, None, list(range(1000))))
    lazy = decode_sequence(data, WHERE)
    assert encode_sequence(lazy) == data
    assert "page_indices" not in vars(lazy)


@pytest.mark.parametrize(
    "pages",
    [msgspec.msgpack.encode(["x"]), msgspec.msgpack.encode([1.5]), b"\x92\x01"],
    ids=["str index", "float index", "truncated"],
)
def test_damaged_page_indices_raise_where_they_were_stored_when_read(pages: bytes) -> None:
    lazy = decode_sequence(msgspec.msgpack.encode([7, None, pages]), WHERE)
    assert lazy.seq_len == 7

    for _ in range(2):  # still damaged the second time: nothing half-decoded is kept
        with pytest.raises(CorruptRecordError, match="page indices do not decode") as caught:
            _ = lazy.page_indices
        assert (caught.value.request_id, caught.value.key, caught.value.field) == (
            "r1",
            WHERE["key"],
            "kv",
        )
    with pytest.raises(CorruptRecordError):
        msgspec.to_builtins(lazy)
    with pytest.raises(CorruptRecordError):
        _ = lazy == KVSequenceInfo(7, None)


def test_a_partition_read_back_through_the_layout_reads_its_pages_lazily() -> None:
    layout = PublishLayout(Codec())
    info = PublishedKVInfo({0: {"a": KVSequenceInfo(1, None, [9, 8])}}, world_size=1)
    fields = {k.encode(): v for k, v in layout.encode("kv", info).items()}

    back = layout.decode(fields, request_id="r1", key="k")["kv"]

    assert type(back) is PublishedKVInfo  # the kind itself is never a stand-in
    assert isinstance(back, PublishedKVInfo)
    seq = back.info[0]["a"]  # type: ignore[attr-defined]
    assert type(seq) is LazyKVSequenceInfo and "page_indices" not in vars(seq)
    assert back == info
    # Merging it with the domain's own update keeps it equal to the eager result.
    eager = copy.deepcopy(info)
    update = PublishedKVInfo({1: {"a": KVSequenceInfo(2, None)}}, world_size=2)
    back.update(update)
    eager.update(update)
    assert back == eager


@s.CODEC_SETTINGS
@given(info=s.kv_info)
def test_kv_infos_round_trip_through_both_paths(info: PublishedKVInfo) -> None:
    codec = Codec()
    whole = codec.decode_kind(codec.encode_kind(info), PublishedInfo)
    fields = {k.encode(): v for k, v in PublishLayout(codec).encode("kv", info).items()}
    parts = PublishLayout(codec).decode(fields)["kv"]
    for back in (whole, parts):
        assert back == info
        assert msgspec.to_builtins(back) == msgspec.to_builtins(info)
        assert pickle.loads(pickle.dumps(back)) == info


def test_v4_map_form_reads_the_same() -> None:
    """Sequences nested in envelopes written before v5 keep the map form."""
    old = msgspec.msgpack.encode(
        {"seq_len": 7, "latest_kv_transfer_info": TRANSFER, "page_indices": [3, 1]}
    )
    assert decode_sequence(old, WHERE) == KVSequenceInfo(7, TRANSFER, [3, 1])
    assert decode_sequence(msgspec.Raw(old), WHERE) == KVSequenceInfo(7, TRANSFER, [3, 1])


@pytest.mark.parametrize(
    ("seq", "error", "message"),
    [
        (KVSequenceInfo(-1, None), ValidationError, "seq_len must be an int >= 0 and < 2\\*\\*63"),
        (KVSequenceInfo(True, None), ValidationError, "seq_len must be an int"),
        (KVSequenceInfo(1, None, (1, 2)), TypeError, "page_indices must be a list"),
        ("seq", TypeError, "expected KVSequenceInfo"),
        (KVSequenceInfo(1, None, [2**64]), OverflowError, "serialize ints"),
    ],
    ids=["negative seq_len", "bool seq_len", "tuple pages", "not a sequence", "huge index"],
)
def test_what_cannot_be_read_back_is_not_written(seq: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        encode_sequence(seq)


def test_a_deeply_nested_transfer_info_is_refused_both_ways() -> None:
    deep: Any = None
    for _ in range(70):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        encode_sequence(KVSequenceInfo(1, deep))
    data = msgspec.msgpack.encode([1, deep, msgspec.msgpack.encode([])])
    with pytest.raises(CorruptRecordError, match="nested deeper than 64 levels"):
        decode_sequence(data, WHERE)
    shallow: Any = None
    for _ in range(60):
        shallow = {"k": shallow}
    assert stored(KVSequenceInfo(1, shallow)).latest_kv_transfer_info == shallow


# -- a whole PublishedKVInfo: one pass for what v5 writes, sequence by sequence otherwise -----


def _stored_info(codec: Codec, sequences: dict[str, bytes]) -> bytes:
    """A KV info's envelope holding these stored sequences for rank 0, as a store holds it."""
    payload = msgspec.msgpack.encode(
        {"info": {0: {k: msgspec.Raw(v) for k, v in sequences.items()}}, "world_size": 1}
    )
    name = codec.registry.name_of(PublishedKVInfo)
    return msgspec.msgpack.encode((SCHEMA_VERSION, name, msgspec.Raw(payload)))


def test_a_whole_kv_info_reads_every_form_its_sequences_may_have() -> None:
    """An envelope written before v5 holds map-form sequences, and a long transfer info is
    checked for depth on its own: either sends the read down the per-sequence path, which
    must give what the one-pass read gives."""
    codec = Codec()
    long_transfer: Any = "x"
    for _ in range(60):
        long_transfer = {"key": long_transfer}
    sequences = {
        "v5": KVSequenceInfo(7, TRANSFER, [3, 1]),
        "long": KVSequenceInfo(8, long_transfer, [4]),
        "v4": KVSequenceInfo(9, TRANSFER, [5, 6]),
    }
    stored_forms = {k: encode_sequence(v) for k, v in sequences.items()}
    stored_forms["v4"] = msgspec.msgpack.encode(
        {"seq_len": 9, "latest_kv_transfer_info": TRANSFER, "page_indices": [5, 6]}
    )
    expected = PublishedKVInfo({0: sequences}, world_size=1)
    for subset in (["v5"], ["v5", "long"], ["v5", "v4"], list(sequences)):
        data = _stored_info(codec, {k: stored_forms[k] for k in subset})
        back = codec.decode_kind(data, PublishedInfo)
        assert back == PublishedKVInfo({0: {k: sequences[k] for k in subset}}, world_size=1)
        assert all(type(seq) is LazyKVSequenceInfo for seq in back.info[0].values())
    assert codec.decode_kind(codec.encode_kind(expected), PublishedInfo) == expected


@pytest.mark.parametrize(
    ("damaged", "message"),
    [
        (msgspec.msgpack.encode([1, None, b"\x01"]), "page indices are not an array"),
        (msgspec.msgpack.encode([1, None, b""]), "page indices are not an array"),
        (msgspec.msgpack.encode([-1, None, b"\x90"]), "does not decode as KVSequenceInfo"),
        (msgspec.msgpack.encode([1, None]), "does not decode as KVSequenceInfo"),
        (msgspec.msgpack.encode(5), "not an array or a map"),
        (b"\x93\x01\xa2\xff\xfe\xc4\x01\x90", "does not decode as KVSequenceInfo"),
        ("deep", "nested deeper than 64 levels"),
    ],
    ids=["pages not an array", "pages empty", "negative seq_len", "short", "an int",
         "transfer not UTF-8", "deep transfer"],
)  # fmt: skip
def test_damage_in_a_whole_kv_info_is_found_on_read_and_named(
    damaged: bytes | str, message: str
) -> None:
    codec = Codec()
    if damaged == "deep":
        deep: Any = None
        for _ in range(70):
            deep = [deep]
        damaged = msgspec.msgpack.encode([1, deep, b"\x90"])
    assert isinstance(damaged, bytes)
    good = encode_sequence(KVSequenceInfo(7, TRANSFER, [3, 1]))
    data = _stored_info(codec, {"good": good, "damaged": damaged})

    with pytest.raises(CorruptRecordError, match=message) as caught:
        codec.decode_kind(data, PublishedInfo, request_id="r1", key="k", field="kv")
    assert (caught.value.request_id, caught.value.key, caught.value.field) == ("r1", "k", "kv")
