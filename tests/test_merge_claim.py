"""The merging claim is served in turn: starved optimistic merges get it in the order they
queued, a waiter that stopped asking loses its place, and leaving frees only its own claim."""

from __future__ import annotations

import time

import fakeredis
import pytest
import redis

from store import scripts as script_files

CLAIM_MS = 5_000
LAPSE_MS = 300


def claim_script(client: redis.Redis, namespace: str):  # type: ignore[no-untyped-def]
    source = script_files.source("merge_claim")
    if isinstance(client, fakeredis.FakeRedis):  # its Lua cannot read the flag line
        source = source.split("\n", 1)[1]
    script = client.register_script(source)
    keys = [f"{namespace}:{{r}}:merging:p", f"{namespace}:{{r}}:merging-queue:p"]

    def call(token: str, mode: str = "TAKE") -> int:
        return int(script(keys=keys, args=[token, CLAIM_MS, LAPSE_MS, mode]))

    return call, keys


def test_waiters_get_the_claim_in_the_order_they_queued(
    client: redis.Redis, namespace: str
) -> None:
    take, (claim, _) = claim_script(client, namespace)
    assert take("a") == 1 and take("a") == 1  # free: taken; asked again: still held
    for waiter in ("c", "b", "d"):  # queued in this order while "a" holds it
        assert take(waiter) == 0
    assert take("a", "LEAVE") == 0 and client.get(claim) is None
    assert [take("b"), take("d")] == [0, 0]  # free, but "c" queued first
    assert take("c") == 1 and client.get(claim) == b"c"
    take("c", "LEAVE")
    assert [take("d"), take("b")] == [0, 1]


def test_a_waiter_that_stopped_asking_loses_its_place(client: redis.Redis, namespace: str) -> None:
    take, (claim, queue) = claim_script(client, namespace)
    assert take("a") == 1
    assert [take("gone"), take("b")] == [0, 0]
    take("a", "LEAVE")
    time.sleep(LAPSE_MS / 1000 * 1.5)  # "gone" never asks again; "b" asks now
    assert take("b") == 1
    assert set(client.hgetall(queue)) <= {b"#"}  # the ticket counter alone
    assert 0 < client.pttl(claim) <= CLAIM_MS


def test_leaving_frees_only_the_leavers_own_claim(client: redis.Redis, namespace: str) -> None:
    take, (claim, queue) = claim_script(client, namespace)
    assert take("a") == 1 and take("b") == 0
    take("b", "LEAVE")  # gives up while "a" holds the claim
    assert client.get(claim) == b"a" and set(client.hgetall(queue)) <= {b"#"}


# -- stepping aside: patience for a stall, not for a queue that moves ------------------------


def _drive_stepping_aside(writers: list[object], max_wait: float) -> int:
    """Run ``optimistic`` with a body that steps aside once for each of ``writers`` (about
    5 ms apart), then commits nothing; how many times it stepped aside."""
    from store.backoff import RetryPolicy
    from store.ops.effects import Commit, Sleep, Unwatch, Watch
    from store.ops.transaction import Plan, optimistic

    asides = 0

    def body(replies: list[object]) -> Plan[str]:
        nonlocal asides
        if asides < len(writers):
            asides += 1
            return Plan(step_aside=True, waiting_for=writers[asides - 1])
        return Plan([], "done")

    policy = RetryPolicy(base_delay=0.0, max_delay=0.0, max_wait=max_wait)
    op = optimistic(["k"], [("GET", "k")], body, policy, {"request_id": "r1", "key": "k"})
    value: object = None
    while True:
        try:
            effect = op.send(value)
        except StopIteration as stop:
            assert stop.value.result == "done"
            return asides
        value = None
        if isinstance(effect, Sleep):
            time.sleep(0.005)
        elif isinstance(effect, Watch):
            value = [b"OK", None]
        else:
            assert isinstance(effect, (Unwatch, Commit)), effect


def test_a_merge_waits_for_a_moving_queue_longer_than_its_patience() -> None:
    """Under load a queue of 64 merges taking the claim in turn can outlast ``max_wait``;
    the last in line must not give up while the claim keeps changing hands."""
    writers = [f"merge-{i}".encode() for i in range(40)]  # about 0.2 s, against 0.05
    assert _drive_stepping_aside(writers, max_wait=0.05) == 40


def test_a_merge_gives_up_on_a_claim_that_does_not_move() -> None:
    from store import TransactionConflictError

    stuck = [b"merge-0"] * 40
    started = time.monotonic()
    with pytest.raises(TransactionConflictError):
        _drive_stepping_aside(stuck, max_wait=0.05)
    assert time.monotonic() - started < 1.0


def _busy_waits(holders: list[object], max_wait: float) -> None:
    """``BusyWait.pause`` once for each of ``holders`` (the claim as each BUSY reply named
    it), about 5 ms apart."""
    from store.backoff import RetryPolicy
    from store.ops.calls import BusyWait

    waiting = BusyWait(RetryPolicy(base_delay=0.0, max_delay=0.0, max_wait=max_wait), {})
    for holder in holders:
        for _ in waiting.pause([b"BUSY", holder]):  # its Sleep
            time.sleep(0.005)


def test_a_server_side_write_waits_out_merges_taking_the_claim_in_turn() -> None:
    _busy_waits([f"merge-{i}".encode() for i in range(40)], max_wait=0.05)


def test_a_server_side_write_gives_up_on_a_claim_that_does_not_move() -> None:
    from store import TransactionConflictError

    with pytest.raises(TransactionConflictError):
        _busy_waits([b"merge-0"] * 40, max_wait=0.05)
