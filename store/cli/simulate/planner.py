"""The simulation's planner: what ``model`` says, behind the runtime's ``Planner`` protocol.

``SimPlanner`` answers the runtime's questions from the model (next steps, which codec pass
can run, final outputs) and sends passes to ``sink``: a list by default (tests, the
reference run), the dispatch list for a replica process. ``AsyncSimPlanner`` is the same
decisions for ``AsyncReplica``, with an awaitable sink (so a send does not block the loop).
``reports_for`` is what the workers answer to a sent pass, as ``store.Report`` values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from store.cli.simulate import model
from store.records import Report, RequestState, Step
from store.runtime.planner import AsyncPlanner, Planner
from store.types import PartitionState

Sent = tuple[str, str, int]


def to_report(r: model.Report) -> Report:
    """A simulated worker's report as the store takes it (published infos built)."""
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
        self.on_finished: Callable[[str], Any] | None = None
        self.before_step: Callable[[], Any] | None = None  # a hook: a slow planner, say
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
        if self.before_step is not None:
            self.before_step()
        return model.next_step(self.spec(request_id), partition, state.fwd_pass_number)

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
        if self.on_finished is not None:
            self.on_finished(request_id)


class AsyncSimPlanner(AsyncPlanner):
    """``SimPlanner``'s decisions behind ``async def`` methods; passes go to ``sink`` and
    finished requests to ``on_finished`` (both awaited) when given, else to the wrapped
    planner's."""

    def __init__(
        self,
        planner: SimPlanner,
        sink: Callable[[Sent], Awaitable[Any]] | None = None,
        on_finished: Callable[[str], Awaitable[Any]] | None = None,
    ) -> None:
        self.planner = planner
        self.sink = sink
        self.on_finished = on_finished
        self.before_step: Callable[[], Awaitable[Any]] | None = None

    async def next_step(self, request_id: str, partition: str, state: PartitionState) -> Step:
        if self.before_step is not None:
            await self.before_step()
        return self.planner.next_step(request_id, partition, state)

    async def dispatch(self, request_id: str, partition: str, fwd_pass: int, step: Step) -> None:
        if self.sink is None:
            self.planner.dispatch(request_id, partition, fwd_pass, step)
        else:
            await self.sink((request_id, partition, fwd_pass))

    async def predict_step(self, report: Report) -> Step | None:
        return self.planner.predict_step(report)

    async def runnable(self, request_id: str, partition: str, state: RequestState) -> bool:
        return self.planner.runnable(request_id, partition, state)

    async def final_outputs(self, request_id: str, state: RequestState) -> Mapping[str, Any]:
        return self.planner.final_outputs(request_id, state)

    async def finished(self, request_id: str, state: RequestState) -> None:
        self.planner.finished(request_id, state)
        if self.on_finished is not None:
            await self.on_finished(request_id)
