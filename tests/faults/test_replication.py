"""A master failing over to a lagging replica: what acknowledged steps does it lose?

A private master and replica; the replica reaches its master through a relay
(``tests/relay.py``) that can hold the replication stream back, which is what replication
lag is: the master has acknowledged writes its replica has not received. Steps (a
report completing a pass, then the advance to the next pass) are acknowledged with the
stream held; then the master is SIGKILLed (the relay drops what it held, as a dead
master's unsent output is lost), the replica is promoted (``REPLICAOF NO ONE``) and the
request is read from it.

- default durability ("master"): every step acknowledged while the stream was held is
  lost; the count is printed and asserted >= 1 (the run is built to show the risk);
- ``durability="replicated"``: while the stream is held, every write raises
  ``ReplicationTimeoutError`` (applied on the master, not acknowledged), so nothing
  acknowledged is lost; with the stream held for a moment and released, the writes wait
  and succeed, and every one of them is on the replica after the master is killed right
  after the last (sync and async stores).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from store import (
    AsyncRequestStore,
    Codec,
    ReplicationTimeoutError,
    Report,
    ReportOutcome,
    RequestStore,
    StalePassError,
)
from store.cli import main as cli
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.conftest import require_binaries
from tests.relay import ReplicationRelay
from tests.servers import RedisServer
from tests.stores import Stores
from tests.strategies import SumInfo, user_registry

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(120)]

MD = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
RID = "r"
STEPS = 10  # steps acknowledged (or tried) while the replication stream is held
WAIT_MS = 200


@dataclass
class Pair:
    master: RedisServer
    relay: ReplicationRelay
    replica: RedisServer

    def synced(self, timeout: float = 10.0) -> None:
        """Wait until the replica has everything the master has."""
        deadline = time.monotonic() + timeout
        with self.master.client() as m, self.replica.client() as r:
            while True:
                info = r.info("replication")
                offset = m.info("replication")["master_repl_offset"]
                if info["master_link_status"] == "up" and info["slave_repl_offset"] == offset:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"replica not in sync: {info}, master at {offset}")
                time.sleep(0.02)

    def fail_over(self) -> RequestStore:
        """SIGKILL the master, drop what the relay held, promote the replica: a store on it."""
        self.master.kill()
        self.relay.stop()
        with self.replica.client() as r:
            r.execute_command("REPLICAOF", "NO", "ONE")
        return RequestStore(self.replica.client(), namespace="dur")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    require_binaries()
    master = RedisServer(tmp_path / "master").start()
    relay = ReplicationRelay((master.host, master.port)).start()
    replica = None
    try:
        replica = RedisServer(
            tmp_path / "replica", None, "--replicaof", master.host, str(relay.port)
        ).start()
        pair = Pair(master, relay, replica)
        pair.synced()
        yield pair
    finally:
        relay.stop()
        for server in (replica, master):
            if server is not None:
                server.stop()


def create(store: RequestStore) -> None:
    state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
    store.create_request(RID, partitions={"llm": state}, connections={}, max_output_tokens=64)


def step(store: Any, p: int) -> None:
    """Complete pass ``p`` and advance to ``p + 1``; both resendable (report id, op id)."""
    store.record_worker_report(RID, "llm", fwd_pass=p, worker_graph_id="wg", rank=0, num_ranks=1)
    store.advance_partition(
        RID, "llm", from_pass=p, metadata=MD, worker_graph_ids=["wg"], op_id=f"adv{p}"
    )


def run_steps(store: Any, tries: int, acked: int) -> tuple[int, int]:
    """Try ``tries`` steps from pass ``acked``; a step that raised is tried again, as a
    conductor would. Returns the passes acknowledged and the replication timeouts met."""
    timeouts = 0
    for _ in range(tries):
        try:
            step(store, acked)
        except ReplicationTimeoutError as e:
            assert e.applied and (e.acknowledged, e.wanted) == (0, 1)
            timeouts += 1
            continue
        acked += 1
    return acked, timeouts


def on_promoted(pair: Pair) -> int:
    promoted = pair.fail_over()
    try:
        return promoted.load_partition(RID, "llm").fwd_pass_number
    finally:
        promoted.close()


def test_without_replicated_durability_acknowledged_steps_are_lost(pair: Pair) -> None:
    store = RequestStore(pair.master.client(), namespace="dur")
    create(store)
    acked, _ = run_steps(store, 3, 0)  # replicated before the lag
    pair.synced()
    pair.relay.hold()
    acked, timeouts = run_steps(store, STEPS, acked)
    assert (acked, timeouts) == (3 + STEPS, 0)  # every step acknowledged
    assert pair.relay.held_bytes > 0
    store.close()
    held = on_promoted(pair)
    lost = acked - held
    print(f"\nmaster durability: {acked} steps acknowledged, {held} on the promoted replica, "
          f"{lost} lost")  # fmt: skip
    assert lost >= 1  # the risk the option is for
    assert held == 3  # exactly those acknowledged while the stream was held


def test_with_replicated_durability_no_acknowledged_step_is_lost(
    pair: Pair, make_store: Stores
) -> None:
    store = make_store(
        pair.master.client(), namespace="dur", durability="replicated", replicas=1,
        wait_ms=WAIT_MS,
    )  # fmt: skip
    create(store)
    acked, _ = run_steps(store, 3, 0)
    pair.relay.hold()
    started = time.monotonic()
    acked, timeouts = run_steps(store, 3, acked)
    took = time.monotonic() - started
    assert (acked, timeouts) == (3, 3)  # each write applied on the master, none acknowledged
    assert took >= 3 * WAIT_MS / 1000
    # The stream held a moment longer, then released: writes that may wait long enough
    # wait for the replica, and succeed.
    patient = make_store(
        pair.master.client(), namespace="dur", durability="replicated", replicas=1,
        wait_ms=3000,
    )  # fmt: skip
    releaser = threading.Timer(0.3, pair.relay.release)
    releaser.start()
    started = time.monotonic()
    acked, timeouts = run_steps(patient, STEPS, acked)
    releaser.join()
    assert (acked, timeouts) == (3 + STEPS, 0)
    assert time.monotonic() - started >= 0.25  # the first write waited for the release
    pair.relay.hold()  # the master dies right after the last acknowledgement
    held = on_promoted(pair)
    print(f"\nreplicated durability: {acked} steps acknowledged, {held} on the promoted "
          f"replica, {max(0, acked - held)} lost")  # fmt: skip
    assert held >= acked  # no acknowledged step lost (a timed-out one may be there too)


async def test_async_store_waits_too(tmp_redis: RedisServer) -> None:
    """A master without replicas: every write times out, applied on the master."""
    store = AsyncRequestStore.from_url(
        f"{tmp_redis.url}?durability=replicated&replicas=1&wait_ms={WAIT_MS}", namespace="dur"
    )
    state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
    started = time.monotonic()
    with pytest.raises(ReplicationTimeoutError, match="0 of the 1 replicas"):
        await store.create_request(RID, partitions={"llm": state}, connections={},
                                   max_output_tokens=8)  # fmt: skip
    assert time.monotonic() - started >= WAIT_MS / 1000
    assert (await store.load_partition(RID, "llm")).fwd_pass_number == 0
    await store.aclose()


def test_cli_demo_waits_for_the_replica(pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    url = pair.master.url
    assert cli.main(["demo", "--redis-url", url, "--durability", "replicated"]) == 0
    assert "summary" in capsys.readouterr().out
    pair.relay.hold()  # the same through the URL's query, with the replica lagging
    code = cli.main(["demo", "--redis-url", f"{url}?durability=replicated&wait_ms=100"])
    assert code == 1
    assert "applied on the master, but 0 of the 1 replicas" in capsys.readouterr().err
    assert cli.main(["ls", "--redis-url", f"{url}?durability=replicated", "--namespace",
                     "mstar-demo"]) == 0  # fmt: skip
    assert cli.main(["demo", "--redis-url", url, "--wait-ms", "100"]) == 1
    assert "need durability='replicated'" in capsys.readouterr().err


def test_a_pipelined_batch_waits_per_write(pair: Pair) -> None:
    store = RequestStore(
        pair.master.client(), namespace="dur", durability="replicated", wait_ms=WAIT_MS
    )
    state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
    rids = [f"b{i}" for i in range(3)]
    for rid in rids:
        store.create_request(rid, partitions={"llm": state}, connections={}, max_output_tokens=8)

    def reports(rank: int, p: int = 0) -> list[Report]:
        return [Report(request_id=rid, partition="llm", fwd_pass=p, worker_graph_id="wg",
                       rank=rank, num_ranks=2) for rid in rids]  # fmt: skip

    results = store.record_worker_reports(reports(0))
    assert all(isinstance(r, ReportOutcome) and r.applied for r in results), results
    pair.relay.hold()
    results = store.record_worker_reports(reports(1))
    assert all(isinstance(r, ReplicationTimeoutError) for r in results), results
    # A refusal wrote nothing: it says so, lagging replica or not.
    results = store.record_worker_reports(reports(0, p=5))
    assert all(isinstance(r, StalePassError) for r in results), results
    pair.relay.release()
    results = store.record_worker_reports(reports(1))  # resent: applied once, now replicated
    assert all(isinstance(r, ReportOutcome) and not r.applied for r in results), results
    assert all(r.pass_complete for r in results if isinstance(r, ReportOutcome))
    store.close()


def test_an_optimistic_merge_waits_after_its_exec(pair: Pair, make_store: Stores) -> None:
    store = make_store(
        pair.master.client(), namespace="dur", codec=Codec(user_registry()),
        durability="replicated", wait_ms=WAIT_MS,
    )  # fmt: skip
    state = PartitionState("llm", MD, resource_publish_info={"sum": SumInfo(0)})
    store.create_request("m", partitions={"llm": state}, connections={}, max_output_tokens=8)
    store.merge_publish_info("m", "llm", {"sum": SumInfo(1)}, op_id="m1", returning=False)
    pair.relay.hold()
    for _ in range(2):  # the first commits; the resend finds it committed, and waits too
        with pytest.raises(ReplicationTimeoutError):
            store.merge_publish_info("m", "llm", {"sum": SumInfo(1)}, op_id="m2", returning=False)
    pair.relay.release()
    store.merge_publish_info("m", "llm", {"sum": SumInfo(1)}, op_id="m2", returning=False)
    assert store.load_partition("m", "llm").resource_publish_info["sum"] == SumInfo(2)


def test_cli_simulate_runs_replicated(pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    """The runtime's replicas (processes of their own) get the durability in the URL."""
    argv = ["simulate", "--redis-url", pair.master.url, "--durability", "replicated",
            "--requests", "4", "--replicas", "2", "--kill", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "result: OK" in capsys.readouterr().out
    with pair.master.client() as m:
        waits = m.info("commandstats")["cmdstat_wait"]["calls"]
    assert waits >= 4 * 3  # creates, reports and steps of every request waited
