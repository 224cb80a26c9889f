"""Stand-ins for the conductor's peers, speaking the engine's own messages.

Every stand-in talks through the engine's pyzmq communicator
(``mstar.communication.communicator.ZMQCommunicator``, IPC endpoints
``ipc://<sockets_dir>/<entity>.ipc``) and sends the engine's own dataclasses, so the
conductor under test (the engine's, or the store-backed one) cannot tell them from the real
processes.

* ``worker_main``: a worker ``worker_<rank>`` (run as a process: ``python -m
  tests.engine.standin worker --rank R --sockets DIR --log FILE``). It "runs" a forward pass
  on NEW_REQUEST (pass 0) and on every INPUT_SIGNALS that carries inputs (pass
  ``fwd_index + 1``: the engine stamps them with the pass just completed), reporting one
  ``WorkerGraphsDone`` per worker graph whose contents are a deterministic function of
  (request id, partition, forward pass, rank); it answers DRAIN_REQUEST with READS_DONE and
  records the rest. Every message in or out, and every pass, is one JSON line in its log.
* ``ApiStandIn``: the API server and its preprocess worker (a thread of the test process):
  submits requests, records every answer and acknowledges completions with READS_DONE.
* ``conductor_main``: the engine's unmodified ``Conductor`` minus its worker launch
  (``python -m tests.engine.standin conductor --model M --config F --sockets DIR``), the
  oracle's conductor until the store's entry point is available.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("MSTAR_RUST_ZMQ", "0")

import msgspec
import zmq
from mstar.api_server.request_types import APIServerMessage
from mstar.communication.communicator import CommProtocol, ZMQCommunicator
from mstar.utils.ipc_format import (
    ConductorMessage,
    ConductorMessageType,
    NewRequestConductor,
    ReadsDone,
    SetupDone,
    WorkerGraphsDone,
    WorkerMessageType,
)

from mstar.graph.base import TensorPointerInfo
from mstar.graph.loop_indices import NestedLoopIndices

__all__ = [
    "CONDUCTOR",
    "DEFAULT_MODEL",
    "MODEL_KWARGS",
    "PREPROCESS_WORKER",
    "ApiStandIn",
    "JsonLog",
    "conductor_main",
    "initial_signals",
    "load_factory",
    "persisted_tensor",
    "worker_main",
]

CONDUCTOR = "conductor"
API_SERVER = "api_server"
PREPROCESS_WORKER = "api_server_preprocess_worker"
DEFAULT_MODEL = "tests.engine.kill_model:make_model"
MODEL_KWARGS: dict[str, Any] = {"temperature": 0.5, "max_output_tokens": 64}
INITIAL_SIGNAL = "ctx"


def load_factory(spec: str) -> Any:
    """``module:function`` -> the function."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _enc_hook(obj: Any) -> Any:
    return repr(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


class JsonLog:
    """One JSON object per line, flushed at once (a killed process loses nothing written)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        record.setdefault("t", time.time())
        line = _ENCODER.encode(record) + b"\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        self._file.close()


def read_log(path: str | Path) -> list[dict[str, Any]]:
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_bytes().splitlines():
        if line.strip():
            records.append(msgspec.json.decode(line))
    return records


def persisted_tensor(
    uuid: str,
    entity: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    node: str | None = None,
    walk: str | None = None,
) -> TensorPointerInfo:
    return TensorPointerInfo(
        dims=[3, 5],
        dtype="bfloat16",
        nbytes=30,
        address=0x1000,
        stride=[5, 1],
        uuid=uuid,
        source_session_id=f"localhost:{entity}",
        source_entity=entity,
        source_tp_size=tp_size,
        source_tp_rank=tp_rank,
        _source_node_name=node,
        _source_graph_walk=walk,
    )


def initial_signals(request_id: str) -> dict[str, list[TensorPointerInfo]]:
    """The preprocess worker's persisted input for a request."""
    return {INITIAL_SIGNAL: [persisted_tensor(f"{request_id}/in", PREPROCESS_WORKER)]}


def _communicator(my_id: str, sockets_dir: str) -> ZMQCommunicator:
    return ZMQCommunicator(
        my_id=my_id,
        push_ids=[CONDUCTOR],
        protocol=CommProtocol.IPC,
        ipc_socket_path_prefix=sockets_dir,
    )


def _conductor_message(kind: ConductorMessageType, body: Any) -> ConductorMessage:
    return ConductorMessage(message_type=kind, body=body)


# ---------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------


class _StandInWorker:
    def __init__(
        self,
        rank: int,
        sockets_dir: str,
        log_path: str,
        model_spec: str,
        pass_delay_s: float,
    ):
        self.me = f"worker_{rank}"
        self.rank = rank
        self.model = load_factory(model_spec)()
        self.log = JsonLog(log_path)
        self.comm = _communicator(self.me, sockets_dir)
        self.pass_delay_s = pass_delay_s
        # rid -> {"wg2w": {...}, "wgs": {partition: set(wg ids)}}
        self.requests: dict[str, dict[str, Any]] = {}
        self.removed: set[str] = set()
        self.ran: set[tuple[str, str, int]] = set()
        self.stop = False

    def send(self, kind: ConductorMessageType, body: Any) -> None:
        self.comm.send(CONDUCTOR, _conductor_message(kind, body))
        self.log.write(ev="send", to=CONDUCTOR, type=kind.value, body=body)

    def outputs(self, rid: str, partition: str, fwd: int) -> NestedLoopIndices:
        salt = zlib.crc32(f"{rid}/{partition}".encode()) % 997
        return NestedLoopIndices(
            loop_name_order=["step"],
            loop_indices={"step": fwd, "salt": salt},
            wg_fwd_pass_idx=fwd,
        )

    def run_pass(self, rid: str, partition: str, fwd: int, walk: str, trigger: str) -> None:
        info = self.requests.get(rid)
        key = (rid, partition, fwd)
        if info is None:
            self.log.write(ev="unknown_request", rid=rid, partition=partition, fwd=fwd)
            return
        wgs = sorted(wg for wg in info["wgs"].get(partition, ()) if wg.rsplit("#", 1)[0] == walk)
        self.log.write(
            ev="pass",
            rid=rid,
            partition=partition,
            fwd=fwd,
            walk=walk,
            worker=self.me,
            trigger=trigger,
            duplicate=key in self.ran,
            after_remove=rid in self.removed,
            wgs=wgs,
        )
        self.ran.add(key)
        if self.pass_delay_s:
            time.sleep(self.pass_delay_s)
        node = self.model.walk_nodes(walk)[0]
        edges = [c.edge_name for c in self.model.shape.outgoing(partition)]
        incoming = [c.edge_name for c in self.model.shape.incoming(partition)]
        for i, wg in enumerate(wgs):
            workers = info["wg2w"][wg]
            tp_rank = workers.index(self.me)
            body = WorkerGraphsDone(
                request_id=rid,
                worker_graph_ids=[wg],
                is_first_tp_rank=tp_rank == 0,
                partition_name=partition,
                output_loop_indices={f"{partition}_out": self.outputs(rid, partition, fwd)},
            )
            if i == 0:
                body.persist_signals = {
                    f"{partition}_h": [
                        persisted_tensor(
                            f"{rid}/{partition}/{fwd}/{self.rank}",
                            self.me,
                            tp_rank=tp_rank,
                            tp_size=len(workers),
                            node=node,
                            walk=walk,
                        )
                    ]
                }
                body.new_token_counts = {**{e: 2 for e in edges}, "text": 1}
                body.stream_tokens_consumed = {e: 2 * (fwd + 1) for e in incoming}
            self.send(ConductorMessageType.WORKER_GRAPHS_DONE, body)

    def handle(self, message: Any) -> None:
        kind = message.message_type
        body = message.body
        self.log.write(ev="recv", type=kind.value, body=body)
        if kind == WorkerMessageType.NEW_REQUEST:
            rid = body.request_id
            ri = body.request_info
            info = self.requests.setdefault(rid, {"wg2w": {}, "wgs": {}})
            info["wg2w"] = dict(body.worker_graph_to_workers)
            info["wgs"][ri.partition_name] = set(body.partition_worker_graph_ids)
            self.run_pass(rid, ri.partition_name, ri.fwd_index, ri.graph_walk, "new_request")
        elif kind == WorkerMessageType.INPUT_SIGNALS:
            ri = body.request_info
            if body.producer_done and not body.inputs:
                self.log.write(
                    ev="producer_done",
                    rid=body.request_id,
                    partition=body.partition_name,
                    producers=sorted(body.producer_done),
                )
                return
            # The engine stamps a pass's InputSignals with the number of the pass just
            # completed (``_process_done_forward`` increments ``fwd_pass_number`` only after
            # sending them), the NewRequest's with 0: the pass to run is one more.
            self.run_pass(
                body.request_id, body.partition_name, ri.fwd_index + 1, ri.graph_walk, "inputs"
            )
        elif kind == WorkerMessageType.UNPERSIST_TENSORS:
            for uuid, count in body.uuid_to_ref_count.items():
                self.log.write(ev="unpersist", rid=body.request_id, uuid=uuid, count=count)
        elif kind == WorkerMessageType.DRAIN_REQUEST:
            self.log.write(ev="drain", rid=body.request_id)
            self.send(
                ConductorMessageType.READS_DONE,
                ReadsDone(request_id=body.request_id, entity_id=self.me),
            )
        elif kind == WorkerMessageType.REMOVE_REQUEST:
            self.log.write(ev="remove", rid=body.request_id)
            self.removed.add(body.request_id)
        else:
            self.log.write(ev="unexpected", type=kind.value)

    def run(self) -> None:
        self.send(ConductorMessageType.SETUP_DONE, SetupDone(worker_id=self.me))
        self.log.write(ev="ready", worker=self.me, pid=os.getpid())
        while not self.stop:
            for message in self.comm.get_all_new_messages(blocking=True, timeout_s=0.05):
                self.handle(message)
        self.log.write(ev="exit", worker=self.me)
        self.log.close()


def worker_main(
    rank: int,
    sockets_dir: str,
    log_path: str,
    model_spec: str = DEFAULT_MODEL,
    pass_delay_s: float = 0.0,
) -> None:
    """Run the stand-in worker ``worker_<rank>`` until SIGTERM/SIGINT."""
    worker = _StandInWorker(rank, sockets_dir, log_path, model_spec, pass_delay_s)

    def _stop(_signum: int, _frame: Any) -> None:
        worker.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run()


# ---------------------------------------------------------------------------------------------
# API server + preprocess worker
# ---------------------------------------------------------------------------------------------


class ApiStandIn:
    """The API server and its preprocess worker, in one thread of the test process.

    ``submit`` sends a NEW_REQUEST (from the preprocess worker, with a persisted initial
    signal of its own); every ``request_complete`` is acknowledged with READS_DONE from the
    preprocess worker, every DRAIN_REQUEST to it answered with READS_DONE. ``answers`` holds
    every answer per request id, in arrival order.
    """

    def __init__(self, sockets_dir: str, log_path: str):
        self.sockets_dir = sockets_dir
        self.log = JsonLog(log_path)
        self.answers: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        self.submitted: dict[str, float] = {}
        self.unpersists: list[tuple[str, str, int]] = []
        self.removed: list[str] = []
        self.drained: list[str] = []
        self.setup_done: list[float] = []
        self.last_received = 0.0  # when the last message from a conductor arrived
        self.received: list[float] = []
        self.errors: list[str] = []
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="api-standin", daemon=True)

    def start(self) -> ApiStandIn:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("API stand-in did not start")
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        self.log.close()

    def submit(self, request_id: str) -> None:
        self.submitted[request_id] = time.time()
        self._queue.put(("submit", request_id))

    def answered(self) -> set[str]:
        with self._lock:
            return {rid for rid, a in self.answers.items() if a}

    def unanswered(self) -> list[str]:
        done = self.answered()
        return sorted(rid for rid in self.submitted if rid not in done)

    def wait_all(self, timeout_s: float) -> list[str]:
        """Wait until every submitted request has an answer; returns those still without."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            missing = self.unanswered()
            if not missing:
                return []
            time.sleep(0.02)
        return self.unanswered()

    def _send(self, comm: ZMQCommunicator, kind: ConductorMessageType, body: Any) -> None:
        comm.send(CONDUCTOR, _conductor_message(kind, body))
        self.log.write(ev="send", sender=comm.my_id, type=kind.value, body=body)

    def _run(self) -> None:
        try:
            api = _communicator(API_SERVER, self.sockets_dir)
            pre = _communicator(PREPROCESS_WORKER, self.sockets_dir)
            poller = zmq.Poller()
            poller.register(api.pull_socket, zmq.POLLIN)
            poller.register(pre.pull_socket, zmq.POLLIN)
        except Exception as exc:  # pragma: no cover - surfaced by start()
            self.errors.append(repr(exc))
            raise
        self._ready.set()
        try:
            while not self._stopped.is_set():
                while True:
                    try:
                        what, rid = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if what == "submit":
                        self._send(
                            pre,
                            ConductorMessageType.NEW_REQUEST,
                            NewRequestConductor(
                                request_id=rid,
                                initial_signals=initial_signals(rid),
                                initial_input_modalities=["text"],
                                initial_output_modalities=["text"],
                                input_metadata={},
                                model_kwargs=dict(MODEL_KWARGS),
                            ),
                        )
                poller.poll(10)
                for message in api.get_all_new_messages():
                    self._on_api(pre, message)
                for message in pre.get_all_new_messages():
                    self._on_preprocess(pre, message)
        except Exception as exc:
            self.errors.append(repr(exc))
            raise
        finally:
            api.pull_socket.close(0)
            pre.pull_socket.close(0)
            for sock in [*api.push_sockets.values(), *pre.push_sockets.values()]:
                sock.close(0)

    def _on_api(self, pre: ZMQCommunicator, message: APIServerMessage) -> None:
        now = time.time()
        self.last_received = now
        self.received.append(now)
        kind = message.message_type
        self.log.write(ev="recv", to=API_SERVER, type=kind, body=message.body)
        if kind == "setup_done":
            self.setup_done.append(now)
            return
        if kind not in ("request_complete", "request_failed"):
            return
        rid = message.body.request_id
        with self._lock:
            self.answers[rid].append((kind, message.body))
        if kind == "request_complete":
            self._send(
                pre,
                ConductorMessageType.READS_DONE,
                ReadsDone(request_id=rid, entity_id=PREPROCESS_WORKER),
            )

    def _on_preprocess(self, pre: ZMQCommunicator, message: Any) -> None:
        now = time.time()
        self.last_received = now
        self.received.append(now)
        kind = message.message_type
        body = message.body
        self.log.write(ev="recv", to=PREPROCESS_WORKER, type=kind.value, body=body)
        if kind == WorkerMessageType.UNPERSIST_TENSORS:
            for uuid, count in body.uuid_to_ref_count.items():
                self.unpersists.append((body.request_id, uuid, count))
        elif kind == WorkerMessageType.DRAIN_REQUEST:
            self.drained.append(body.request_id)
            self._send(
                pre,
                ConductorMessageType.READS_DONE,
                ReadsDone(request_id=body.request_id, entity_id=PREPROCESS_WORKER),
            )
        elif kind == WorkerMessageType.REMOVE_REQUEST:
            self.removed.append(body.request_id)


# ---------------------------------------------------------------------------------------------
# The engine's conductor, without its workers
# ---------------------------------------------------------------------------------------------


def conductor_main(model_spec: str, config: str, sockets_dir: str, log_level: str) -> None:
    """The unmodified engine ``Conductor`` (its worker launch skipped), run forever."""
    from mstar.conductor.conductor import Conductor

    class _NoLaunchConductor(Conductor):
        def _launch_workers(self) -> None:
            return

    logging.basicConfig(level=getattr(logging, log_level), stream=sys.stderr)
    conductor = _NoLaunchConductor(
        model=load_factory(model_spec)(),
        model_config_file=config,
        socket_path_prefix=sockets_dir,
        log_level=log_level,
    )
    print("conductor: constructed", file=sys.stderr, flush=True)
    conductor.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.engine.standin")
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--sockets", required=True)
    w.add_argument("--log", required=True)
    w.add_argument("--model", default=DEFAULT_MODEL)
    w.add_argument("--pass-delay", type=float, default=0.0)
    c = sub.add_parser("conductor")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--config", required=True)
    c.add_argument("--sockets", required=True)
    c.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.what == "worker":
        worker_main(args.rank, args.sockets, args.log, args.model, args.pass_delay)
    else:
        conductor_main(args.model, args.config, args.sockets, args.log_level)


if __name__ == "__main__":
    main()
