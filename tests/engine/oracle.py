"""The engine's own in-memory conductor as an oracle for differential tests.

mstar-ai 0.2.1's ``Conductor`` runs here unmodified: only its worker launch is skipped and
its communicator replaced (no processes, no sockets), so every decision (ingest, rank
counting, forward-pass bookkeeping, ref counts, the drain barrier) is the engine's own code.
A ``ScriptedModel`` built from a random ``Shape`` stands in for a real model: real
``WorkerGraph``s and ``ShardingConfig``s, and forward-pass decisions that are a pure function
of their arguments, so another implementation of the conductor's state (the Redis-backed
store) can call the very same function and must reach the very same state.

Messages are generated against the oracle's evolving state (``next_message``): what a
worker could plausibly report next, plus the odd late, unknown or failing message.

Nothing from ``store`` is imported: this is the engine's side of the comparison.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import mstar.conductor.conductor as conductor_module
import yaml
from mstar.conductor.conductor import Conductor
from mstar.utils.ipc_format import (
    ConductorMessageType,
)

from tests.engine.oracle_messages import (
    finishing_messages,
    new_request_message,
    next_message,
)
from tests.engine.oracle_model import (
    MAX_WORKERS,
    PREPROCESS_WORKER,
    SHARDED_SIGNAL,
    ConnectionShape,
    PartitionShape,
    ScriptedModel,
    Shape,
    StageShape,
    WalkShape,
    choices,
    shapes,
)

__all__ = [
    "MAX_WORKERS",
    "PREPROCESS_WORKER",
    "SHARDED_SIGNAL",
    "ConnectionShape",
    "LoopOutcome",
    "PartitionShape",
    "RecordingCommunicator",
    "ScriptedModel",
    "Shape",
    "StageShape",
    "WalkShape",
    "choices",
    "finishing_messages",
    "make_conductor",
    "new_request_message",
    "next_message",
    "quiet_conductor_logs",
    "run_loop_once",
    "shapes",
    "unlaunched",
    "write_config",
]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The conductor
# ---------------------------------------------------------------------------------------------


class RecordingCommunicator:
    """Stands in for the ZMQ communicator: ``send`` records a copy of the message as it was
    when sent (the real one pickles it then; the conductor keeps mutating what it refers
    to), and ``get_all_new_messages`` hands out what ``run_loop_once`` put in the inbox."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.sent: list[tuple[str, Any]] = []
        self.inbox: list[Any] = []

    def send(self, entity_id: str, msg: Any) -> None:
        self.sent.append((entity_id, copy.deepcopy(msg)))

    def get_all_new_messages(self, *args: Any, **kwargs: Any) -> list:
        messages, self.inbox = self.inbox, []
        return messages


class _UnlaunchedConductor(Conductor):
    """The engine's conductor minus its worker processes (and so minus their atexit hook)."""

    def _launch_workers(self) -> None:
        return


@contextlib.contextmanager
def unlaunched() -> Iterator[None]:
    """While a ``Conductor`` (or a subclass) is built: a ``RecordingCommunicator`` for its
    sockets and no free-port probe."""
    with (
        mock.patch.object(conductor_module, "make_communicator", RecordingCommunicator),
        mock.patch.object(conductor_module, "_pick_free_tcp_port", lambda: 0),
    ):
        yield


def write_config(shape: Shape, folder: Path | str) -> Path:
    """``shape``'s model config YAML, written as ``model.yaml`` in ``folder`` (made if
    missing)."""
    tmp = Path(folder)
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(shape.config()))
    return config


def make_conductor(shape: Shape, tmp_path: Path | str, drain_ttl_s: float = 120.0) -> Conductor:
    """An engine ``Conductor`` over a ``ScriptedModel(shape)``, with no workers or sockets.

    Writes the model config YAML under ``tmp_path``. During construction only the
    communicator factory and the free-port probe are patched; ``sent`` on
    ``conductor.communicator`` then lists every ``(destination, message)``.
    """
    config = write_config(shape, tmp_path)
    with (
        unlaunched(),
        mock.patch.dict(os.environ, {"MSTAR_DRAIN_TTL_S": str(drain_ttl_s)}),
    ):
        return _UnlaunchedConductor(
            model=ScriptedModel(shape),
            model_config_file=str(config),
            socket_path_prefix=str(Path(tmp_path) / "sockets"),
            log_level="WARNING",
        )


@dataclass
class LoopOutcome:
    """What one pass of the run loop did: the messages it sent, and the exception its
    ``except Exception`` swallowed (the rest of that batch is then dropped)."""

    sent: list[tuple[str, Any]] = field(default_factory=list)
    error: Exception | None = None


def run_loop_once(conductor: Conductor, messages: Sequence[Any]) -> LoopOutcome:
    """Deliver ``messages`` as one batch and run one iteration of ``Conductor.run()``'s loop.

    The messages are deep-copied first, as the pickling transport would (the conductor keeps
    and mutates parts of them, e.g. ``initial_signals``). The body below is copied from
    mstar-ai 0.2.1 ``mstar/conductor/conductor.py`` lines 1344-1408 (``while True:``), with
    ``self`` as ``conductor``, without nvtx ranges and the closing sleep, and recording the
    swallowed exception.
    """
    self = conductor
    comm: RecordingCommunicator = self.communicator  # type: ignore[assignment]
    comm.inbox.extend(copy.deepcopy(list(messages)))
    first_sent = len(comm.sent)
    error: Exception | None = None

    # ---- verbatim from Conductor.run() (0.2.1), minus nvtx and sleep ----
    # fmt: off
    try:
        done_partition_forwards: list[tuple[str, str, bool]] = []

        startup_backlog = self._startup_message_backlog
        self._startup_message_backlog = []
        for message in startup_backlog + self.communicator.get_all_new_messages():
            if message.message_type == ConductorMessageType.NEW_REQUEST:
                self._ingest_request(message.body)
            elif message.message_type == ConductorMessageType.ABORT_REQUEST:
                self._abort_request(message.body.request_id)
            elif message.message_type == ConductorMessageType.FAIL_REQUESTS:
                self._fail_requests(message.body)
            elif message.message_type == ConductorMessageType.READS_DONE:
                self._handle_reads_done(message.body)
            elif message.message_type == ConductorMessageType.WORKER_GRAPHS_DONE:
                rid = message.body.request_id
                # Draining requests linger in self.requests (concurrency
                # accounting) but are being torn down — ignore late dones.
                if rid not in self.requests or rid in self.draining:
                    conductor_module.logger.debug(
                        "WORKER_GRAPHS_DONE for unknown request %s (already completed?)", rid
                    )
                    continue

                done_parts = self._process_worker_graphs_done(message.body)
                for pname in done_parts:
                    done_partition_forwards.append(
                        (rid, pname, message.body.partition_done)
                    )
            else:
                raise ValueError(f"Unknown message type: {message.message_type}")

        completed_requests = []

        for request_id, partition_name, p_done in done_partition_forwards:
            if request_id not in self.requests or request_id in self.draining:
                continue  # already completed by another partition in this cycle
            all_done = self._process_done_forward(
                request_id, partition_name,
                partition_done_from_worker=p_done,
            )
            if all_done:
                completed_requests.append(request_id)

        for request_id in dict.fromkeys(completed_requests):
            if request_id in self.requests and request_id not in self.draining:
                self._process_request_done(request_id)

        self._sweep_expiry()

    except Exception as exc:
        conductor_module.logger.exception("Conductor error in main loop")
        error = exc
    # fmt: on
    # ---- end of the copy ----

    return LoopOutcome(sent=comm.sent[first_sent:], error=error)


@contextlib.contextmanager
def quiet_conductor_logs() -> Iterator[None]:
    """The run loop logs every swallowed exception with a traceback: hush it in tests."""
    log = logging.getLogger(conductor_module.__name__)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
