"""Every mutating operation, with its reply lost or its connection reset, applies once.

The store sends through ``tests/proxy.py``. "Lost reply": the proxy lets Redis run the
operation's command and closes the connection before the reply reaches the store, so the
store cannot know it was applied and sends it again. "Reset before": the connection is
reset as the command arrives, so nothing ran and the resend is the first application.
Either way the state afterwards, read straight from Redis, must be exactly one application,
and the call must return what one application returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from store import Codec, Lease, RequestStore
from store import scripts as script_files
from store.ops.core import SCRIPT_NAMES
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
)
from tests.proxy import FaultProxy, Match, Rule, command, exec_with, script
from tests.servers import RedisServer
from tests.stores import Stores
from tests.strategies import SumInfo, user_registry

pytestmark = pytest.mark.servers

RID = "r1"
CONN = "llm->codec"
MD = CurrentForwardConductorMetadata("prefill", True)
NEXT = CurrentForwardConductorMetadata("decode", False)
LATER = 3600.0  # a check an hour from now (seconds, by the server's clock)


def codec() -> Codec:
    return Codec(user_registry())


def create(store: Any) -> None:
    store.create_request(
        RID,
        partitions={
            "llm": PartitionState(
                "llm", MD, current_worker_graph_ids={"wg"},
                resource_publish_info={"sum": SumInfo(10)},
            ),
            "codec": PartitionState("codec", MD, current_worker_graph_ids={"wg-c"}),
        },
        connections={CONN: StreamingConnectionState("llm", "codec", "tokens")},
        max_output_tokens=64,
        seed=7,
    )  # fmt: skip


def kv(rank: int) -> PublishedKVInfo:
    shard = KVSequenceInfo(seq_len=5 + rank, latest_kv_transfer_info=None, page_indices=[rank, 9])
    return PublishedKVInfo(info={rank: {"main": shard}}, world_size=2)


# -- the cases: what to do, which command's reply to lose, what one application leaves ----


@dataclass(frozen=True)
class Case:
    name: str
    match: Match
    act: Callable[[Any, Any], Any]  # (store through the proxy, what prepare returned)
    check: Callable[[RequestStore, Any, Any], None]  # (store on Redis, prepared, result)
    prepare: Callable[[RequestStore], Any] = create


def check_created(direct: RequestStore, _: Any, result: Any) -> None:
    assert result is None
    state = direct.load_request(RID)
    assert state.record.max_output_tokens == 64 and state.record.seed == 7
    assert state.partitions["llm"].resource_publish_info == {"sum": SumInfo(10)}
    assert state.connections[CONN].token_count == 0
    assert direct.list_requests() == [RID]


def check_updated(direct: RequestStore, _: Any, result: Any) -> None:
    llm = direct.load_partition(RID, "llm")
    assert (llm.num_output_tokens, llm.curr_forward_outputs) == (4, ["a", "b"])


def check_producer_done(direct: RequestStore, _: Any, result: Any) -> None:
    conn = direct.load_connection(RID, CONN)
    assert (conn.producer_done, conn.token_count) == (True, 0)


def check_final_output(direct: RequestStore, _: Any, result: Any) -> None:
    assert direct.load_record(RID).final_outputs == {"text": {"tokens": 5}}


def check_tokens(direct: RequestStore, _: Any, result: Any) -> None:
    assert result == 5
    assert direct.load_connection(RID, CONN).token_count == 5


def check_consumed(direct: RequestStore, _: Any, result: Any) -> None:
    assert result == 3
    assert direct.load_connection(RID, CONN).consumed_count == 3


def report(store: Any, _: Any) -> Any:
    return store.record_worker_report(
        RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=2,
        new_tokens=4, output_names=["o"],
    )  # fmt: skip


def check_report(direct: RequestStore, _: Any, result: Any) -> None:
    assert result.rank_completions == 1 and not result.pass_complete
    llm = direct.load_partition(RID, "llm")
    assert llm.wg_rank_completions == {"wg": 1}
    assert (llm.num_output_tokens, llm.curr_forward_outputs) == (4, ["o"])
    assert direct.load_connection(RID, CONN).token_count == 4


def check_advanced(direct: RequestStore, _: Any, result: Any) -> None:
    assert result == 1
    llm = direct.load_partition(RID, "llm")
    assert (llm.fwd_pass_number, llm.random_seed, llm.metadata) == (1, 1, NEXT)


def check_kv_merged(direct: RequestStore, _: Any, result: Any) -> None:
    expected = {"kv": kv(0), "pos": PublishedPositionInfo({"llm": 3})}
    assert dict(result) in (expected, {})  # {} when returning=False
    held = direct.load_partition(RID, "llm").resource_publish_info
    assert held == {"sum": SumInfo(10), **expected}


def check_summed(direct: RequestStore, _: Any, result: Any) -> None:
    assert dict(result) == {"sum": SumInfo(15)}  # SumInfo adds: a second merge would show
    assert direct.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(15)}


def check_claimed(direct: RequestStore, _: Any, result: Any) -> None:
    lease = direct.leases(RID)["llm"]
    assert (lease.holder, lease.token) == ("me", 1)  # the fencing token went up once


def claimed(direct: RequestStore) -> Lease:
    create(direct)
    lease = direct.claim_step(RID, "llm", "me")
    assert lease is not None
    return lease


def server_now(direct: RequestStore) -> float:
    seconds, micros = direct.client.time()
    return seconds + micros / 1e6


def look_at(direct: RequestStore) -> float | None:
    """When recovery looks at llm next (the recovery index's hint)."""
    return direct.client.zscore(direct.keys.deadlines, f"{RID} llm")


def check_time(direct: RequestStore) -> float:
    """The check time the lease hash holds for llm, which claims decide by."""
    return float(direct.client.hget(direct.keys.lease(RID), "check[llm]") or 0)


def check_released(direct: RequestStore, lease: Lease, result: Any) -> None:
    assert direct.leases(RID) == {}
    now = server_now(direct)
    assert check_time(direct) == pytest.approx(now + LATER, abs=5)
    hint = look_at(direct)  # never later than the check time (on one server: equal)
    assert hint is not None and now < hint <= check_time(direct)
    # The token stays: a release resent once more is still recognised as the holder's.
    direct.release_lease(lease, check_in=LATER)


def check_renewed(direct: RequestStore, lease: Lease, result: Lease) -> None:
    assert (result.token, result.holder) == (lease.token, "me")
    held = direct.leases(RID)["llm"]
    assert held.token == lease.token
    assert held.expires_at == pytest.approx(result.expires_at)
    assert held.expires_at > lease.expires_at + 30


def check_scheduled(direct: RequestStore, _: Any, result: Any) -> None:
    hint = look_at(direct)
    assert hint == pytest.approx(server_now(direct) + LATER, abs=5)
    assert direct.due_steps() == []


def check_kept(direct: RequestStore, _: Any, result: Any) -> None:
    assert direct.load_record(RID).finished_at > 0
    assert 0 < direct.client.ttl(direct.keys.meta(RID)) <= 60
    assert look_at(direct) is None


def check_gone(direct: RequestStore, _: Any, result: Any) -> None:
    assert result in (None, True, [RID])  # finish, delete, reap
    assert not direct.request_exists(RID)
    assert direct.list_requests() == []
    assert direct.client.keys(f"{direct.keys.namespace}:*") == []


def scheduled(direct: RequestStore) -> None:
    create(direct)
    direct.schedule_check(RID, "llm", LATER)


CASES = [
    Case("create_request", script("create_request"), lambda s, _: create(s), check_created,
         prepare=lambda direct: None),
    Case("create_request(index)", command("ZADD"), lambda s, _: create(s), check_created,
         prepare=lambda direct: None),
    Case("update_partition", script("update_fields"),
         lambda s, _: s.update_partition(RID, "llm", num_output_tokens=4,
                                         curr_forward_outputs=["a", "b"]),
         check_updated),
    Case("set_producer_done", script("update_fields"),
         lambda s, _: s.set_producer_done(RID, CONN), check_producer_done),
    Case("set_final_output", script("update_fields"),
         lambda s, _: s.set_final_output(RID, "text", {"tokens": 5}), check_final_output),
    Case("add_tokens", script("add_tokens"), lambda s, _: s.add_tokens(RID, CONN, 5),
         check_tokens),
    Case("raise_consumed_count", script("raise_field"),
         lambda s, _: s.raise_consumed_count(RID, CONN, 3), check_consumed),
    Case("record_worker_report", script("report"), report, check_report),
    Case("advance_partition", script("advance_partition"),
         lambda s, _: s.advance_partition(RID, "llm", from_pass=0, metadata=NEXT,
                                          worker_graph_ids=["wg"]),
         check_advanced),
    Case("merge_publish_info(server)", exec_with(script("merge_parts")),
         lambda s, _: s.merge_publish_info(
             RID, "llm", {"kv": kv(0), "pos": PublishedPositionInfo({"llm": 3})}),
         check_kv_merged),
    Case("merge_publish_info(server, returning=False)", script("merge_parts"),
         lambda s, _: s.merge_publish_info(
             RID, "llm", {"kv": kv(0), "pos": PublishedPositionInfo({"llm": 3})},
             returning=False),
         check_kv_merged),
    Case("merge_publish_info(optimistic)", exec_with(command("HSET")),
         lambda s, _: s.merge_publish_info(RID, "llm", {"sum": SumInfo(5)}), check_summed),
    Case("claim_step", script("claim_step"), lambda s, _: s.claim_step(RID, "llm", "me"),
         check_claimed),
    Case("release_lease", script("step"),
         lambda s, lease: s.release_lease(lease, check_in=LATER), check_released,
         prepare=claimed),
    Case("renew_lease", script("renew_lease"), lambda s, lease: s.renew_lease(lease, ttl=60),
         check_renewed, prepare=claimed),
    Case("schedule_check", script("hint"),
         lambda s, _: s.schedule_check(RID, "llm", LATER), check_scheduled),
    Case("finish_request(keep_for)", script("finish_request"),
         lambda s, _: s.finish_request(RID, keep_for=60), check_kept, prepare=scheduled),
    Case("finish_request(delete)", script("delete_request"),
         lambda s, _: s.finish_request(RID), check_gone, prepare=scheduled),
    Case("delete_request", script("delete_request"), lambda s, _: s.delete_request(RID),
         check_gone, prepare=scheduled),
    Case("reap", script("delete_request"), lambda s, _: s.reap(max_age=0), check_gone,
         prepare=scheduled),
]  # fmt: skip


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture
def direct(fault_server: RedisServer, namespace: str) -> Iterator[RequestStore]:
    """A store on the Redis itself, not through the proxy: what is really stored.

    Every script is loaded first, so that the command a rule hits is the one that runs
    (not an EVALSHA refused with NOSCRIPT before the EVAL that runs).
    """
    client = fault_server.client()
    for name in SCRIPT_NAMES:
        client.script_load(script_files.source(name))
    yield RequestStore(client, namespace=namespace, codec=codec())
    for key in client.scan_iter(match=f"{namespace}:*"):
        client.unlink(key)
    client.close()


@pytest.fixture
def proxied(proxy: FaultProxy, namespace: str, make_store: Stores) -> Any:
    """A store of the test's kind (sync or async) that reaches Redis through the proxy."""
    return make_store.from_url(proxy.url, namespace=namespace, codec=codec())


def arm(proxy: FaultProxy, fault: str, match: Match) -> Rule:
    if fault == "lost reply":
        return proxy.drop_reply(match)
    return proxy.reset_before(match)


@pytest.mark.parametrize("fault", ["lost reply", "reset before"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_lost_reply_or_a_reset_applies_once(
    case: Case, fault: str, proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    prepared = case.prepare(direct)
    rule = arm(proxy, fault, case.match)

    result = case.act(proxied, prepared)

    assert rule.fired.is_set(), f"the {fault} never happened: no {case.name} command was seen"
    case.check(direct, prepared, result)


@pytest.mark.parametrize("fault", ["lost reply", "reset before"])
def test_a_lost_reply_inside_a_multi_step_operation_resumes_it(
    fault: str, proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    """delete_request is two round trips (the request's keys; then its index entries and its
    recovery index entries): losing the last reply must not leave any of them behind."""
    scheduled(direct)
    rule = arm(proxy, fault, command("ZREM", direct.keys.deadlines))
    assert proxied.delete_request(RID) is True
    assert rule.fired.is_set()
    check_gone(direct, None, True)


# -- what a resend answers (issue 14 item 1: liveness under lost replies) ------------------------


def test_a_claim_resent_by_its_holder_returns_its_lease(
    proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    create(direct)
    direct.schedule_check(RID, "llm", 0)  # due: what recovery claims
    proxy.drop_reply(script("claim_step"))
    lease = proxied.claim_step(RID, "llm", "me")
    held = direct.leases(RID)["llm"]
    assert lease is not None
    assert (lease.holder, lease.token) == (held.holder, held.token) == ("me", 1)
    # Recovery looks at the step again when the lease runs out, not before.
    assert direct.due_steps() == []
    look = direct.client.zscore(direct.keys.deadlines, f"{RID} llm")
    assert look is not None and abs(look - held.expires_at) < 1.0


def test_the_completing_report_resent_still_completes_the_pass(
    proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    create(direct)
    direct.record_worker_report(RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=1, num_ranks=2)
    proxy.drop_reply(script("report"))
    outcome = proxied.record_worker_report(
        RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=2, replica_id="me"
    )
    assert direct.load_partition(RID, "llm").wg_rank_completions == {"wg": 2}
    assert direct.leases(RID)["llm"].token == 1  # granted once, in the first application
    assert outcome.pass_complete
    assert outcome.lease is not None and outcome.lease.token == 1


def test_a_delayed_reply_is_waited_for_not_resent(
    proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    """A slow reply (well under the socket timeout) is not a lost one."""
    create(direct)
    rule = proxy.delay_replies(0.3, script("add_tokens"))
    started = time.monotonic()
    assert proxied.add_tokens(RID, CONN, 2) == 2
    assert time.monotonic() - started >= 0.3
    assert rule.fired.is_set()
    assert proxy.count(script("add_tokens")) == 1
    assert direct.load_connection(RID, CONN).token_count == 2


@pytest.mark.parametrize("fault", ["lost reply", "reset before"])
def test_an_optimistic_merge_cut_between_watch_and_exec_while_another_merges(
    fault: str, proxy: FaultProxy, proxied: Any, direct: RequestStore
) -> None:
    """Another replica's merge commits between this merge's WATCH and the loss of its
    EXEC's connection: the retry must fold both in, each once (SumInfo adds)."""
    create(direct)
    arm_with = proxy.drop_reply if fault == "lost reply" else proxy.reset_before
    rule = arm_with(
        exec_with(command("HSET")),
        on_fire=lambda: direct.merge_publish_info(RID, "llm", {"sum": SumInfo(1)}),
    )
    merged = proxied.merge_publish_info(RID, "llm", {"sum": SumInfo(5)})
    assert rule.fired.is_set()
    assert merged == {"sum": SumInfo(16)}
    assert direct.load_partition(RID, "llm").resource_publish_info == {"sum": SumInfo(16)}
