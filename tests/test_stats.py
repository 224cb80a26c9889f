"""``store.stats``: the heartbeat flush's exact commands, and what they leave in Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from store.errors import ValidationError
from store.keys import KeySpace
from store.observe import COUNTERS
from store.stats import (
    BUCKET_TTL,
    flush_commands,
    last_minute,
    minute_of,
    parse_counts,
    parse_replica,
)
from tests.conftest import send_flush

KEYS = KeySpace("ns")
NOW = 28_333_333 * 60 + 30.5  # 30.5 s into epoch minute 28_333_333


def test_minute_of() -> None:
    assert minute_of(NOW) == 28_333_333
    assert minute_of(28_333_333 * 60) == 28_333_333
    assert minute_of(28_333_333 * 60 - 0.001) == 28_333_332


def test_first_flush_writes_the_replica_hash_and_the_deltas_of_the_minute() -> None:
    commands = flush_commands(
        KEYS, "replica-1", {"passes": 7, "reports": 14}, {},
        leases=2, requests=3, now=NOW, heartbeat_interval=2.0,
    )  # fmt: skip

    zeros = [x for name in COUNTERS for x in (name, 0)]
    hset = ["HSET", "ns:replica:replica-1", *zeros, "leases", 2, "requests", 3, "at", repr(NOW)]
    hset[hset.index("passes") + 1] = 7
    hset[hset.index("reports") + 1] = 14
    assert commands == [
        tuple(hset),
        ("PEXPIRE", "ns:replica:replica-1", 6000),
        ("HINCRBY", "ns:stats:28333333", "passes", 7),
        ("HINCRBY", "ns:stats:28333333", "reports", 14),
        ("EXPIRE", "ns:stats:28333333", BUCKET_TTL),
    ]


def test_a_flush_with_nothing_new_writes_no_bucket() -> None:
    totals = {"passes": 7}
    commands = flush_commands(
        KEYS, "r", totals, totals, leases=0, requests=0, now=NOW, heartbeat_interval=1.0
    )
    assert [c[0] for c in commands] == ["HSET", "PEXPIRE"]


@pytest.mark.parametrize(("replica", "totals", "flushed", "interval", "message"), [
    ("", {}, {}, 1.0, "replica id must be a str"),
    (None, {}, {}, 1.0, "replica id must be a str"),
    ("r", {"passes": 1}, {"passes": 2}, 1.0, "counter 'passes' went down from 2 to 1"),
    ("r", {}, {}, 0.0, "heartbeat interval must be positive"),
])  # fmt: skip
def test_bad_flush_arguments_are_typed_errors(
    replica: str, totals: dict[str, int], flushed: dict[str, int], interval: float, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        flush_commands(
            KEYS, replica, totals, flushed,
            leases=0, requests=0, now=NOW, heartbeat_interval=interval,
        )  # fmt: skip


def test_flushes_of_two_replicas_add_up_in_redis(client: redis.Redis, namespace: str) -> None:
    keys = KeySpace(namespace)
    first = {"passes": 5, "takeovers": 1}

    def flush(replica: str, totals: dict[str, int], flushed: dict[str, int], **kw: Any) -> None:
        send_flush(client, keys, replica, totals, flushed, heartbeat_interval=2.0, **kw)

    flush("a", first, {}, leases=1, requests=2, now=NOW)
    flush("b", {"passes": 3}, {}, leases=4, requests=5, now=NOW)
    # a's second flush sends only what changed since its first.
    flush("a", {"passes": 9, "takeovers": 1}, first, leases=0, requests=1, now=NOW + 2)

    bucket = parse_counts(client.hgetall(keys.stats_bucket(minute_of(NOW))))
    assert bucket == {"passes": 5 + 3 + 4, "takeovers": 1}
    assert 0 < client.ttl(keys.stats_bucket(minute_of(NOW))) <= BUCKET_TTL
    a = parse_replica("a", NOW + 2, client.hgetall(keys.replica_stats("a")))
    assert (a.leases, a.requests, a.flushed_at) == (0, 1, NOW + 2)
    assert a.counters == {**dict.fromkeys(COUNTERS, 0), "passes": 9, "takeovers": 1}
    assert 0 < client.pttl(keys.replica_stats("a")) <= 6000


def test_a_damaged_replica_hash_reads_as_unknown_not_an_error() -> None:
    stats = parse_replica("r", NOW, {b"passes": b"x", b"leases": b"\xff", b"at": b"soon"})
    assert stats.counters["passes"] == 0
    assert (stats.leases, stats.requests, stats.flushed_at) == (None, None, None)


def test_last_minute_weighs_the_previous_bucket_by_what_is_left_of_the_window() -> None:
    current, previous = {"passes": 10}, {"passes": 60, "fenced": 2}
    # 30.5 s into the minute: the window holds 29.5 s of the previous minute.
    estimate = last_minute(current, previous, NOW)
    assert estimate["passes"] == pytest.approx(10 + 60 * 29.5 / 60)
    assert estimate["fenced"] == pytest.approx(2 * 29.5 / 60)
    assert estimate["takeovers"] == 0
    assert last_minute(current, previous, minute_of(NOW) * 60)["passes"] == 70
