"""``durability="replicated"``: the option's plumbing, on fakeredis and on the bare core.

fakeredis has no ``WAIT``, so these tests put an executor in front of the store's that
takes the ``WAIT`` off each write it sees and answers it with a set count of replicas;
every other command runs on fakeredis. What ``WAIT`` does on a real master and replica is
in tests/faults/test_replication.py.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import fakeredis
import pytest

from store import (
    AsyncRequestStore,
    Codec,
    ConfigurationError,
    FencedError,
    ReplicationTimeoutError,
    RequestExistsError,
    RequestStore,
    StalePassError,
    StoreError,
)
from store.cli import main as cli
from store.durability import (
    Durability,
    durability_of,
    split_durability,
    split_url,
    with_durability,
)
from store.ops.effects import Commit, ErrorReply, Op, Send, SendMany, Write
from store.ops.settings import Settings
from store.records import Step
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.strategies import SumInfo, user_registry

pytestmark = pytest.mark.fake

MD = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)


@pytest.fixture
def fake_client(fake_server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fake_server)


def create_small_request(store: RequestStore, rid: str) -> None:
    """One partition "llm" (worker graph "wg", a "sum" info) at pass 0."""
    state = PartitionState(
        "llm", MD, current_worker_graph_ids={"wg"}, resource_publish_info={"sum": SumInfo(0)}
    )
    store.create_request(rid, partitions={"llm": state}, connections={}, max_output_tokens=8)


class AnsweringWait:
    """Runs operations on ``inner`` with each trailing ``WAIT`` answered by ``acked``."""

    def __init__(self, inner: Any, acked: int | ErrorReply) -> None:
        self.inner = inner
        self.acked = acked
        self.waits: list[tuple[Any, ...]] = []  # the command each WAIT followed
        self.sent: list[Any] = []  # every command sent

    def run(self, op: Op[Any]) -> Any:
        return self.inner.run(self._answered(op))

    def _strip(self, send: Send) -> tuple[Send, bool]:
        self.sent += list(send.commands)
        if send.commands and send.commands[-1][0] == "WAIT":
            self.waits.append(tuple(send.commands[-2]))
            return Send(send.key, send.commands[:-1], send.node, send.asking), True
        return send, False

    def _answered(self, op: Op[Any]) -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                if isinstance(effect, Send):
                    effect, waited = self._strip(effect)
                    value = yield effect
                    value = [*value, self.acked] if waited else value
                elif isinstance(effect, (SendMany, Write)):
                    stripped = [self._strip(s) for s in effect.sends]
                    if isinstance(effect, Write):  # a batch: answered at its Collect
                        assert not any(w for _, w in stripped), "WAIT in a pipelined batch"
                    value = yield type(effect)([s for s, _ in stripped])
                    if isinstance(effect, SendMany):
                        value = [
                            [*v, self.acked] if w and isinstance(v, list) else v
                            for v, (_, w) in zip(value, stripped, strict=True)
                        ]
                elif isinstance(effect, Commit) and effect.commands[-1][0] == "WAIT":
                    self.sent += list(effect.commands)
                    self.waits.append(("EXEC",))
                    value = yield Commit(effect.commands[:-1])
                    value = [*value, self.acked]
                else:
                    if isinstance(effect, Commit):
                        self.sent += list(effect.commands)
                    value = yield effect
            except Exception as e:  # thrown in by the executor: handed to the operation
                error, value = e, None


def answered(store: RequestStore, acked: int | ErrorReply) -> AnsweringWait:
    executor = AnsweringWait(store._executor, acked)
    store._executor = executor
    return executor


def replicated(client: Any, namespace: str, **options: Any) -> RequestStore:
    return RequestStore(
        client, namespace=namespace, codec=Codec(user_registry()), durability="replicated",
        replicas=1, wait_ms=200, **options,
    )  # fmt: skip


def script_names(store: RequestStore, commands: list[tuple[Any, ...]]) -> list[str]:
    scripts = store._core.scripts
    by_arg = {sha: name for name, sha in scripts.shas.items()}
    by_arg.update({source: name for name, source in scripts.sources.items()})
    return [by_arg.get(c[1], c[0]) if c[0] in ("EVALSHA", "EVAL") else c[0] for c in commands]


def test_every_pass_changing_write_waits(fake_client: Any, namespace: str) -> None:
    store = replicated(fake_client, namespace)
    executor = answered(store, 1)
    create_small_request(store, "r")
    store.record_worker_report("r", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1)
    store.advance_partition("r", "llm", from_pass=0, metadata=MD, worker_graph_ids=["wg"])
    store.merge_publish_info("r", "llm", {"sum": SumInfo(1)}, returning=False)  # optimistic
    lease = store.claim_step("r", "llm", "replica-a")
    assert lease is not None
    store.take_step(lease, Step(MD, ("wg",)))
    store.finish_request("r", keep_for=60)
    create_small_request(store, "s")
    store.delete_request("s")
    waited = script_names(store, executor.waits)
    for write in ("create_request", "report", "step", "advance_partition", "claim_step",
                  "finish_request", "delete_request", "EXEC"):  # fmt: skip
        assert write in waited, f"{write} did not wait: {waited}"
    assert all(c == ("WAIT", 1, 200) for c in executor.sent if c[0] == "WAIT")
    assert store.durability == Durability("replicated", 1, 200)


def test_master_mode_sends_no_wait(fake_client: Any, namespace: str) -> None:
    store = RequestStore(fake_client, namespace=namespace, codec=Codec(user_registry()))
    executor = answered(store, 0)
    create_small_request(store, "r")
    store.record_worker_report("r", "llm", fwd_pass=0, worker_graph_id="wg", rank=0, num_ranks=1)
    store.merge_publish_info("r", "llm", {"sum": SumInfo(1)}, returning=False)
    assert executor.sent and not executor.waits
    assert all(c[0] != "WAIT" for c in executor.sent)


def test_too_few_replicas_raise_after_the_write_applied(fake_client: Any, namespace: str) -> None:
    store = replicated(fake_client, namespace)
    answered(store, 0)
    with pytest.raises(ReplicationTimeoutError) as raised:
        create_small_request(store, "r")
    error = raised.value
    assert (error.acknowledged, error.wanted, error.wait_ms, error.applied) == (0, 1, 200, True)
    assert error.request_id == "r"
    assert "applied on the master" in str(error) and "0 of the 1" in str(error)
    plain = RequestStore(fake_client, namespace=namespace, codec=Codec(user_registry()))
    assert plain.load_partition("r", "llm").fwd_pass_number == 0  # the write is there
    with pytest.raises(ReplicationTimeoutError):  # the optimistic path says so too
        store.merge_publish_info("r", "llm", {"sum": SumInfo(2)}, op_id="m1", returning=False)
    assert plain.load_partition("r", "llm").resource_publish_info["sum"] == SumInfo(2)
    with pytest.raises(ReplicationTimeoutError):  # a resend finds it applied: waits again
        store.merge_publish_info("r", "llm", {"sum": SumInfo(2)}, op_id="m1", returning=False)
    answered(store, 1)  # the replica caught up: the retry is applied once and succeeds
    store.merge_publish_info("r", "llm", {"sum": SumInfo(2)}, op_id="m1", returning=False)
    assert plain.load_partition("r", "llm").resource_publish_info["sum"] == SumInfo(2)


def test_a_refused_write_says_so_not_that_it_was_applied(fake_client: Any, namespace: str) -> None:
    store = replicated(fake_client, namespace)
    answered(store, 1)
    create_small_request(store, "r")
    assert store.claim_step("r", "llm", "replica-a") is not None
    answered(store, 0)
    with pytest.raises(FencedError):  # wrote nothing: the refusal, not a replication timeout
        store.update_partition("r", "llm", random_seed=3)
    with pytest.raises(StalePassError):  # a status the caller turns into its error
        store.record_worker_report("r", "llm", fwd_pass=7, worker_graph_id="wg", rank=0,
                                   num_ranks=1)  # fmt: skip
    with pytest.raises(RequestExistsError):
        create_small_request(store, "r")
    assert store.claim_step("r", "llm", "replica-b") is None  # HELD: nothing written


def test_a_refused_wait_is_a_store_error(fake_client: Any, namespace: str) -> None:
    store = replicated(fake_client, namespace)
    answered(store, ErrorReply("ERR", "ERR WAIT cannot be used with replica instances"))
    with pytest.raises(StoreError, match="refused WAIT"):
        create_small_request(store, "r")


def test_durability_from_the_url() -> None:
    url = (
        "redis://127.0.0.1:1/2?durability=replicated&replicas=2&wait_ms=300&health_check_interval=5"
    )
    rest, options = split_url(url)
    assert rest == "redis://127.0.0.1:1/2?health_check_interval=5"
    assert options == {"durability": "replicated", "replicas": 2, "wait_ms": 300}
    assert split_url("redis://h:1/0") == ("redis://h:1/0", {})
    store = RequestStore.from_url(url)  # redis-py never sees the store's options
    try:
        assert store.durability == Durability("replicated", 2, 300)
        assert store.client.connection_pool.connection_kwargs["health_check_interval"] == 5
    finally:
        store.close()
    passed = RequestStore.from_url(url, wait_ms=400)  # an option passed wins over the URL's
    assert passed.durability == Durability("replicated", 2, 400)
    passed.close()
    assert RequestStore.from_url("redis://h:1/0").durability == Durability()


async def test_async_store_takes_the_same_option() -> None:
    store = AsyncRequestStore.from_url("redis://127.0.0.1:1/0?durability=replicated")
    assert store.durability == Durability("replicated", 1, 500)
    await store.aclose()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("quorum",), "durability must be"),
        (("replicated", 0), "replicas must be an int >= 1"),
        (("replicated", 1, 0), "wait_ms must be an int >= 1"),
        (("master", 2), "need durability='replicated'"),
        ((Durability("replicated"), 2), "in the Durability"),
    ],
)
def test_bad_settings_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        durability_of(*args)


def test_a_wait_longer_than_the_socket_timeout_is_refused(fake_client: Any) -> None:
    with pytest.raises(ConfigurationError, match="socket timeout"):
        RequestStore.from_url("redis://127.0.0.1:1/0?durability=replicated&wait_ms=5000")
    with pytest.raises(ConfigurationError, match=r"wait_ms=.*below"):
        RequestStore.from_url("redis://127.0.0.1:1/0", durability="replicated", wait_ms=9000)
    assert Settings().durability == Durability()
    with pytest.raises(ConfigurationError, match="expected a number"):
        split_url("redis://h:1/0?replicas=two")


def test_a_url_carries_the_durability_to_another_process() -> None:
    wanted = Durability("replicated", 2, 300)
    url = with_durability("redis://h:1/0?health_check_interval=5&wait_ms=9", wanted)
    assert (
        url == "redis://h:1/0?health_check_interval=5&durability=replicated&replicas=2&wait_ms=300"
    )
    assert split_durability(url) == ("redis://h:1/0?health_check_interval=5", wanted)
    assert with_durability(url, Durability()) == "redis://h:1/0?health_check_interval=5"
    assert split_durability("redis://h:1/0") == ("redis://h:1/0", Durability())


@pytest.mark.parametrize("command", ["demo", "simulate"])
def test_the_cli_refuses_replicated_on_the_embedded_redis(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, "--durability", "replicated"]) == 1
    assert "needs --redis-url: a Redis with replicas" in capsys.readouterr().err
