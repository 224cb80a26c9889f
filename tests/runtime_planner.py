"""Runtime planners for tests, built on the simulation's own (``SimPlanner``).

``PredictingPlanner`` also predicts every step (the model's next step depends on the pass
number only); ``TwoRankPlanner`` is one tensor-parallel-2 partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from store import Report, RequestState, Step
from store.cli.simulate import model
from store.cli.simulate.planner import SimPlanner
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
)


class PredictingPlanner(SimPlanner):
    def predict_step(self, report: Report) -> Step | None:
        return model.next_step(self.spec(report.request_id), report.partition, report.fwd_pass)


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
        shard = KVSequenceInfo(
            seq_len=16 + fwd_pass, latest_kv_transfer_info=None, page_indices=[rank]
        )
        kv = PublishedKVInfo(info={rank: {"llm": shard}}, world_size=2)
        report = Report(
            request_id=request_id, partition="llm", fwd_pass=fwd_pass,
            worker_graph_id="llm-tp2", rank=rank, num_ranks=2,
            new_tokens=1 if rank == 0 else 0, published={"kv": kv},
        )  # fmt: skip
        reports.append(report)
    return reports
