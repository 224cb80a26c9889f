"""The replica runtime's contract, run over ``Replica`` (sync store) and ``AsyncReplica``
(async store, async planner), on fakeredis and on the real Redis.

Final states are compared with the crash-free reference of ``mstar-store simulate``
(``store.cli.simulate.reference``): the same model driven by one replica, every report
once and in order, so a run that loses, doubles or misorders anything under duplicates,
losses, takeovers or drains shows as a difference.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from store import (
    AsyncPlanner,
    ConfigurationError,
    ReplicaDrainingError,
    ReportStatus,
    RequestStore,
    Timing,
)
from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import reference_run
from store.records import Report
from store.runtime import Replica
from tests.runtime_harness import FAST, Harness, assert_matches, finished, pump
from tests.runtime_planner import PredictingPlanner, TwoRankPlanner

SEED = 11
IDS = model.request_ids(6)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(SEED, IDS)


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make(kind: str, client: redis.Redis, namespace: str) -> Iterator[Any]:
    made: list[Harness] = []

    def make(planner: SimPlanner | None = None, timing: Timing = FAST, **kw: Any) -> Harness:
        harness = Harness(kind, client, namespace, planner or SimPlanner(SEED), timing, **kw)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def tts_ids(n: int) -> list[str]:
    return [rid for rid in IDS if model.spec(SEED, rid).model == model.TTS][:n]


# -- whole requests -------------------------------------------------------------------------


@pytest.mark.parametrize("predict", [False, True], ids=["plain", "predict"])
@pytest.mark.parametrize("batched", [False, True], ids=["one", "batched"])
def test_requests_finish_with_the_reference_final_states(
    make: Any, reference: dict[str, Any], predict: bool, batched: bool
) -> None:
    planner = (PredictingPlanner if predict else SimPlanner)(SEED)
    harness = make(planner)
    for rid in IDS:
        harness.submit(rid)
    pump(harness, IDS, batched=batched)
    assert_matches(harness.store, reference, IDS)
    assert sorted(set(planner.finished_ids)) == sorted(IDS)
    counts = harness.counts
    passes = sum(model.spec(SEED, rid).passes for rid in IDS)
    assert counts["passes"] == passes  # one step per pass, none twice
    assert counts["finished"] == len(IDS)
    assert counts.get("resends", 0) == 0 and counts.get("takeovers", 0) == 0


def test_every_report_delivered_twice_changes_nothing(make: Any, reference: dict[str, Any]) -> None:
    harness = make()
    for rid in IDS:
        harness.submit(rid)
    pump(harness, IDS, deliver=lambda reports: [r for r in reports for _ in (1, 2)])
    assert_matches(harness.store, reference, IDS)
    passes = sum(model.spec(SEED, rid).passes for rid in IDS)
    statuses = harness.statuses
    # The copy of a pass's completing report comes after its step: its pass is over.
    assert statuses[ReportStatus.STALE] == passes
    assert statuses[ReportStatus.DUPLICATE] == statuses[ReportStatus.APPLIED] - passes
    assert harness.counts["passes"] == passes


def test_a_pass_whose_reports_are_lost_is_sent_again(make: Any, reference: dict[str, Any]) -> None:
    # Fixed deadlines: every first answer is lost, so the passes would look slow (the
    # deadlines following them are tested in test_runtime_overload).
    harness = make(timing=dataclasses.replace(FAST, deadline_factor=0.0))
    seen: set[tuple[str, str, int]] = set()

    def lose_first_answer(reports: list[Report]) -> list[Report]:
        """Every pass's first answer is lost on its way (half the ranks of it)."""
        if not reports:
            return reports
        key = (reports[0].request_id, reports[0].partition, reports[0].fwd_pass)
        if key in seen:
            return reports
        seen.add(key)
        return reports[1:]

    ids = IDS[:3]
    for rid in ids:
        harness.submit(rid)
    pump(harness, ids, deliver=lose_first_answer)
    assert_matches(harness.store, reference, ids)
    counts = harness.counts
    passes = sum(model.spec(SEED, rid).passes for rid in ids)
    assert passes <= counts["resends"] <= 2 * passes  # every pass's first answer was lost
    assert counts["takeovers"] >= counts["resends"]


# -- what a report's result says --------------------------------------------------------------


def test_report_results_applied_duplicate_stale_gone(make: Any) -> None:
    harness = make()
    rid = next(r for r in IDS if model.spec(SEED, r).model == model.TEXT)
    harness.submit(rid)
    planner = harness.planner
    (report,) = planner.reports_for(rid, model.DEFAULT, 0)
    first = harness.apply_report(report)
    assert (first.status, first.drove, first.new_pass, first.finished) == (
        ReportStatus.APPLIED, True, 1, False,
    )  # fmt: skip
    assert planner.sent[-1] == (rid, model.DEFAULT, 1)
    again = harness.apply_report(report)
    assert (again.status, again.drove) == (ReportStatus.STALE, False)  # its pass is over
    pump(harness, [rid])
    late = harness.apply_report(planner.reports_for(rid, model.DEFAULT, 1)[0])
    assert late.status is ReportStatus.STALE
    harness.store.delete_request(rid)
    assert harness.apply_report(report).status is ReportStatus.GONE


def test_a_resent_completing_report_still_drives_its_step(make: Any) -> None:
    """The completing report's reply was lost (here: applied by the store directly under
    this replica's id): the resend is a duplicate, and drives the step at once."""
    harness = make()
    rid = next(r for r in IDS if model.spec(SEED, r).model == model.TEXT)
    harness.submit(rid)
    (report,) = harness.planner.reports_for(rid, model.DEFAULT, 0)
    outcome = harness.store.record_worker_report(
        rid, model.DEFAULT, fwd_pass=0, worker_graph_id=report.worker_graph_id, rank=0,
        num_ranks=1, new_tokens=report.new_tokens, output_names=report.output_names,
        published=report.published, replica_id=harness.replica.id,
    )  # fmt: skip
    assert outcome.lease is not None
    result = harness.apply_report(report)
    assert (result.status, result.drove, result.new_pass) == (ReportStatus.DUPLICATE, True, 1)
    assert harness.store.load_partition(rid, model.DEFAULT).fwd_pass_number == 1


def test_a_resent_report_that_took_its_predicted_step_sends_the_new_pass(make: Any) -> None:
    """The completing report took its predicted step in the same call and its reply was
    lost (here: applied by the store directly under this replica's id, the pass never
    sent): the resend is a duplicate that sends the new pass at once."""
    harness = make(TwoRankPlanner(3, predict=True))
    harness.submit("r")
    harness.planner.sent.clear()
    first, last = harness.planner.reports_for("r", "llm", 0)
    assert harness.apply_report(first).status is ReportStatus.APPLIED
    outcome = harness.store.record_worker_report(
        "r", "llm", fwd_pass=0, worker_graph_id="llm-tp2", rank=1, num_ranks=2,
        published=last.published, replica_id=harness.replica.id,
        then_step=harness.planner.predict_step(last), check_in=30.0,
    )  # fmt: skip
    assert outcome.stepped_to == 1 and harness.planner.sent == []
    result = harness.apply_report(last)
    assert (result.status, result.drove, result.new_pass) == (ReportStatus.DUPLICATE, True, 1)
    assert harness.planner.sent == [("r", "llm", 1)]


def test_a_step_claimed_by_another_replica_first_is_fenced(make: Any, kind: str) -> None:
    """Replica A stalls between its report and its step past the lease; B claims the step:
    A's step is refused, changes nothing, and B's drive stands."""
    rid = next(r for r in IDS if model.spec(SEED, r).model == model.TEXT)
    claimed: list[Any] = []
    b = make(replica_id="replica-b")

    def stall(point: str) -> None:
        if point == "after_report" and not claimed:
            time.sleep(FAST.lease_ttl + 0.1)
            lease = b.store.claim_step(rid, model.DEFAULT, "replica-b")
            assert lease is not None
            claimed.append(lease)

    a = make(replica_id="replica-a", failpoints=stall)
    a.submit(rid)
    (report,) = a.planner.reports_for(rid, model.DEFAULT, 0)
    result = a.apply_report(report)
    assert (result.status, result.drove) == (ReportStatus.FENCED, False)
    part = a.store.load_partition(rid, model.DEFAULT)
    assert part.fwd_pass_number == 0  # A changed nothing
    assert a.planner.sent == [(rid, model.DEFAULT, 0)]  # nor sent anything
    assert a.counts["fenced"] == 1


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.fake
@pytest.mark.parametrize(
    ("predict", "batched", "expected"),
    [(False, False, 3), (True, False, 2), (False, True, 2)],
    ids=["plain", "predict", "batched"],
)
def test_round_trips_per_two_rank_pass(
    make: Any, client: redis.Redis, predict: bool, batched: bool, expected: int
) -> None:
    """A decode pass of the LLM (tensor parallel 2, both ranks publishing KV) costs 3 round
    trips (two reports, one step), 2 when the step is predicted (taken by the completing
    report) or when both reports are applied in one batch (record, then step)."""
    from tests.counting import count_round_trips
    from tests.runtime_planner import TwoRankPlanner, two_rank_reports

    harness = make(TwoRankPlanner(passes=12, predict=predict))
    harness.submit("llm-only")
    store = harness.replica.store
    counting = count_round_trips(store)
    per_pass = []
    while harness.planner.sent:
        rid, _, fwd_pass = harness.planner.sent.pop(0)
        before = counting.round_trips
        reports = two_rank_reports(rid, fwd_pass)
        if batched:
            harness.apply_reports(reports)
        else:
            for report in reports:
                harness.apply_report(report)
        per_pass.append(counting.round_trips - before)
    assert finished(harness.store, "llm-only")
    # The first passes load scripts into the server (NOSCRIPT, once); the last finishes.
    steady = per_pass[2:-1]
    assert steady == [expected] * len(steady), per_pass


# -- the background loop, drain, expiry ------------------------------------------------------------


def test_run_heartbeats_with_stats_and_leaves_on_drain(make: Any, client: redis.Redis) -> None:
    harness = make()
    rid = IDS[0]
    harness.submit(rid)
    harness.start()
    keys = harness.store.keys
    end = time.monotonic() + 10
    while client.zscore(keys.replicas, "replica-1") is None:
        assert time.monotonic() < end, "no heartbeat"
        time.sleep(0.02)
    pump(harness, [rid])
    end = time.monotonic() + 10
    while int(client.hget(keys.replica_stats("replica-1"), "finished") or 0) < 1:
        assert time.monotonic() < end, client.hgetall(keys.replica_stats("replica-1"))
        time.sleep(0.02)
    harness.stop()
    assert harness.drain() == 0  # nothing held: nothing to hand over
    assert client.zscore(keys.replicas, "replica-1") is None
    with pytest.raises(ReplicaDrainingError):
        harness.apply_report(harness.planner.reports_for(rid, model.DEFAULT, 0)[0])


def test_drain_hands_over_and_another_replica_takes_over_within_one_interval(
    make: Any, client: redis.Redis
) -> None:
    """A's steps are in flight (its planner is stuck deciding them) when it drains: their
    leases are handed over, and B (running its loop) claims each within one recovery
    interval of the hand-over, by the server's clock (the history stream's times). A's
    steps, decided at last, are refused."""
    interval = 0.25
    timing = Timing(
        lease_ttl=10.0, pass_deadline=5.0, recovery_interval=interval, heartbeat=1.0,
        keep_for=60.0, drain_timeout=0.2,
    )  # fmt: skip
    release = threading.Event()

    class Stuck(SimPlanner):
        def next_step(self, *args: Any) -> Any:
            release.wait(10)  # A decides its steps only once it has drained
            return super().next_step(*args)

    ids = [r for r in IDS if model.spec(SEED, r).model == model.TEXT][:2]
    a = make(Stuck(SEED), timing, replica_id="replica-a")
    b = make(SimPlanner(SEED), timing, replica_id="replica-b")
    for rid in ids:
        a.submit(rid)
    sent = list(a.planner.sent)
    a.planner.sent.clear()
    workers = []
    for rid, partition, fwd_pass in sent:
        (report,) = a.planner.reports_for(rid, partition, fwd_pass)
        workers.append(threading.Thread(target=a.apply_report, args=(report,)))
    b.start()
    for worker in workers:
        worker.start()
    end = time.monotonic() + 10
    while len(a.replica.books.held()) < len(ids):
        assert time.monotonic() < end
        time.sleep(0.01)
    assert a.drain() == len(ids)
    while b.counts.get("takeovers", 0) < len(ids):  # until then A's late steps could win
        assert time.monotonic() < end
        time.sleep(0.01)
    release.set()
    for worker in workers:
        worker.join(10)
    pump(b, ids)
    for rid in ids:
        entries = client.xrange(a.store.keys.history(rid))
        released = [int(i.split(b"-")[0]) for i, f in entries if f.get(b"op") == b"release"
                    and f.get(b"replica") == b"replica-a"]  # fmt: skip
        claims = [int(i.split(b"-")[0]) for i, f in entries if f.get(b"op") == b"claim"
                  and f.get(b"replica") == b"replica-b"]  # fmt: skip
        assert released and claims, entries
        takeover = (claims[0] - released[0]) / 1000
        assert takeover <= interval * 1.2, (takeover, interval)
    assert b.counts["takeovers"] >= len(ids)
    assert a.counts["fenced"] == len(ids)  # A's late steps were refused


def test_finished_requests_are_kept_for_keep_for_then_expire(
    make: Any, client: redis.Redis
) -> None:
    timing = dataclasses.replace(FAST, keep_for=0.5)
    harness = make(timing=timing)
    rid = IDS[0]
    harness.submit(rid)
    pump(harness, [rid])
    assert harness.store.load_record(rid).final_outputs
    ttl = client.pttl(harness.store.keys.meta(rid))
    assert 0 < ttl <= 500
    end = time.monotonic() + 10
    while client.exists(harness.store.keys.meta(rid)):
        assert time.monotonic() < end
        time.sleep(0.05)
    assert rid in harness.store.list_requests()  # until reaped: its keys are gone
    assert harness.store.reap(max_age=3600) == [rid]
    assert rid not in harness.store.list_requests()


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.fake
def test_timing_must_agree_with_the_store(client: redis.Redis, namespace: str) -> None:
    store = RequestStore(client, namespace=namespace, lease_ttl=10.0)
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        Replica(store, planner=SimPlanner(SEED), timing=Timing(lease_ttl=5.0))
    with pytest.raises(ConfigurationError, match="pass_deadline"):
        Timing(pass_deadline=0)
    with pytest.raises(ConfigurationError, match="replica id"):
        Replica(store, planner=SimPlanner(SEED), replica_id="")
    with pytest.raises(ConfigurationError, match="AsyncReplica"):
        Replica(store, planner=AsyncPlanner())


def test_claim_step_refuses_a_step_of_a_finished_request(make: Any) -> None:
    harness = make()
    rid = IDS[0]
    harness.submit(rid)
    pump(harness, [rid])
    partition = next(iter(harness.store.load_request(rid).partitions))
    assert harness.store.claim_step(rid, partition, "someone") is None
    # ... and recovery is not asked to look at it again.
    assert (rid, partition) not in harness.store.due_steps()
