"""The ``mstar-store`` command line, driven in-process through ``store.cli.main``.

Against fakeredis, ``store.cli.main.make_client`` is replaced so that the command runs on the
test's fake server; against real Redis the command gets ``--redis-url`` like a user would.
"""

from __future__ import annotations

import json
import re
import sys
import time
import tomllib
from pathlib import Path

import fakeredis
import msgspec
import pytest
import redis

from store.cli import demo
from store.cli import main as cli
from store.schema import SCHEMA_VERSION
from store.store import RequestStore
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionDefinition,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests.conftest import Run


@pytest.fixture(autouse=True)
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSTAR_REDIS_URL", raising=False)
    monkeypatch.delenv("MSTAR_NAMESPACE", raising=False)


@pytest.fixture
def store(client: redis.Redis, namespace: str) -> RequestStore:
    return RequestStore(client, namespace=namespace)


def summary(out: str) -> dict[str, int]:
    """The demo's summary table as {row label: number}."""
    table = out.split("\nsummary\n", 1)[1]
    rows = re.findall(r"^  ([a-z ]+?)\s+(\d+)  ", table, flags=re.MULTILINE)
    return {label: int(value) for label, value in rows}


def seed_request(store: RequestStore, rid: str) -> None:
    """A two-partition request whose LLM (two ranks) finished one pass of 3 tokens."""
    meta = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
    store.create_request(
        rid,
        partitions={
            "llm": PartitionState("llm", meta, current_worker_graph_ids={"wg"}),
            "codec": PartitionState("codec", meta, current_worker_graph_ids={"cwg"}),
        },
        connections={"llm->codec": StreamingConnectionState("llm", "codec", "llm->codec")},
        max_output_tokens=13,
        seed=7,
        resource_configs={"sampler": SamplingReqConfig(top_k=5, _seed=7)},
        partition_definitions={"llm": PartitionDefinition("llm", {"prefill", "decode"}, "prefill")},
    )
    for rank in (0, 1):
        kv = KVSequenceInfo(
            seq_len=20, latest_kv_transfer_info=None, page_indices=[rank * 10, rank * 10 + 1]
        )
        store.merge_publish_info(
            rid,
            "llm",
            {
                "kv": PublishedKVInfo(info={rank: {"main": kv}}, world_size=2),
                "position": PublishedPositionInfo(counters={"main": 20}),
            },
        )
        store.record_worker_report(
            rid, "llm", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=2,
            new_tokens=3 if rank == 0 else 0,
        )  # fmt: skip
    store.advance_partition(rid, "llm", from_pass=0, metadata=meta, worker_graph_ids=["wg"])
    store.set_final_output(rid, "text", "hello")


# -- demo ----------------------------------------------------------------------------------


def test_demo_summary_counts_what_the_plan_drives(
    run: Run, client: redis.Redis, namespace: str
) -> None:
    result = run("demo", "--requests", "2")

    assert result.code == 0, result.err
    plan = demo.plan(2)
    llm_passes = sum(len(p.llm_chunks) for p in plan)
    codec_passes = result.out.count("\n  codec pass ")
    numbers = summary(result.out)
    assert numbers["requests"] == 2
    assert numbers["tokens"] == sum(p.max_output_tokens for p in plan) == 13 + 19
    assert result.out.count("\n  llm   pass ") == llm_passes
    assert numbers["forward passes"] == llm_passes + codec_passes
    assert numbers["worker reports"] == demo.LLM_RANKS * llm_passes + codec_passes
    assert numbers["merges"] == demo.LLM_RANKS * llm_passes  # one per rank per LLM pass
    assert numbers["transaction retries"] == 0  # one conductor, no contention
    assert "llm->codec 19/19 done  -> done" in result.out
    assert list(client.scan_iter(match=f"{namespace}:*")) == []  # finished requests deleted


@pytest.mark.fake
def test_demo_runs_on_an_embedded_fakeredis_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert "embedded in-process fakeredis" in lines[0]
    assert "namespace 'mstar-demo'" in lines[0]
    assert len(lines) < 60
    assert summary("\n".join(lines))["tokens"] == sum(p.max_output_tokens for p in demo.plan(3))


def test_demo_keep_leaves_finished_requests_for_ls(run: Run) -> None:
    assert run("demo", "--requests", "2", "--keep").code == 0

    result = run("ls")

    lines = result.out.splitlines()
    assert result.code == 0
    assert lines[0].startswith("2 requests in namespace")
    assert re.search(r"llm: pass 3 tokens 13 \[done\].*llm->codec 13/13 done$", lines[1])
    assert re.search(r"llm: pass 4 tokens 19 \[done\].*llm->codec 19/19 done$", lines[2])


@pytest.mark.fake
@pytest.mark.parametrize("missing", ["fakeredis", "lupa"])
def test_demo_without_fakeredis_says_what_to_install(
    missing: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if it were not installed

    assert cli.main(["demo"]) == 1

    out, err = capsys.readouterr()
    assert out == ""
    assert f"needs {missing}" in err
    assert "pip install 'mstar-conductor-store[demo]'" in err
    assert "--redis-url" in err
    assert err.startswith("error: ")
    assert "Traceback" not in err


@pytest.mark.fake
def test_demo_rejects_a_non_positive_request_count() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--requests", "0"])
    assert exc.value.code == 2


# -- ls --------------------------------------------------------------------------------------


def test_ls_says_so_when_the_namespace_is_empty(run: Run, namespace: str) -> None:
    result = run("ls")

    assert result.code == 0
    # Then the namespaces that hold requests, if any do (a shared Redis: tests/test_cli_guidance)
    said = f"no requests in namespace {namespace!r}"
    assert result.out.startswith(said) and result.out.count("\n") == 1


def test_ls_prints_one_line_of_progress_per_request(run: Run, store: RequestStore) -> None:
    seed_request(store, "r-1")
    seed_request(store, "r-2")
    store.update_partition("r-2", "codec", is_done=True)
    store.raise_consumed_count("r-2", "llm->codec", 2)

    result = run("ls")

    lines = result.out.splitlines()
    assert result.code == 0
    assert len(lines) == 3
    assert re.fullmatch(
        r"r-1  age \d+s  llm: pass 1 tokens 3  codec: pass 0 tokens 0  llm->codec 3/0", lines[1]
    )
    assert lines[2].endswith("llm: pass 1 tokens 3  codec: pass 0 tokens 0 [done]  llm->codec 3/2")


def test_ls_lists_the_requests_of_every_m_star_conductor(run: Run, store: RequestStore) -> None:
    from store.conductor import ConductorRequest
    from store.types import (
        CurrentForwardConductorMetadata,
        PartitionState,
        StreamingConnectionState,
    )

    seed_request(store, "r-1")
    for rid, owner in (("c-1", "east"), ("c-2", "west")):
        walk = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
        parts = {n: PartitionState(n, walk, fwd_pass_number=2) for n in ("llm", "codec")}
        conns = {"llm->codec": StreamingConnectionState("llm", "codec", "text", token_count=3)}
        request = ConductorRequest(
            rid, {}, {}, {"wg": ["worker_0"]}, {"wg"}, 9, 0, {},
            partition_states=parts, streaming_connections=conns, owner=owner,
        )  # fmt: skip
        store.ingest_request(request)
    store.abort_request("c-2", now=0.0)

    result = run("ls")

    lines = result.out.splitlines()
    assert result.code == 0
    assert lines[2] == f"2 requests held by M* conductors in namespace {store.keys.namespace!r}"
    assert (
        lines[3]
        == "c-1  deployment east  llm: pass 2 tokens 0  codec: pass 2 tokens 0  llm->codec 3/0"
    )
    assert lines[4].startswith("c-2  deployment west  llm: pass 2")
    assert lines[4].endswith("tearing down (waits for api_server_preprocess_worker, worker_0)")


def test_ls_flags_an_index_entry_without_its_request(
    run: Run, store: RequestStore, client: redis.Redis
) -> None:
    seed_request(store, "r-1")
    client.zadd(store.keys.index, {"ghost": 0})  # as a create interrupted after the index

    lines = run("ls").out.splitlines()

    assert lines[0].startswith("2 requests")
    assert any(line.startswith("ghost") and "not held" in line for line in lines)
    assert any(line.startswith("r-1") and "llm: pass 1" in line for line in lines)


def test_ls_tells_an_expired_finished_request_from_an_interrupted_one(
    run: Run, store: RequestStore, client: redis.Redis
) -> None:
    for rid in ("done", "ghost", "kept"):
        seed_request(store, rid)
    store.finish_request("done", keep_for=0.05)
    store.finish_request("kept", keep_for=3600)
    time.sleep(0.2)  # the finished request's keys expire; reap has not run
    store.delete_request("ghost")
    client.zadd(store.keys.index, {"ghost": 0})  # as a create interrupted after the index

    by_id = {line.split()[0]: line for line in run("ls").out.splitlines()[1:]}

    assert "expired (finished, kept until 20" in by_id["done"]
    assert "interrupted" not in by_id["done"]
    assert "not held: its create or delete was interrupted" in by_id["ghost"]
    assert "llm: pass 1" in by_id["kept"]  # still held, shown as usual
    assert store.kept_until("ghost") is None
    store.reap(max_age=3600)  # drops both: "done" expired, "ghost" is as old as its score
    assert store.kept_until("done") is None
    assert store.list_requests() == ["kept"]


def test_ls_prints_a_line_for_each_damaged_request_and_goes_on(
    run: Run, store: RequestStore, client: redis.Redis
) -> None:
    for rid in ("r-1", "r-2", "r-3", "r-4"):
        seed_request(store, rid)
    llm = store.keys.partition("r-1", "llm")
    client.hset(llm, "curr_forward_outputs", b"9" * 20)  # a length no list can have
    client.hset(store.keys.connection("r-2", "llm->codec"), "token_count", b"-4")
    client.hset(store.keys.lease("r-3"), b"holder[\xff]", b"replica-1")

    lines = run("ls").out.splitlines()

    assert lines[0].startswith("4 requests")
    by_id = {line.split()[0]: line for line in lines[1:]}
    assert by_id["r-1"] == (
        f"r-1  unreadable: key {llm!r}, field 'curr_forward_outputs': "
        "PartitionState.curr_forward_outputs does not decode: "
        f"{b'9' * 20!r} is not a decimal integer"
    )
    assert "field 'token_count'" in by_id["r-2"] and "outside its domain" in by_id["r-2"]
    assert by_id["r-3"].startswith("r-3  unreadable: ")
    assert "llm: pass 1 tokens 3" in by_id["r-4"]


# -- show ------------------------------------------------------------------------------------


def test_show_prints_every_part_of_the_request(run: Run, store: RequestStore) -> None:
    seed_request(store, "r-1")

    result = run("show", "r-1")

    out = result.out
    assert result.code == 0
    assert out.startswith("request r-1 in namespace")
    assert re.search(r"^  max_output_tokens\s+13$", out, re.MULTILINE)
    assert re.search(r"^  seed\s+7$", out, re.MULTILINE)
    assert re.search(r"^    sampler\s+sampling temperature=0.6 top_k=5 .* _seed=7$", out, re.M)
    assert re.search(r"^    llm\s+name='llm' graph_walks=\{decode, prefill\}", out, re.MULTILINE)
    assert re.search(r"^  final_outputs\s+\{text: 'hello'\}$", out, re.MULTILINE)
    assert "partition llm\n" in out and "partition codec\n" in out
    assert re.search(r"^  fwd_pass_number\s+1$", out, re.MULTILINE)
    assert re.search(r"^  num_output_tokens\s+3$", out, re.MULTILINE)
    assert re.search(r"^  current_worker_graph_ids\s+\{wg\}$", out, re.MULTILINE)
    assert (
        "    kv        kv (world size 2) rank 0: main seq_len 20 pages 2; "
        "rank 1: main seq_len 20 pages 2\n" in out
    )
    assert "    position  position main=20\n" in out
    assert "connection llm->codec\n" in out
    assert re.search(r"^  token_count\s+3$", out, re.MULTILINE)


def test_show_json_parses_back_to_the_stored_state(run: Run, store: RequestStore) -> None:
    seed_request(store, "r-1")

    result = run("show", "r-1", "--json")

    assert result.code == 0
    data = json.loads(result.out)
    held = store.load_request("r-1")
    llm = data["partitions"]["llm"]
    assert data["record"]["request_id"] == "r-1"
    assert data["record"]["max_output_tokens"] == held.record.max_output_tokens == 13
    assert data["record"]["resource_configs"]["sampler"] == {
        "kind": "sampling",
        "value": {
            "temperature": 0.6, "top_k": 5, "top_p": 1.0, "ignore_eos": False,
            "repetition_penalty": 1.0, "_seed": 7,
        },
    }  # fmt: skip
    assert data["record"]["partition_definitions"]["llm"]["graph_walks"] == ["decode", "prefill"]
    assert data["record"]["final_outputs"] == {"text": "hello"}
    assert llm["num_output_tokens"] == held.partitions["llm"].num_output_tokens == 3
    assert llm["current_worker_graph_ids"] == ["wg"]
    assert llm["resource_publish_info"]["kv"]["kind"] == "kv"
    assert llm["resource_publish_info"]["kv"]["value"]["info"]["1"]["main"]["page_indices"] == [
        10,
        11,
    ]
    assert llm["resource_publish_info"]["position"]["value"] == {"counters": {"main": 20}}
    assert data["connections"]["llm->codec"]["token_count"] == 3


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_show_of_a_damaged_request_is_one_line_and_exit_1(
    run: Run, store: RequestStore, client: redis.Redis, as_json: bool
) -> None:
    seed_request(store, "r-1")
    seed_request(store, "r-2")
    client.hset(store.keys.partition("r-1", "llm"), "fwd_pass_number", str(2**53).encode())
    pages = msgspec.msgpack.encode([20, None, msgspec.msgpack.encode(["x"])])
    client.hset(store.keys.publish_info("r-2", "llm"), "kv[0:main]", pages)  # read lazily

    for rid, field in (("r-1", "fwd_pass_number"), ("r-2", "kv")):
        result = run("show", rid, *(["--json"] if as_json else []))

        assert (result.code, result.out) == (1, "")
        assert result.err.startswith("error: ") and result.err.count("\n") == 1
        assert f"field '{field}'" in result.err


def test_show_of_a_missing_request_is_an_error(run: Run, namespace: str) -> None:
    result = run("show", "nope")

    assert result.code == 1
    assert result.out == ""
    # Then the namespaces that hold requests, if any do (tests/test_cli_guidance.py).
    said = f"error: no such request (request 'nope') in namespace {namespace!r}"
    assert result.err.startswith(said) and result.err.count("\n") == 1


# -- errors and options ----------------------------------------------------------------------


@pytest.mark.fake
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ls", "--namespace", "bad ns"], "error: namespace 'bad ns' may hold only"),
        (["show", "bad id"], "error: request id may hold only printable ASCII"),
        (["ls", "--redis-url", "http://x"], "error: 'http://x': unsupported scheme 'http'"),
        (["ls", "--redis-url", "redis://x:port"], "error: bad Redis URL 'redis://x:port'"),
        (["ls", "--redis-url", "redis://127.0.0.1:1/0"], "error: Redis unreachable"),
    ],
)
def test_store_errors_exit_1_with_a_one_line_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 1

    out, err = capsys.readouterr()
    assert err.startswith(message)
    assert err.count("\n") == 1  # one line, no traceback
    assert out == ""


@pytest.mark.fake
def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


@pytest.mark.fake
def test_url_and_namespace_default_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    urls: list[str | None] = []

    def make_client(args: object) -> fakeredis.FakeRedis:
        urls.append(getattr(args, "redis_url", None))
        return fakeredis.FakeRedis()

    monkeypatch.setattr(cli, "make_client", make_client)
    monkeypatch.setenv("MSTAR_REDIS_URL", "redis://example.invalid:6380/2")
    monkeypatch.setenv("MSTAR_NAMESPACE", "from-env")

    assert cli.main(["ls"]) == 0
    assert cli.main(["ls", "--redis-url", "redis://flag:6379/0", "--namespace", "flag"]) == 0
    assert cli.main(["demo", "--requests", "1"]) == 0  # throwaway data: not the live store

    lines = capsys.readouterr().out.splitlines()
    assert urls == ["redis://example.invalid:6380/2", "redis://flag:6379/0", None]
    assert lines[0] == "no requests in namespace 'from-env'"
    assert lines[1] == "no requests in namespace 'flag'"
    assert "namespace 'mstar-demo'" in lines[2]


# -- --version -----------------------------------------------------------------------------


def test_version_names_the_package_and_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])

    assert exc.value.code == 0
    printed = re.fullmatch(r"mstar-store (\S+) \(schema v(\d+)\)\n", capsys.readouterr().out)
    assert printed is not None
    # The installed metadata is this source tree's (an editable install), and so is the schema.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert printed.groups() == (pyproject["project"]["version"], str(SCHEMA_VERSION))


def test_history_shows_what_an_m_star_conductor_did(run: Run, store: RequestStore) -> None:
    from store.conductor import ConductorRequest
    from store.types import CurrentForwardConductorMetadata, PartitionState

    walk = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
    parts = {"llm": PartitionState("llm", walk)}
    store.ingest_request(ConductorRequest("c-1", {}, {}, {"wg": ["w"]}, {"wg"}, 9, 0, {}, parts))
    store.abort_request("c-1", now=0.0)

    result = run("history", "c-1")

    assert result.code == 0
    assert "2 entries" in result.out and "no longer held" not in result.out
    assert "ingest" in result.out and "abort" in result.out
