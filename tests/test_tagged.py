"""Engine values inside plain data: tagged on write, their classes back on read, damage named."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

from store.codec import Codec
from store.codec.tagged import TUPLE_EXT, VALUE_EXT, register_value_kind, tag
from store.errors import ConfigurationError, CorruptRecordError
from store.types import KVLayout, MooncakeKVTransferInfo, NestedLoopIndices

LOOPS = NestedLoopIndices(["a"], {"a": 2}, 5)
MOONCAKE = MooncakeKVTransferInfo("e", "s", 7, KVLayout.NHD)


@pytest.mark.parametrize(
    "value",
    [
        {"t": (1, (2, "x")), "l": LOOPS, "m": [MOONCAKE, KVLayout.NHD]},
        [LOOPS, {"deep": {"er": (MOONCAKE,)}}],
        (),
    ],
    ids=repr,
)
def test_plain_data_keeps_the_engines_classes(value: Any) -> None:
    codec = Codec()
    back = codec.decode(codec.encode(value, Any), Any, key="k", field="f")
    assert back == value
    assert repr(back) == repr(value)  # tuples stay tuples, classes stay classes


def test_plain_data_without_engine_values_is_written_as_it_is() -> None:
    value = {"a": [1, 2.5, None, b"x", {"b": "c"}]}
    assert tag(value) is value
    assert Codec().encode(value, Any) == msgspec.msgpack.encode(value)


@pytest.mark.parametrize(
    ("ext", "message"),
    [
        (msgspec.msgpack.Ext(9, b"\x90"), "unknown msgpack extension 9"),
        (msgspec.msgpack.Ext(VALUE_EXT, msgspec.msgpack.encode(["nobody", {}])), "nobody"),
        (msgspec.msgpack.Ext(VALUE_EXT, msgspec.msgpack.encode(["loop_indices", {}])), "loop"),
        (msgspec.msgpack.Ext(VALUE_EXT, b"\xc1"), "tagged|decode|invalid|Expected"),
        (msgspec.msgpack.Ext(TUPLE_EXT, b"\x01"), "array|Expected"),
    ],
)
def test_a_damaged_tag_is_a_corrupt_record_naming_where(ext: Any, message: str) -> None:
    data = msgspec.msgpack.encode({"x": ext})
    with pytest.raises(CorruptRecordError, match=message) as caught:
        Codec().decode(data, dict[str, Any], request_id="r", key="k", field="final_outputs")
    assert (caught.value.request_id, caught.value.key, caught.value.field) == (
        "r",
        "k",
        "final_outputs",
    )


def test_a_tag_nested_too_deeply_is_refused_on_read() -> None:
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    payload = msgspec.msgpack.encode(deep)
    data = msgspec.msgpack.encode(msgspec.msgpack.Ext(TUPLE_EXT, payload))
    with pytest.raises(CorruptRecordError, match="deep"):
        Codec().decode(data, Any, key="k")


def test_a_value_kind_name_is_taken_once() -> None:
    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(ConfigurationError, match="taken"):
        register_value_kind(Other, "loop_indices")
    with pytest.raises(ConfigurationError, match="neither"):
        register_value_kind(int, "int")
