"""RecordLayout: dataclasses as hash fields, exactly as the layout table in store/layout.py says."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import Codec, CorruptRecordError, UnknownKindError, ValidationError
from store.codec.layout import RecordLayout
from store.records import RequestRecord
from store.schema import SCHEMA_VERSION, VERSION_FIELD
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests import strategies as s
from tests.strategies import CODEC_SETTINGS, BeamConfig, user_registry

CODEC = Codec(user_registry())
PARTITION = RecordLayout(PartitionState, CODEC, exclude=("resource_publish_info",))
CONNECTION = RecordLayout(StreamingConnectionState, CODEC)
RECORD = RecordLayout(RequestRecord, CODEC)
WHERE = {"request_id": "r1", "key": "ns:{r1}:part:llm"}
VERSION = str(SCHEMA_VERSION).encode()


def as_redis(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """Hash fields as HGETALL returns them."""
    return {k.encode(): v for k, v in fields.items()}


def partition(**changes: object) -> PartitionState:
    state = PartitionState("llm", CurrentForwardConductorMetadata("walk", True))
    for name, value in changes.items():
        setattr(state, name, value)
    return state


def test_partition_fields_exactly() -> None:
    state = partition(
        fwd_pass_number=3,
        random_seed=-7,
        is_done=True,
        completed_worker_graph_ids={"wg1"},
        current_worker_graph_ids={"wg1", "wg2"},
        wg_rank_completions={"wg1": 2},
        num_output_tokens=12,
        curr_forward_outputs=["text", "audio"],
    )
    fields = PARTITION.encode(state)
    metadata = fields.pop("metadata")
    assert CODEC.decode(metadata, CurrentForwardConductorMetadata) == state.metadata
    assert fields == {
        VERSION_FIELD: VERSION,
        "partition_name": b"llm",
        "fwd_pass_number": b"3",
        "random_seed": b"-7",
        "is_done": b"1",
        "completed_worker_graph_ids[wg1]": b"1",
        "current_worker_graph_ids[wg1]": b"1",
        "current_worker_graph_ids[wg2]": b"1",
        "wg_rank_completions[wg1]": b"2",
        "num_output_tokens": b"12",
        "curr_forward_outputs": b"2",
        "curr_forward_outputs[0]": b"text",
        "curr_forward_outputs[1]": b"audio",
    }


def test_connection_fields_exactly() -> None:
    conn = StreamingConnectionState("llm", "codec", "edge", 5, 2, False)
    assert CONNECTION.encode(conn) == {
        VERSION_FIELD: VERSION,
        "from_partition": b"llm",
        "to_partition": b"codec",
        "edge_name": b"edge",
        "token_count": b"5",
        "consumed_count": b"2",
        "producer_done": b"0",
    }


def test_empty_collections_write_no_entries_but_a_list_keeps_its_length() -> None:
    fields = PARTITION.encode(partition())
    assert not any("[" in name for name in fields)
    assert fields["curr_forward_outputs"] == b"0"


def test_polymorphic_map_values_are_envelopes() -> None:
    record = RequestRecord("r1", 10, 0, ["llm"], [], resource_configs={"s": SamplingReqConfig()})
    fields = RECORD.encode(record)
    assert (
        CODEC.decode_kind(fields["resource_configs[s]"], SamplingReqConfig) == SamplingReqConfig()
    )


def test_encode_field_names_only_that_attribute() -> None:
    assert PARTITION.encode_field("wg_rank_completions", {"a": 1, "b": 0}) == {
        "wg_rank_completions[a]": b"1",
        "wg_rank_completions[b]": b"0",
    }
    assert PARTITION.encode_field("is_done", False) == {"is_done": b"0"}


# -- round trips -------------------------------------------------------------------------------


@CODEC_SETTINGS
@given(s.partition_states())
def test_partition_roundtrip(state: PartitionState) -> None:
    infos = state.resource_publish_info
    back = PARTITION.decode(
        as_redis(PARTITION.encode(state)), extra={"resource_publish_info": infos}
    )
    assert back == state


@CODEC_SETTINGS
@given(s.connection_states())
def test_connection_roundtrip(conn: StreamingConnectionState) -> None:
    assert CONNECTION.decode(as_redis(CONNECTION.encode(conn))) == conn


request_records = st.builds(
    RequestRecord,
    request_id=s.text,
    max_output_tokens=s.lua_counts,
    seed=s.int64,
    partitions=st.lists(s.names, max_size=3),
    connections=st.lists(s.text, max_size=3),
    partition_definitions=st.dictionaries(s.text, s.partition_definitions, max_size=2),
    resource_configs=st.dictionaries(s.text, s.user_configs, max_size=3),
    final_outputs=s.json_dicts,
    created_at=s.times,
    finished_at=s.times,
)


@CODEC_SETTINGS
@given(request_records)
def test_request_record_roundtrip(record: RequestRecord) -> None:
    assert RECORD.decode(as_redis(RECORD.encode(record))) == record


def test_required_empty_list_roundtrips() -> None:
    # A request without streaming connections is the common single-partition case.
    record = RequestRecord("r1", 10, 0, ["default"], [])
    assert RECORD.decode(as_redis(RECORD.encode(record))) == record


def test_map_keys_and_members_may_hold_brackets() -> None:
    state = partition(current_worker_graph_ids={"a]b", "[x", ""}, wg_rank_completions={"]": 1})
    assert PARTITION.decode(as_redis(PARTITION.encode(state))) == state


def test_store_fields_are_not_attributes() -> None:
    raw = as_redis(PARTITION.encode(partition(fwd_pass_number=1)))
    raw[b"_reports[0:wg]"] = b"1"
    raw[b"_op"] = b"x"
    assert PARTITION.decode(raw) == partition(fwd_pass_number=1)


# -- encode errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("fwd_pass_number", "3", "expected int, got str"),
        ("fwd_pass_number", 1.0, "expected int, got float"),
        ("fwd_pass_number", True, "expected int, got bool"),
        ("fwd_pass_number", 2**63, "outside the 64-bit signed range"),
        ("num_output_tokens", -(2**63) - 1, "outside the 64-bit signed range"),
        ("is_done", 1, "expected bool, got int"),
        ("partition_name", b"llm", "expected str, got bytes"),
        ("current_worker_graph_ids", {1}, "keys and members must be str, got int"),
        ("wg_rank_completions", {"a": "1"}, "expected int, got str"),
        ("wg_rank_completions", {2: 1}, "keys and members must be str"),
        ("curr_forward_outputs", [None], "expected str, got NoneType"),
        ("wg_rank_completions", ["a"], "has no attribute 'items'"),
    ],
)
def test_encode_rejects_wrong_types_naming_the_field(
    attribute: str, value: object, message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        PARTITION.encode_field(attribute, value, **WHERE)
    assert (info.value.request_id, info.value.key, info.value.field) == (
        "r1",
        WHERE["key"],
        attribute,
    )
    assert f"field '{attribute}'" in str(info.value)


def test_encode_rejects_an_unknown_attribute() -> None:
    with pytest.raises(ValidationError, match="PartitionState has no stored attribute 'nope'"):
        PARTITION.encode_field("nope", 1, **WHERE)


def test_excluded_attributes_are_not_stored() -> None:
    with pytest.raises(ValidationError, match="no stored attribute 'resource_publish_info'"):
        PARTITION.encode_field("resource_publish_info", {}, **WHERE)


def test_an_unregistered_config_kind_is_named_with_its_field() -> None:
    @dataclass
    class Unregistered(BeamConfig):
        extra: list[int] = field(default_factory=list)

    record = RequestRecord("r1", 1, 0, ["llm"], [], resource_configs={"u": Unregistered()})
    with pytest.raises(UnknownKindError, match="Unregistered is not a registered kind") as info:
        RECORD.encode(record, request_id="r1", key="ns:{r1}:meta")
    assert info.value.kind.endswith("Unregistered")
    assert (info.value.key, info.value.field) == ("ns:{r1}:meta", "resource_configs")


# -- decode errors -----------------------------------------------------------------------------


def good_partition_hash() -> dict[bytes, bytes]:
    return as_redis(PARTITION.encode(partition(curr_forward_outputs=["a", "b"])))


@pytest.mark.parametrize(
    ("field_name", "value", "message"),
    [
        ("fwd_pass_number", b"three", "is not a decimal integer"),
        ("fwd_pass_number", b"1.5", "is not a decimal integer"),
        ("fwd_pass_number", b"", "is not a decimal integer"),
        ("fwd_pass_number", b"1" * 21, "is not a decimal integer"),
        ("is_done", b"yes", "is not a flag"),
        ("is_done", b"", "is not a flag"),
        ("curr_forward_outputs", b"3", "list of length 3 holds 2 entries"),
        ("curr_forward_outputs", b"x", "is not a decimal integer"),
        ("metadata", b"\x81", "does not decode as CurrentForwardConductorMetadata"),
        ("metadata", b"\xc1", "malformed"),
        ("metadata", CODEC.encode(5), "Expected `object`, got `int`"),
        ("metadata", CODEC.encode({"graph_walk": "w"}), "missing"),
        ("partition_name", b"\xff\xfe", "does not decode"),
    ],
)
def test_decode_names_the_bad_field(field_name: str, value: bytes, message: str) -> None:
    raw = good_partition_hash()
    raw[field_name.encode()] = value
    with pytest.raises(CorruptRecordError, match=message) as info:
        PARTITION.decode(raw, **WHERE)
    assert (info.value.request_id, info.value.key, info.value.field) == (
        "r1",
        WHERE["key"],
        field_name,
    )


def test_decode_bad_map_value_names_the_attribute() -> None:
    raw = good_partition_hash()
    raw[b"wg_rank_completions[wg]"] = b"many"
    with pytest.raises(CorruptRecordError, match="wg_rank_completions does not decode") as info:
        PARTITION.decode(raw, **WHERE)
    assert info.value.field == "wg_rank_completions"


def test_decode_list_with_a_hole() -> None:
    raw = good_partition_hash()
    del raw[b"curr_forward_outputs[0]"]
    with pytest.raises(CorruptRecordError, match="list of length 2 holds 1 entries") as info:
        PARTITION.decode(raw, **WHERE)
    assert info.value.field == "curr_forward_outputs"


@pytest.mark.parametrize("missing", [b"partition_name", b"metadata"])
def test_decode_missing_required_field(missing: bytes) -> None:
    raw = good_partition_hash()
    del raw[missing]
    with pytest.raises(CorruptRecordError, match="is missing") as info:
        PARTITION.decode(raw, **WHERE)
    assert info.value.field == missing.decode()


def test_decode_malformed_field_name() -> None:
    raw = good_partition_hash()
    raw[b"wg_rank_completions[wg"] = b"1"
    with pytest.raises(CorruptRecordError, match="malformed field name") as info:
        PARTITION.decode(raw, **WHERE)
    assert info.value.field == "wg_rank_completions[wg"


def test_decode_nested_corrupt_value_names_the_field() -> None:
    record = RequestRecord("r1", 1, 0, ["llm"], [], resource_configs={"p": SamplingReqConfig()})
    raw = as_redis(RECORD.encode(record))
    raw[b"resource_configs[p]"] = CODEC.encode_kind(PublishedPositionInfo())
    with pytest.raises(CorruptRecordError, match="not a ResourceReqConfig") as info:
        RECORD.decode(raw, request_id="r1", key="ns:{r1}:meta")
    assert (info.value.key, info.value.field) == ("ns:{r1}:meta", "resource_configs")
