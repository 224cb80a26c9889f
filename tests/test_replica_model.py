"""Replicas A, B and C interleave their operations on shared requests; a model says what must hold.

A hypothesis state machine drives the real ``RequestStore`` (one store object per replica, so each
has its own topology cache, all on one Redis) and keeps an in-memory model of the guarantees the
store gives several conductor replicas (issue 3): reports counted once, one replica learns that a
pass completed, one advance per pass, leases with fencing tokens, and deduplicated merges and
token counts. After every step the stored request, its leases and the recovery index must equal
the model.

Time is the store's ``time.time()``, replaced by a clock the machine moves, so leases expire when
a rule says so and never because the test ran slowly.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from unittest import mock

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import store.ops.core
import store.ops.leases
import store.ops.lifecycle
import store.ops.reports
from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    PartitionDefinition,
    PartitionState,
    StreamingConnectionState,
    merge_publish_info,
)
from mstar.engine.resources import (
    KVSequenceInfo,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
)
from store import (
    ReportOutcome,
    RequestExistsError,
    RequestRecord,
    RequestStore,
    StalePassError,
    UnknownWorkerGraphError,
)
from store.errors import FencedError
from store.records import Lease
from tests.conftest import delete_namespace

REPLICAS = ("A", "B", "C")
LEASE_TTL = 10.0
# A realistic epoch time with sub-second digits: stored expiry times must survive the trip
# through Lua numbers and hash strings exactly.
START_TIME = 1_700_000_000.123456
MAX_REQUESTS = 3

# Ranks per worker graph, per partition. "ghost" is never in a pass.
WORKER_GRAPHS = {
    "llm": {"llm_tp": 2, "sampler": 1},
    "codec": {"codec": 1},
    "default": {"main": 2},
}
GHOST = "ghost"
SHAPES = {
    "pipeline": {"partitions": ("llm", "codec"), "connections": ("llm->codec",)},
    "single": {"partitions": ("default",), "connections": ()},
}
FIRST_PASS = {"llm": {"llm_tp", "sampler"}, "codec": {"codec"}, "default": {"main"}}

# More than the usual 60 x 30: with 19 rules, 60 runs of 30 steps apply only ~75 reports in
# all (most deliveries are stale or duplicates by design), too few to meet rarer interleavings.
FAKE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
REAL_SETTINGS = settings(FAKE_SETTINGS, max_examples=15)

E = TypeVar("E", bound=BaseException)


class Clock:
    """Stands in for the ``time`` module inside ``store.store`` (``time()`` and ``sleep()``)."""

    def __init__(self) -> None:
        self.now = START_TIME

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        # The store sleeps only while backing off; the machine's clock is not wall time.
        self.now += seconds


# -- strategies -------------------------------------------------------------------------------

metadatas = st.builds(
    CurrentForwardConductorMetadata,
    graph_walk=st.sampled_from(["prefill", "decode"]),
    is_prefill=st.booleans(),
)
# Few ranks and labels, so that merges overlap: the KV kind's "other wins per label" makes a
# merge applied twice (around another merge) visible.
kv_infos = st.builds(
    PublishedKVInfo,
    info=st.dictionaries(
        st.integers(0, 1),
        st.dictionaries(
            st.sampled_from(["k", "v"]),
            st.builds(
                KVSequenceInfo,
                seq_len=st.integers(0, 50),
                latest_kv_transfer_info=st.none() | st.integers(0, 9),
                page_indices=st.lists(st.integers(0, 9), max_size=3),
            ),
            min_size=1,
            max_size=2,
        ),
        min_size=1,
        max_size=2,
    ),
    world_size=st.integers(1, 2),
)
position_infos = st.builds(
    PublishedPositionInfo,
    counters=st.dictionaries(st.sampled_from(["text", "audio"]), st.integers(0, 100), max_size=2),
)
published = st.fixed_dictionaries({"kv": kv_infos}, optional={"pos": position_infos})


# -- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """One worker's rank report, as a replica would receive it (and may receive it again)."""

    request_id: str
    partition: str
    fwd_pass: int
    worker_graph_id: str
    rank: int
    new_tokens: int = 0
    output_names: tuple[str, ...] = ()
    consumed: tuple[tuple[str, int], ...] = ()

    @property
    def num_ranks(self) -> int:
        return WORKER_GRAPHS[self.partition].get(self.worker_graph_id, 1)


@dataclass(frozen=True)
class Advance:
    """One advance call, kept so that it can be sent again with the same op id."""

    request_id: str
    partition: str
    from_pass: int
    metadata: CurrentForwardConductorMetadata
    worker_graph_ids: tuple[str, ...]
    done: bool
    op_id: str
    fence: Lease | None


@dataclass
class RequestModel:
    """What the store must hold for one request, and what it must remember about its past."""

    create_kwargs: dict[str, Any]
    record: RequestRecord
    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]
    # (worker graph, rank) reported in each partition's current pass
    reported: dict[str, set[tuple[str, int]]]
    # applied op ids, prefixed per operation as the store does ("advance:", "merge:", ...)
    ops: set[str] = field(default_factory=set)
    fencing_token: int = 0
    # partition -> token of its latest lease (a write fenced with any other token is rejected)
    lease_tokens: dict[str, int] = field(default_factory=dict)
    # partition -> its latest lease, until released
    held: dict[str, Lease] = field(default_factory=dict)

    def outgoing(self, partition: str) -> list[str]:
        return [c for c in self.connections if c.split("->")[0] == partition]

    def incoming(self, partition: str) -> list[str]:
        return [c for c in self.connections if c.split("->")[1] == partition]

    def superseded(self, lease: Lease) -> bool:
        return self.lease_tokens.get(lease.partition) != lease.token


def _raises(error: type[E], call: Callable[[], object]) -> E:
    with pytest.raises(error) as info:
        call()
    return info.value


class ReplicaMachine(RuleBasedStateMachine):
    """Replicas A, B, C (one ``RequestStore`` each) against one Redis and one model."""

    def __init__(self, real_client: redis.Redis | None = None) -> None:
        super().__init__()
        self.clock = Clock()
        self._clock_patches = [
            mock.patch.object(module, "time", self.clock)
            for module in (store.ops.core, store.ops.leases, store.ops.lifecycle, store.ops.reports)
        ]
        for patch in self._clock_patches:
            patch.start()
        self.namespace = f"t-replicas-{uuid.uuid4().hex[:12]}"
        self.real_client = real_client
        if real_client is None:
            server = fakeredis.FakeServer()
            clients: list[Any] = [fakeredis.FakeRedis(server=server) for _ in REPLICAS]
        else:
            clients = [real_client] * len(REPLICAS)
        self.stores = {
            replica: RequestStore(client, namespace=self.namespace, lease_ttl=LEASE_TTL)
            for replica, client in zip(REPLICAS, clients, strict=True)
        }
        self.requests: dict[str, RequestModel] = {}
        self.deadlines: dict[tuple[str, str], float] = {}  # the recovery index
        self.completed_passes: set[tuple[str, str, int]] = set()
        self.reports: list[Report] = []
        self.advances: list[Advance] = []
        self.leases: list[Lease] = []
        self.merges: list[tuple[str, str, Mapping[str, PublishedInfo], str]] = []
        self.token_adds: list[tuple[str, str, int, str]] = []
        self._op_ids = itertools.count()

    def teardown(self) -> None:
        for patch in self._clock_patches:
            patch.stop()
        if self.real_client is not None:
            delete_namespace(self.real_client, self.namespace)

    # -- helpers --------------------------------------------------------------------------

    def fresh_op(self) -> str:
        return f"op{next(self._op_ids)}"

    def pick_request(self, data: st.DataObject, *, with_connections: bool = False) -> str:
        rids = [r for r, m in self.requests.items() if m.connections or not with_connections]
        return data.draw(st.sampled_from(sorted(rids)), label="request")

    def pick_partition(self, data: st.DataObject, rid: str) -> str:
        return data.draw(st.sampled_from(sorted(self.requests[rid].partitions)), label="partition")

    def grant(self, model: RequestModel, partition: str, holder: str, fwd_pass: int) -> Lease:
        model.fencing_token += 1
        lease = Lease(
            model.record.request_id,
            partition,
            holder,
            model.fencing_token,
            fwd_pass,
            self.clock.now + LEASE_TTL,
        )
        model.lease_tokens[partition] = lease.token
        model.held[partition] = lease
        self.deadlines[(lease.request_id, partition)] = lease.expires_at
        return lease

    def lease_state(self, lease: Lease) -> str:
        model = self.requests[lease.request_id]
        if model.superseded(lease):
            return "superseded"
        return "held" if lease.partition in model.held else "released"

    def missing_reports(self) -> list[tuple[str, str, str, int]]:
        """(request, partition, worker graph, rank) not yet reported in the current passes."""
        out = []
        for rid, model in sorted(self.requests.items()):
            for name, part in sorted(model.partitions.items()):
                for wg in sorted(part.current_worker_graph_ids):
                    for rank in range(WORKER_GRAPHS[name][wg]):
                        if (wg, rank) not in model.reported[name]:
                            out.append((rid, name, wg, rank))
        return out

    def draw_payload(
        self, data: st.DataObject, rid: str, partition: str, fwd_pass: int, wg: str, rank: int
    ) -> Report:
        if rank != 0:  # only rank 0 carries tokens, outputs and consumed counts
            return Report(rid, partition, fwd_pass, wg, rank)
        incoming = self.requests[rid].incoming(partition)
        connections = self.requests[rid].connections
        # Around the count held, so that a report that would lower it comes up.
        consumed = {
            c: max(0, connections[c].consumed_count + data.draw(st.integers(-3, 3), label=c))
            for c in incoming
        }
        return Report(
            rid,
            partition,
            fwd_pass,
            wg,
            rank,
            new_tokens=data.draw(st.integers(0, 5), label="new_tokens"),
            output_names=tuple(
                data.draw(st.lists(st.sampled_from(["tok", "eos", "img"]), max_size=2))
            ),
            consumed=tuple(sorted(consumed.items())),
        )

    # -- create ---------------------------------------------------------------------------

    def create(self, shape: str, seed: int, max_tokens: int, replica: str) -> None:
        rid = f"r{len(self.requests)}"
        names = SHAPES[shape]["partitions"]
        partitions = {
            name: PartitionState(
                name,
                CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True),
                random_seed=seed,
                current_worker_graph_ids=set(FIRST_PASS[name]),
                resource_publish_info={"pos": PublishedPositionInfo({"text": 0})},
            )
            for name in names
        }
        connections = {}
        for conn in SHAPES[shape]["connections"]:
            source, target = conn.split("->")
            connections[conn] = StreamingConnectionState(source, target, edge_name="tokens")
        definitions = {
            name: PartitionDefinition(name, {"prefill", "decode"}, "prefill") for name in names
        }
        kwargs: dict[str, Any] = {
            "partitions": partitions,
            "connections": connections,
            "max_output_tokens": max_tokens,
            "seed": seed,
            "resource_configs": {"sampling": SamplingReqConfig(seed=seed)},
            "partition_definitions": definitions,
            "op_id": f"create-{rid}",
        }
        self.stores[replica].create_request(rid, **copy.deepcopy(kwargs))
        record = RequestRecord(
            request_id=rid,
            max_output_tokens=max_tokens,
            seed=seed,
            partitions=list(partitions),
            connections=list(connections),
            partition_definitions=copy.deepcopy(definitions),
            resource_configs={"sampling": SamplingReqConfig(seed=seed)},
            created_at=self.clock.now,
        )
        self.requests[rid] = RequestModel(
            create_kwargs=kwargs,
            record=record,
            partitions=copy.deepcopy(partitions),
            connections=copy.deepcopy(connections),
            reported={name: set() for name in names},
        )

    @initialize(seed=st.integers(0, 1000), replica=st.sampled_from(REPLICAS))
    def first_request(self, seed: int, replica: str) -> None:
        self.create("pipeline", seed, 64, replica)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(
        shape=st.sampled_from(sorted(SHAPES)),
        seed=st.integers(0, 1000),
        max_tokens=st.integers(1, 64),
        replica=st.sampled_from(REPLICAS),
    )
    def create_request(self, shape: str, seed: int, max_tokens: int, replica: str) -> None:
        self.create(shape, seed, max_tokens, replica)

    @rule(data=st.data(), replica=st.sampled_from(REPLICAS), same_op=st.booleans())
    def create_again(self, data: st.DataObject, replica: str, same_op: bool) -> None:
        """A resent create (same op id) succeeds and changes nothing; another is refused."""
        rid = self.pick_request(data)
        kwargs = copy.deepcopy(self.requests[rid].create_kwargs)
        if same_op:
            self.stores[replica].create_request(rid, **kwargs)
        else:
            kwargs["op_id"] = self.fresh_op()
            _raises(RequestExistsError, lambda: self.stores[replica].create_request(rid, **kwargs))

    # -- reports --------------------------------------------------------------------------

    def deliver(self, report: Report, via: str, named: bool) -> None:
        """Apply ``report`` through replica ``via`` and check the outcome against the model."""
        model = self.requests[report.request_id]
        part = model.partitions[report.partition]
        holder = via if named else None

        def call() -> ReportOutcome:
            return self.stores[via].record_worker_report(
                report.request_id,
                report.partition,
                fwd_pass=report.fwd_pass,
                worker_graph_id=report.worker_graph_id,
                rank=report.rank,
                num_ranks=report.num_ranks,
                new_tokens=report.new_tokens,
                output_names=report.output_names,
                consumed=dict(report.consumed),
                replica_id=holder,
            )

        if report.fwd_pass != part.fwd_pass_number:
            stale = _raises(StalePassError, call)
            assert (stale.expected, stale.current) == (report.fwd_pass, part.fwd_pass_number)
            return
        if report.worker_graph_id not in part.current_worker_graph_ids:
            _raises(UnknownWorkerGraphError, call)
            return
        self.reports.append(report)
        wg, slot = report.worker_graph_id, (report.worker_graph_id, report.rank)
        if slot in model.reported[report.partition]:
            count = part.wg_rank_completions.get(wg, 0)
            assert call() == ReportOutcome(False, count, False, False, None)
            return
        model.reported[report.partition].add(slot)
        count = part.wg_rank_completions.get(wg, 0) + 1
        part.wg_rank_completions[wg] = count
        wg_complete = count == report.num_ranks
        if wg_complete:
            part.completed_worker_graph_ids.add(wg)
        part.num_output_tokens += report.new_tokens
        for c in model.outgoing(report.partition):
            model.connections[c].token_count += report.new_tokens
        for c, consumed in report.consumed:
            conn = model.connections[c]
            conn.consumed_count = max(conn.consumed_count, consumed)
        part.curr_forward_outputs.extend(report.output_names)
        pass_complete = wg_complete and (
            part.current_worker_graph_ids <= part.completed_worker_graph_ids
        )
        lease = None
        if pass_complete:
            key = (report.request_id, report.partition, report.fwd_pass)
            assert key not in self.completed_passes, "a pass completed twice"
            self.completed_passes.add(key)
            if holder is not None:
                lease = self.grant(model, report.partition, holder, report.fwd_pass)
                self.leases.append(lease)
        assert call() == ReportOutcome(True, count, wg_complete, pass_complete, lease)

    @rule(
        data=st.data(),
        via=st.sampled_from(REPLICAS),
        named=st.booleans(),
        pass_offset=st.sampled_from([0, 0, 0, 1, -1]),
    )
    def deliver_report(self, data: st.DataObject, via: str, named: bool, pass_offset: int) -> None:
        """Any report: possibly for another pass, or for a worker graph not in this pass."""
        rid = self.pick_request(data)
        name = self.pick_partition(data, rid)
        wg = data.draw(st.sampled_from([*sorted(WORKER_GRAPHS[name]), GHOST]), label="wg")
        rank = data.draw(st.integers(0, WORKER_GRAPHS[name].get(wg, 1) - 1), label="rank")
        current = self.requests[rid].partitions[name].fwd_pass_number
        fwd_pass = max(0, current + pass_offset)
        self.deliver(self.draw_payload(data, rid, name, fwd_pass, wg, rank), via, named)

    @precondition(lambda self: bool(self.missing_reports()))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS), named=st.booleans())
    def deliver_missing_report(self, data: st.DataObject, via: str, named: bool) -> None:
        """A report the current pass still waits for, so that passes do complete."""
        rid, name, wg, rank = data.draw(st.sampled_from(self.missing_reports()), label="slot")
        current = self.requests[rid].partitions[name].fwd_pass_number
        self.deliver(self.draw_payload(data, rid, name, current, wg, rank), via, named)

    @precondition(lambda self: bool(self.reports))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS), named=st.booleans())
    def redeliver_report(self, data: st.DataObject, via: str, named: bool) -> None:
        """A report delivered before, again (to any replica): it counts once."""
        self.deliver(data.draw(st.sampled_from(self.reports), label="report"), via, named)

    # -- advance --------------------------------------------------------------------------

    def advance(self, call: Advance, via: str) -> None:
        model = self.requests[call.request_id]
        part = model.partitions[call.partition]

        def send() -> int:
            return self.stores[via].advance_partition(
                call.request_id,
                call.partition,
                from_pass=call.from_pass,
                metadata=call.metadata,
                worker_graph_ids=call.worker_graph_ids,
                done=call.done,
                op_id=call.op_id,
                fence=call.fence,
            )

        if call.fence is not None and model.superseded(call.fence):
            fenced = _raises(FencedError, send)
            assert fenced.current == model.lease_tokens[call.partition]
            return
        if f"advance:{call.op_id}" in model.ops:
            assert send() == call.from_pass + 1
            return
        if call.from_pass != part.fwd_pass_number:
            stale = _raises(StalePassError, send)
            assert (stale.expected, stale.current) == (call.from_pass, part.fwd_pass_number)
            return
        model.ops.add(f"advance:{call.op_id}")
        model.reported[call.partition] = set()
        part.metadata = copy.deepcopy(call.metadata)
        part.current_worker_graph_ids = set(call.worker_graph_ids)
        part.completed_worker_graph_ids = set()
        part.wg_rank_completions = {}
        part.curr_forward_outputs = []
        part.fwd_pass_number += 1
        part.random_seed += 1
        if call.done:
            part.is_done = True
            for c in model.outgoing(call.partition):
                model.connections[c].producer_done = True
        self.advances.append(call)
        assert send() == part.fwd_pass_number

    def draw_advance(
        self, data: st.DataObject, rid: str, name: str, from_pass: int, fence: Lease | None
    ) -> Advance:
        wgs = data.draw(st.sets(st.sampled_from(sorted(WORKER_GRAPHS[name])), max_size=2))
        return Advance(
            rid,
            name,
            from_pass,
            data.draw(metadatas, label="metadata"),
            tuple(sorted(wgs)),
            data.draw(st.sampled_from([False, False, False, True]), label="done"),
            self.fresh_op(),
            fence,
        )

    @rule(data=st.data(), via=st.sampled_from(REPLICAS), pass_offset=st.sampled_from([0, 0, 1, -1]))
    def advance_partition(self, data: st.DataObject, via: str, pass_offset: int) -> None:
        """Advance from the current pass or a stale one, fenced with one of ``via``'s leases
        on the partition (latest first), or not fenced at all."""
        rid = self.pick_request(data)
        name = self.pick_partition(data, rid)
        current = self.requests[rid].partitions[name].fwd_pass_number
        own = [
            lease
            for lease in reversed(self.leases)
            if (lease.request_id, lease.partition, lease.holder) == (rid, name, via)
        ]
        fence = data.draw(st.sampled_from([None, *own]), label="fence")
        from_pass = max(0, current + pass_offset)
        self.advance(self.draw_advance(data, rid, name, from_pass, fence), via)

    @rule(data=st.data(), replicas=st.permutations(REPLICAS))
    def race_advance(self, data: st.DataObject, replicas: list[str]) -> None:
        """Two replicas advance from the same pass: the second finds it stale."""
        rid = self.pick_request(data)
        name = self.pick_partition(data, rid)
        current = self.requests[rid].partitions[name].fwd_pass_number
        first = self.draw_advance(data, rid, name, current, None)
        second = self.draw_advance(data, rid, name, current, None)
        self.advance(first, replicas[0])
        self.advance(second, replicas[1])

    @precondition(lambda self: bool(self.advances))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def resend_advance(self, data: st.DataObject, via: str) -> None:
        """An applied advance, sent again with its op id (a reply was lost): applied once."""
        self.advance(data.draw(st.sampled_from(self.advances), label="advance"), via)

    # -- leases ---------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 4.0, LEASE_TTL, LEASE_TTL + 1.0]))
    def let_time_pass(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def claim_step(self, data: st.DataObject, via: str) -> None:
        """None while a live lease covers the partition, else a new lease with a higher token."""
        rid = self.pick_request(data)
        name = self.pick_partition(data, rid)
        model = self.requests[rid]
        lease = self.stores[via].claim_step(rid, name, via)
        held = model.held.get(name)
        if held is not None and held.expires_at > self.clock.now:
            assert lease is None
            return
        previous = model.fencing_token
        expected = self.grant(model, name, via, model.partitions[name].fwd_pass_number)
        assert lease == expected
        assert lease.token > previous
        self.leases.append(lease)

    @precondition(lambda self: any(m.held for m in self.requests.values()))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def take_over(self, data: st.DataObject, via: str) -> None:
        """A lease's holder goes quiet past its expiry and ``via`` claims the step."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.requests.items() if m.held)))
        model = self.requests[rid]
        name = data.draw(st.sampled_from(sorted(model.held)), label="partition")
        self.clock.now = max(self.clock.now, model.held[name].expires_at)
        expected = self.grant(model, name, via, model.partitions[name].fwd_pass_number)
        assert self.stores[via].claim_step(rid, name, via) == expected
        self.leases.append(expected)

    def release(self, lease: Lease, check_at: float | None) -> None:
        model = self.requests[lease.request_id]
        store = self.stores[lease.holder]
        if model.superseded(lease):
            _raises(FencedError, lambda: store.release_lease(lease, check_at=check_at))
            return
        store.release_lease(lease, check_at=check_at)
        model.held.pop(lease.partition, None)
        key = (lease.request_id, lease.partition)
        if check_at is None:
            self.deadlines.pop(key, None)
        else:
            self.deadlines[key] = check_at

    @precondition(lambda self: any(m.held for m in self.requests.values()))
    @rule(data=st.data(), finished=st.booleans())
    def drive_step(self, data: st.DataObject, finished: bool) -> None:
        """A lease's holder does its step: advance if the pass the lease is about is still
        current, then record the step as sent (check again later, or never: finished)."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.requests.items() if m.held)))
        model = self.requests[rid]
        lease = model.held[data.draw(st.sampled_from(sorted(model.held)), label="partition")]
        if model.partitions[lease.partition].fwd_pass_number == lease.pass_number:
            call = self.draw_advance(data, rid, lease.partition, lease.pass_number, lease)
            self.advance(call, lease.holder)
        self.release(lease, None if finished else self.clock.now + 5.0)

    @precondition(lambda self: bool(self.leases))
    @rule(
        data=st.data(),
        pool=st.sampled_from(["superseded", "held", "released"]),
        action=st.sampled_from(["advance", "final_output", "release", "renew"]),
    )
    def write_with_lease(self, data: st.DataObject, pool: str, action: str) -> None:
        """A write fenced with a lease granted earlier: refused, changing nothing, once the
        lease was superseded; applied while it is the partition's latest."""
        candidates = [lease for lease in self.leases if self.lease_state(lease) == pool]
        lease = data.draw(st.sampled_from(candidates or self.leases), label="lease")
        rid, name, via = lease.request_id, lease.partition, lease.holder
        model = self.requests[rid]
        store = self.stores[via]
        if action == "advance":
            current = model.partitions[name].fwd_pass_number
            self.advance(self.draw_advance(data, rid, name, current, lease), via)
            return
        superseded = model.superseded(lease)
        if action == "final_output":
            output = data.draw(st.sampled_from(["text", "audio"]), label="output")
            value = data.draw(st.integers(0, 100) | st.lists(st.integers(0, 9), max_size=2))
            if superseded:
                _raises(
                    FencedError, lambda: store.set_final_output(rid, output, value, fence=lease)
                )
            else:
                store.set_final_output(rid, output, value, fence=lease)
                model.record.final_outputs[output] = value
        elif action == "release":
            self.release(lease, data.draw(st.sampled_from([None, self.clock.now + 5.0])))
        else:
            ttl = data.draw(st.sampled_from([None, 3.0]), label="ttl")
            if superseded or name not in model.held:  # a released lease cannot be renewed
                _raises(FencedError, lambda: store.renew_lease(lease, ttl))
                return
            renewed = store.renew_lease(lease, ttl)
            expires = self.clock.now + (ttl or LEASE_TTL)
            assert renewed == replace(lease, expires_at=expires)
            model.held[name] = replace(model.held[name], expires_at=expires)
            self.deadlines[(rid, name)] = expires
            self.leases.append(renewed)

    # -- published info, token counts -----------------------------------------------------

    def merge(
        self, rid: str, name: str, other: Mapping[str, PublishedInfo], op: str, via: str
    ) -> None:
        model = self.requests[rid]
        held = model.partitions[name].resource_publish_info
        merged = self.stores[via].merge_publish_info(rid, name, copy.deepcopy(other), op_id=op)
        if other and f"merge:{op}" not in model.ops:
            model.ops.add(f"merge:{op}")
            merge_publish_info(held, copy.deepcopy(dict(other)))
        assert merged == {label: held[label] for label in other if label in held}

    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def merge_fresh_info(self, data: st.DataObject, via: str) -> None:
        rid = self.pick_request(data)
        name = self.pick_partition(data, rid)
        other = data.draw(published, label="other")
        op = self.fresh_op()
        self.merges.append((rid, name, other, op))
        self.merge(rid, name, other, op, via)

    @precondition(lambda self: bool(self.merges))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def resend_merge(self, data: st.DataObject, via: str) -> None:
        """The same merge with its op id again: folded in once."""
        self.merge(*data.draw(st.sampled_from(self.merges), label="merge"), via)

    def add_tokens(self, rid: str, conn: str, count: int, op: str, via: str) -> None:
        model = self.requests[rid]
        if f"tokens:{op}" not in model.ops:
            model.ops.add(f"tokens:{op}")
            model.connections[conn].token_count += count
        assert self.stores[via].add_tokens(rid, conn, count, op_id=op) == (
            model.connections[conn].token_count
        )

    @rule(data=st.data(), via=st.sampled_from(REPLICAS), count=st.integers(0, 10))
    def add_fresh_tokens(self, data: st.DataObject, via: str, count: int) -> None:
        rid = self.pick_request(data, with_connections=True)
        conn = data.draw(st.sampled_from(sorted(self.requests[rid].connections)))
        op = self.fresh_op()
        self.token_adds.append((rid, conn, count, op))
        self.add_tokens(rid, conn, count, op, via)

    @precondition(lambda self: bool(self.token_adds))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def resend_tokens(self, data: st.DataObject, via: str) -> None:
        """The same token add with its op id again: counted once."""
        self.add_tokens(*data.draw(st.sampled_from(self.token_adds), label="add"), via)

    @rule(data=st.data(), via=st.sampled_from(REPLICAS), count=st.integers(0, 30))
    def raise_consumed(self, data: st.DataObject, via: str, count: int) -> None:
        rid = self.pick_request(data, with_connections=True)
        conn_name = data.draw(st.sampled_from(sorted(self.requests[rid].connections)))
        conn = self.requests[rid].connections[conn_name]
        conn.consumed_count = max(conn.consumed_count, count)
        assert self.stores[via].raise_consumed_count(rid, conn_name, count) == conn.consumed_count

    # -- the invariant --------------------------------------------------------------------

    @invariant()
    def store_equals_model(self) -> None:
        for rid, model in self.requests.items():
            state = self.stores["C"].load_request(rid)
            assert state.partitions == model.partitions
            assert state.connections == model.connections
            assert state.record == model.record
            assert self.stores["B"].leases(rid) == model.held
        due = sorted(
            (at, f"{rid} {name}")
            for (rid, name), at in self.deadlines.items()
            if at <= self.clock.now
        )
        expected_due = [tuple(member.split(" ")) for _, member in due]
        assert self.stores["A"].due_steps(now=self.clock.now) == expected_due


@pytest.mark.fake
def test_replicas_on_fakeredis() -> None:
    run_state_machine_as_test(ReplicaMachine, settings=FAKE_SETTINGS)


@pytest.mark.real
def test_replicas_on_real_redis(real_client: redis.Redis) -> None:
    class OnRealRedis(ReplicaMachine):
        # Each example works in a namespace of its own and deletes it in teardown.
        def __init__(self) -> None:
            super().__init__(real_client)

    run_state_machine_as_test(OnRealRedis, settings=REAL_SETTINGS)
