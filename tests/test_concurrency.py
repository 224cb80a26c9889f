"""Many processes on one request: the stored state must equal a sequential fold of every op.

Each worker is a separate process (forkserver context, so nothing is shared but the Redis
server) that builds its own ``RequestStore`` from a URL. Every operation's content is a pure
function of (worker, op index), so the parent can compute the expected end state itself.
"""

from __future__ import annotations

import asyncio
import random
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest

from store import (
    AsyncRequestStore,
    Codec,
    KindRegistry,
    RequestStore,
    StalePassError,
    TransactionConflictError,
)
from store.codec.kinds import default_registry
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    StreamingConnectionState,
    merge_publish_info,
)
from tests import backends
from tests.backends import delete_namespace, redis_url_for_tests
from tests.processes import run_workers
from tests.servers import free_port

# Many processes contend for one partition and must all commit at default settings: no
# other test's load beside them (see the ``exclusive`` fixture in conftest.py).
pytestmark = pytest.mark.exclusive

RID = "req-1"


@dataclass
class TagsInfo(PublishedInfo):
    """A user kind (merged in Python, so by an optimistic transaction): a union of tags."""

    tags: set[str] = field(default_factory=set)

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, TagsInfo)
        self.tags |= other.tags


# A registry of this module's own, so the process-wide default one is left as it is.
REGISTRY = KindRegistry()
for _name, _kind in default_registry.names().items():
    REGISTRY.register(_kind, _name)
REGISTRY.register(TagsInfo, "tags")


def _store(url: str, namespace: str) -> RequestStore:
    return RequestStore.from_url(url, namespace=namespace, codec=Codec(REGISTRY))


KV_LABELS = ("kv0", "kv1", "kv2")
BARRIER_TIMEOUT = 60.0


def _metadata() -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)


def _connection(source: str, target: str) -> StreamingConnectionState:
    return StreamingConnectionState(source, target, edge_name=f"{source}-{target}")


def _create(store: RequestStore, worker_graph_ids: set[str] | None = None) -> None:
    """One request: ``src`` streams into ``p``, ``p`` streams into ``q``."""
    partitions = {
        name: PartitionState(name, _metadata(), current_worker_graph_ids=set(wgs))
        for name, wgs in (("src", ()), ("p", worker_graph_ids or ()), ("q", ()))
    }
    connections = {"src->p": _connection("src", "p"), "p->q": _connection("p", "q")}
    store.create_request(RID, partitions=partitions, connections=connections, max_output_tokens=1)


@contextmanager
def _namespace_cleaned(url: str) -> Iterator[str]:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    try:
        yield namespace
    finally:
        with backends.connect(url) as c:
            delete_namespace(c, namespace)


def _report(worker: int, barrier: Any, results: Any, work: Callable[[], dict[str, Any]]) -> None:
    """Run ``work`` in a child and put its result, or its traceback, on ``results``."""
    try:
        outcome = work()
    except BaseException:
        barrier.abort()  # the others must not wait for this one at the next barrier
        outcome = {"traceback": f"worker {worker}:\n{traceback.format_exc()}"}
    outcome["worker"] = worker
    results.put(outcome)


# -- merges and token adds on one request ---------------------------------------------------


def _merge_op(worker: int, i: int) -> dict[str, Any]:
    """Op ``i`` of ``worker``: a fresh object each call, as a merge may update in place.

    Every KV shard gets a cache label of its own (a KV merge lets the newer shard win per
    label, which would make the fold order-dependent), every shard names the same world size
    (the first merge of a label fixes it) and positions are above 0 and merge by max (a
    label's first merge takes a position of 0 too, a later one does not), so the fold of all
    ops is the same in every order. Odd ops also carry a user kind, which sends
    the whole merge down the optimistic path; even ones merge on the server.
    """
    rank = worker % 4
    shard = KVSequenceInfo(
        seq_len=i + 1,
        latest_kv_transfer_info={"worker": worker, "op": i},
        page_indices=[worker, i, i + 1],
    )
    op: dict[str, Any] = {
        KV_LABELS[(worker + i) % len(KV_LABELS)]: PublishedKVInfo(
            info={rank: {f"w{worker}.{i}": shard}}, world_size=4
        ),
        "pos": PublishedPositionInfo(counters={f"w{worker}": i + 1, "shared": 10 * i + worker + 1}),
    }
    if i % 2:
        op["tags"] = TagsInfo({f"w{worker}.{i}"})
    return op


def _token_op(worker: int, i: int) -> int:
    return (worker * 7 + i) % 5 + 1


def _merge_worker(
    worker: int, barrier: Any, results: Any, url: str, namespace: str, ops: int
) -> None:
    def work() -> dict[str, Any]:
        store = _store(url, namespace)
        conflicts = 0
        barrier.wait(BARRIER_TIMEOUT)
        for i in range(ops):
            try:
                store.merge_publish_info(RID, "p", _merge_op(worker, i))
            except TransactionConflictError:
                conflicts += 1
            store.add_tokens(RID, "p->q", _token_op(worker, i))
        stats = store.stats
        store.client.close()
        return {
            "transactions": stats.transactions,
            "server_merges": stats.server_merges,
            "attempts": stats.attempts,
            "retries": stats.retries,
            "conflicts": conflicts,
        }

    _report(worker, barrier, results, work)


TASKS_PER_PROCESS = 16


def _async_merge_worker(
    worker: int, barrier: Any, results: Any, url: str, namespace: str, ops: int
) -> None:
    """As ``_merge_worker``, with the ops spread over 16 asyncio tasks on one store."""

    async def run() -> dict[str, Any]:
        store = AsyncRequestStore.from_url(url, namespace=namespace, codec=Codec(REGISTRY))
        conflicts = 0

        async def task(first: int) -> None:
            nonlocal conflicts
            for i in range(first, ops, TASKS_PER_PROCESS):
                try:
                    await store.merge_publish_info(RID, "p", _merge_op(worker, i))
                except TransactionConflictError:
                    conflicts += 1
                await store.add_tokens(RID, "p->q", _token_op(worker, i))

        barrier.wait(BARRIER_TIMEOUT)
        await asyncio.gather(*(task(t) for t in range(TASKS_PER_PROCESS)))
        stats = store.stats
        await store.aclose()
        return {
            "transactions": stats.transactions,
            "server_merges": stats.server_merges,
            "attempts": stats.attempts,
            "retries": stats.retries,
            "conflicts": conflicts,
        }

    _report(worker, barrier, results, lambda: asyncio.run(run()))


def _fold(order: list[tuple[int, int]]) -> dict[str, Any]:
    held: dict[str, Any] = {}
    for worker, i in order:
        merge_publish_info(held, _merge_op(worker, i))
    return held


def _check_merges(
    url: str, backend: str, workers: int, ops: int, target: Callable[..., None] = _merge_worker
) -> None:
    with _namespace_cleaned(url) as namespace:
        store = _store(url, namespace)
        _create(store)
        outcomes = run_workers(target, workers, url, namespace, ops)

        all_ops = [(w, i) for w in range(workers) for i in range(ops)]
        expected = _fold(all_ops)
        shuffled = list(all_ops)
        random.Random(7).shuffle(shuffled)
        assert _fold(list(reversed(all_ops))) == expected == _fold(shuffled)
        assert sum(len(expected[label].info[r]) for label in KV_LABELS for r in range(4)) == len(
            all_ops
        )

        # A merge that ran out of tries is missing below: say so first.
        assert sum(o["conflicts"] for o in outcomes) == 0
        held = store.load_partition(RID, "p").resource_publish_info
        assert held == expected
        tokens = sum(_token_op(w, i) for w, i in all_ops)
        assert store.load_connection(RID, "p->q").token_count == tokens

        transactions = sum(o["transactions"] for o in outcomes)
        server_merges = sum(o["server_merges"] for o in outcomes)
        retries = sum(o["retries"] for o in outcomes)
        print(
            f"\n{workers} processes x {ops} merges on {backend}: {server_merges} merged on "
            f"the server; {retries} retries over {transactions} optimistic commits "
            f"({retries / transactions:.2f} retries per commit, "
            f"max attempts in one process {max(o['attempts'] for o in outcomes)})"
        )
        odd = sum(1 for _, i in all_ops if i % 2)
        assert (transactions, server_merges) == (odd, len(all_ops) - odd)
        assert sum(o["conflicts"] for o in outcomes) == 0
        store.client.close()


@pytest.mark.real
@pytest.mark.slow
def test_concurrent_merges_and_token_adds_equal_the_sequential_fold(
    real_redis_error: str | None,
) -> None:
    if real_redis_error:
        pytest.skip(real_redis_error)
    _check_merges(redis_url_for_tests(), "real Redis", workers=8, ops=200)


@pytest.mark.real
@pytest.mark.slow
def test_concurrent_async_merges_and_token_adds_equal_the_sequential_fold(
    real_redis_error: str | None,
) -> None:
    """4 processes, each with 16 asyncio tasks on one AsyncRequestStore, on one partition."""
    if real_redis_error:
        pytest.skip(real_redis_error)
    _check_merges(redis_url_for_tests(), "real Redis (async)", 4, 200, target=_async_merge_worker)


@pytest.fixture
def fake_tcp_url() -> Iterator[str]:
    """A fakeredis server on a TCP port, so that other processes share one fake backend."""
    server = fakeredis.TcpFakeServer(("127.0.0.1", free_port()), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"redis://{host}:{port}/0"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.fake
@pytest.mark.slow
def test_concurrent_merges_on_a_shared_fakeredis_tcp_server(fake_tcp_url: str) -> None:
    _check_merges(fake_tcp_url, "fakeredis over TCP", workers=8, ops=20)


# -- duplicate reports and advance races ---------------------------------------------------

WORKER_GRAPHS = ("wg0", "wg1", "wg2")
RANKS = 4
PASSES = 30
ROUNDS = 20


REPORTS = [(wg, rank) for wg in WORKER_GRAPHS for rank in range(RANKS)]


def _deliverers(fwd_pass: int, report: int, workers: int) -> list[int]:
    """The distinct processes that deliver one report: two or three of them."""
    copies = 2 + (fwd_pass + report) % 2
    first = (fwd_pass * 5 + report) % workers
    return [(first + k * 3) % workers for k in range(copies)]


def _new_tokens(fwd_pass: int, wg: str) -> int:
    return fwd_pass + int(wg[2:]) + 1


def _consumed(fwd_pass: int, wg: str) -> int:
    return 3 * fwd_pass + int(wg[2:])


def _report_worker(
    worker: int, barrier: Any, results: Any, url: str, namespace: str, workers: int
) -> None:
    def work() -> dict[str, Any]:
        store = RequestStore.from_url(url, namespace=namespace)
        rng = random.Random(worker)
        outcomes = []
        for fwd_pass in range(PASSES):
            mine = [
                (n, report)
                for n, report in enumerate(REPORTS)
                if worker in _deliverers(fwd_pass, n, workers)
            ]
            rng.shuffle(mine)
            barrier.wait(BARRIER_TIMEOUT)
            completed = False
            for _, (wg, rank) in mine:
                carries = rank == 0
                outcome = store.record_worker_report(
                    RID,
                    "p",
                    fwd_pass=fwd_pass,
                    worker_graph_id=wg,
                    rank=rank,
                    num_ranks=RANKS,
                    new_tokens=_new_tokens(fwd_pass, wg) if carries else 0,
                    output_names=[f"{wg}@{fwd_pass}"] if carries else [],
                    consumed={"src->p": _consumed(fwd_pass, wg)} if carries else None,
                )
                outcomes.append((fwd_pass, wg, rank, outcome))
                completed = completed or (outcome.applied and outcome.pass_complete)
            # Every delivery, duplicates included, lands within its pass (a late one would
            # get StalePassError); then the conductor that saw the pass complete moves on.
            # The last pass stays open so that its per-pass state can be checked.
            barrier.wait(BARRIER_TIMEOUT)
            if completed and fwd_pass < PASSES - 1:
                store.advance_partition(
                    RID,
                    "p",
                    from_pass=fwd_pass,
                    metadata=_metadata(),
                    worker_graph_ids=WORKER_GRAPHS,
                )
            barrier.wait(BARRIER_TIMEOUT)

        last_pass = None
        if worker == 0:  # every report is in: snapshot the open pass before the races
            state = store.load_partition(RID, "p")
            last_pass = {
                "fwd_pass_number": state.fwd_pass_number,
                "wg_rank_completions": state.wg_rank_completions,
                "completed_worker_graph_ids": sorted(state.completed_worker_graph_ids),
                "curr_forward_outputs": sorted(state.curr_forward_outputs),
            }
        races = []
        for round_ in range(ROUNDS):
            barrier.wait(BARRIER_TIMEOUT)
            from_pass = PASSES - 1 + round_
            try:
                new = store.advance_partition(RID, "p", from_pass=from_pass, metadata=_metadata())
                races.append((from_pass, "won", new))
            except StalePassError as e:
                races.append((from_pass, "stale", e.current))
            barrier.wait(BARRIER_TIMEOUT)
        store.client.close()
        return {"outcomes": outcomes, "last_pass": last_pass, "races": races}

    _report(worker, barrier, results, work)


@pytest.mark.real
@pytest.mark.slow
def test_duplicate_reports_count_once_and_exactly_one_advance_wins(
    real_redis_error: str | None,
) -> None:
    if real_redis_error:
        pytest.skip(real_redis_error)
    url, workers = redis_url_for_tests(), 8
    with _namespace_cleaned(url) as namespace:
        store = RequestStore.from_url(url, namespace=namespace)
        _create(store, set(WORKER_GRAPHS))
        results = run_workers(_report_worker, workers, url, namespace, workers)
        outcomes = [o for r in results for o in r["outcomes"]]

        deliveries = sum(
            len(_deliverers(p, n, workers)) for p in range(PASSES) for n in range(len(REPORTS))
        )
        assert len(outcomes) == deliveries > PASSES * len(REPORTS) * 2
        for fwd_pass in range(PASSES):
            of_pass = [o for o in outcomes if o[0] == fwd_pass]
            for wg, rank in REPORTS:
                applied = [o for p, w, r, o in of_pass if (w, r) == (wg, rank) and o.applied]
                assert len(applied) == 1, (fwd_pass, wg, rank)
            for wg in WORKER_GRAPHS:
                counts = sorted(
                    o.rank_completions for _, w, _, o in of_pass if w == wg and o.applied
                )
                assert counts == list(range(1, RANKS + 1)), (fwd_pass, wg)
                assert (
                    sum(o.worker_graph_complete for _, w, _, o in of_pass if w == wg and o.applied)
                    == 1
                )
            # Exactly one delivery completed the pass; its resent copies say so too.
            completing = [(w, r) for _, w, r, o in of_pass if o.applied and o.pass_complete]
            assert len(completing) == 1, fwd_pass
            copies = [o for _, w, r, o in of_pass if (w, r) == completing[0] and not o.applied]
            assert copies and all(o.pass_complete for o in copies)
            others = [o for _, w, r, o in of_pass if (w, r) != completing[0]]
            assert not any(o.pass_complete for o in others)

        last = PASSES - 1
        assert results[0]["last_pass"] == {
            "fwd_pass_number": last,
            "wg_rank_completions": dict.fromkeys(WORKER_GRAPHS, RANKS),
            "completed_worker_graph_ids": list(WORKER_GRAPHS),
            "curr_forward_outputs": sorted(f"{wg}@{last}" for wg in WORKER_GRAPHS),
        }

        # Every race was won exactly once, and each win moved the pass by one.
        races = [race for r in results for race in r["races"]]
        for round_ in range(ROUNDS):
            from_pass = PASSES - 1 + round_
            of_round = [race for race in races if race[0] == from_pass]
            assert len(of_round) == workers
            assert [race[2] for race in of_round if race[1] == "won"] == [from_pass + 1]
            assert all(race[2] == from_pass + 1 for race in of_round if race[1] == "stale")

        final = store.load_partition(RID, "p")
        assert final.fwd_pass_number == PASSES - 1 + ROUNDS
        tokens = sum(_new_tokens(p, wg) for p in range(PASSES) for wg in WORKER_GRAPHS)
        assert final.num_output_tokens == tokens
        assert store.load_connection(RID, "p->q").token_count == tokens
        assert store.load_connection(RID, "src->p").consumed_count == _consumed(last, "wg2")
        store.client.close()
