"""A replica process for the crash tests: ``python -m tests.runtime_proc '<json config>'``.

It runs a ``Replica`` (with the simulation's ``SimPlanner``) on the Redis at
``config["url"]``: a thread runs ``run(stop)``, the main loop takes report references from
the shared list ``<ns>:rt:reports`` and applies them. Passes the planner sends go to
``<ns>:rt:dispatch`` for the test's workers. With ``config["failpoint"]`` = ``{"point",
"hit", "action"}`` the process kills itself (``kill``: SIGKILL) or stops itself (``stop``:
SIGSTOP, after telling the test through ``<ns>:rt:signals``) at the ``hit``-th time it
passes that point; once continued, every write it attempts is logged to ``<ns>:rt:audit``
with its outcome. SIGTERM drains it; it exits by itself when its parent is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from store import Lease, Replica, RequestStore, StoreConnectionError, Timing
from store.cli.simulate.planner import SimPlanner
from store.io.connect import client_from_url

WRITES = frozenset({
    "record_worker_report", "record_worker_reports", "take_step", "take_steps",
    "release_lease", "set_final_output", "finish_request", "claim_step", "create_request",
    "schedule_check",
})  # fmt: skip


class Lists:
    """The test's own lists, beside the store's keys."""

    def __init__(self, namespace: str) -> None:
        prefix = f"{namespace}:rt"
        self.dispatch = f"{prefix}:dispatch"
        self.reports = f"{prefix}:reports"
        self.signals = f"{prefix}:signals"
        self.audit = f"{prefix}:audit"


def report_ref(rid: str, partition: str, fwd_pass: int, rank: int) -> bytes:
    return json.dumps([rid, partition, fwd_pass, rank]).encode()


def target(args: tuple[Any, ...]) -> list[str]:
    """The (request, partition) a write is about: from its lease, or its first arguments."""
    first = args[0] if args else None
    if isinstance(first, Lease):
        return [first.request_id, first.partition]
    return [str(a) for a in args[:2] if isinstance(a, str)]


class Audited:
    """The store, with every write logged once ``on`` is set."""

    def __init__(self, store: RequestStore, client: Any, key: str) -> None:
        self._store = store
        self._client = client
        self._key = key
        self.on = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in WRITES:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return attr(*args, **kwargs)
            try:
                result = attr(*args, **kwargs)
            except Exception as e:
                self._client.rpush(self._key, json.dumps([name, *target(args), type(e).__name__]))
                raise
            self._client.rpush(self._key, json.dumps([name, *target(args), "ok"]))
            return result

        return call


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    parent = os.getppid()
    client = client_from_url(config["url"])
    lists = Lists(config["namespace"])
    timing = Timing(**config["timing"])
    store = RequestStore(client, namespace=config["namespace"], lease_ttl=timing.lease_ttl)
    audited = Audited(store, client, lists.audit)
    planner = SimPlanner(
        config["seed"], sink=lambda sent: client.rpush(lists.dispatch, json.dumps(sent))
    )
    hits = 0
    failpoint = config.get("failpoint")

    def at(point: str) -> None:
        nonlocal hits
        if failpoint is None or point != failpoint["point"]:
            return
        if failpoint.get("holding") and not replica.books.held():
            return  # only while this replica holds a lease
        hits += 1
        if hits != failpoint["hit"]:
            return
        if failpoint["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        held = [[lease.request_id, lease.partition] for lease in replica.books.held()]
        client.rpush(lists.signals, json.dumps(held))
        os.kill(os.getpid(), signal.SIGSTOP)
        audited.on = True  # continued: from here on, every write is logged

    replica = Replica(
        audited,  # type: ignore[arg-type]
        planner=planner, replica_id=config["replica_id"], timing=timing, failpoints=at,
    )  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    loop = threading.Thread(target=replica.run, args=(stop,), daemon=True)
    loop.start()
    end = time.monotonic() + config.get("max_lifetime", 120)
    while not stop.is_set() and os.getppid() == parent and time.monotonic() < end:
        raw = client.lpop(lists.reports)
        if raw is None:
            time.sleep(0.005)
            continue
        rid, partition, fwd_pass, rank = json.loads(raw)
        report = planner.reports_for(rid, partition, fwd_pass)[rank]
        try:
            replica.apply_report(report)
        except StoreConnectionError:
            client.rpush(lists.reports, raw)  # not known to be applied: deliver it again
            time.sleep(0.1)
    stop.set()
    replica.drain()
    loop.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
