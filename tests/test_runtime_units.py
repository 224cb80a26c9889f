"""The runtime's pure parts without any Redis: timing, books, waves, and the decisions
driven by a scripted stand-in for the store and the planner."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from store import (
    ConfigurationError,
    FencedError,
    Lease,
    Report,
    ReportOutcome,
    RequestNotFound,
    Step,
    StoreConnectionError,
    Timing,
)
from store.keys import KeySpace
from store.observe import Instruments
from store.ops.core import Topology
from store.records import RequestRecord, RequestState
from store.runtime import decisions, recovery
from store.runtime.books import Books
from store.runtime.decisions import Call, Failpoint, ReportStatus
from store.runtime.timing import HEARTBEAT, REAP, RECOVERY, Deadlines, Latencies, Schedule
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)

pytestmark = pytest.mark.fake

META = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def books(timing: Timing | None = None, clock: Clock | None = None) -> Books:
    return Books(
        "me", KeySpace("ns"), timing or Timing(), clock=clock or Clock(), wall_clock=Clock(),
        rng=random.Random(1), instruments=Instruments("ns"),
    )  # fmt: skip


# -- timing ------------------------------------------------------------------------------


def test_timing_refuses_settings_that_cannot_work() -> None:
    for bad in ({"lease_ttl": 0}, {"heartbeat": float("nan")}, {"jitter": 2},
                {"pass_deadline": 10, "max_pass_deadline": 5}, {"recovery_batch": 0}):  # fmt: skip
        with pytest.raises(ConfigurationError):
            Timing(**bad)  # type: ignore[arg-type]


def test_latency_p99() -> None:
    latencies = Latencies(1000)
    assert latencies.p99() is None
    for i in range(1, 101):
        latencies.add(i / 100)
    assert latencies.p99() == 0.99
    small = Latencies(3)
    for v in (5.0, 1.0, 2.0, 3.0):
        small.add(v)
    assert small.p99() == 3.0  # the window keeps the latest three


def test_latency_p99_is_that_of_the_window_as_samples_come_and_go() -> None:
    rng = random.Random(7)
    latencies, window = Latencies(50), deque(maxlen=50)
    for _ in range(2_000):
        value = rng.choice([rng.uniform(0, 2), 1.0, 0.5])  # repeats too
        latencies.add(value)
        window.append(value)
        ordered = sorted(window)
        assert latencies.p99() == ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def test_deadlines_follow_observed_latency_double_per_send_and_are_capped() -> None:
    timing = Timing(pass_deadline=1.0, deadline_factor=4.0, max_pass_deadline=30.0, jitter=0.25)
    latencies = Latencies(100)
    deadlines = Deadlines(timing, latencies, random.Random(3))
    assert deadlines.base() == 1.0  # nothing observed: the floor
    latencies.add(0.1)
    assert deadlines.base() == 1.0  # 4 x 0.1 is below the floor
    latencies.add(2.0)
    assert deadlines.base() == 8.0
    assert [deadlines.wait(n) for n in (0, 1, 2, 3, 4)] == [8.0, 8.0, 16.0, 30.0, 30.0]
    for send in (1, 2, 5):
        for _ in range(50):
            assert deadlines.wait(send) <= deadlines.check_in(send) <= deadlines.wait(send) * 1.25
    pauses = [deadlines.retry_pause(n) for n in range(1, 12)]
    assert all(timing.retry_pause <= p <= timing.max_retry_pause for p in pauses)
    assert pauses[-1] >= timing.max_retry_pause / 2


def test_schedule_runs_duties_at_their_intervals_and_pauses_after_failures() -> None:
    timing = Timing(heartbeat=2.0, recovery_interval=1.0, reap_interval=60.0)
    schedule = Schedule(timing, Deadlines(timing, Latencies(1), random.Random(0)), now=0.0)
    assert schedule.due(0.0) == [HEARTBEAT, RECOVERY]
    schedule.done(HEARTBEAT, 0.0)
    schedule.done(RECOVERY, 0.0, backlog=True)  # a full batch: look again at once
    assert schedule.due(0.0) == [RECOVERY]
    schedule.done(RECOVERY, 0.0)
    assert schedule.wait(0.0) == 1.0
    assert schedule.due(60.0) == [HEARTBEAT, RECOVERY, REAP]
    first = schedule.failed(RECOVERY, 60.0)
    later = [schedule.failed(RECOVERY, 60.0) for _ in range(10)]
    assert first < timing.retry_pause * 2 + 1e-9 and max(later) <= timing.max_retry_pause
    schedule.done(RECOVERY, 61.0)
    assert schedule.failures == 0


# -- books --------------------------------------------------------------------------------


def lease(token: int = 1, partition: str = "p", **kw: Any) -> Lease:
    return Lease(
        "r", partition, "me", token, kw.pop("pass_number", 0), kw.pop("expires", 110.0), **kw
    )


def test_books_hold_each_lease_once_and_forget_lapsed_ones() -> None:
    clock = Clock()
    b = books(Timing(lease_ttl=10.0), clock)
    assert b.hold(lease(1))
    assert not b.hold(lease(1))  # the same lease, claimed back by its holder: one drive
    assert b.hold(lease(2))  # a newer one replaces it
    b.drop(lease(1))  # an older lease's end does not drop the newer
    assert [x.token for x in b.held()] == [2]
    clock.now += 10.0
    assert b.held() == []


def test_books_measure_latency_from_a_pass_s_first_send() -> None:
    clock = Clock()
    b = books(clock=clock)
    b.sent("r", "p", 3)
    clock.now += 0.5
    b.sent("r", "p", 3)  # sent again
    assert b.since_sent("r", "p", 3) == 0.0 and b.sending("r", "p", 3)
    clock.now += 0.25
    b.completed("r", "p", 3)
    assert b.latencies.p99() == 0.75
    assert not b.sending("r", "p", 3) and b.since_sent("r", "p", 3) is None
    b.completed("r", "p", 4)  # not sent by this replica: no sample
    assert b.latencies.p99() == 0.75


# -- waves --------------------------------------------------------------------------------


def report(rid: str, partition: str, fwd_pass: int, rank: int = 0) -> Report:
    return Report(
        request_id=rid, partition=partition, fwd_pass=fwd_pass, worker_graph_id="wg",
        rank=rank, num_ranks=2,
    )  # fmt: skip


def test_waves_keep_one_pass_per_request_and_no_repeats() -> None:
    reports = [
        report("a", "p", 0, 0), report("b", "p", 0, 0), report("a", "p", 0, 1),  # one wave
        report("a", "p", 0, 1),  # a repeat: next wave
        report("a", "p", 1, 0),  # the next pass of a: next wave
        report("a", "q", 1, 0),  # another partition of a: next wave
        report("b", "p", 1, 0),
    ]  # fmt: skip
    assert decisions.waves(reports) == [[0, 1, 2], [3], [4], [5, 6]]
    assert decisions.waves([]) == []


# -- decisions, scripted ------------------------------------------------------------------


Answer = Any | Callable[[Call], Any]


def drive(program: decisions.Program[Any], answers: Mapping[str, Answer]) -> tuple[Any, list[Any]]:
    """Run ``program`` with ``answers[method]`` (a value, an exception to raise, or a
    function of the call); returns its result and every effect it yielded."""
    seen: list[Any] = []
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value, seen
        seen.append(effect)
        value, error = None, None
        if isinstance(effect, Failpoint):
            continue
        answer = answers[effect.method]
        if isinstance(answer, BaseException):
            error = answer
        else:
            value = answer(effect) if callable(answer) else answer


def calls(seen: list[Any]) -> list[str]:
    return [e.method for e in seen if isinstance(e, Call)]


def partition(fwd_pass: int = 0, *, complete: bool = False, done: bool = False) -> PartitionState:
    return PartitionState(
        "p", META, fwd_pass_number=fwd_pass, is_done=done,
        current_worker_graph_ids=set() if done else {"wg"},
        completed_worker_graph_ids={"wg"} if complete else set(),
    )  # fmt: skip


def request(*parts: PartitionState, conns: tuple[str, ...] = ()) -> RequestState:
    record = RequestRecord("r", 8, 0, [p.partition_name for p in parts], list(conns))
    connections = {c: StreamingConnectionState(*c.split("->"), c) for c in conns}
    return RequestState(record, {p.partition_name: p for p in parts}, connections)


ALONE = Topology(("p",), ())


def test_a_complete_report_drives_its_step_and_sends_the_next_pass() -> None:
    b = books()
    outcome = ReportOutcome(True, 2, True, True, lease=lease(), stored=lambda: partition(0))
    step = Step(META, ("wg",))
    result, seen = drive(
        decisions.apply_report(b, report("r", "p", 0), predict=False),
        {"record_worker_report": outcome, "next_step": step, "take_step": 1,
         "topology": ALONE, "dispatch": None},
    )  # fmt: skip
    assert result == decisions.ReportResult(ReportStatus.APPLIED, drove=True, new_pass=1)
    assert calls(seen) == ["record_worker_report", "next_step", "take_step", "topology", "dispatch"]
    assert [e.name for e in seen if isinstance(e, Failpoint)] == [
        "after_report", "after_step", "after_dispatch",
    ]  # fmt: skip
    assert b.held() == []


def test_a_pass_the_planner_fails_to_send_is_left_to_its_deadline() -> None:
    b = books()
    outcome = ReportOutcome(True, 2, True, True, lease=lease(), stored=lambda: partition(0))
    result, _ = drive(
        decisions.apply_report(b, report("r", "p", 0), predict=False),
        {"record_worker_report": outcome, "next_step": Step(META, ("wg",)), "take_step": 1,
         "topology": ALONE, "dispatch": ConnectionError("transport down")},
    )  # fmt: skip
    assert result == decisions.ReportResult(ReportStatus.APPLIED, drove=True, new_pass=1)
    assert b.counts["dispatch_errors"] == 1 and b.counts["dispatches"] == 0
    assert b.held() == []


def test_a_predicted_step_is_taken_by_the_report_itself() -> None:
    b = books()
    step = Step(META, ("wg",))
    outcome = ReportOutcome(True, 2, True, True, lease=lease(), stepped_to=1)
    result, seen = drive(
        decisions.apply_report(b, report("r", "p", 0), predict=True),
        {"predict_step": step, "record_worker_report": lambda call: (
            outcome if call.kwargs["then_step"] == step and call.kwargs["check_in"] > 0 else None
        ), "topology": ALONE, "dispatch": None},
    )  # fmt: skip
    assert result.drove and result.new_pass == 1
    assert calls(seen) == ["predict_step", "record_worker_report", "topology", "dispatch"]


def test_a_batch_takes_its_predicted_steps_in_the_reports_call() -> None:
    b = books()
    step = Step(META, ("wg",))
    stepped = ReportOutcome(True, 2, True, True, lease=lease(), stepped_to=1)
    pending = ReportOutcome(True, 1, False, False)
    result, seen = drive(
        decisions.apply_reports(b, [report("r", "p", 0, 0), report("r", "p", 0, 1)], predict=True),
        {"predict_step": step, "record_worker_reports": lambda call: (
            [pending, stepped] if call.kwargs["then_steps"] == [step, step]
            and len(call.kwargs["check_in"]) == 2 and min(call.kwargs["check_in"]) > 0
            else None
        ), "topology": ALONE, "dispatch": None},
    )  # fmt: skip
    assert result == [
        decisions.ReportResult(ReportStatus.APPLIED),
        decisions.ReportResult(ReportStatus.APPLIED, drove=True, new_pass=1),
    ]
    assert calls(seen) == [
        "predict_step", "predict_step", "record_worker_reports", "topology", "dispatch",
    ]  # fmt: skip
    assert b.counts["passes"] == 1 and b.held() == []


def test_a_fenced_step_is_dropped() -> None:
    b = books()
    outcome = ReportOutcome(False, 2, True, True, lease=lease(), stored=lambda: partition(0))
    result, _ = drive(
        decisions.apply_report(b, report("r", "p", 0), predict=False),
        {"record_worker_report": outcome, "next_step": Step(META, ("wg",)),
         "take_step": FencedError(1, 2, request_id="r")},
    )  # fmt: skip
    assert result == decisions.ReportResult(ReportStatus.FENCED)
    assert b.held() == [] and b.counts["fenced"] == 1 and b.counts["duplicates"] == 1


def claimed(sends: int = 1, sent_at: float = 0.0) -> Lease:
    return lease(5, expires=110.0, sends=sends, sent_at=sent_at)


def test_recovery_sends_a_lost_pass_again_and_backs_off() -> None:
    b = books(Timing(pass_deadline=1.0, jitter=0.0))
    released: list[float] = []
    _, seen = drive(
        recovery.redo(b, claimed(sends=2)),
        {"load_request": request(partition(0)), "topology": ALONE, "runnable": True,
         "dispatch": None, "release_lease": lambda call: released.append(call.kwargs["check_in"])},
    )  # fmt: skip
    assert calls(seen) == ["load_request", "topology", "runnable", "dispatch", "release_lease"]
    assert released == [4.0]  # the third send waits 1 s x 2**2
    assert b.counts["resends"] == 1 and b.held() == []


def test_recovery_does_not_resend_a_pass_sent_lately_or_one_that_cannot_run() -> None:
    clock = Clock()
    b = books(Timing(pass_deadline=1.0, jitter=0.0), clock)
    b.sent("r", "p", 0)
    clock.now += 0.25  # the deadline grew since this replica sent it
    released: list[float] = []
    answers = {"load_request": request(partition(0)), "topology": ALONE, "runnable": True,
               "release_lease": lambda call: released.append(call.kwargs["check_in"])}  # fmt: skip
    _, seen = drive(recovery.redo(b, claimed(sends=1)), answers)
    assert "dispatch" not in calls(seen) and released == [0.75] and b.counts["fresh"] == 1
    _, seen = drive(recovery.redo(b, claimed(sends=3)), {**answers, "runnable": False})
    assert "dispatch" not in calls(seen) and b.counts["waiting"] == 1


def test_recovery_does_not_resend_a_pass_another_replica_sent_lately() -> None:
    # Claimed at 100 (expires 110, lease_ttl 10): the last holder sent the pass at 99.75, as
    # the store recorded; this replica never sent it. Ending the lease counts no send.
    b = books(Timing(lease_ttl=10.0, pass_deadline=1.0, jitter=0.0))
    released: list[tuple[float, bool]] = []
    answers = {"load_request": request(partition(0)), "topology": ALONE, "runnable": True,
               "release_lease": lambda call: released.append(
                   (call.kwargs["check_in"], call.kwargs["sent"]))}  # fmt: skip
    _, seen = drive(recovery.redo(b, claimed(sends=1, sent_at=99.75)), answers)
    assert "dispatch" not in calls(seen) and released == [(0.75, False)]
    _, seen = drive(recovery.redo(b, claimed(sends=1, sent_at=95.0)), {**answers, "dispatch": None})
    assert "dispatch" in calls(seen) and released[1] == (2.0, True)


def test_recovery_takes_a_complete_pass_s_step_and_finishes_a_done_request() -> None:
    b = books()
    states = [request(partition(0, complete=True)), request(partition(1, done=True))]
    _, seen = drive(
        recovery.redo(b, claimed()),
        {"load_request": lambda call: states.pop(0), "next_step": Step(META, (), True),
         "take_step": 1, "topology": ALONE, "final_outputs": {"text": 1},
         "set_final_output": None, "finished": None, "finish_request": None},
    )  # fmt: skip
    assert calls(seen) == [
        "load_request", "next_step", "take_step", "topology", "load_request", "final_outputs",
        "set_final_output", "finished", "finish_request",
    ]  # fmt: skip
    assert b.counts["finished"] == 1


def test_recovery_of_a_done_partition_whose_request_is_not_done_ends_its_checks() -> None:
    b = books()
    done, running = (
        partition(3, done=True),
        PartitionState("q", META, current_worker_graph_ids={"wg"}),
    )
    releases: list[Any] = []
    _, seen = drive(
        recovery.redo(b, claimed()),
        {"load_request": request(done, running, conns=("p->q",)),
         "topology": Topology(("p", "q"), ("p->q",)), "runnable": False,
         "release_lease": lambda call: releases.append(call.kwargs["check_in"])},
    )  # fmt: skip
    assert releases == [None] and "finish_request" not in calls(seen)
    assert "runnable" in calls(seen)  # its consumer was looked at (a nudge may be lost)


PRODUCER = Topology(("p", "q"), ("p->q",))


def consumer(fwd_pass: int = 4, *, reported: bool = False) -> PartitionState:
    return PartitionState(
        "q", META, fwd_pass_number=fwd_pass, current_worker_graph_ids={"wg"},
        wg_rank_completions={"wg": {0}} if reported else {},
    )  # fmt: skip


def test_a_nudge_reads_only_the_consumer_when_it_cannot_be_sent() -> None:
    """The whole request (the producer's KV pages) is not read for a consumer this replica
    sent already, or one that has reported: its partition alone says so."""
    b = books()
    b.sent("r", "q", 4)
    for answer, sending in ((consumer(4), b), (consumer(5, reported=True), books())):
        _, seen = drive(decisions.nudge_consumers(sending, "r", "p", None, PRODUCER),
                        {"load_partition": answer})  # fmt: skip
        assert calls(seen) == ["load_partition"]
        assert seen[0].args == ("r", "q")


def test_a_nudge_that_may_send_reads_the_request_and_asks_the_planner() -> None:
    b = books()
    state = request(partition(3), consumer(4), conns=("p->q",))
    sent: list[Any] = []
    _, seen = drive(
        decisions.nudge_consumers(b, "r", "p", None, PRODUCER),
        {"load_partition": consumer(4), "load_request": state, "runnable": True,
         "dispatch": lambda call: sent.append(call.args[:3])},
    )  # fmt: skip
    assert calls(seen) == ["load_partition", "load_request", "runnable", "dispatch"]
    assert sent == [("r", "q", 4)] and b.counts["nudges"] == 1
    # the request's snapshot decides: the consumer reported in between, so nothing is sent
    later = request(partition(3), consumer(4, reported=True), conns=("p->q",))
    _, seen = drive(
        decisions.nudge_consumers(books(), "r", "p", None, PRODUCER),
        {"load_partition": consumer(4), "load_request": later},
    )  # fmt: skip
    assert calls(seen) == ["load_partition", "load_request"]


def test_a_nudge_of_a_request_gone_reads_nothing_more() -> None:
    gone = RequestNotFound("no such request", request_id="r")
    _, seen = drive(decisions.nudge_consumers(books(), "r", "p", None, PRODUCER),
                    {"load_partition": gone})  # fmt: skip
    assert calls(seen) == ["load_partition"]


def test_a_step_taken_in_the_report_nudges_from_the_consumers_it_brought_back() -> None:
    """The report that took its step came back with the consumer as the step left it
    (``ReportOutcome.consumers``): the nudge decides from that and reads no partition; the
    whole request is read only for a consumer that may be sent."""
    step = Step(META, ("wg",))

    def took(consumer_now: PartitionState) -> ReportOutcome:
        return ReportOutcome(
            True, 1, True, True, Lease("r", "p", "me", 1, 3, 110.0), stepped_to=4,
            stored_consumers=lambda: {"q": consumer_now},
        )  # fmt: skip

    b = books()
    b.sent("r", "q", 4)  # sent by this replica already: nothing to do
    _, seen = drive(
        decisions.apply_report(b, report("r", "p", 3), predict=True),
        {"predict_step": step, "record_worker_report": took(consumer(4)), "topology": PRODUCER,
         "dispatch": None},
    )  # fmt: skip
    assert calls(seen) == ["predict_step", "record_worker_report", "topology", "dispatch"]
    sent: list[Any] = []
    _, seen = drive(
        decisions.apply_report(books(), report("r", "p", 3), predict=True),
        {"predict_step": step, "record_worker_report": took(consumer(4)), "topology": PRODUCER,
         "dispatch": lambda call: sent.append(call.args[:3]),
         "load_request": request(partition(4), consumer(4), conns=("p->q",)), "runnable": True},
    )  # fmt: skip
    assert "load_partition" not in calls(seen)
    assert sent == [("r", "p", 4), ("r", "q", 4)]


def test_a_batch_nudges_from_the_consumers_its_steps_brought_back() -> None:
    """As one at a time: the steps taken in a wave's reports brought their consumers back,
    so no ``load_partitions`` is sent for them."""
    b = books()
    b.sent("s", "q", 4)
    step = Step(META, ("wg",))
    reports = [report(rid, "p", 3) for rid in ("r", "s")]
    stepped = [
        ReportOutcome(True, 1, True, True, Lease(rid, "p", "me", 1, 3, 110.0), stepped_to=4,
                      stored_consumers=lambda: {"q": consumer(4)})
        for rid in ("r", "s")
    ]  # fmt: skip
    sent: list[Any] = []
    _, seen = drive(
        decisions.apply_reports(b, reports, predict=True),
        {"predict_step": step, "record_worker_reports": stepped, "topology": PRODUCER,
         "dispatch": lambda call: sent.append(call.args[:3]),
         "load_request": request(partition(4), consumer(4), conns=("p->q",)), "runnable": True},
    )  # fmt: skip
    assert "load_partitions" not in calls(seen) and "load_partition" not in calls(seen)
    assert sent == [("r", "p", 4), ("s", "p", 4), ("r", "q", 4)]


def test_a_batch_reads_the_consumers_its_steps_nudge_in_one_call() -> None:
    """Three requests' producers step in one wave: their consumers are read in one
    ``load_partitions``; one may be sent (read whole, sent), one was sent already by this
    replica, and one could not be read (that report's entry is the error)."""
    b = books()
    b.sent("s", "q", 4)
    step = Step(META, ("wg",))
    reports = [report(rid, "p", 3) for rid in ("r", "s", "t")]
    stepped = [
        ReportOutcome(True, 1, True, True, lease=Lease(rid, "p", "me", 1, 3, 110.0), stepped_to=4)
        for rid in ("r", "s", "t")
    ]
    down = StoreConnectionError("Redis unreachable", request_id="t")
    sent: list[Any] = []
    result, seen = drive(
        decisions.apply_reports(b, reports, predict=True),
        {"predict_step": step, "record_worker_reports": stepped, "topology": PRODUCER,
         "dispatch": lambda call: sent.append(call.args[:3]),
         "load_partitions": lambda call: (
             [consumer(4), consumer(4), down]
             if call.args[0] == [("r", "q"), ("s", "q"), ("t", "q")] else None
         ),
         "load_request": request(partition(4), consumer(4), conns=("p->q",)),
         "runnable": True},
    )  # fmt: skip
    assert calls(seen).count("load_partitions") == 1
    assert "load_partition" not in calls(seen)
    assert [call.args for call in seen if getattr(call, "method", None) == "load_request"] == [
        ("r",)
    ]
    drove = decisions.ReportResult(ReportStatus.APPLIED, drove=True, new_pass=4)
    assert result == [drove, drove, down]
    assert sent == [("r", "p", 4), ("s", "p", 4), ("t", "p", 4), ("r", "q", 4)]
    assert b.counts["nudges"] == 1


def test_a_claim_of_a_step_this_replica_drives_already_is_left_alone() -> None:
    b = books()
    assert b.hold(claimed())
    _, seen = drive(recovery.redo(b, claimed()), {})
    assert seen == []
