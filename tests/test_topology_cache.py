"""The store remembers the partitions and connections of the requests it read, the one
remembered longest ago out first: a report that carries tokens needs them, and one of a
request it forgot reads the request's record first (one more round trip)."""

from __future__ import annotations

import fakeredis
import pytest

from store import ConfigurationError, RequestStore
from store.ops.settings import DEFAULT_TOPOLOGY_CACHE_SIZE
from tests.test_lifetimes import create  # the tts shape: an LLM streaming to a codec

pytestmark = pytest.mark.fake


def report_a_token(store: RequestStore, rid: str) -> None:
    """Rank 0's report of pass 0 with a token (applied once, then a duplicate)."""
    store.record_worker_report(
        rid, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=8, new_tokens=1
    )


def test_the_default_holds_a_replica_s_requests_in_flight() -> None:
    assert DEFAULT_TOPOLOGY_CACHE_SIZE >= 10_000


def test_a_forgotten_request_is_read_again_and_the_one_remembered_first_goes_first() -> None:
    store = RequestStore(fakeredis.FakeRedis(), namespace="t-cache", topology_cache_size=2)
    core = store._core

    def held() -> list[str]:
        return [rid for rid in ("a", "b", "c") if core.cached_topology(rid) is not None]

    for rid in ("a", "b", "c"):
        create(store, rid)  # creating remembers
    assert held() == ["b", "c"]
    report_a_token(store, "b")  # known: nothing read
    report_a_token(store, "a")  # forgotten: read again, in place of "b"
    assert held() == ["a", "c"]
    assert store.load_connection("a", "llm->codec").token_count == 1
    store.load_record("b")  # any read of a record remembers it
    assert held() == ["a", "b"]


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="topology_cache_size"):
        RequestStore(fakeredis.FakeRedis(), topology_cache_size=-1)
