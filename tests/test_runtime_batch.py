"""``apply_reports`` (batched) gives the results of ``apply_report`` one at a time, and
leaves the same state: a property test over report sequences in any order, with
duplicates, late and early copies, over three models (text, LLM -> codec, TP-2), with a
planner that knows no step ahead and with one that predicts every step (the completing
reports then take their steps in the batch's own call)."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import Replica, Report, RequestStore, Timing
from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.cli.simulate.reference import canonical
from tests.runtime_planner import TwoRankPlanner, two_rank_reports

pytestmark = pytest.mark.fake

SEED = 4
TEXT = next(r for r in model.request_ids(20) if model.spec(SEED, r).model == model.TEXT)
TTS = next(r for r in model.request_ids(20) if model.spec(SEED, r).model == model.TTS)
TP2 = "tp2-request"
TIMING = Timing(lease_ttl=30.0, pass_deadline=30.0, max_pass_deadline=60.0)


class Planner(SimPlanner):
    """The simulation's models, and one more request of a TP-2 partition (3 passes)."""

    tp2 = TwoRankPlanner(3)

    def create(self, request_id: str) -> dict[str, Any]:
        return (self.tp2 if request_id == TP2 else super()).create(request_id)

    def next_step(self, request_id: str, partition: str, state: Any) -> Any:
        planner = self.tp2 if request_id == TP2 else super()
        return planner.next_step(request_id, partition, state)

    def runnable(self, request_id: str, partition: str, state: Any) -> bool:
        planner = self.tp2 if request_id == TP2 else super()
        return planner.runnable(request_id, partition, state)

    def final_outputs(self, request_id: str, state: Any) -> Any:
        planner = self.tp2 if request_id == TP2 else super()
        return planner.final_outputs(request_id, state)


class Predicting(Planner):
    """The same planner, predicting every step (as a decode loop knows it ahead)."""

    tp2 = TwoRankPlanner(3, predict=True)

    def predict_step(self, report: Report) -> Any:
        if report.request_id == TP2:
            return self.tp2.predict_step(report)
        return model.next_step(self.spec(report.request_id), report.partition, report.fwd_pass)


def universe() -> list[Report]:
    """Every report the workers could send for these requests, each pass's ranks."""
    planner = Planner(SEED)
    out: list[Report] = []
    for rid in (TEXT, TTS):
        spec = planner.spec(rid)
        for partition in spec.partitions:
            passes = spec.codec_passes if partition == model.CODEC else len(spec.chunks)
            for fwd_pass in range(passes):
                out += planner.reports_for(rid, partition, fwd_pass)
    for fwd_pass in range(3):
        out += two_rank_reports(TP2, fwd_pass)
    return out


UNIVERSE = universe()
# In an order that mostly moves forward (so that requests get somewhere), with noise.
reports_strategy = st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=1, max_size=40).map(
    lambda picks: [UNIVERSE[i] for i in picks]
)


def replica(
    server: fakeredis.FakeServer, namespace: str, planner_class: type[Planner] = Planner
) -> tuple[Replica, RequestStore]:
    store = RequestStore(
        fakeredis.FakeRedis(server=server), namespace=namespace, lease_ttl=TIMING.lease_ttl
    )
    planner = planner_class(SEED)
    rep = Replica(store, planner=planner, timing=TIMING, replica_id="r")
    for rid in (TEXT, TTS, TP2):
        rep.submit(rid, **planner.create(rid))
    return rep, store


def state_of(store: RequestStore) -> dict[str, Any]:
    return {rid: canonical(store.load_request(rid)) for rid in (TEXT, TTS, TP2)}


def describe(result: Any) -> Any:
    return type(result).__name__ if isinstance(result, Exception) else result


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)  # fmt: skip
@given(
    reports=st.one_of(
        reports_strategy,
        st.permutations(UNIVERSE).map(list),
        st.just(sorted(UNIVERSE, key=lambda r: r.fwd_pass)),  # in pass order: all finish
    ),
    cuts=st.lists(st.integers(1, 8), min_size=1, max_size=10),
)
@pytest.mark.parametrize("planner_class", [Planner, Predicting])
def test_batched_results_and_state_equal_one_at_a_time(
    planner_class: type[Planner], reports: list[Report], cuts: list[int]
) -> None:
    server = fakeredis.FakeServer()
    one, one_store = replica(server, "one", planner_class)
    many, many_store = replica(server, "many", planner_class)
    expected = []
    for report in reports:
        try:
            expected.append(one.apply_report(report))
        except Exception as e:
            expected.append(e)
    got: list[Any] = []
    at, i = 0, 0
    while at < len(reports):
        size = cuts[i % len(cuts)]
        got += many.apply_reports(reports[at : at + size])
        at, i = at + size, i + 1
    assert [describe(r) for r in got] == [describe(r) for r in expected]
    assert state_of(many_store) == state_of(one_store)


@pytest.mark.parametrize("planner_class", [Planner, Predicting])
def test_in_pass_order_every_request_finishes_in_both(planner_class: type[Planner]) -> None:
    """The property above runs on orders that finish requests, too (a sanity check that
    its examples reach the finishing code)."""
    server = fakeredis.FakeServer()
    many, store = replica(server, "ns", planner_class)
    taken: list[int] = []
    take_steps = store.take_steps
    store.take_steps = lambda steps: taken.append(len(steps)) or take_steps(steps)  # type: ignore[method-assign]
    in_order = sorted(UNIVERSE, key=lambda r: r.fwd_pass)
    results = many.apply_reports(in_order)
    assert sum(1 for r in results if not isinstance(r, Exception) and r.finished) == 3
    assert all(store.load_record(rid).finished_at for rid in (TEXT, TTS, TP2))
    # Known ahead, every step is taken by the report that completes its pass.
    assert (sum(taken) == 0) == (planner_class is Predicting), taken
