"""The ACL user the docs document (``store.acl.acl_rules``) can do all the store does,
and ``doctor`` names what a user lacks. On a private server with ACL users of its own."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from store import Codec, ReplicaRegistry, Step
from store import acl as store_acl
from store.cli import main as cli
from store.health import worst
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionState,
    PublishedKVInfo,
)
from tests.servers import RedisServer
from tests.stores import Stores
from tests.test_concurrency import REGISTRY, TagsInfo  # a kind merged by WATCH/MULTI/EXEC

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret"
DECODE = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)


def test_every_command_of_the_scripts_is_granted() -> None:
    called = set()
    for script in (ROOT / "store" / "scripts").glob("*.lua"):
        called |= set(re.findall(r"redis\.p?call\('([A-Za-z]+)'", script.read_text()))
    assert called  # the pattern still matches how the scripts call Redis
    assert {c.upper() for c in called} <= set(store_acl.COMMANDS)


def test_the_docs_document_the_rules() -> None:
    readme = (ROOT / "docs" / "deploying-redis.md").read_text()
    words = " ".join(word for word in readme.split() if word != "\\")  # continued lines
    assert f"ACL SETUSER mstar on >PASSWORD {store_acl.acl_rules('mstar')}" in words


def add_user(server: RedisServer, name: str, rules: str) -> str:
    """Create ACL user ``name`` with ``rules``; its URL."""
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{PASSWORD}", *rules.split())
    return f"redis://{name}:{PASSWORD}@{server.host}:{server.port}/0"


def workload(store: Any, client: Any) -> None:
    """Every kind of store call: create, merge (server-side and WATCH), report, step,
    claim, reads, finish, reap, delete, list."""
    prefill = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
    for rid in ("r-1", "r-2"):
        part = PartitionState("llm", prefill, current_worker_graph_ids={"wg"})
        store.create_request(rid, partitions={"llm": part}, max_output_tokens=8, check_in=0.0)
    kv = PublishedKVInfo(
        info={0: {"llm": KVSequenceInfo(seq_len=3, latest_kv_transfer_info=None, page_indices=[1])}}
    )
    store.merge_publish_info("r-1", "llm", {"kv": kv})
    store.merge_publish_info("r-2", "llm", {"tags": TagsInfo({"a"})})
    store.merge_publish_info("r-2", "llm", {"tags": TagsInfo({"b"})})
    for rank in (0, 1):
        outcome = store.record_worker_report(
            "r-1", "llm", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=2,
            new_tokens=1 if rank == 0 else 0, replica_id="replica-a",
        )  # fmt: skip
    assert outcome.pass_complete and outcome.lease is not None
    assert store.take_step(outcome.lease, Step(DECODE, ("wg",)), check_in=30.0) == 1
    lease = store.claim_step("r-2", "llm", "replica-a")  # its check time (0 s) has come
    assert lease is not None
    store.release_lease(lease, sent=False)
    state = store.load_request("r-2")
    assert state.partitions["llm"].resource_publish_info["tags"].tags == {"a", "b"}
    store.update_partition("r-2", "llm", num_output_tokens=2)
    store.due_steps(limit=10)
    store.finish_request("r-1", keep_for=60.0)
    assert store.kept_until("r-1") is not None
    store.reap(max_age=3600.0)
    assert store.list_requests() == ["r-1", "r-2"]
    assert store.delete_request("r-2")
    ReplicaRegistry(client, namespace=store.keys.namespace).heartbeat("replica-a")


@pytest.mark.servers
def test_the_documented_user_can_do_everything_and_doctor_says_ok(
    tmp_redis: RedisServer, namespace: str, make_store: Stores,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = add_user(tmp_redis, "mstar", store_acl.acl_rules(namespace))
    store = make_store.from_url(url, namespace=namespace, codec=Codec(REGISTRY))
    workload(store, store.client)
    found = {f.check: f for f in store.check_server()}
    assert found["acl"].level == "ok", found["acl"]
    assert found["acl"].message.startswith("user mstar may run every command")
    assert worst(list(found.values())) != "fatal"

    for argv in (["ls"], ["show", "r-1"], ["history", "r-1"], ["top", "--once"], ["doctor"]):
        code = cli.main([*argv, "--redis-url", url, "--namespace", namespace])
        out, err = capsys.readouterr()
        assert code == 0, (argv, out, err)
    assert "may run every command" in out


@pytest.mark.servers
@pytest.mark.parametrize(
    ("missing", "named"),
    [("-xadd", "XADD"), ("-evalsha", "EVALSHA"), ("-zscan", "ZSCAN")],
)
def test_a_user_missing_one_command_gets_a_finding_naming_it(
    tmp_redis: RedisServer, namespace: str, make_store: Stores,
    capsys: pytest.CaptureFixture[str], missing: str, named: str,
) -> None:  # fmt: skip
    url = add_user(tmp_redis, "short", f"{store_acl.acl_rules(namespace)} {missing}")
    store = make_store.from_url(url, namespace=namespace)

    found = {f.check: f for f in store.check_server()}

    assert found["acl"].level == "fatal"
    assert f"user short may not run {named} on {namespace}:*" in found["acl"].message
    assert f"grant +{named.lower()}" in found["acl"].message
    code = cli.main(["doctor", "--redis-url", url, "--namespace", namespace])
    assert code == 1
    assert f"may not run {named}" in capsys.readouterr().out


@pytest.mark.servers
def test_a_user_without_the_key_pattern_or_config_get(
    tmp_redis: RedisServer, namespace: str
) -> None:
    rules = store_acl.acl_rules(namespace)
    others = add_user(tmp_redis, "others", rules.replace(f"~{namespace}:*", "~elsewhere:*"))
    from store import RequestStore

    with RequestStore.from_url(others, namespace=namespace) as store:
        acl = {f.check: f for f in store.check_server()}["acl"]
    assert acl.level == "fatal"
    assert f"may not touch keys {namespace}:*: grant ~{namespace}:*" in acl.message

    no_config = add_user(tmp_redis, "noconfig", f"{rules} -config|get")
    with RequestStore.from_url(no_config, namespace=namespace) as store:
        found = {f.check: f for f in store.check_server()}
    assert found["acl"].level == "warning"  # doctor reads INFO instead
    assert "CONFIG|GET" in found["acl"].message
    assert found["eviction"].level == "ok"  # from INFO memory


@pytest.mark.servers
def test_wait_is_asked_for_only_by_a_replicated_store(
    tmp_redis: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = add_user(tmp_redis, "nowait", f"{store_acl.acl_rules(namespace)} -wait")
    from store import RequestStore

    with RequestStore.from_url(url, namespace=namespace) as store:
        assert {f.check: f for f in store.check_server()}["acl"].level == "ok"
    replicated = f"{url}?durability=replicated&wait_ms=100"
    with RequestStore.from_url(replicated, namespace=namespace) as store:
        acl = {f.check: f for f in store.check_server()}["acl"]
    assert acl.level == "fatal"
    assert "may not run WAIT" in acl.message and "grant +wait" in acl.message
    assert cli.main(["doctor", "--redis-url", replicated, "--namespace", namespace]) == 1
    assert "may not run WAIT" in capsys.readouterr().out
