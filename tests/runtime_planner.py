"""A runtime planner for tests: the simulated models of ``store.cli.simulate.model``.

``SimPlanner`` says what ``model`` says (next steps, which codec pass can run, final
outputs) and sends passes to ``sink`` (a list by default); ``reports_for`` is what the
workers answer to a sent pass, as ``store.Report`` values. ``PredictingPlanner`` also
predicts every step (the model's next step depends on the pass number only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mstar.conductor.request_info import CurrentForwardConductorMetadata, PartitionState
from mstar.engine.resources import KVSequenceInfo, PublishedKVInfo
from store import Planner, Report, RequestState, Step
from store.cli.simulate import model

Sent = tuple[str, str, int]


def to_report(r: model.Report) -> Report:
    return Report(
        request_id=r.request_id, partition=r.partition, fwd_pass=r.fwd_pass,
        worker_graph_id=r.worker_graph_id, rank=r.rank, num_ranks=r.num_ranks,
        new_tokens=r.new_tokens, output_names=r.output_names, consumed=dict(r.consumed),
        published=r.published(),
    )  # fmt: skip


class SimPlanner(Planner):
    def __init__(self, seed: int, sink: Callable[[Sent], Any] | None = None) -> None:
        self.seed = seed
        self.sent: list[Sent] = []
        self.sink = sink or self.sent.append
        self.finished_ids: list[str] = []
        self._specs: dict[str, model.RequestSpec] = {}

    def spec(self, request_id: str) -> model.RequestSpec:
        found = self._specs.get(request_id)
        if found is None:
            found = self._specs[request_id] = model.spec(self.seed, request_id)
        return found

    def create(self, request_id: str) -> dict[str, Any]:
        """``submit``'s keyword arguments for the request."""
        return model.initial_request(self.spec(request_id))

    def reports_for(self, request_id: str, partition: str, fwd_pass: int) -> list[Report]:
        return [to_report(r) for r in model.reports(self.spec(request_id), partition, fwd_pass)]

    def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        step = model.next_step(self.spec(request_id), partition, state.fwd_pass_number)
        return Step(step.metadata, step.worker_graph_ids, step.done)

    def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Step) -> None:
        self.sink((request_id, partition, fwd_pass))

    def runnable(self, request_id: str, partition: str, state: RequestState) -> bool:
        part = state.partitions[partition]
        return model.ready(
            self.spec(request_id), partition, part.fwd_pass_number, state.connections
        )

    def final_outputs(self, request_id: str, state: RequestState) -> Mapping[str, Any]:
        return model.final_outputs(self.spec(request_id), state)

    def finished(self, request_id: str, state: RequestState) -> None:
        self.finished_ids.append(request_id)


class PredictingPlanner(SimPlanner):
    def predict_step(self, report: Report) -> Step | None:
        step = model.next_step(self.spec(report.request_id), report.partition, report.fwd_pass)
        return Step(step.metadata, step.worker_graph_ids, step.done)


class TwoRankPlanner(SimPlanner):
    """One partition, "llm", run by a tensor-parallel-2 worker graph for ``passes`` passes;
    both ranks publish their KV shard (merged by the server), rank 0 emits a token."""

    def __init__(self, passes: int, *, predict: bool = False) -> None:
        super().__init__(0)
        self.passes = passes
        self.predicts = predict

    def create(self, request_id: str) -> dict[str, Any]:
        prefill = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
        part = PartitionState("llm", prefill, current_worker_graph_ids={"llm-tp2"})
        return {"partitions": {"llm": part}, "max_output_tokens": self.passes}

    def reports_for(self, request_id: str, partition: str, fwd_pass: int) -> list[Report]:
        return two_rank_reports(request_id, fwd_pass)

    def _step_after(self, fwd_pass: int) -> Step:
        done = fwd_pass + 1 >= self.passes
        decode = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
        return Step(decode, () if done else ("llm-tp2",), done)

    def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        return self._step_after(state.fwd_pass_number)

    def runnable(self, request_id: str, partition: str, state: RequestState) -> bool:
        return True

    def final_outputs(self, request_id: str, state: RequestState) -> Mapping[str, Any]:
        return {"text": {"tokens": state.partitions["llm"].num_output_tokens}}

    def predict_step(self, report: Report) -> Step | None:
        return self._step_after(report.fwd_pass) if self.predicts else None


def two_rank_reports(request_id: str, fwd_pass: int) -> list[Report]:
    reports = []
    for rank in (0, 1):
        shard = KVSequenceInfo(seq_len=16 + fwd_pass, page_indices=[rank])
        kv = PublishedKVInfo(info={rank: {"llm": shard}}, world_size=2)
        report = Report(
            request_id=request_id, partition="llm", fwd_pass=fwd_pass,
            worker_graph_id="llm-tp2", rank=rank, num_ranks=2,
            new_tokens=1 if rank == 0 else 0, published={"kv": kv},
        )  # fmt: skip
        reports.append(report)
    return reports
