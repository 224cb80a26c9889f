"""mstar-ai's own ``Conductor``, with every request it drives written to the store.

The engine's code makes every decision: this subclass overrides no decision method. It
holds back the messages the conductor sends, and each turn of the engine's run loop ends
with a commit: the requests the turn touched are written to the store
(``save_conductor_requests``: fenced, versioned, whole or not at all, one round trip), and
only then are the turn's messages sent. A conductor that crashes loses at most the turn it
was in; its successor (``attach=True``) reads every request back, claims it (which fences
out the old process, were it only paused), and carries it on with the workers that hold its
caches. Overridden, and why:

- ``__init__``: the store, the deployment, attach; worker graph ids from the store when
  attaching (the engine makes them afresh with ``uuid4``; live workers hold the old ones).
- ``_launch_workers``: not when attaching (the workers live on) or with ``launch=False``.
- ``_wait_for_workers_ready``: not when attaching (the workers were ready long ago).
- ``_sweep_expiry``: the engine's own, then the turn's commit (it is the last call of each
  turn of the run loop).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

from mstar.api_server.request_types import APIServerMessage, RequestComplete
from mstar.conductor.conductor import Conductor, DrainingRequest, RequestData
from mstar.utils.ipc_format import ConductorMessageType

from store.conductor.convert import from_request_data
from store.conductor.record import ConductorRequest
from store.errors import FencedError, RequestNotFound, StoreError
from store.records import Lease
from store.store import RequestStore

log = logging.getLogger(__name__)

FENCED_EXIT = 75
"""Exit status of a conductor that found another conductor of its deployment in charge."""
STALL_REASON = (
    "conductor restarted: a report of this request's forward pass was lost with the "
    "conductor before it was stored, and a pass cannot be run twice"
)


class StoreConductor(Conductor):  # type: ignore[misc]
    """The engine's ``Conductor``, its requests held in ``store`` under ``deployment``."""

    def __init__(
        self,
        model: Any,
        model_config_file: str,
        *,
        store: RequestStore,
        deployment: str,
        attach: bool = False,
        launch: bool = True,
        stall_timeout: float = 60.0,
        epoch_check_every: float = 0.5,
        **engine_options: Any,
    ) -> None:
        self._store = store
        self._deployment = deployment
        self._attach = attach
        self._launch = launch and not attach
        self._stall_timeout = stall_timeout
        self._epoch_check_every = epoch_check_every
        self._leases: dict[str, Lease] = {}
        self._stalled: dict[str, float] = {}  # recovered request -> when it is failed
        self._touched: set[str] = set()
        self._held: set[str] = set()  # written to the store and not dropped
        self._next_epoch_check = 0.0
        if attach:
            known = store.attach_deployment(deployment)
            _reuse_worker_graph_ids(model, known.worker_graph_ids)
        super().__init__(model, model_config_file, **engine_options)
        if attach:
            del model.get_worker_graphs  # the model's own again (a closure does not pickle)
            self._epoch = known.epoch
        else:
            self._epoch = store.start_deployment(deployment, list(self.worker_graphs)).epoch
        self.communicator: Any = _TurnCommunicator(self.communicator, self)
        if attach:
            self._recover()

    # -- the engine's lifecycle -----------------------------------------------------------

    def _launch_workers(self) -> None:
        if self._launch:
            super()._launch_workers()

    def _wait_for_workers_ready(self) -> None:
        if not self._attach:
            super()._wait_for_workers_ready()

    def _sweep_expiry(self) -> None:
        """The engine's own sweep, the last call of each run-loop turn; then the turn's
        commit, so that its messages leave now rather than after the loop's sleep."""
        super()._sweep_expiry()
        self.communicator.end_turn()

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Read back every request of this deployment, claim it, rebuild the engine's state."""
        start = time.monotonic()
        now = time.perf_counter()
        for rid in self._store.list_conductor_requests():
            try:
                held = self._store.load_conductor_request(rid)
            except RequestNotFound:
                continue
            if held.owner != self._deployment:
                continue
            self._claim(rid)
            self.requests[rid] = self._request_data(held)
            self._held.add(rid)
            if held.early_reads_done:
                self._early_reads_done[rid] = set(held.early_reads_done)
            if held.teardown is not None:
                t = held.teardown
                self.draining[rid] = DrainingRequest(
                    set(t.expected_acks), set(t.participants), t.failure_error, t.failure_status
                )
                self._draining_deadlines.append((now + self._drain_ttl_s, rid))
                if held.concluded and not held.answered:
                    self._answer_again(rid, held)
            else:
                self._stalled[rid] = time.monotonic() + self._stall_timeout
        print(
            f"attached: {len(self.requests)} requests in {time.monotonic() - start:.3f} s",
            file=sys.stderr,
            flush=True,
        )

    def _request_data(self, held: ConductorRequest) -> RequestData:
        return RequestData(
            persist_signals=held.persist_signals,
            persist_signal_ref_cnt=held.persist_signal_ref_cnt,
            worker_graph_to_workers=held.worker_graph_to_workers,
            all_worker_graph_ids=held.all_worker_graph_ids,
            max_output_tokens=held.max_output_tokens,
            random_seed=held.random_seed,
            resource_configs=held.resource_configs,
            sharding_config=self._build_request_sharding_config(held.worker_graph_to_workers),
            partition_states=held.partition_states,
            partition_definitions=held.partition_definitions,
            streaming_connections=held.streaming_connections,
            final_outputs=held.final_outputs,
            conductor_ingest_time=held.conductor_ingest_time,
            conductor_finish_time=held.conductor_finish_time,
        )

    def _answer_again(self, rid: str, held: ConductorRequest) -> None:
        """A completed request whose answer may not have left the dead conductor: send it
        (the API server takes a second, equal RequestComplete as the first). The
        UnpersistTensors of the turn that completed it are not known any more: the teardown's
        RemoveRequest frees those tensors."""
        print(f"answered again: {rid}", file=sys.stderr, flush=True)
        self.communicator.send(
            "api_server",
            APIServerMessage(
                message_type="request_complete",
                body=RequestComplete(
                    request_id=rid,
                    final_outputs=held.final_outputs,
                    conductor_ingest_time=held.conductor_ingest_time,
                    conductor_finish_time=held.conductor_finish_time,
                    graph_timings={},
                    rx_info=[],
                    tx_info=[],
                ),
            ),
        )

    # -- the commit at the end of each turn ----------------------------------------------

    def _note(self, messages: Iterable[Any]) -> None:
        for message in messages:
            body = message.body
            if message.message_type == ConductorMessageType.FAIL_REQUESTS:
                self._touched.update(body.errors)
                continue
            rid = getattr(body, "request_id", None)
            if rid is None:
                continue
            self._touched.add(rid)
            if message.message_type == ConductorMessageType.WORKER_GRAPHS_DONE:
                self._stalled.pop(rid, None)  # it moves: its pass was not lost

    def _commit(self, sends: list[tuple[str, Any]]) -> None:
        """Write what the last turn changed, then send what it decided, then forget what
        it tore down. Raises ``StoreError`` with nothing sent if a write failed."""
        answered: set[str] = set()
        for _, message in sends:
            rid = getattr(getattr(message, "body", None), "request_id", None)
            if rid is not None:
                self._touched.add(rid)
                if isinstance(message, APIServerMessage) and message.message_type in (
                    "request_complete",
                    "request_failed",
                ):
                    answered.add(rid)
        touched = self._touched
        self._save_all([rid for rid in touched if rid in self.requests], answered=False)
        inner = self.communicator.inner
        for destination, message in sends:
            inner.send(destination, message)
        self._touched = set()
        gone = [rid for rid in touched if rid not in self.requests and rid in self._held]
        if gone:
            results = self._store.drop_conductor_requests(gone, [self._lease(r) for r in gone])
            self._check(results)
            for rid in gone:
                self._held.discard(rid)
                self._leases.pop(rid, None)
        self._save_all([rid for rid in answered if rid in self.requests], answered=True)
        self._fail_stalled()
        self._check_epoch()

    def _save_all(self, rids: list[str], *, answered: bool) -> None:
        if not rids:
            return
        records = [self._record(rid, answered=answered) for rid in rids]
        leases = [self._lease(rid) for rid in rids]
        if len(rids) == 1:  # the common turn at low load: without the pipelining's cost
            try:
                self._store.save_conductor_request(records[0], lease=leases[0])
            except StoreError as e:
                self._check([e])
        else:
            self._check(self._store.save_conductor_requests(records, leases))
        self._held.update(rids)

    def _record(self, rid: str, *, answered: bool) -> ConductorRequest:
        data = self.requests[rid]
        record = from_request_data(
            rid,
            data,
            self._all_worker_graph_ids_to_graph_walks,
            draining=self.draining.get(rid),
            early_reads_done=self._early_reads_done.get(rid, frozenset()),
        )
        record.owner = self._deployment
        record.concluded = data.conductor_finish_time > 0
        record.answered = answered
        return record

    def _check(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, FencedError):
                self._fenced_out(str(result))
        for result in results:
            if isinstance(result, StoreError):
                raise result

    def _lease(self, rid: str) -> Lease:
        lease = self._leases.get(rid)
        return lease if lease is not None else self._claim(rid)

    def _claim(self, rid: str) -> Lease:
        lease = self._store.claim_conductor_request(rid, self._deployment, ttl=3600.0)
        if lease is None:
            self._fenced_out(f"request {rid} is held by another deployment")
        assert lease is not None
        self._leases[rid] = lease
        return lease

    def _fenced_out(self, why: str) -> None:
        """Another conductor of this deployment took over: stop at once, sending nothing."""
        print(f"fenced out, exiting: {why}", file=sys.stderr, flush=True)
        os._exit(FENCED_EXIT)

    def _fail_stalled(self) -> None:
        """A recovered request that no report moved for ``stall_timeout``: its pass's
        reports went with the dead conductor; fail it cleanly (the engine's teardown)."""
        if not self._stalled:
            return
        now = time.monotonic()
        for rid, due in list(self._stalled.items()):
            if due > now:
                continue
            del self._stalled[rid]
            data = self.requests.get(rid)
            if data is not None and rid not in self.draining:
                log.warning("request %s failed: %s", rid, STALL_REASON)
                self._remove_request(rid, data, failure_error=STALL_REASON)
                self._touched.add(rid)

    def _check_epoch(self) -> None:
        now = time.monotonic()
        if now < self._next_epoch_check:
            return
        self._next_epoch_check = now + self._epoch_check_every
        if self._store.deployment_epoch(self._deployment) != self._epoch:
            self._fenced_out(f"deployment {self._deployment} has a newer conductor")


class _TurnCommunicator:
    """The engine's communicator, with sends held until the turn's state is stored."""

    def __init__(self, inner: Any, conductor: StoreConductor) -> None:
        self.inner = inner
        self.conductor = conductor
        self._sends: list[tuple[str, Any]] = []

    def send(self, entity_id: str, msg: Any) -> None:
        self._sends.append((entity_id, msg))

    def end_turn(self) -> bool:
        """Store what the turn changed, then send what it decided. False when the store
        failed: nothing of the turn was sent, and it is tried again at the next call."""
        sends, self._sends = self._sends, []
        try:
            self.conductor._commit(sends)
        except StoreError:  # the store's own reconnect already waited its bound
            log.exception("the turn's state was not stored; its messages wait")
            self._sends = sends + self._sends
            return False
        return True

    def get_all_new_messages(self, *args: Any, **kwargs: Any) -> list[Any]:
        # A turn the engine's loop left by an exception (before its sweep) commits here; a
        # commit that fails takes no new message.
        if not self.end_turn():
            return []
        messages: list[Any] = self.inner.get_all_new_messages(*args, **kwargs)
        self.conductor._note(messages)
        return messages

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _reuse_worker_graph_ids(model: Any, ids: tuple[str, ...]) -> None:
    """Make ``model.get_worker_graphs`` give its worker graphs ``ids``, in order."""
    build = model.get_worker_graphs

    def get_worker_graphs(config_path: str) -> Any:
        graphs = build(config_path)
        if len(graphs) != len(ids):
            raise RuntimeError(
                f"the model has {len(graphs)} worker graphs, the deployment {len(ids)}: "
                "attach with the model and config the deployment was started with"
            )
        for graph, wg_id in zip(graphs, ids, strict=True):
            graph.worker_graph_id = wg_id
        return graphs

    model.get_worker_graphs = get_worker_graphs
