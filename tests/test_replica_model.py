"""Replicas A, B and C interleave their operations on shared requests; a model says what must hold.

A hypothesis state machine drives the real ``RequestStore`` (one store object per replica, so each
has its own topology cache, all on one Redis) and keeps an in-memory model of the guarantees the
store gives several conductor replicas (issue 3): reports counted once (a duplicate says what the
first delivery did), one report completes a pass, one lease per completed pass, leases with
fencing tokens (a write fenced with a superseded lease is refused, an unfenced one while a replica
holds a live lease; a holder's re-claim gives its lease back; a finished request's steps are
never claimed), steps taken once, and deduplicated merges and token counts. After every step the
stored request, its lease hash, the recovery index and the other indexes must equal the model.

Time. Every time that decides something (is a lease live, is a step due) is the Redis server's
clock, read by the scripts (``redis.call('TIME')``). The model keeps each such time as a ``Span``
(the server times read just before and just after the call that wrote it) and, once it has read
the stored value back and found it inside, as that value.

- On fakeredis the machine owns the server's clock: fakeredis answers TIME, expires keys and
  makes stream ids from ``time.time()`` in ``fakeredis.commands_mixins.server_mixin``,
  ``fakeredis._socket._base`` and ``fakeredis._helpers``; those three see ``ServerClock``
  instead, which only ``let_time_pass`` and ``take_over`` move. Spans are single instants, so
  every stored time is predicted exactly (float for float, as Lua computes it), leases lapse
  exactly when a rule says so and never because the test ran slowly.
- On a real Redis the server clock cannot be moved. There the lease TTL is long (``REAL_TTL``,
  far longer than an example runs) and the rules that move time are off, so a lease lives
  until it is ended, superseded or the request finishes, and expiries are read relative to the
  server's TIME. Lapses of real time are covered by tests/test_lifetimes.py; what this run adds
  is every interleaving the machine makes on the real server (its Lua, its TIME, its number
  formatting). A decision that the spans cannot settle (a lease about to lapse while an example
  runs) fails loudly instead of guessing.

The store's own (client-side) clock must not matter for leases: ``store.ops.core`` and
``store.ops.lifecycle`` read a ``ClientClock`` whose time runs ``CLIENT_SKEW`` off per replica
(A behind, C ahead, by far more than a lease's TTL), and on fakeredis the server clock sits years
away from every client's. Only ``created_at`` / ``finished_at`` (the replica's clock, checked
against its bracket) and the requests index come from the client clock.

Replies carry times with every digit: a lease returned by a claim, report or renewal expires
exactly when the lease hash says.

The recovery index must hold an entry per partition with a check time in its lease hash: on
one server at that time to the microsecond, and none other, whatever was refused, resent or
lost (the scripts write both at once); on a cluster, where the store writes the index beside
the script or after it, never later than the check time, and a refused step or create may
leave an entry without one (it costs one early look; see store/ops/leases.py).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar
from unittest import mock

import fakeredis
import fakeredis._helpers
import fakeredis._socket._base
import fakeredis.commands_mixins.server_mixin
import pytest
import redis
from hypothesis import HealthCheck, event, settings
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
import store.ops.lifecycle
from store import (
    RequestExistsError,
    RequestRecord,
    RequestStore,
    StalePassError,
    UnknownWorkerGraphError,
)
from store.errors import FencedError, StoreError
from store.records import Lease, Step
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionDefinition,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
    merge_publish_info,
)
from tests import backends
from tests.conftest import delete_namespace, new_namespace

REPLICAS = ("A", "B", "C")
FAKE_TTL = 10.0
REAL_TTL = 60.0
# A realistic epoch time with sub-second digits (in microseconds, as TIME gives it): stored
# times must survive the trip through Lua numbers and hash strings exactly.
START_US = 1_700_000_000_123_456
# Each replica's own clock, off the wall clock by this much: leases must not care.
CLIENT_SKEW = {"A": -1000.0, "B": 0.0, "C": 1000.0}
KEPT = "r0"  # never finished, so that most claims and steps meet a request still running
KEEP_FOR = 86_400.0  # a finished request is kept this long: longer than any example's time
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

# More than the usual 60 x 30: with this many rules, 60 runs of 30 steps apply too few reports
# (most deliveries are stale or duplicates by design) to meet rarer interleavings.
FAKE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
REAL_SETTINGS = settings(FAKE_SETTINGS, max_examples=50)

E = TypeVar("E", bound=StoreError)


@dataclass(frozen=True)
class Span:
    """A time known to lie in [lo, hi] (a single instant on fakeredis)."""

    lo: float
    hi: float

    @staticmethod
    def at(x: float) -> Span:
        return Span(x, x)

    def __add__(self, other: Span | float) -> Span:
        o = other if isinstance(other, Span) else Span.at(other)
        return Span(self.lo + o.lo, self.hi + o.hi)

    def __sub__(self, other: Span) -> Span:
        return Span(self.lo - other.hi, self.hi - other.lo)

    def map(self, f: Callable[[float], float]) -> Span:
        """``f`` (non-decreasing) applied to the time."""
        return Span(f(self.lo), f(self.hi))

    def holds(self, x: float, slack: float) -> bool:
        return self.lo - slack <= x <= self.hi + slack


class Undecided(AssertionError):
    """The spans cannot say whether a time has come (only on a real server)."""


def later(a: Span, b: Span) -> bool:
    """Is ``a > b``, as a script compares them?"""
    if a.lo > b.hi:
        return True
    if a.hi <= b.lo:
        return False
    raise Undecided(f"cannot tell whether {a} > {b}: an example ran too long for REAL_TTL")


class ServerClock:
    """fakeredis's ``time`` module: TIME, key expiry and stream ids follow ``us``."""

    def __init__(self) -> None:
        self.us = START_US

    def time(self) -> float:
        return self.us / 1_000_000

    def now(self) -> float:
        """What the scripts' ``now()`` computes from TIME's (seconds, microseconds)."""
        seconds, micros = divmod(self.us, 1_000_000)
        return seconds + micros / 1_000_000

    def move_to(self, at: float) -> None:
        """Move on to the first microsecond at which ``now()`` is at least ``at``."""
        self.us = max(self.us, math.ceil(at * 1_000_000) - 1)
        while self.now() < at:
            self.us += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class ClientClock:
    """The store's own ``time`` module: the wall clock, off by the calling replica's skew."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class OnReplica:
    """A replica's ``RequestStore``, every call of it run on that replica's client clock."""

    def __init__(self, store: RequestStore, clock: ClientClock, replica: str) -> None:
        self.store = store
        self.clock = clock
        self.offset = CLIENT_SKEW[replica]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.clock.offset = self.offset
            return attr(*args, **kwargs)

        return call


@dataclass
class Result:
    """What one store call did: its value, or the ``StoreError`` it raised."""

    value: Any = None
    error: StoreError | None = None

    def ok(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"expected success, got {self.error!r}") from self.error
        return self.value

    def failed(self, kind: type[E]) -> E:
        assert isinstance(self.error, kind), f"expected {kind.__name__}, got {self.error!r}"
        event(f"refused: {kind.__name__}")
        return self.error

    def fenced(self, token: int, current: int, partition: str | None = None) -> None:
        error = self.failed(FencedError)
        assert (error.token, error.current) == (token, current)
        if not token:
            assert error.partition == partition
            event("refused: unfenced write under a live lease")


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
class Held:
    """A lease the lease hash holds on one partition (holder, token, pass, expiry)."""

    holder: str
    token: int
    pass_number: int
    expires: Span


@dataclass
class RequestModel:
    """What the store must hold for one request, and what it must remember about its past."""

    create_kwargs: dict[str, Any]
    record: RequestRecord
    created_at: Span  # by the creating replica's clock
    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]
    # (worker graph, rank) reported in each partition's current pass
    reported: dict[str, set[tuple[str, int]]]
    # partition -> (worker graph, rank) of the report that completed its current pass
    completer: dict[str, tuple[str, int]] = field(default_factory=dict)
    # applied op ids, prefixed per operation as the store does ("advance:", "merge:", ...)
    ops: set[str] = field(default_factory=set)
    finished_at: Span | None = None
    # -- the lease hash
    fencing_token: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # token of each partition's latest lease
    held: dict[str, Held] = field(default_factory=dict)  # until ended (or the request finished)
    checks: dict[str, Span] = field(default_factory=dict)  # when a claim may take the step
    sends: dict[str, int] = field(default_factory=dict)
    sent: dict[str, Span] = field(default_factory=dict)
    stepped: dict[str, str] = field(default_factory=dict)  # "<pass>:<token>" of the last step

    def outgoing(self, partition: str) -> list[str]:
        return [c for c in self.connections if c.split("->")[0] == partition]

    def incoming(self, partition: str) -> list[str]:
        return [c for c in self.connections if c.split("->")[1] == partition]

    def superseded(self, lease: Lease) -> bool:
        return self.tokens.get(lease.partition, 0) != lease.token


class ReplicaMachine(RuleBasedStateMachine):
    """Replicas A, B, C (one ``RequestStore`` each) against one Redis and one model."""

    on_real_redis: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.fake = not self.on_real_redis
        self.ttl = FAKE_TTL if self.fake else REAL_TTL
        self.slack = 0.0 if self.fake else 1e-6
        self.namespace = new_namespace()
        self.server_clock = ServerClock()
        self.client_clock = ClientClock()
        modules: list[types.ModuleType] = [store.ops.core, store.ops.lifecycle]
        self._patches = [mock.patch.object(m, "time", self.client_clock) for m in modules]
        if self.fake:
            server_modules = (
                fakeredis.commands_mixins.server_mixin,
                fakeredis._socket._base,
                fakeredis._helpers,
            )
            self._patches += [
                mock.patch.object(m, "time", self.server_clock) for m in server_modules
            ]
        for patch in self._patches:
            patch.start()
        if self.fake:
            server = fakeredis.FakeServer()
            clients: list[Any] = [fakeredis.FakeRedis(server=server) for _ in REPLICAS]
        else:
            # A client of its own per example: the stores keep the connections they take, and
            # closing the client in teardown closes them.
            clients = [backends.connect()] * len(REPLICAS)
        self.client = clients[0]
        self.stores = {
            replica: OnReplica(
                RequestStore(client, namespace=self.namespace, lease_ttl=self.ttl),
                self.client_clock,
                replica,
            )
            for replica, client in zip(REPLICAS, clients, strict=True)
        }
        self.keys = self.stores["A"].keys
        if self.fake:  # the server's TIME is the machine's clock
            assert self.client.time() == divmod(START_US, 1_000_000)
        self.requests: dict[str, RequestModel] = {}
        self.finished_index: dict[str, Span] = {}
        self.completed_passes: set[tuple[str, str, int]] = set()
        self.reports: list[Report] = []
        self.advances: list[Advance] = []
        self.steps: list[tuple[Lease, Step, float | None]] = []
        self.leases: list[Lease] = []
        self.merges: list[tuple[str, str, Mapping[str, PublishedInfo], str]] = []
        self.token_adds: list[tuple[str, str, int, str]] = []
        self._op_ids = itertools.count()

    def teardown(self) -> None:
        try:
            if not self.fake:
                try:
                    delete_namespace(self.client, self.namespace)
                finally:
                    self.client.close()
        finally:
            for patch in reversed(self._patches):
                patch.stop()

    # -- time -----------------------------------------------------------------------------

    def server_now(self) -> float:
        if self.fake:
            return self.server_clock.now()
        seconds, micros = self.client.time()
        return seconds + micros / 1_000_000  # as the scripts' now() computes it

    def timed(self, call: Callable[[], Any]) -> tuple[Result, Span]:
        """Run a store call; its result and the server's time around it."""
        lo = self.server_now()
        try:
            result = Result(call())
        except StoreError as e:
            result = Result(error=e)
        return result, Span(lo, self.server_now())

    def client_timed(self, via: str, call: Callable[[], Any]) -> tuple[Result, Span, Span]:
        """``timed``, and ``via``'s client clock around the call."""
        lo = time.time() + CLIENT_SKEW[via]
        result, t = self.timed(call)
        return result, t, Span(lo, time.time() + CLIENT_SKEW[via])

    def live(self, expires: Span, t: Span) -> bool:
        return later(expires, t)

    # -- helpers --------------------------------------------------------------------------

    def fresh_op(self) -> str:
        return f"op{next(self._op_ids)}"

    def pick_request(self, data: st.DataObject, *, with_connections: bool = False) -> str:
        rids = [r for r, m in self.requests.items() if m.connections or not with_connections]
        return data.draw(st.sampled_from(sorted(rids)), label="request")

    def pick_partition(self, data: st.DataObject, rid: str) -> str:
        return data.draw(st.sampled_from(sorted(self.requests[rid].partitions)), label="partition")

    def draw_check_in(self, data: st.DataObject) -> float | None:
        return data.draw(st.sampled_from([None, 0.0, self.ttl / 2]), label="check_in")

    def grant(
        self, model: RequestModel, partition: str, holder: str, fwd_pass: int, t: Span
    ) -> None:
        model.fencing_token += 1
        expires = t + self.ttl
        model.tokens[partition] = model.fencing_token
        model.held[partition] = Held(holder, model.fencing_token, fwd_pass, expires)
        model.checks[partition] = expires

    def end_lease(
        self, model: RequestModel, partition: str, t: Span, check_in: float | None
    ) -> None:
        model.held.pop(partition, None)
        if check_in is None:
            model.checks.pop(partition, None)
        else:
            model.checks[partition] = t + check_in

    def check_lease(self, actual: Lease, rid: str, partition: str, *, reply: bool) -> None:
        """``actual`` is the lease held on ``partition`` (as a reply carries it, or stored)."""
        model = self.requests[rid]
        held = model.held[partition]
        expected = (rid, partition, held.holder, held.token, held.pass_number)
        got = (actual.request_id, actual.partition, actual.holder, actual.token)
        assert (*got, actual.pass_number) == expected
        expires = held.expires
        assert expires.holds(actual.expires_at, self.slack), (actual.expires_at, expires)
        assert actual.sends == model.sends.get(partition, 0)
        sent = model.sent.get(partition)
        if sent is None:
            assert actual.sent_at == 0.0
        else:
            assert sent.holds(actual.sent_at, self.slack), (actual.sent_at, sent)

    def lease_for(self, rid: str, partition: str) -> Lease:
        """The lease object of the lease held on ``partition`` (as its holder has it)."""
        held = self.requests[rid].held[partition]
        return next(
            lease
            for lease in reversed(self.leases)
            if (lease.request_id, lease.partition, lease.token) == (rid, partition, held.token)
        )

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

    def create(
        self, shape: str, seed: int, max_tokens: int, replica: str, check_in: float | None
    ) -> None:
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
            "resource_configs": {"sampling": SamplingReqConfig(_seed=seed)},
            "partition_definitions": definitions,
            "op_id": f"create-{rid}",
            "check_in": check_in,
        }
        store = self.stores[replica]
        result, t, created = self.client_timed(
            replica, lambda: store.create_request(rid, **copy.deepcopy(kwargs))
        )
        result.ok()
        record = RequestRecord(
            request_id=rid,
            max_output_tokens=max_tokens,
            seed=seed,
            partitions=list(partitions),
            connections=list(connections),
            partition_definitions=copy.deepcopy(definitions),
            resource_configs={"sampling": SamplingReqConfig(_seed=seed)},
        )
        model = RequestModel(
            create_kwargs=kwargs,
            record=record,
            created_at=created,
            partitions=copy.deepcopy(partitions),
            connections=copy.deepcopy(connections),
            reported={name: set() for name in names},
        )
        self.requests[rid] = model
        if check_in is not None:
            for name in names:
                model.checks[name] = t + check_in

    @initialize(seed=st.integers(0, 1000), replica=st.sampled_from(REPLICAS))
    def first_request(self, seed: int, replica: str) -> None:
        self.create("pipeline", seed, 64, replica, None)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(
        shape=st.sampled_from(sorted(SHAPES)),
        seed=st.integers(0, 1000),
        max_tokens=st.integers(1, 64),
        replica=st.sampled_from(REPLICAS),
        check_in=st.sampled_from([None, None, 0.0, 1.0]),
    )
    def create_request(
        self, shape: str, seed: int, max_tokens: int, replica: str, check_in: float | None
    ) -> None:
        self.create(shape, seed, max_tokens, replica, check_in)

    @rule(data=st.data(), replica=st.sampled_from(REPLICAS), same_op=st.booleans())
    def create_again(self, data: st.DataObject, replica: str, same_op: bool) -> None:
        """A resent create (same op id) succeeds and changes nothing; another is refused."""
        rid = self.pick_request(data)
        model = self.requests[rid]
        kwargs = copy.deepcopy(model.create_kwargs)
        if not same_op:
            kwargs["op_id"] = self.fresh_op()
        store = self.stores[replica]
        result, _ = self.timed(lambda: store.create_request(rid, **kwargs))
        if same_op:
            result.ok()
        else:
            result.failed(RequestExistsError)

    # -- reports --------------------------------------------------------------------------

    def deliver(self, report: Report, via: str, named: bool) -> None:
        """Apply ``report`` through replica ``via`` and check the outcome against the model."""
        rid, name = report.request_id, report.partition
        model = self.requests[rid]
        part = model.partitions[name]
        holder = via if named else None
        store = self.stores[via]
        result, t = self.timed(
            lambda: store.record_worker_report(
                rid,
                name,
                fwd_pass=report.fwd_pass,
                worker_graph_id=report.worker_graph_id,
                rank=report.rank,
                num_ranks=report.num_ranks,
                new_tokens=report.new_tokens,
                output_names=report.output_names,
                consumed=dict(report.consumed),
                replica_id=holder,
            )
        )
        if report.fwd_pass != part.fwd_pass_number:
            stale = result.failed(StalePassError)
            assert (stale.expected, stale.current) == (report.fwd_pass, part.fwd_pass_number)
            return
        if report.worker_graph_id not in part.current_worker_graph_ids:
            result.failed(UnknownWorkerGraphError)
            return
        outcome = result.ok()
        self.reports.append(report)
        wg, slot = report.worker_graph_id, (report.worker_graph_id, report.rank)
        if slot in model.reported[name]:
            # A duplicate changes nothing and says what the first delivery did: whether it
            # completed the pass, and the lease if this replica still holds it live.
            completed = model.completer.get(name) == slot
            held = model.held.get(name)
            gets_lease = (
                completed
                and held is not None
                and held.holder == holder
                and held.pass_number == report.fwd_pass
                and self.live(held.expires, t)
            )
            assert not outcome.applied
            assert outcome.rank_completions == part.wg_rank_completions.get(wg, 0)
            assert outcome.worker_graph_complete == completed
            assert outcome.pass_complete == completed
            assert outcome.stepped_to is None
            event(
                f"report: duplicate{' of the completer' if completed else ''}"
                f"{' with its lease' if gets_lease else ''}"
            )
            self.check_outcome_lease(outcome, rid, name, gets_lease)
            return
        model.reported[name].add(slot)
        count = part.wg_rank_completions.get(wg, 0) + 1
        part.wg_rank_completions[wg] = count
        wg_complete = count == report.num_ranks
        if wg_complete:
            part.completed_worker_graph_ids.add(wg)
        part.num_output_tokens += report.new_tokens
        for c in model.outgoing(name):
            model.connections[c].token_count += report.new_tokens
        for c, consumed in report.consumed:
            conn = model.connections[c]
            conn.consumed_count = max(conn.consumed_count, consumed)
        part.curr_forward_outputs.extend(report.output_names)
        pass_complete = wg_complete and (
            part.current_worker_graph_ids <= part.completed_worker_graph_ids
        )
        if pass_complete:
            key = (rid, name, report.fwd_pass)
            assert key not in self.completed_passes, "a pass completed twice"
            self.completed_passes.add(key)
            model.completer[name] = slot
            event("report: completed a pass")
            if holder is not None and model.finished_at is None:  # finished: no lease
                self.grant(model, name, holder, report.fwd_pass, t)
        assert outcome.applied
        assert outcome.rank_completions == count
        assert outcome.worker_graph_complete == wg_complete
        assert outcome.pass_complete == pass_complete
        assert outcome.stepped_to is None
        self.check_outcome_lease(
            outcome, rid, name, pass_complete and holder is not None and model.finished_at is None
        )

    def check_outcome_lease(self, outcome: Any, rid: str, name: str, expected: bool) -> None:
        if not expected:
            assert outcome.lease is None
            assert outcome.partition is None
            return
        assert outcome.lease is not None
        self.check_lease(outcome.lease, rid, name, reply=True)
        # The partition as stored right after the report, publish info included.
        assert outcome.partition == self.requests[rid].partitions[name]
        self.leases.append(outcome.lease)

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

    def apply_advance(
        self,
        model: RequestModel,
        name: str,
        metadata: CurrentForwardConductorMetadata,
        worker_graph_ids: tuple[str, ...],
        done: bool,
    ) -> int:
        part = model.partitions[name]
        model.reported[name] = set()
        model.completer.pop(name, None)
        part.metadata = copy.deepcopy(metadata)
        part.current_worker_graph_ids = set(worker_graph_ids)
        part.completed_worker_graph_ids = set()
        part.wg_rank_completions = {}
        part.curr_forward_outputs = []
        part.fwd_pass_number += 1
        part.random_seed += 1
        if done:
            part.is_done = True
            for c in model.outgoing(name):
                model.connections[c].producer_done = True
        return part.fwd_pass_number

    def advance(self, call: Advance, via: str) -> None:
        model = self.requests[call.request_id]
        name = call.partition
        part = model.partitions[name]
        store = self.stores[via]
        result, t = self.timed(
            lambda: store.advance_partition(
                call.request_id,
                name,
                from_pass=call.from_pass,
                metadata=call.metadata,
                worker_graph_ids=call.worker_graph_ids,
                done=call.done,
                op_id=call.op_id,
                fence=call.fence,
            )
        )
        if call.fence is not None:
            if model.superseded(call.fence):
                result.fenced(call.fence.token, model.tokens.get(name, 0))
                return
        else:  # unfenced: refused while any replica holds a live lease on the partition
            held = model.held.get(name)
            if held is not None and self.live(held.expires, t):
                result.fenced(0, held.token, name)
                return
        if f"advance:{call.op_id}" in model.ops:
            assert result.ok() == call.from_pass + 1
            return
        if call.from_pass != part.fwd_pass_number:
            stale = result.failed(StalePassError)
            assert (stale.expected, stale.current) == (call.from_pass, part.fwd_pass_number)
            return
        model.ops.add(f"advance:{call.op_id}")
        new_pass = self.apply_advance(model, name, call.metadata, call.worker_graph_ids, call.done)
        self.advances.append(call)
        assert result.ok() == new_pass

    def draw_step(self, data: st.DataObject, name: str) -> Step:
        wgs = data.draw(st.sets(st.sampled_from(sorted(WORKER_GRAPHS[name])), max_size=2))
        return Step(
            data.draw(metadatas, label="metadata"),
            tuple(sorted(wgs)),
            data.draw(st.sampled_from([False, False, False, True]), label="done"),
        )

    def draw_advance(
        self, data: st.DataObject, rid: str, name: str, from_pass: int, fence: Lease | None
    ) -> Advance:
        step = self.draw_step(data, name)
        return Advance(
            rid,
            name,
            from_pass,
            step.metadata,
            step.worker_graph_ids,
            step.done,
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
        """Two replicas advance from the same pass, unfenced: the second finds it stale (and
        both are refused while a replica holds a live lease on the partition)."""
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

    @precondition(lambda self: self.fake)
    @rule(seconds=st.sampled_from([1.0, 4.0, FAKE_TTL, FAKE_TTL + 1.0]))
    def let_time_pass(self, seconds: float) -> None:
        self.server_clock.us += round(seconds * 1_000_000)

    def claim(self, rid: str, name: str, via: str) -> Lease | None:
        """``via`` claims the partition's step; checks the answer against the model."""
        model = self.requests[rid]
        store = self.stores[via]
        result, t = self.timed(lambda: store.claim_step(rid, name, via))
        lease: Lease | None = result.ok()
        if model.finished_at is not None:
            assert lease is None  # a finished request's steps are never claimed
            model.checks.pop(name, None)  # nor looked at again (a late step's check time)
            event("claim: request finished")
            return None
        held = model.held.get(name)
        if held is not None and self.live(held.expires, t):
            if held.holder != via:  # look again when the holder's lease lapses
                assert lease is None
                event("claim: held by another")
                return None
            # The holder's re-claim (its reply was lost): its own lease back.
            assert lease is not None
            event("claim: the holder's own lease back")
            self.check_lease(lease, rid, name, reply=True)
            self.leases.append(lease)
            return lease
        check = model.checks.get(name)
        if check is not None and self.live(check, t):  # not due yet
            assert lease is None
            event("claim: not due")
            return None
        previous = model.fencing_token
        event("claim: granted" + (" (took over a lapsed lease)" if held else ""))
        self.grant(model, name, via, model.partitions[name].fwd_pass_number, t)
        assert lease is not None
        assert lease.token > previous
        self.check_lease(lease, rid, name, reply=True)
        self.leases.append(lease)
        return lease

    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def claim_step(self, data: st.DataObject, via: str) -> None:
        """None while another replica's live lease covers the partition, before its check
        time, or once the request finished; the holder's own lease for the holder; else a new
        lease with a higher token."""
        rid = self.pick_request(data)
        self.claim(rid, self.pick_partition(data, rid), via)

    @precondition(lambda self: self.fake and any(m.held for m in self.requests.values()))
    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def take_over(self, data: st.DataObject, via: str) -> None:
        """A lease's holder goes quiet past its expiry and ``via`` claims the step."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.requests.items() if m.held)))
        model = self.requests[rid]
        name = data.draw(st.sampled_from(sorted(model.held)), label="partition")
        self.server_clock.move_to(model.held[name].expires.hi)
        previous = model.fencing_token
        lease = self.claim(rid, name, via)
        if model.finished_at is None:  # (a lease held when the request finished lapses)
            assert lease is not None and lease.token == previous + 1

    def release(self, lease: Lease, check_in: float | None, sent: bool) -> None:
        model = self.requests[lease.request_id]
        name = lease.partition
        store = self.stores[lease.holder]
        result, t = self.timed(lambda: store.release_lease(lease, check_in=check_in, sent=sent))
        if model.superseded(lease):
            result.fenced(lease.token, model.tokens.get(name, 0))
            return
        result.ok()
        if sent:
            model.sends[name] = model.sends.get(name, 0) + 1
            model.sent[name] = t
        self.end_lease(model, name, t, check_in)

    def take_step(self, lease: Lease, step: Step, check_in: float | None) -> None:
        rid, name = lease.request_id, lease.partition
        model = self.requests[rid]
        store = self.stores[lease.holder]
        result, t = self.timed(lambda: store.take_step(lease, step, check_in=check_in))
        current = model.partitions[name].fwd_pass_number
        if model.stepped.get(name) == f"{lease.pass_number}:{lease.token}":
            assert result.ok() == current  # a resent step, recognised even if superseded
            event("step: resend recognised" + (" (superseded)" if model.superseded(lease) else ""))
            return
        if model.superseded(lease):
            result.fenced(lease.token, model.tokens.get(name, 0))
            return
        if current != lease.pass_number:
            stale = result.failed(StalePassError)
            assert (stale.expected, stale.current) == (lease.pass_number, current)
            return
        new_pass = self.apply_advance(model, name, step.metadata, step.worker_graph_ids, step.done)
        model.stepped[name] = f"{lease.pass_number}:{lease.token}"
        model.sends[name] = 1
        model.sent[name] = t
        self.end_lease(model, name, t, check_in)
        self.steps.append((lease, step, check_in))
        event("step: taken")
        assert result.ok() == new_pass

    @precondition(lambda self: any(m.held for m in self.requests.values()))
    @rule(data=st.data(), how=st.sampled_from(["take_step", "advance_then_release"]))
    def drive_step(self, data: st.DataObject, how: str) -> None:
        """A lease's holder does its step: if the pass the lease is about is still current,
        take the step (``take_step``, or an advance fenced with the lease and then a release),
        else send the pass again; recovery looks again later, or never."""
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.requests.items() if m.held)))
        model = self.requests[rid]
        lease = self.lease_for(rid, data.draw(st.sampled_from(sorted(model.held)), label="p"))
        check_in = self.draw_check_in(data)
        if model.partitions[lease.partition].fwd_pass_number != lease.pass_number:
            self.release(lease, check_in, sent=True)
        elif how == "take_step":
            self.take_step(lease, self.draw_step(data, lease.partition), check_in)
        else:
            call = self.draw_advance(data, rid, lease.partition, lease.pass_number, lease)
            self.advance(call, lease.holder)
            self.release(lease, check_in, sent=True)

    @precondition(lambda self: bool(self.steps))
    @rule(data=st.data())
    def resend_step(self, data: st.DataObject) -> None:
        """A step taken before, sent again (its reply was lost): it says the pass it is at
        and changes nothing, even after newer leases."""
        self.take_step(*data.draw(st.sampled_from(self.steps), label="step"))

    @precondition(lambda self: bool(self.leases))
    @rule(
        data=st.data(),
        pool=st.sampled_from(["superseded", "held", "released"]),
        action=st.sampled_from(["advance", "step", "final_output", "release", "renew", "finish"]),
    )
    def write_with_lease(self, data: st.DataObject, pool: str, action: str) -> None:
        """A write fenced with a lease granted earlier: refused, changing nothing, once the
        lease was superseded; applied while it is the partition's latest."""
        candidates = [lease for lease in self.leases if self.lease_state(lease) == pool]
        lease = data.draw(st.sampled_from(candidates or self.leases), label="lease")
        rid, name, via = lease.request_id, lease.partition, lease.holder
        model = self.requests[rid]
        if action == "advance":
            current = model.partitions[name].fwd_pass_number
            self.advance(self.draw_advance(data, rid, name, current, lease), via)
        elif action == "step":
            self.take_step(lease, self.draw_step(data, name), self.draw_check_in(data))
        elif action == "final_output":
            self.final_output(data, rid, via, lease)
        elif action == "release":
            self.release(lease, self.draw_check_in(data), data.draw(st.booleans(), label="sent"))
        elif action == "finish" and rid != KEPT:
            self.finish(rid, via, lease)
        else:
            self.renew(lease, data.draw(st.sampled_from([None, self.ttl * 0.3]), label="ttl"))

    def renew(self, lease: Lease, ttl: float | None) -> None:
        model = self.requests[lease.request_id]
        name = lease.partition
        store = self.stores[lease.holder]
        result, t = self.timed(lambda: store.renew_lease(lease, ttl))
        if model.superseded(lease):
            result.fenced(lease.token, model.tokens.get(name, 0))
            return
        if name not in model.held:  # a released lease cannot be renewed
            result.fenced(lease.token, lease.token)
            return
        renewed: Lease = result.ok()
        expires = t + (ttl or self.ttl)
        model.held[name].expires = expires
        model.checks[name] = expires
        assert replace(renewed, expires_at=lease.expires_at) == lease
        assert expires.holds(renewed.expires_at, self.slack)
        self.leases.append(renewed)
        event("renewed")

    def refused_unfenced(self, model: RequestModel, result: Result, t: Span) -> bool:
        """An unfenced request-level write is refused while any partition's lease is live."""
        live = {n: h for n, h in model.held.items() if self.live(h.expires, t)}
        if not live:
            return False
        error = result.failed(FencedError)
        assert error.token == 0
        assert error.partition in live
        assert error.current == live[error.partition].token
        return True

    def final_output(self, data: st.DataObject, rid: str, via: str, fence: Lease | None) -> None:
        model = self.requests[rid]
        output = data.draw(st.sampled_from(["text", "audio"]), label="output")
        value = data.draw(st.integers(0, 100) | st.lists(st.integers(0, 9), max_size=2))
        store = self.stores[via]
        result, t = self.timed(lambda: store.set_final_output(rid, output, value, fence=fence))
        if fence is not None and model.superseded(fence):
            result.fenced(fence.token, model.tokens.get(fence.partition, 0))
            return
        if fence is None and self.refused_unfenced(model, result, t):
            return
        result.ok()
        model.record.final_outputs[output] = value

    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def unfenced_final_output(self, data: st.DataObject, via: str) -> None:
        """A request-level write without a lease: refused while any replica drives a step."""
        self.final_output(data, self.pick_request(data), via, None)

    def finish(self, rid: str, via: str, fence: Lease | None) -> None:
        model = self.requests[rid]
        store = self.stores[via]
        result, t, finished = self.client_timed(
            via, lambda: store.finish_request(rid, fence=fence, keep_for=KEEP_FOR)
        )
        if fence is not None and model.superseded(fence):
            result.fenced(fence.token, model.tokens.get(fence.partition, 0))
            return
        if fence is None and self.refused_unfenced(model, result, t):
            return
        result.ok()
        # Its index writes follow the applied finish (a refused one writes neither).
        self.finished_index[rid] = t + KEEP_FOR
        model.finished_at = finished
        event("finished")
        model.held.clear()  # no partition is driven any more; the tokens stay
        model.checks.clear()

    @rule(data=st.data(), via=st.sampled_from(REPLICAS))
    def finish_request(self, data: st.DataObject, via: str) -> None:
        """The request is done, kept for inspection (refused while a replica drives a step)."""
        rid = self.pick_request(data)
        if rid != KEPT:
            self.finish(rid, via, None)

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

    def settle(self, span: Span, actual: float, what: str) -> Span:
        """``actual`` must lie in ``span``; from now on the model knows it exactly."""
        assert span.holds(actual, self.slack), f"{what}: {actual!r} outside {span}"
        return Span.at(actual)

    def scores(self, key: str) -> dict[str, float]:
        return {m.decode(): s for m, s in self.client.zrange(key, 0, -1, withscores=True)}

    @invariant()
    def store_equals_model(self) -> None:
        for rid, model in self.requests.items():
            state = self.stores["C"].load_request(rid)
            assert state.partitions == model.partitions
            assert state.connections == model.connections
            record = state.record
            model.created_at = self.settle(model.created_at, record.created_at, "created_at")
            if model.finished_at is None:
                assert record.finished_at == 0.0
            else:
                model.finished_at = self.settle(
                    model.finished_at, record.finished_at, "finished_at"
                )
            expected = replace(
                model.record, created_at=record.created_at, finished_at=record.finished_at
            )
            assert record == expected
            self.check_lease_hash(rid, model)
            leases = self.stores["B"].leases(rid)
            assert sorted(leases) == sorted(model.held)
            for name, lease in leases.items():
                self.check_lease(lease, rid, name, reply=False)
        self.check_indexes()

    def check_lease_hash(self, rid: str, model: RequestModel) -> None:
        """The lease hash, field by field (the checks and bookkeeping ``leases`` omits)."""
        raw = {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.lease(rid)).items()}
        names = sorted(model.partitions)
        assert raw.pop("token", "0") == str(model.fencing_token)
        assert raw.pop("finished", None) == (None if model.finished_at is None else "1")
        for name in names:
            assert raw.pop(f"token[{name}]", None) == (
                str(model.tokens[name]) if name in model.tokens else None
            )
            assert raw.pop(f"stepped[{name}]", None) == model.stepped.get(name)
            sends = raw.pop(f"sends[{name}]", None)
            assert int(sends or 0) == model.sends.get(name, 0)
            for what, spans in (("check", model.checks), ("sent", model.sent)):
                value = raw.pop(f"{what}[{name}]", None)
                assert (value is None) == (name not in spans), (what, name, value)
                if value is not None:
                    spans[name] = self.settle(spans[name], float(value), f"{what}[{name}]")
            held = model.held.get(name)
            value = raw.pop(f"expires[{name}]", None)
            assert (value is None) == (held is None)
            if held is not None:
                assert value is not None
                held.expires = self.settle(held.expires, float(value), f"expires[{name}]")
                assert raw.pop(f"holder[{name}]") == held.holder
                assert raw.pop(f"pass[{name}]") == str(held.pass_number)
            raw.pop(f"stepped_by[{name}]", None)  # only a report that steps writes it
        assert not raw, f"lease hash fields the model does not know: {raw}"

    def check_indexes(self) -> None:
        index = self.scores(self.keys.deadlines)
        # The recovery index mirrors the check times: exactly on one server, never later on
        # a cluster (see the module docstring).
        checks = {f"{rid} {n}" for rid, m in self.requests.items() for n in m.checks}
        exact = self.stores["A"].store._core.scripts_write_index
        if exact:
            assert sorted(index) == sorted(checks)
        else:  # a refused step or create may leave an entry behind: one early look
            assert checks <= set(index), checks - set(index)
            if set(index) - checks:
                event("cluster: index entry without a check time")
        for member in checks:
            rid, _, name = member.partition(" ")
            stored = self.client.hget(self.keys.lease(rid), f"check[{name}]")
            assert stored is not None, member
            score = index[member]
            assert score == float(stored) if exact else score <= float(stored), (
                member,
                stored,
                score,
            )
        finished = self.scores(self.keys.finished)
        assert sorted(finished) == sorted(self.finished_index)
        for rid, score in finished.items():
            self.finished_index[rid] = self.settle(self.finished_index[rid], score, rid)
        requests = self.scores(self.keys.index)
        assert requests == {rid: m.created_at.lo for rid, m in self.requests.items()}
        # What recovery is told to look at: by the server's clock, oldest first.
        result, t = self.timed(lambda: self.stores["A"].due_steps())
        order = sorted(index.items(), key=lambda item: (item[1], item[0].encode()))
        surely = [m for m, s in order if s <= t.lo]
        maybe = [m for m, s in order if s <= t.hi]
        due = [f"{rid} {name}" for rid, name in result.ok()]
        assert due[: len(surely)] == surely and due == maybe[: len(due)]


@pytest.mark.fake
@pytest.mark.slow
def test_replicas_on_fakeredis() -> None:
    run_state_machine_as_test(ReplicaMachine, settings=FAKE_SETTINGS)


@pytest.mark.real
@pytest.mark.slow
def test_replicas_on_real_redis(real_client: redis.Redis) -> None:
    # ``real_client`` only vouches for the server (reachable, holding no foreign keys).
    class OnRealRedis(ReplicaMachine):
        # Each example works in a namespace of its own and deletes it in teardown.
        on_real_redis = True

    run_state_machine_as_test(OnRealRedis, settings=REAL_SETTINGS)
