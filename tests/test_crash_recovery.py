"""Replica processes killed or paused at chosen instants, on a real Redis.

Each test starts replica A as a child process with a test-only patch applied inside that
child (the library has no test hooks): at the chosen instant the patch tells the parent,
through a Redis list, and waits, so the parent can SIGKILL or SIGSTOP it exactly there.
Replica B is then started; it must take the step over through ``due_steps`` /
``claim_step`` and finish the request with the crash-free reference's final state.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import store.io.sync
from store.cli.simulate import model, replica
from store.cli.simulate.fleet import Delivery, Fleet
from store.cli.simulate.reference import canonical, reference_run
from store.cli.simulate.replica import Report, Timing
from store.errors import FencedError
from store.store import RequestStore
from tests import backends
from tests.backends import redis_url_for_tests

pytestmark = pytest.mark.real

SEED = 5
CRASH_PASS = 1  # the LLM pass at whose completion replica A is stopped
TIMING = Timing(lease_ttl=1.0, pass_deadline=1.0, recovery_interval=0.05)
WAIT = 60.0  # generous bound of every wait; a healthy run takes a few seconds


def tts_request() -> str:
    """The first request of SEED that runs the LLM -> codec model."""
    return next(r for r in model.request_ids(20) if model.spec(SEED, r).model == model.TTS)


# -- inside the child process -----------------------------------------------------------


def child(patch_name: str, config_json: str) -> None:
    """Entry of a patched replica process: apply the patch, then run the normal replica."""
    config = json.loads(config_json)
    signals = backends.connect(config["redis_url"])
    key = f"{config['namespace']}:test:signal"
    PATCHES[patch_name](lambda what: signals.rpush(key, what))
    replica.main([config_json])


def _at_crash_pass(partition: str, from_pass: int) -> bool:
    return partition == model.LLM and from_pass == CRASH_PASS


def _stop_before_advance(signal_parent: Callable[[str], Any]) -> None:
    original = RequestStore.advance_partition

    def advance(self: RequestStore, rid: str, partition: str, **kw: Any) -> int:
        if _at_crash_pass(partition, kw["from_pass"]):
            signal_parent("before-advance")
            time.sleep(WAIT)
        return original(self, rid, partition, **kw)

    RequestStore.advance_partition = advance  # type: ignore[method-assign]


def _stop_after_advance(signal_parent: Callable[[str], Any]) -> None:
    original = RequestStore.advance_partition

    def advance(self: RequestStore, rid: str, partition: str, **kw: Any) -> int:
        new_pass = original(self, rid, partition, **kw)
        if _at_crash_pass(partition, kw["from_pass"]):
            signal_parent("after-advance")  # advanced; the next pass not sent, lease held
            time.sleep(WAIT)
        return new_pass

    RequestStore.advance_partition = advance  # type: ignore[method-assign]


def _stop_inside_merge(signal_parent: Callable[[str], Any]) -> None:
    original = store.io.sync.round_trip
    marker = f"/{model.LLM}/{CRASH_PASS}/"

    def round_trip(conn: Any, commands: Any) -> list[Any]:
        ops = [
            arg
            for command in commands
            if command[0] in ("EVALSHA", "EVAL")
            for arg in command
            if isinstance(arg, str) and arg.startswith("merge:") and marker in arg
        ]
        if ops:
            conn.send_packed_command(conn.pack_commands(commands))  # Redis merges...
            signal_parent(f"inside-merge {ops[0]}")  # ...and A dies before the reply
            time.sleep(WAIT)
        return original(conn, commands)

    store.io.sync.round_trip = round_trip


def _pause_before_advance(signal_parent: Callable[[str], Any]) -> None:
    original = RequestStore.advance_partition

    def advance(self: RequestStore, rid: str, partition: str, **kw: Any) -> int:
        if not _at_crash_pass(partition, kw["from_pass"]):
            return original(self, rid, partition, **kw)
        signal_parent("before-advance")
        time.sleep(3.0)  # the parent SIGSTOPs us in here; we wake long past our lease
        try:
            new_pass = original(self, rid, partition, **kw)
        except FencedError:
            signal_parent("fenced")
            raise
        except Exception as e:
            signal_parent(f"raised {type(e).__name__}")
            raise
        signal_parent("not-fenced")
        return new_pass

    RequestStore.advance_partition = advance  # type: ignore[method-assign]


PATCHES: dict[str, Callable[[Callable[[str], Any]], None]] = {
    "stop_before_advance": _stop_before_advance,
    "stop_after_advance": _stop_after_advance,
    "stop_inside_merge": _stop_inside_merge,
    "pause_before_advance": _pause_before_advance,
}


def patched(name: str) -> list[str]:
    code = f"import sys; from tests.test_crash_recovery import child; child({name!r}, sys.argv[1])"
    return [sys.executable, "-c", code]


# -- in the test process ------------------------------------------------------------------


@pytest.fixture
def fleet(real_client: redis.Redis, namespace: str, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(
        real_client,
        redis_url=redis_url_for_tests(),
        namespace=namespace,
        seed=SEED,
        timing=TIMING,
        delivery=Delivery(duplicate_rate=0.0),
        log_dir=tmp_path,
        max_lifetime=WAIT * 2,
        delete_finished=False,
    )
    try:
        yield fleet
    finally:
        fleet.stop()


def pump_until(fleet: Fleet, done: Callable[[], Any], what: str) -> Any:
    """Run the workers and delivery until ``done()`` returns something truthy."""
    deadline = time.monotonic() + WAIT
    while not (found := done()):
        assert not fleet.failures, fleet.failures
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}; unfinished: {fleet.describe_unfinished()}"
        )
        if not fleet.step():
            time.sleep(0.002)
    return found


def signal_from(client: redis.Redis, namespace: str) -> Callable[[], str | None]:
    def pop() -> str | None:
        raw = client.lpop(f"{namespace}:test:signal")
        return raw.decode() if isinstance(raw, bytes) else None

    return pop


def start_alone(fleet: Fleet, patch: str, rid: str) -> str:
    """Replica A, patched, as the only replica: every report of ``rid`` goes to it."""
    a = fleet.spawn(patched(patch))
    fleet.wait_until_up([a], timeout=WAIT)
    fleet.create([rid])
    return a


def finish_with_a_successor(fleet: Fleet, rid: str) -> None:
    b = fleet.spawn()
    pump_until(fleet, lambda: rid in fleet.finished, f"{rid} to finish")
    fleet.stop()
    assert fleet.finished == reference_run(SEED, [rid], TIMING)
    assert fleet.stats.counters.get("claims", 0) >= 1, f"{b} never took a step over"


def test_killed_holding_the_lease_before_the_advance(
    fleet: Fleet, real_client: redis.Redis, namespace: str
) -> None:
    rid = tts_request()
    a = start_alone(fleet, "stop_before_advance", rid)
    pump_until(fleet, signal_from(real_client, namespace), "A to complete the pass")
    fleet.kill(a)
    # A died where intended: the pass is complete, A holds the lease, nothing advanced.
    part = fleet.store.load_partition(rid, model.LLM)
    assert part.fwd_pass_number == CRASH_PASS and model.pass_complete(part)
    assert fleet.store.leases(rid)[model.LLM].holder == a
    finish_with_a_successor(fleet, rid)


def test_killed_with_a_merge_applied_and_its_reply_unread(
    fleet: Fleet, real_client: redis.Redis, namespace: str
) -> None:
    rid = tts_request()
    a = start_alone(fleet, "stop_inside_merge", rid)
    said = pump_until(fleet, signal_from(real_client, namespace), "A to be inside a merge")
    fleet.kill(a)
    # The merge reached Redis and was applied, its reply never read; the report that follows
    # a merge was never sent. The successor's redelivery must merge nothing twice.
    rank = int(said.rsplit("/", 1)[1])
    kv = fleet.store.load_partition(rid, model.LLM).resource_publish_info["kv"]
    assert kv.info[rank][model.LLM].latest_kv_transfer_info["pass"] == CRASH_PASS  # type: ignore[attr-defined]
    assert fleet.store.load_partition(rid, model.LLM).fwd_pass_number == CRASH_PASS
    finish_with_a_successor(fleet, rid)


def test_killed_after_the_advance_before_the_release(
    fleet: Fleet, real_client: redis.Redis, namespace: str
) -> None:
    rid = tts_request()
    a = start_alone(fleet, "stop_after_advance", rid)
    pump_until(fleet, signal_from(real_client, namespace), "A to advance")
    fleet.kill(a)
    # Advanced, but the next pass never sent and the lease never released.
    part = fleet.store.load_partition(rid, model.LLM)
    assert part.fwd_pass_number == CRASH_PASS + 1 and not part.wg_rank_completions
    assert fleet.store.leases(rid)[model.LLM].holder == a
    finish_with_a_successor(fleet, rid)


def test_a_replica_paused_past_its_lease_is_fenced_and_changes_nothing(
    fleet: Fleet, real_client: redis.Redis, namespace: str
) -> None:
    rid = tts_request()
    signals = signal_from(real_client, namespace)
    a = start_alone(fleet, "pause_before_advance", rid)
    assert pump_until(fleet, signals, "A to complete the pass") == "before-advance"
    fleet.pause(a)  # SIGSTOP, with A's lease live and its advance not sent
    fleet.spawn()
    pump_until(fleet, lambda: rid in fleet.finished, f"{rid} to finish without A")
    before = canonical(fleet.store.load_request(rid))
    stale_lease = fleet.store.leases(rid)
    fleet.resume(a)  # SIGCONT: A goes on with its advance, fenced by its old lease
    assert pump_until(fleet, signals, "A's advance to return") == "fenced"
    assert canonical(fleet.store.load_request(rid)) == before
    assert fleet.store.leases(rid) == stale_lease
    fleet.stop()
    assert fleet.finished == reference_run(SEED, [rid], TIMING)
    assert fleet.stats.counters.get("fenced", 0) >= 1


@pytest.mark.slow
def test_duplicated_and_reordered_reports_across_processes(fleet: Fleet) -> None:
    fleet.delivery = Delivery(duplicate_rate=0.6, reorder_window=0.05, late_window=0.5)
    ids = model.request_ids(4)
    fleet.wait_until_up([fleet.spawn() for _ in range(3)], timeout=WAIT)
    fleet.create(ids)
    pump_until(fleet, lambda: not fleet.pending(), "every request to finish")
    fleet.stop()
    assert fleet.finished == reference_run(SEED, ids, TIMING)
    counters = fleet.stats.counters
    assert counters.get("duplicates", 0) + counters.get("stale", 0) > 0


def test_every_report_twice_in_reverse_order_gives_the_reference(
    real_client: redis.Redis, namespace: str
) -> None:
    """One in-process replica, each pass's reports delivered backwards, twice, then late."""
    ids = model.request_ids(4)
    store_ = RequestStore(real_client, namespace=namespace, lease_ttl=TIMING.lease_ttl)
    keys = replica.SimKeys(namespace)
    one = replica.Replica(store_, replica_id="solo", seed=SEED, timing=TIMING, keys=keys)
    for rid in ids:
        replica.ingest(store_, keys, model.spec(SEED, rid), TIMING.pass_deadline)
    finished = {}
    for _ in range(10_000):
        raw = real_client.lpop(keys.dispatch)
        if raw is None:
            break
        rid, partition, fwd_pass = replica.decode_dispatch(raw)  # type: ignore[arg-type]
        batch: list[Report] = model.reports(one.spec(rid), partition, fwd_pass)
        for report in reversed(batch):
            one.handle(report)
            one.handle(report)  # absorbed as a duplicate while the pass is open
        for report in batch:
            one.handle(report)  # late: stale once the pass has moved on
    while (done := real_client.lpop(keys.finished)) is not None:
        rid = done.decode()  # type: ignore[union-attr]
        finished[rid] = canonical(store_.load_request(rid))
    assert finished == reference_run(SEED, ids, TIMING)
    assert one.stats.counters["duplicates"] > 0
    assert one.stats.counters["stale"] > 0
