"""Domains of stored numbers, and the bounds that keep a read as cheap as its bytes.

Every numeric field of every stored type has a domain (or is left unbounded on purpose);
what is refused on write is exactly what is reported corrupt on read, so the store never
writes what it cannot read back and never reads back a number it would not have written.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import Codec, CorruptRecordError, ValidationError
from store.codec import bounds, domains
from store.codec.domains import (
    COUNT,
    FIELDS,
    PASS,
    TIME,
    TOKENS,
    UNBOUNDED,
    check_float,
    check_int,
    check_stored,
)
from store.codec.layout import RecordLayout
from store.codec.leases import decode_leases
from store.records import Lease, RequestRecord
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionDefinition,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests.strategies import CODEC_SETTINGS, json_like

STORED_TYPES = [
    RequestRecord,
    PartitionState,
    StreamingConnectionState,
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    KVSequenceInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    Lease,
]


@pytest.mark.parametrize("cls", STORED_TYPES, ids=lambda c: c.__name__)
def test_every_numeric_field_of_every_stored_type_has_a_domain(cls: type) -> None:
    """A new numeric field must be given a domain (or be declared unbounded) on purpose."""
    numeric = set(domains.numeric_fields(cls))
    decided = set(FIELDS.get(cls, {})) | set(UNBOUNDED.get(cls, ()))
    assert numeric == decided


@pytest.mark.parametrize(
    ("value", "ok"),
    [(0, True), (2**53 - 1, True), (2**53, False), (-1, False), (True, False), (1.0, False),
     ("1", False), (None, False)],
)  # fmt: skip
def test_check_int_takes_exactly_the_ints_of_the_domain(value: Any, ok: bool) -> None:
    if ok:
        assert check_int(value, PASS, what="fwd_pass") == value
        assert check_stored(value, PASS, what="fwd_pass") == value
        return
    with pytest.raises(ValidationError) as caught:
        check_int(value, PASS, what="fwd_pass", request_id="r1", key="k", field="f")
    assert str(caught.value) == (
        f"fwd_pass must be an int >= 0 and < 2**53, got {value!r} "
        "(request 'r1', key 'k', field 'f')"
    )
    with pytest.raises(CorruptRecordError, match="outside its domain"):
        check_stored(value, PASS, what="fwd_pass")


@pytest.mark.parametrize(
    ("value", "ok"),
    [(0, True), (1.5, True), (1700000000, True), (-0.5, False), (math.inf, False),
     (math.nan, False), (2.0**53, False), (10**400, False), (True, False), ("1", False)],
)  # fmt: skip
def test_check_float_takes_finite_numbers_of_the_domain(value: Any, ok: bool) -> None:
    if ok:
        assert check_float(value, TIME, what="at") == float(value)
    else:
        with pytest.raises(ValidationError, match="at must be a finite number >= 0"):
            check_float(value, TIME, what="at")


def test_the_named_domains_say_what_scripts_can_compare() -> None:
    for domain in (PASS, TOKENS, COUNT):
        assert (domain.low, domain.high) == (0, 2**53)
    assert domains.RANKS.low == 1
    assert domains.KV_RANK.high == 2**63  # a part name, read back as a signed 64-bit int


# -- the domains in the layout --------------------------------------------------------------

PARTITION = RecordLayout(PartitionState, Codec(), exclude=("resource_publish_info",))
CONNECTION = RecordLayout(StreamingConnectionState, Codec())
RECORD = RecordLayout(RequestRecord, Codec())


@pytest.mark.parametrize(
    ("layout", "field", "value", "raw"),
    [
        (PARTITION, "fwd_pass_number", 2**53, b"9007199254740992"),
        (PARTITION, "num_output_tokens", -1, b"-1"),
        (PARTITION, "random_seed", 2**63 - 2**53, str(2**63 - 2**53).encode()),
        (PARTITION, "wg_rank_completions", {"wg": -2}, b"-2"),
        (CONNECTION, "token_count", 2**60, str(2**60).encode()),
        (CONNECTION, "consumed_count", -5, b"-5"),
        (RECORD, "max_output_tokens", -1, b"-1"),
        (RECORD, "created_at", -1.0, msgspec.msgpack.encode(-1.0)),
        (RECORD, "finished_at", math.inf, msgspec.msgpack.encode(math.inf)),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_number_outside_its_domain_is_refused_on_write_and_corrupt_on_read(
    layout: RecordLayout[Any], field: str, value: Any, raw: bytes
) -> None:
    with pytest.raises(ValidationError) as refused:
        layout.encode_field(field, value, request_id="r1", key="k")
    assert (refused.value.key, refused.value.field) == ("k", field)
    assert "must be" in str(refused.value)

    good = _good_hash(layout)
    name = f"{field}[wg]" if isinstance(value, dict) else field
    good[name.encode()] = raw
    with pytest.raises(CorruptRecordError, match="outside its domain") as corrupt:
        layout.decode(good, request_id="r1", key="k")
    assert (corrupt.value.key, corrupt.value.field) == ("k", field)


def _good_hash(layout: RecordLayout[Any]) -> dict[bytes, bytes]:
    values: dict[type, Any] = {
        PartitionState: PartitionState("p", CurrentForwardConductorMetadata("w", True)),
        StreamingConnectionState: StreamingConnectionState("a", "b", "e"),
        RequestRecord: RequestRecord("r1", 1, 0, ["p"], []),
    }
    return {k.encode(): v for k, v in layout.encode(values[layout.cls]).items()}


# -- bounds -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "value"),
    [(b"0", 0), (b"7", 7), (b"-7", -7), (b"9223372036854775807", 2**63 - 1),
     (b"-9223372036854775808", -(2**63))],
)  # fmt: skip
def test_parse_int_reads_the_canonical_decimal_form(raw: bytes, value: int) -> None:
    assert bounds.parse_int(raw) == value


@pytest.mark.parametrize(
    "raw",
    [b"", b"-", b"-0", b"03", b"+3", b" 3", b"3 ", b"3.0", b"1e3", b"\xd9\xa3", b"1_000",
     b"9223372036854775808", b"-9223372036854775809", b"1" * 20, b"9" * 10_000],
)  # fmt: skip
def test_parse_int_refuses_anything_else(raw: bytes) -> None:
    with pytest.raises(ValueError):
        bounds.parse_int(raw)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max([0, *(_depth(k) for k in value), *(_depth(v) for v in value.values())])
    if isinstance(value, list):
        return 1 + max([0, *(_depth(v) for v in value)])
    return 0


nested = st.recursive(
    json_like,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=40,
)


@CODEC_SETTINGS
@given(value=nested, limit=st.integers(0, 12))
def test_too_deep_measures_the_nesting_of_any_value(value: Any, limit: int) -> None:
    data = msgspec.msgpack.encode(value)
    assert bounds.too_deep(data, limit) == (_depth(value) > limit)


def test_too_deep_walks_only_what_its_cheap_checks_cannot_clear() -> None:
    wide = msgspec.msgpack.encode([[i] for i in range(100)])  # 101 openers, 2 levels
    assert not bounds.too_deep(wide)
    deep = b"\x91" * 65 + b"\xc0"
    assert bounds.too_deep(deep) and not bounds.too_deep(deep[1:])
    # The walk ends at the end of the bytes, whatever length a header claims, and at a byte
    # that is no msgpack; the decoder then says what is wrong.
    assert not bounds.too_deep(b"\xdd\xff\xff\xff\xff" + b"\x91\x01" * 70)
    assert not bounds.too_deep(b"\xc1" + b"\x91" * 70)
    assert bounds.too_deep(b"\x91" * 70 + b"\xc1")


# -- leases ------------------------------------------------------------------------------------


def test_leases_decode_from_the_lease_hash() -> None:
    raw = {
        b"token": b"7",
        b"holder[llm]": b"replica-1",
        b"token[llm]": b"7",
        b"expires[llm]": b"1700000010.123456",
        b"pass[llm]": b"3",
        b"token[codec]": b"5",  # released: no holder, the token stays
    }
    assert decode_leases(raw, "r1", "k") == {
        "llm": Lease("r1", "llm", "replica-1", 7, 3, 1700000010.123456)
    }


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        (b"holder[\xff]", b"replica-1", "lease field name is not UTF-8"),
        (b"holder[llm]", b"\xfe", "lease holder is not UTF-8"),
        (b"holder[llm]", b"", "lease holder ''"),
        (b"token[llm]", b"seven", "is not a decimal integer"),
        (b"token[llm]", b"-1", "outside its domain"),
        (b"pass[llm]", str(2**53).encode(), "outside its domain"),
        (b"expires[llm]", b"nan", "is not a number"),
        (b"expires[llm]", b"inf", "is not a number"),
        (b"expires[llm]", b"-1.5", "outside its domain"),
        (b"expires[llm]", b"1e999", "outside its domain"),
    ],
)
def test_a_damaged_lease_is_corrupt_naming_its_field(field: bytes, value: bytes, why: str) -> None:
    raw = {b"holder[llm]": b"r", b"token[llm]": b"7", b"expires[llm]": b"1.5", b"pass[llm]": b"3"}
    raw[field] = value
    with pytest.raises(CorruptRecordError, match=why) as caught:
        decode_leases(raw, "r1", "k")
    assert caught.value.key == "k" and caught.value.field


@pytest.mark.parametrize("missing", [b"token[llm]", b"expires[llm]", b"pass[llm]"])
def test_a_held_lease_missing_a_field_is_corrupt(missing: bytes) -> None:
    raw = {b"holder[llm]": b"r", b"token[llm]": b"7", b"expires[llm]": b"1.5", b"pass[llm]": b"3"}
    del raw[missing]
    with pytest.raises(CorruptRecordError, match="without this field") as caught:
        decode_leases(raw, "r1", "k")
    assert caught.value.field == missing.decode()


def test_the_lease_decoder_uses_the_lease_domains() -> None:
    assert FIELDS[Lease] == {
        "token": domains.FENCING_TOKEN, "pass_number": PASS, "expires_at": TIME,
        "sends": domains.COUNT, "sent_at": TIME,
    }  # fmt: skip
