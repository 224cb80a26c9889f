"""The key layout: exact key strings, one cluster slot per request, and what names may hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from store import KeySpace, ValidationError
from store.keys import (
    MAX_NAME_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    connection_name,
    split_connection_name,
    validate_name,
    validate_request_id,
)
from tests.strategies import CODEC_SETTINGS, names

KEYS = KeySpace("ns")


def test_exact_keys() -> None:
    assert KEYS.index == "ns:requests"
    assert KEYS.request_prefix("r1") == "ns:{r1}:"
    assert KEYS.meta("r1") == "ns:{r1}:meta"
    assert KEYS.partition("r1", "llm") == "ns:{r1}:part:llm"
    assert KEYS.publish_info("r1", "llm") == "ns:{r1}:pub:llm"
    assert KEYS.connection("r1", "llm->codec") == "ns:{r1}:conn:llm->codec"
    assert KEYS.ops("r1") == "ns:{r1}:ops"
    assert KEYS.lease("r1") == "ns:{r1}:lease"
    assert KEYS.merging("r1", "llm") == "ns:{r1}:merging:llm"
    assert KEYS.merging_queue("r1", "llm") == "ns:{r1}:merging-queue:llm"
    assert KEYS.deadlines == "ns:deadlines"
    assert KEYS.replicas == "ns:replicas"


def test_the_redis_type_of_every_key() -> None:
    """What ``TYPE`` must answer at each key (a script that met another one names it)."""
    keys = KeySpace("ns:a")
    hashes = [keys.meta("r"), keys.partition("r", "ops"), keys.publish_info("r", "history"),
              keys.connection("r", "a->b"), keys.lease("r"), keys.merging_queue("r", "p"),
              keys.replica_stats("x"), keys.stats_bucket(7)]  # fmt: skip
    assert {keys.redis_type(k) for k in hashes} == {"hash"}
    assert keys.redis_type(keys.merging("r", "p")) == "string"
    assert keys.redis_type(keys.history("r")) == "stream"
    zsets = [keys.ops("r"), keys.index, keys.deadlines, keys.finished, keys.replicas]
    assert {keys.redis_type(k) for k in zsets} == {"zset"}


def test_default_namespace() -> None:
    assert KeySpace().meta("r") == "mstar:{r}:meta"


def test_request_keys_lists_every_key_of_the_topology() -> None:
    assert KEYS.request_keys("r", ["llm", "codec"], ["llm->codec"]) == [
        "ns:{r}:meta",
        "ns:{r}:lease",
        "ns:{r}:history",
        "ns:{r}:ops",
        "ns:{r}:conductor",
        "ns:{r}:part:llm",
        "ns:{r}:pub:llm",
        "ns:{r}:merging:llm",
        "ns:{r}:merging-queue:llm",
        "ns:{r}:part:codec",
        "ns:{r}:pub:codec",
        "ns:{r}:merging:codec",
        "ns:{r}:merging-queue:codec",
        "ns:{r}:conn:llm->codec",
    ]


request_ids = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="{}"),
    min_size=1,
    max_size=MAX_REQUEST_ID_LENGTH,
)


@CODEC_SETTINGS
@given(request_ids, names, names)
def test_every_request_key_shares_one_slot(rid: str, a: str, b: str) -> None:
    space = KeySpace("some:ns")
    keys = space.request_keys(rid, [a, b], [connection_name(a, b)])
    assert len(keys) == 14
    assert validate_request_id(rid) == rid
    assert {key_slot(k.encode()) for k in keys} == {key_slot(rid.encode())}
    # The shared keys hash on their whole name, in no request's tag.
    assert "{" not in space.index + space.deadlines + space.replicas


def test_the_hash_tag_is_the_request_id() -> None:
    # Two requests land wherever their ids hash, independent of the namespace.
    assert key_slot(b"a:{req-1}:meta") == key_slot(KeySpace("other").meta("req-1").encode())


@pytest.mark.parametrize("rid", ["r", "req-1", "a.b_c:d/e|f~g!#", "x" * MAX_REQUEST_ID_LENGTH])
def test_valid_request_ids(rid: str) -> None:
    assert validate_request_id(rid) == rid


@pytest.mark.parametrize(
    ("rid", "message"),
    [
        ("", "request id is empty"),
        ("x" * (MAX_REQUEST_ID_LENGTH + 1), "over the limit of 200"),
        ("a{b", "'{' or '}'"),
        ("a}b", "'{' or '}'"),
        ("a b", "without spaces"),
        ("a\nb", "printable ASCII"),
        ("é", "printable ASCII"),
        (None, "must be a str, not NoneType"),
        (12, "must be a str, not int"),
        (b"r", "must be a str, not bytes"),
    ],
)
def test_invalid_request_ids(rid: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        validate_request_id(rid)
    assert isinstance(info.value, ValueError)


def test_invalid_request_id_names_itself() -> None:
    with pytest.raises(ValidationError) as info:
        validate_request_id("bad id")
    assert info.value.request_id == "bad id"
    assert "(request 'bad id')" in str(info.value)


@pytest.mark.parametrize("name", ["llm", "a-b", "a.b", "A_9", "x" * MAX_NAME_LENGTH])
def test_valid_names(name: str) -> None:
    assert validate_name(name, what="partition name") == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "partition name is empty"),
        ("x" * (MAX_NAME_LENGTH + 1), "over the limit of 128"),
        ("a->b", "no '->'"),
        ("a b", "may hold only"),
        ("a{b}", "may hold only"),
        ("a:b", "may hold only"),
        ("a/b", "may hold only"),
        (None, "partition name must be a str, not NoneType"),
        (3, "partition name must be a str, not int"),
    ],
)
def test_invalid_names(name: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        validate_name(name, what="partition name", request_id="r1")
    assert info.value.request_id == "r1"
    assert "(request 'r1')" in str(info.value)


def test_connection_names() -> None:
    assert connection_name("llm", "codec") == "llm->codec"
    assert split_connection_name("llm->codec") == ("llm", "codec")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("llm", "must be '<from_partition>-><to_partition>'"),
        ("a->b->c", "must be '<from_partition>-><to_partition>'"),
        (None, "must be '<from_partition>-><to_partition>'"),
        ("->b", "connection source partition is empty"),
        ("a->", "connection target partition is empty"),
        ("a b->c", "connection source partition 'a b' may hold only"),
    ],
)
def test_invalid_connection_names(name: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        split_connection_name(name, request_id="r1")
    assert info.value.request_id == "r1"


@pytest.mark.parametrize("namespace", ["", "a b", "a{b}", "x" * (MAX_NAME_LENGTH + 1), "ns/x"])
def test_invalid_namespaces(namespace: str) -> None:
    with pytest.raises(ValidationError, match=r"namespace .* may hold only"):
        KeySpace(namespace)


@pytest.mark.parametrize("namespace", [None, 5])
def test_non_str_namespace(namespace: object) -> None:
    with pytest.raises(ValidationError, match="namespace"):
        KeySpace(namespace)  # type: ignore[arg-type]


def test_namespace_may_hold_colons() -> None:
    assert KeySpace("app:v1").index == "app:v1:requests"


def test_operator_keys() -> None:
    assert KEYS.replica_stats("replica-2") == "ns:replica:replica-2"
    assert KEYS.stats_bucket(28_512_345) == "ns:stats:28512345"
    assert KEYS.history("r1") == "ns:{r1}:history"


@CODEC_SETTINGS
@given(request_ids)
def test_history_shares_the_request_slot(rid: str) -> None:
    # The scripts append to it in the same call that changes the request.
    assert key_slot(KEYS.history(rid).encode()) == key_slot(KEYS.meta(rid).encode())


def test_namespace_statistics_are_in_no_request_slot() -> None:
    # Written by replicas with their heartbeat, never from a request's script.
    assert "{" not in KEYS.replica_stats("r") + KEYS.stats_bucket(1)
