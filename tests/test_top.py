"""``mstar-store top``: the numbers of a frame, from live namespaces, at a bounded cost."""

from __future__ import annotations

import json
import sys
import time
import types
from typing import Any

import fakeredis
import pytest
import redis

import store.io.sync as store_io_sync
from store.cli import top
from store.keys import KeySpace
from store.replicas import ReplicaRegistry
from store.stats import minute_of
from store.store import RequestStore
from tests import backends
from tests.conftest import Run, send_flush
from tests.conftest import create_small_request as create

# 15 s into the current minute: the previous minute's bucket weighs 45/60 in the estimate.
NOW = minute_of(time.time()) * 60 + 15.0
BEAT = 60.0  # heartbeat interval: replica hashes live 3 minutes, longer than any test


@pytest.fixture(autouse=True)
def _clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(top, "now", lambda: NOW)


def busy_namespace(store: RequestStore) -> None:
    """3 requests, 2 steps due (30 s and 10 s ago), 2 live replicas and 1 silent, and
    statistics flushed over this minute and the one before."""
    client, keys = store.client, store.keys
    for rid in ("r-1", "r-2", "r-3"):
        create(store, rid)
    # The recovery index as the steps left it, at the test's fixed clock.
    client.zadd(keys.deadlines, {"r-1 llm": NOW - 30, "r-2 llm": NOW - 10, "r-3 llm": NOW + 100})
    registry = ReplicaRegistry(client, namespace=keys.namespace)
    registry.heartbeat("replica-a", now=NOW)
    registry.heartbeat("replica-b", now=NOW - 2)
    registry.heartbeat("replica-gone", now=NOW - 600)

    def flush(replica: str, totals: dict[str, int], flushed: dict[str, int], **kw: Any) -> None:
        send_flush(client, keys, replica, totals, flushed, heartbeat_interval=BEAT, **kw)

    before = {"passes": 60, "reports": 120}
    flush("replica-a", before, {}, leases=1, requests=1, now=NOW - 60)
    later = {"passes": 90, "reports": 180, "finished": 6, "takeovers": 2, "fenced": 1}
    flush("replica-a", later, before, leases=2, requests=3, now=NOW - 1)
    flush("replica-b", {"duplicates": 4}, {}, leases=0, requests=1, now=NOW - 2)


def test_once_json_shows_the_numbers_of_the_namespace(
    run: Run, store: RequestStore, client: redis.Redis
) -> None:
    busy_namespace(store)

    result = run("top", "--once", "--json")

    assert result.code == 0, result.err
    frame = json.loads(result.out)
    assert frame["requests"] == {
        "in_flight": 3,
        "finished_per_s": pytest.approx(6 / 60),
        "held_by_m_star_conductors": 0,
    }
    # This minute's 30 passes count whole, the previous minute's 60 for 45 s of 60.
    assert frame["passes_per_s"] == pytest.approx((30 + 60 * 0.75) / 60)
    assert frame["reports_per_s"] == pytest.approx((60 + 120 * 0.75) / 60)
    assert frame["steps_due"] == {"count": 2, "oldest_age_s": 30.0, "oldest": "r-1 llm"}
    assert frame["last_minute"]["takeovers"] == 2
    assert frame["last_minute"]["fenced"] == 1
    assert frame["last_minute"]["duplicates"] == 4
    assert frame["replicas"] == [
        {"id": "replica-a", "beat_age_s": 0.0, "leases": 2, "requests": 3, "stats_age_s": 1.0},
        {"id": "replica-b", "beat_age_s": 2.0, "leases": 0, "requests": 1, "stats_age_s": 2.0},
    ]
    assert frame["silent_replicas"] == 1
    if isinstance(client, fakeredis.FakeRedis):
        assert frame["redis"] is None  # fakeredis has no INFO
    else:
        assert frame["redis"]["used_memory_bytes"] > 0
        assert frame["redis"]["nodes"] == len(backends.masters(client))


def test_an_empty_namespace_is_all_zeros(run: Run) -> None:
    frame = json.loads(run("top", "--once", "--json").out)
    assert frame["requests"] == {
        "in_flight": 0,
        "finished_per_s": 0.0,
        "held_by_m_star_conductors": 0,
    }
    assert frame["steps_due"] == {"count": 0, "oldest_age_s": None, "oldest": None}
    assert frame["replicas"] == []
    assert set(frame["last_minute"].values()) == {0.0}


def test_a_live_replica_without_statistics_shows_as_unknown(run: Run, store: RequestStore) -> None:
    ReplicaRegistry(store.client, namespace=store.keys.namespace).heartbeat("new", now=NOW)
    (replica,) = json.loads(run("top", "--once", "--json").out)["replicas"]
    assert replica == {
        "id": "new", "beat_age_s": 0.0, "leases": None, "requests": None, "stats_age_s": None
    }  # fmt: skip


def _hide_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("rich", "rich.console", "rich.live", "rich.table"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("with_rich", [True, False], ids=["rich", "plain"])
def test_once_draws_the_frame_for_people(
    run: Run, store: RequestStore, monkeypatch: pytest.MonkeyPatch, with_rich: bool
) -> None:
    if not with_rich:
        _hide_rich(monkeypatch)
    busy_namespace(store)

    result = run("top", "--once")

    assert result.code == 0, result.err
    out = result.out
    assert f"namespace '{store.keys.namespace}'" in out
    assert "3 in flight, 0.1 finished/s" in out
    assert "1.2/s, reports 2.5/s" in out
    assert "2, the oldest due for 30s (r-1 llm: see `mstar-store history`)" in out
    assert "takeovers 2, fenced 1, duplicates 4" in out
    assert "2 alive (beat within 5 s), 1 silent" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["replica-a", "0s", "ago", "2", "3", "1s", "ago"] in lines
    assert ("│" in out or "─" in out) is False  # no box drawing, for scripts


@pytest.mark.parametrize("with_rich", [True, False], ids=["rich", "plain"])
def test_live_view_redraws_until_interrupted(
    run: Run, store: RequestStore, monkeypatch: pytest.MonkeyPatch, with_rich: bool
) -> None:
    if not with_rich:
        _hide_rich(monkeypatch)
    create(store, "r-1")
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(top, "time", types.SimpleNamespace(sleep=sleep, time=time.time))
    frames: list[top.Frame] = []
    sample = top.sample
    monkeypatch.setattr(top, "sample", lambda *a: frames.append(sample(*a)) or frames[-1])

    result = run("top", "--interval", "0.5")

    assert result.code == 130
    assert sleeps == [0.5, 0.5, 0.5]
    assert len(frames) == 3 and {f.in_flight for f in frames} == {1}
    assert "1 in flight" in result.out
    assert ("hint: `pip install" in result.err) is not with_rich


def test_json_needs_once(run: Run) -> None:
    result = run("top", "--json")
    assert (result.code, result.err) == (2, "error: --json prints one frame: use it with --once\n")


def test_a_frame_costs_the_same_however_many_requests_are_held(
    store: RequestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[tuple[Any, ...]]] = []
    pack = store_io_sync.pack

    def record(conn: Any, commands: Any) -> Any:
        sent.append(list(commands))
        return pack(conn, commands)

    monkeypatch.setattr(store_io_sync, "pack", record)
    ReplicaRegistry(store.client, namespace=store.keys.namespace).heartbeat("a", now=NOW)
    keys = KeySpace(store.keys.namespace)
    costs = []
    for held in (10, 200):
        for i in range(len(store.list_requests()), held):
            create(store, f"r-{i}")
        sent.clear()
        frame = top.sample(store.client, keys, NOW, 5.0)
        assert frame.in_flight == held
        costs.append(sent[:])
    assert costs[0] == costs[1]
    if len(backends.masters(store.client)) == 1:  # a cluster spreads them over its nodes
        # 7 namespace reads; the M* requests' count with 1 per live replica; INFO memory
        # and stats; in 3 round trips.
        assert sum(len(p) for p in costs[0]) == 11 and len(costs[0]) == 3
    assert not any(b"{" in str(arg).encode() for p in costs[0] for c in p for arg in c)


@pytest.mark.cluster
def test_top_on_a_cluster_sums_the_masters(
    tmp_cluster: Any, namespace: str, run_cluster: Run
) -> None:
    c = tmp_cluster.client()
    try:
        store = RequestStore(c, namespace=namespace)
        busy_namespace(store)
        frame = json.loads(run_cluster("top", "--once", "--json").out)
    finally:
        c.close()
    assert frame["requests"]["in_flight"] == 3
    assert frame["steps_due"]["count"] == 2
    assert [r["id"] for r in frame["replicas"]] == ["replica-a", "replica-b"]
    assert frame["redis"]["nodes"] == 3
    assert frame["redis"]["used_memory_bytes"] > 0


@pytest.fixture
def run_cluster(tmp_cluster: Any, namespace: str, capsys: pytest.CaptureFixture[str]) -> Run:
    from store.cli import main as cli
    from tests.conftest import Result

    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in tmp_cluster.ports)

    def run(*argv: str) -> Result:
        code = cli.main([*argv, "--namespace", namespace, "--redis-url", url])
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def test_the_requests_of_m_star_conductors_are_counted(store: RequestStore) -> None:
    from store.conductor import ConductorRequest
    from store.types import CurrentForwardConductorMetadata, PartitionState

    walk = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
    for rid in ("c-1", "c-2"):
        parts = {"llm": PartitionState("llm", walk)}
        request = ConductorRequest(rid, {}, {}, {"wg": ["w"]}, {"wg"}, 9, 0, {}, parts)
        store.ingest_request(request)
    frame = top.sample(store.client, KeySpace(store.keys.namespace), NOW, 5.0)
    assert frame.conducted == 2
    assert ("M* requests", "2 held by M* conductors (`mstar-store ls` lists them)") in (
        top.summary_rows(frame, 5.0)
    )
