"""Redis SIGKILLed and restarted under writer processes: what was acknowledged survives.

Several writer processes (``tests/faults/writers.py``), each with its own store built from
the URL, write rounds to a private Redis with AOF. Once each has some rounds acknowledged,
Redis is SIGKILLed mid-stream, left down for longer than the writers' patience, and
restarted on the same port; the writers ride through (their calls retry; a call that gave
up is resent with its op ids) and go on writing. Then every
request must hold exactly the rounds its writer saw acknowledged:

- ``appendfsync always``: every acknowledged write is there, none twice (asserted);
- ``appendfsync everysec``: what is missing is measured and printed; only "no corrupt
  record, nothing doubled" is asserted. (A killed process loses nothing Redis wrote to the
  file, fsynced or not: the kernel keeps it; only a machine crash loses the last second.)
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

from store import Codec, RequestStore
from tests.faults import writers
from tests.servers import RedisServer
from tests.strategies import SumInfo, user_registry

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(180)]

WRITERS = 3
ROUNDS_BEFORE = 30  # acknowledged by every writer before the kill
ROUNDS_AFTER = 30  # more, by every writer, after the restart
DOWN_FOR = 2.5  # longer than the writers' patience: some give up and resend their round
WAIT = 60.0


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(
    ("fsync", "tmp_redis"),
    [
        ("always", ("--appendonly", "yes", "--appendfsync", "always")),
        ("everysec", ("--appendonly", "yes", "--appendfsync", "everysec")),
    ],
    indirect=["tmp_redis"],
)
def test_acknowledged_writes_survive_a_sigkill(
    fsync: str, kind: str, tmp_redis: RedisServer, namespace: str
) -> None:
    direct = RequestStore(tmp_redis.client(), namespace=namespace, codec=Codec(user_registry()))
    for w in range(WRITERS):
        writers.create(direct, w)
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    acked = [spawn.Value("q", 0, lock=False) for _ in range(WRITERS)]
    retried = [spawn.Value("q", 0, lock=False) for _ in range(WRITERS)]
    procs = [
        spawn.Process(
            target=writers.run,
            args=(kind, tmp_redis.url, namespace, w, acked[w], retried[w], stop),
            daemon=True,
        )
        for w in range(WRITERS)
    ]
    for p in procs:
        p.start()
    try:
        wait_until(lambda: all(a.value >= ROUNDS_BEFORE for a in acked), "writers are writing")
        at_kill = [a.value for a in acked]
        tmp_redis.kill()
        time.sleep(DOWN_FOR)
        started = time.monotonic()
        tmp_redis.restart()  # same port and dir: the AOF is replayed
        restarted = time.monotonic() - started
        wait_until(
            lambda: all(a.value >= k + ROUNDS_AFTER for a, k in zip(acked, at_kill, strict=True)),
            "writers write again after the restart",
        )
    finally:
        stop.set()
        for p in procs:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    lost = []
    for w in range(WRITERS):
        state = direct.load_request(writers.request_id(w))  # decodes every record
        tokens = state.connections[writers.CONN].token_count
        total = state.partitions["llm"].resource_publish_info["sum"]
        assert isinstance(total, SumInfo)
        assert tokens <= acked[w].value and total.total <= acked[w].value  # nothing doubled
        lost.append((acked[w].value - tokens, acked[w].value - total.total))
    print(
        f"\n[appendfsync {fsync}, {kind} writers] restart took {restarted:.2f} s; "
        f"rounds acknowledged {[a.value for a in acked]} ({at_kill} at the kill); "
        f"resent after a give-up {[r.value for r in retried]}; "
        f"acknowledged but lost (tokens, merges) per writer: {lost}"
    )
    if fsync == "always":
        assert lost == [(0, 0)] * WRITERS
    direct.client.close()
