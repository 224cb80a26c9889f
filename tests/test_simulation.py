"""``mstar-store simulate``: runtime replica processes, SIGKILLs, drains and duplicates,
checked end to end.

The command is driven in-process through ``store.cli.main``; its replicas are real
processes (``store.Replica``, or ``store.AsyncReplica`` with ``--async``), on the real Redis
or on the embedded fakeredis TCP server.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from store.cli import main as cli
from store.cli.simulate import model, reference
from store.replicas import ReplicaRegistry
from store.store import RequestStore
from tests.conftest import redis_url_for_tests
from tests.servers import RedisServer


@dataclass
class Result:
    code: int
    out: str
    err: str


def simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    code = cli.main(["simulate", *argv])
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def summary_value(out: str, label: str) -> str:
    match = re.search(rf"^  {re.escape(label)}\s+(.*)$", out, re.MULTILINE)
    assert match, f"no {label!r} row in:\n{out}"
    return match.group(1)


def assert_all_finished_and_matched(
    result: Result, requests: int, kills: int, drains: int = 0
) -> None:
    assert result.code == 0, result.out + result.err
    assert summary_value(result.out, "requests finished") == f"{requests}/{requests}"
    assert summary_value(result.out, "final states").startswith(f"{requests}/{requests} equal")
    assert summary_value(result.out, "nothing doubled").startswith(f"{requests}/{requests} ")
    stopped = summary_value(result.out, "replica processes")
    assert f"{kills} SIGKILLed" in stopped
    if drains:
        assert f"{drains} drained" in stopped
    assert "result: OK" in result.out
    # The progress's last state, as a plain line: stderr is no terminal here.
    assert f"\n{requests}/{requests} finished" in "\n" + result.err
    assert "\r" not in result.err


# -- the runtime's replicas, sync and async, killed and drained ------------------------------
#
# 4 requests, 3 replicas, one SIGKILL and one drain: the kill costs a lease TTL (2 s) of
# the steps the victim held and a pass deadline (2 s) of the reports it had taken; each
# run takes about 5-8 s on a loaded machine.


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_runtime_replicas_on_fakeredis_over_tcp_match_the_reference(
    capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    aio = ["--async"] if kind == "async" else []
    result = simulate(
        capsys, "--replicas", "3", "--requests", "4", "--kill", "2", "--drain", "1",
        "--seed", "4", "--timeout", "60", *aio,
    )  # fmt: skip
    assert "embedded Redis: fakeredis TcpFakeServer" in result.out
    assert ("AsyncReplica" if aio else "(Replica)") in result.out
    assert_all_finished_and_matched(result, requests=4, kills=1, drains=1)


@pytest.mark.real
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_runtime_replicas_on_real_redis_match_the_reference(
    real_client: redis.Redis, namespace: str, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    aio = ["--async"] if kind == "async" else []
    result = simulate(
        capsys, "--replicas", "3", "--requests", "6", "--kill", "2", "--drain", "1",
        "--seed", "2", "--redis-url", redis_url_for_tests(), "--namespace", namespace,
        "--timeout", "60", *aio,
    )  # fmt: skip
    assert_all_finished_and_matched(result, requests=6, kills=1, drains=1)
    assert not list(real_client.scan_iter(match=f"{namespace}:*")), "the run left keys behind"


def test_drain_may_not_exceed_kill(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate(capsys, "--kill", "1", "--drain", "2")
    assert result.code == 2
    assert "--drain 2 exceeds --kill 1" in result.err


@pytest.mark.real
def test_a_final_state_that_differs_from_the_reference_exits_1(
    real_client: redis.Redis,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reference runs in this process, the replicas in theirs: only the reference's
    # final outputs change, as if a run had lost a token.
    honest = model.final_outputs

    def off_by_one(spec: model.RequestSpec, state: Any) -> dict[str, Any]:
        outputs = honest(spec, state)
        outputs["text"] = {"tokens": outputs["text"]["tokens"] + 1}
        return outputs

    monkeypatch.setattr(model, "final_outputs", off_by_one)
    result = simulate(
        capsys, "--replicas", "1", "--requests", "2", "--kill", "0",
        "--redis-url", redis_url_for_tests(), "--namespace", namespace, "--timeout", "60",
    )  # fmt: skip
    assert result.code == 1
    assert summary_value(result.out, "requests finished") == "2/2"
    assert summary_value(result.out, "final states").startswith("0/2 equal")
    assert "mismatch req-0000" in result.out
    assert "record.final_outputs.text.tokens: expected" in result.out
    assert "result: FAILED (2 differ from the reference)" in result.out


@pytest.mark.real
def test_a_run_past_its_timeout_exits_1_and_says_so(
    real_client: redis.Redis, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = simulate(
        capsys, "--replicas", "1", "--requests", "12", "--kill", "0",
        "--redis-url", redis_url_for_tests(), "--namespace", namespace, "--timeout", "0.5",
    )  # fmt: skip
    assert result.code == 1
    said = result.out + result.err
    assert "TIMEOUT: the run did not finish within" in said or "did not start within" in said
    assert not list(real_client.scan_iter(match=f"{namespace}:*")), "the run left keys behind"


@pytest.mark.real
def test_simulate_refuses_a_namespace_that_holds_requests(
    real_client: redis.Redis, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    real_client.zadd(f"{namespace}:requests", {"someone-elses": 1.0})
    result = simulate(
        capsys, "--requests", "1", "--redis-url", redis_url_for_tests(), "--namespace", namespace
    )
    assert result.code == 1
    assert "holds requests or replicas already" in result.err
    assert real_client.zscore(f"{namespace}:requests", "someone-elses") == 1.0


def test_the_reference_is_the_same_every_time_and_differences_name_the_field() -> None:
    ids = model.request_ids(4)
    first = reference.reference_run(11, ids)
    assert first == reference.reference_run(11, ids)
    assert set(first) == set(ids)
    for rid in ids:
        spec = model.spec(11, rid)
        state = first[rid]
        assert all(p["is_done"] for p in state["partitions"].values())
        assert state["record"]["final_outputs"]["text"] == {"tokens": spec.total_tokens}
        if spec.model == model.TTS:
            stream = state["connections"][model.STREAM]
            assert stream["token_count"] == stream["consumed_count"] == spec.total_tokens
    other = reference.reference_run(12, ids)
    diff = reference.differences(first[ids[0]], other[ids[0]])
    assert diff and all(":" in line for line in diff)
    assert reference.differences(first[ids[0]], first[ids[0]]) == []


@pytest.mark.real
def test_replicas_lists_heartbeats_and_ls_shows_the_driver(
    real_client: redis.Redis, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = ReplicaRegistry(real_client, namespace=namespace)
    registry.heartbeat("replica-live")
    registry.heartbeat("replica-gone", now=time.time() - 600)
    store = RequestStore(real_client, namespace=namespace)
    rid = next(r for r in model.request_ids(20) if model.spec(0, r).model == model.TEXT)
    store.create_request(rid, **model.initial_request(model.spec(0, rid)), check_in=60)
    (report,) = model.reports(model.spec(0, rid), model.DEFAULT, 0)
    outcome = store.record_worker_report(
        rid, model.DEFAULT, fwd_pass=0, worker_graph_id=report.worker_graph_id, rank=0,
        num_ranks=1, new_tokens=report.new_tokens, replica_id="replica-live",
    )  # fmt: skip
    assert outcome.lease is not None
    url = ["--redis-url", redis_url_for_tests(), "--namespace", namespace]

    assert cli.main(["replicas", *url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1 live replica in namespace {namespace!r}")
    assert re.search(r"replica-live\s+live\s+last heartbeat \d+\.\ds ago", out)
    assert "replica-gone" not in out and "1 silent" in out
    assert cli.main(["replicas", "--all", *url]) == 0
    assert re.search(r"replica-gone\s+silent\s+last heartbeat 10m0\ds ago", capsys.readouterr().out)

    assert cli.main(["ls", *url]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(rid))
    assert re.search(r"driver default: replica-live \(lease \d+s left\)", line), line
    store.release_lease(outcome.lease, check_in=60)
    assert cli.main(["ls", *url]) == 0
    assert "driver" not in capsys.readouterr().out


def test_without_lua_for_fakeredis_simulate_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "lupa" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = simulate(capsys, "--requests", "1")
    assert result.code == 1
    assert "'lupa' package is missing" in result.err
    assert "pip install 'fakeredis[lua]'" in result.err


@pytest.mark.servers
@pytest.mark.parametrize(
    "tmp_redis", [("--appendonly", "yes", "--appendfsync", "always")], indirect=True
)
def test_a_redis_restart_mid_run_is_one_line_and_the_run_goes_on(
    tmp_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis (AOF) stops for 6 s mid-run and comes back: the replicas' runtime rides
    through, the harness says so in one line, and every request ends as the reference."""
    ready = threading.Event()

    def restart() -> None:
        deadline = time.monotonic() + 30
        client = tmp_redis.client()
        while time.monotonic() < deadline and not client.keys("*:sim:dispatch*"):
            time.sleep(0.01)  # the run has started its requests
        client.close()
        tmp_redis.stop()
        time.sleep(6.0)  # longer than the store keeps reconnecting (5 s): its calls fail
        tmp_redis.start()
        ready.set()

    threading.Thread(target=restart, daemon=True).start()
    result = simulate(
        capsys, "--replicas", "2", "--requests", "24", "--kill", "0", "--seed", "5",
        "--redis-url", tmp_redis.url, "--timeout", "60",
    )  # fmt: skip
    assert ready.wait(30)
    assert "Traceback" not in result.out + result.err
    said = [line for line in result.out.splitlines() if "Redis unreachable mid-run" in line]
    assert len(said) == 1, result.out
    assert_all_finished_and_matched(result, requests=24, kills=0)
