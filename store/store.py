"""``RequestStore``: one request's conductor state in Redis, safe under concurrent replicas.

How each operation stays correct when a replica races another or a reply is lost:

=========================  ==========================================  ======================
operation                  how it runs                                 applied twice?
=========================  ==========================================  ======================
create_request             one script writes every hash or none        guarded: op id in meta
load_*                     one script reads a consistent snapshot      read only
update_partition,          one script: replace fields of a record      idempotent by nature
set_producer_done,         that exists
set_final_output
raise_consumed_count       one script: max(held, new)                  idempotent by nature
add_tokens                 one script: HINCRBY                         guarded: op id
record_worker_report       one script, keyed by (pass, worker graph,   guarded: report id
                           rank); counters change server-side
advance_partition          one script, compare-and-set on the pass     guarded: op id, and
                                                                       the pass check
merge_publish_info         optimistic WATCH/MULTI/EXEC, kinds merge    guarded: op id
                           with their own ``update``
delete_request             UNLINK of the request's keys                idempotent by nature
=========================  ==========================================  ======================

An op id is generated per call unless the caller passes one; a caller that may deliver the
same operation again (after a crash, say) passes a stable id so the repeat is recognised.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis

from migrations import RecordKind
from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    PartitionState,
    StreamingConnectionState,
)
from mstar.engine.resources import PublishedInfo
from store import scripts
from store.backoff import RetryPolicy
from store.codec.layout import RecordLayout
from store.codec.published import MergedInfos, PublishLayout, check_label
from store.codec.values import Codec
from store.errors import (
    ConfigurationError,
    ConnectionNotFound,
    CorruptRecordError,
    FencedError,
    NotFoundError,
    PartitionNotFound,
    RequestExistsError,
    RequestNotFound,
    StalePassError,
    StoreConnectionError,
    StoreError,
    TransactionConflictError,
    UnknownWorkerGraphError,
    ValidationError,
)
from store.io.connect import client_from_url
from store.io.transaction import Outcome, Plan, optimistic
from store.io.wire import Scripts, hash_reply
from store.keys import (
    MAX_NAME_LENGTH,
    KeySpace,
    connection_name,
    split_connection_name,
    validate_name,
    validate_request_id,
)
from store.records import Lease, ReportOutcome, RequestRecord, RequestState
from store.schema import SCHEMA_VERSION, VERSION_FIELD
from store.upgrade import RecordOutdated, parse_version, to_current, upgrade_stored

_SCRIPTS = (
    "create_request",
    "apply_report",
    "advance_partition",
    "add_tokens",
    "raise_field",
    "update_fields",
    "load_hashes",
    "claim_step",
    "release_lease",
    "renew_lease",
    "merge_parts",
)
_VERSION = str(SCHEMA_VERSION).encode()
# An optimistic merge that lost this many rounds asks server-side merges to wait _CLAIM_MS.
_CLAIM_AFTER = 4
_CLAIM_MS = 200


@dataclass(frozen=True)
class _Topology:
    partitions: tuple[str, ...]
    connections: tuple[str, ...]

    def outgoing(self, partition: str) -> tuple[str, ...]:
        return self._ends[0].get(partition, ())

    def incoming(self, partition: str) -> tuple[str, ...]:
        return self._ends[1].get(partition, ())

    @cached_property
    def _ends(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        out: dict[str, tuple[str, ...]] = {}
        into: dict[str, tuple[str, ...]] = {}
        for conn in self.connections:
            source, target = conn.split("->")
            out[source] = (*out.get(source, ()), conn)
            into[target] = (*into.get(target, ()), conn)
        return out, into


@dataclass
class StoreStats:
    """Counters of merges: optimistic transactions (with their tries) and server-side merges."""

    transactions: int = 0
    attempts: int = 0
    server_merges: int = 0

    @property
    def retries(self) -> int:
        return self.attempts - self.transactions

    @property
    def merges(self) -> int:
        """Merges committed, by either path."""
        return self.transactions + self.server_merges


class RequestStore:
    """The conductor's per-request state on Redis (single server, Sentinel or Cluster)."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "mstar",
        codec: Codec | None = None,
        retry: RetryPolicy | None = None,
        dedupe_window: float = 3600.0,
        lease_ttl: float = 10.0,
        topology_cache_size: int = 4096,
    ) -> None:
        kwargs: dict[str, Any] = getattr(client, "get_connection_kwargs", dict)()
        if kwargs.get("decode_responses"):
            raise ConfigurationError("the store needs a client with decode_responses=False")
        if dedupe_window <= 0 or lease_ttl <= 0:
            raise ConfigurationError("dedupe_window and lease_ttl must be positive")
        self.client = client
        self.keys = KeySpace(namespace)
        self.codec = codec or Codec()
        self.retry = retry or RetryPolicy()
        self.dedupe_window = dedupe_window
        self.lease_ttl = lease_ttl
        self.stats = StoreStats()
        self._partition = RecordLayout(
            PartitionState, self.codec, exclude=("resource_publish_info",)
        )
        self._connection = RecordLayout(StreamingConnectionState, self.codec)
        self._record = RecordLayout(RequestRecord, self.codec)
        self._published = PublishLayout(self.codec)
        self._scripts = Scripts(client, {name: scripts.source(name) for name in _SCRIPTS})
        self._topologies: OrderedDict[str, _Topology] = OrderedDict()
        self._op_pid, self._op_prefix, self._op_count = 0, "", itertools.count()
        self._topology_cache_size = topology_cache_size

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "mstar", **options: Any) -> RequestStore:
        """A store on the Redis at ``url`` (see ``store.io.connect`` for the URL forms)."""
        store_options = {
            k: options.pop(k)
            for k in ("codec", "retry", "dedupe_window", "lease_ttl", "topology_cache_size")
            if k in options
        }
        return cls(client_from_url(url, **options), namespace=namespace, **store_options)

    # -- create, list, delete --------------------------------------------------------

    def create_request(
        self,
        request_id: str,
        *,
        partitions: Mapping[str, PartitionState],
        connections: Mapping[str, StreamingConnectionState] | None = None,
        max_output_tokens: int,
        seed: int = 0,
        resource_configs: Mapping[str, Any] | None = None,
        partition_definitions: Mapping[str, Any] | None = None,
        op_id: str | None = None,
    ) -> None:
        """Store a new request with all its partitions and connections, all or nothing.

        Raises ``RequestExistsError`` if the id is held already (a resend of this very create
        after a lost reply is recognised and succeeds).
        """
        rid = validate_request_id(request_id)
        connections = connections or {}
        self._validate_topology(rid, partitions, connections)
        record = RequestRecord(
            request_id=rid,
            max_output_tokens=max_output_tokens,
            seed=seed,
            partitions=list(partitions),
            connections=list(connections),
            partition_definitions=dict(partition_definitions or {}),
            resource_configs=dict(resource_configs or {}),
            created_at=time.time(),
        )
        meta_key = self.keys.meta(rid)
        hashes: list[tuple[str, dict[str, bytes]]] = [
            (meta_key, self._record.encode(record, request_id=rid, key=meta_key))
        ]
        for name, state in partitions.items():
            key = self.keys.partition(rid, name)
            hashes.append((key, self._partition.encode(state, request_id=rid, key=key)))
            pub = self.keys.publish_info(rid, name)
            hashes.append((pub, self._encode_infos(rid, pub, state.resource_publish_info)))
        for name, conn in connections.items():
            key = self.keys.connection(rid, name)
            hashes.append((key, self._connection.encode(conn, request_id=rid, key=key)))
        args: list[Any] = [op_id or self._new_op_id()]
        for _, fields in hashes:
            args.append(len(fields))
            for field, value in fields.items():
                args += [field, value]
        with self._redis_errors(rid):
            # Index first: a crash in between leaves an index entry without a request (which
            # readers skip and delete removes), never a request no index can find.
            self.client.zadd(self.keys.index, {rid: record.created_at}, nx=True)
            status = self._scripts("create_request", [k for k, _ in hashes], args, request_id=rid)
        if status[0] == b"EXISTS":
            raise RequestExistsError("a request with this id is held already", request_id=rid)
        self._remember(rid, _Topology(tuple(partitions), tuple(connections)))

    def _validate_topology(
        self,
        rid: str,
        partitions: Mapping[str, PartitionState],
        connections: Mapping[str, StreamingConnectionState],
    ) -> None:
        if not partitions:
            raise ValidationError("a request needs at least one partition", request_id=rid)
        for name, state in partitions.items():
            validate_name(name, what="partition name", request_id=rid)
            if not isinstance(state, PartitionState):
                raise ValidationError(
                    f"partition {name!r} must be a PartitionState, not {type(state).__name__}",
                    request_id=rid,
                )
            if state.partition_name != name:
                raise ValidationError(
                    f"partition stored as {name!r} is named {state.partition_name!r}",
                    request_id=rid,
                    field="partition_name",
                )
        for name, conn in connections.items():
            source, target = split_connection_name(name, request_id=rid)
            if not isinstance(conn, StreamingConnectionState):
                raise ValidationError(
                    f"connection {name!r} must be a StreamingConnectionState", request_id=rid
                )
            if (conn.from_partition, conn.to_partition) != (source, target):
                raise ValidationError(
                    f"connection stored as {name!r} joins "
                    f"{connection_name(conn.from_partition, conn.to_partition)!r}",
                    request_id=rid,
                )
            for end in (source, target):
                if end not in partitions:
                    raise ValidationError(
                        f"connection {name!r} names partition {end!r}, which the request "
                        "does not have",
                        request_id=rid,
                    )

    def list_requests(self) -> list[str]:
        """Ids of the requests held, oldest first (read from the index, never a SCAN)."""
        with self._redis_errors(None):
            return [rid.decode() for rid in self.client.zrange(self.keys.index, 0, -1)]

    def request_exists(self, request_id: str) -> bool:
        rid = validate_request_id(request_id)
        with self._redis_errors(rid):
            return bool(self.client.exists(self.keys.meta(rid)))

    def delete_request(self, request_id: str) -> bool:
        """Remove the request and all its keys; False if it was not held."""
        rid = validate_request_id(request_id)
        self._topologies.pop(rid, None)
        try:
            topology = self._load_topology(rid)
        except RequestNotFound:
            topology = None
        partitions = list(topology.partitions) if topology else []
        keys = self.keys.request_keys(
            rid, partitions, list(topology.connections) if topology else []
        )
        with self._redis_errors(rid):
            self.client.unlink(*keys)
            if partitions:
                members = [_deadline_member(rid, p) for p in partitions]
                self.client.zrem(self.keys.deadlines, *members)
            self.client.zrem(self.keys.index, rid)
        return topology is not None

    # -- reads -------------------------------------------------------------------------

    def load_request(self, request_id: str) -> RequestState:
        """A consistent snapshot of the whole request."""
        rid = validate_request_id(request_id)
        for _ in range(2):
            topology = self._topology(rid)
            keys = [self.keys.meta(rid)]
            keys += [self.keys.partition(rid, p) for p in topology.partitions]
            keys += [self.keys.publish_info(rid, p) for p in topology.partitions]
            keys += [self.keys.connection(rid, c) for c in topology.connections]
            hashes = self._load_hashes(rid, keys)
            if not hashes[0]:
                self._topologies.pop(rid, None)
                raise RequestNotFound("no such request", request_id=rid)
            record = self._decode_record(rid, hashes[0])
            if (tuple(record.partitions), tuple(record.connections)) != (
                topology.partitions,
                topology.connections,
            ):
                self._topologies.pop(rid, None)  # recreated with another shape: read again
                continue
            n = len(topology.partitions)
            parts = {
                p: self._decode_partition(rid, p, hashes[1 + i], hashes[1 + n + i])
                for i, p in enumerate(topology.partitions)
            }
            conns = {
                c: self._decode_connection(rid, c, hashes[1 + 2 * n + i])
                for i, c in enumerate(topology.connections)
            }
            return RequestState(record, parts, conns)
        raise CorruptRecordError("request topology keeps changing under the read", request_id=rid)

    def load_record(self, request_id: str) -> RequestRecord:
        """The request-level record (max tokens, seed, configs, definitions, outputs)."""
        rid = validate_request_id(request_id)
        (raw,) = self._load_hashes(rid, [self.keys.meta(rid)])
        if not raw:
            raise RequestNotFound("no such request", request_id=rid)
        return self._decode_record(rid, raw)

    def load_partition(self, request_id: str, partition_name: str) -> PartitionState:
        """The partition's state, publish info included, equal to what was stored."""
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        part, pub = self._load_hashes(
            rid, [self.keys.partition(rid, name), self.keys.publish_info(rid, name)]
        )
        if not part:
            self._raise_not_found(rid, PartitionNotFound, f"no partition {name!r}")
        return self._decode_partition(rid, name, part, pub)

    def load_connection(self, request_id: str, name: str) -> StreamingConnectionState:
        rid = validate_request_id(request_id)
        split_connection_name(name, request_id=rid)
        (raw,) = self._load_hashes(rid, [self.keys.connection(rid, name)])
        if not raw:
            self._raise_not_found(rid, ConnectionNotFound, f"no connection {name!r}")
        return self._decode_connection(rid, name, raw)

    # -- field writes --------------------------------------------------------------------

    def update_partition(self, request_id: str, partition_name: str, **attributes: Any) -> None:
        """Replace the given attributes of a stored partition; other fields are untouched.

        Use ``merge_publish_info`` for published info and ``advance_partition`` to move to
        the next forward pass.
        """
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        key = self.keys.partition(rid, name)
        if "resource_publish_info" in attributes:
            raise ValidationError(
                "resource_publish_info is changed with merge_publish_info",
                request_id=rid,
                key=key,
                field="resource_publish_info",
            )
        self._update_fields(rid, key, self._partition, attributes, PartitionNotFound)

    def set_producer_done(self, request_id: str, connection: str) -> None:
        """Mark that the producer of a streaming connection will send no more tokens."""
        rid = validate_request_id(request_id)
        split_connection_name(connection, request_id=rid)
        key = self.keys.connection(rid, connection)
        self._update_fields(rid, key, self._connection, {"producer_done": True}, ConnectionNotFound)

    def set_final_output(
        self, request_id: str, name: str, value: Any, *, fence: Lease | None = None
    ) -> None:
        """Record one of the request's final outputs (plain data) under ``name``.

        With ``fence``, the write is rejected (``FencedError``) if that lease was superseded.
        """
        rid = validate_request_id(request_id)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
            raise ValidationError("output name must be a non-empty str", request_id=rid)
        key = self.keys.meta(rid)
        fields = self._record.encode_field("final_outputs", {name: value}, request_id=rid, key=key)
        self._run(
            rid,
            "update_fields",
            [key, self.keys.lease(rid)],
            [_VERSION, *_fence_args(fence), 0, *_pairs(fields)],
            RequestNotFound,
            fence,
        )

    def _update_fields(
        self,
        rid: str,
        key: str,
        layout: RecordLayout[Any],
        attributes: Mapping[str, Any],
        missing: type[StoreError],
        fence: Lease | None = None,
    ) -> None:
        replaced: list[str] = []
        fields: dict[str, bytes] = {}
        for attr, value in attributes.items():
            fields.update(layout.encode_field(attr, value, request_id=rid, key=key))
            if layout.fields[attr].shape != "scalar":
                replaced.append(attr)
        args = [_VERSION, *_fence_args(fence), len(replaced), *replaced, *_pairs(fields)]
        self._run(rid, "update_fields", [key, self.keys.lease(rid)], args, missing, fence)

    def add_tokens(
        self, request_id: str, connection: str, count: int, *, op_id: str | None = None
    ) -> int:
        """Add ``count`` tokens to a connection's ``token_count``; returns the new count."""
        rid = validate_request_id(request_id)
        split_connection_name(connection, request_id=rid)
        _check_int(count, "count", rid, minimum=0)
        keys = [self.keys.connection(rid, connection), self.keys.ops(rid)]
        args = [_VERSION, count, f"tokens:{op_id or self._new_op_id()}", *self._window()]
        return int(self._run(rid, "add_tokens", keys, args, ConnectionNotFound)[1])

    def raise_consumed_count(self, request_id: str, connection: str, count: int) -> int:
        """Raise ``consumed_count`` to ``count`` (never lowers it); returns the value held."""
        rid = validate_request_id(request_id)
        split_connection_name(connection, request_id=rid)
        _check_int(count, "count", rid, minimum=0)
        keys = [self.keys.connection(rid, connection)]
        args = [_VERSION, "consumed_count", count]
        return int(self._run(rid, "raise_field", keys, args, ConnectionNotFound)[1])

    # -- the forward-pass lifecycle ------------------------------------------------------

    def record_worker_report(
        self,
        request_id: str,
        partition_name: str,
        *,
        fwd_pass: int,
        worker_graph_id: str,
        rank: int,
        num_ranks: int,
        new_tokens: int = 0,
        output_names: Sequence[str] = (),
        consumed: Mapping[str, int] | None = None,
        replica_id: str | None = None,
    ) -> ReportOutcome:
        """Apply one worker-graph rank report, once, in one round trip.

        The rank counts towards ``wg_rank_completions``; the rank-0 report also carries the
        new output tokens (added to the partition and to every outgoing connection), the
        consumed counts of incoming connections (raised, never lowered) and output names.
        A second delivery of the same (pass, worker graph, rank) changes nothing. The report
        that completes the pass, if it names ``replica_id``, comes back with that replica's
        lease on the next step (``ReportOutcome.lease``), granted in the same script.
        """
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        key = self.keys.partition(rid, name)
        _check_int(fwd_pass, "fwd_pass", rid, minimum=0)
        _check_int(num_ranks, "num_ranks", rid, minimum=1)
        _check_int(rank, "rank", rid, minimum=0)
        _check_int(new_tokens, "new_tokens", rid, minimum=0)
        if rank >= num_ranks:
            raise ValidationError(
                f"rank {rank} is outside a worker graph of {num_ranks} ranks", request_id=rid
            )
        if not isinstance(worker_graph_id, str) or not 0 < len(worker_graph_id) <= 128:
            raise ValidationError(
                "worker graph id must be a str of 1 to 128 characters", request_id=rid, key=key
            )
        consumed = dict(consumed or {})
        output_names = list(output_names)
        if rank != 0 and (new_tokens or consumed or output_names):
            raise ValidationError(
                f"only the rank-0 report carries tokens, consumed counts and outputs "
                f"(got rank {rank})",
                request_id=rid,
                key=key,
            )
        for output in output_names:
            if not isinstance(output, str):
                raise ValidationError("output names must be str", request_id=rid, key=key)
        holder = _check_replica_id(replica_id, rid)
        for attempt in range(2):
            # Only tokens and consumed counts touch connections; other reports skip them.
            if new_tokens or consumed:
                topology = self._topology(rid)
                outgoing, incoming = topology.outgoing(name), topology.incoming(name)
            else:
                outgoing = incoming = ()
            unknown = set(consumed) - set(incoming)
            if unknown and attempt == 0:
                self._topologies.pop(rid, None)
                continue
            if unknown:
                raise ValidationError(
                    f"consumed counts name {sorted(unknown)}, which are not incoming "
                    f"connections of {name!r}",
                    request_id=rid,
                    key=key,
                )
            for conn_name, count in consumed.items():
                _check_int(count, f"consumed[{conn_name}]", rid, minimum=0)
            fed = [c for c in incoming if c in consumed]
            keys = [key, self.keys.lease(rid)]
            keys += [self.keys.connection(rid, c) for c in outgoing]
            keys += [self.keys.connection(rid, c) for c in fed]
            now = time.time()
            args: list[Any] = [
                _VERSION, fwd_pass, worker_graph_id, rank, num_ranks, new_tokens,
                len(outgoing), len(fed), name, holder, now, self.lease_ttl,
                *(consumed[c] for c in fed), *output_names,
            ]  # fmt: skip
            try:
                reply = self._run(rid, "apply_report", keys, args, PartitionNotFound)
            except ConnectionNotFound:
                if attempt:
                    raise
                self._topologies.pop(rid, None)  # the cached topology was stale
                continue
            if reply[0] == b"STALE":
                raise StalePassError(fwd_pass, int(reply[1]), request_id=rid, key=key)
            if reply[0] == b"NOWG":
                raise UnknownWorkerGraphError(
                    f"worker graph {worker_graph_id!r} is not in the current forward pass",
                    request_id=rid,
                    key=key,
                    field="current_worker_graph_ids",
                )
            lease = None
            if int(reply[4]):
                lease = Lease(rid, name, holder, int(reply[4]), fwd_pass, now + self.lease_ttl)
                self._schedule(rid, name, lease.expires_at)
            return ReportOutcome(
                applied=reply[0] == b"OK",
                rank_completions=int(reply[1]),
                worker_graph_complete=bool(reply[2]),
                pass_complete=bool(reply[3]),
                lease=lease,
            )
        raise AssertionError("unreachable")

    def advance_partition(
        self,
        request_id: str,
        partition_name: str,
        *,
        from_pass: int,
        metadata: CurrentForwardConductorMetadata,
        worker_graph_ids: Sequence[str] = (),
        done: bool = False,
        op_id: str | None = None,
        fence: Lease | None = None,
    ) -> int:
        """Move the partition from pass ``from_pass`` to the next; returns the new pass.

        Per-pass sets and counts reset, ``metadata`` replaces the old, ``fwd_pass_number`` and
        ``random_seed`` go up by one; ``done`` also sets ``is_done`` and ``producer_done`` on
        every outgoing connection. Raises ``StalePassError`` (changing nothing) when
        ``from_pass`` is no longer current, and ``FencedError`` when ``fence`` was superseded.
        """
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        key = self.keys.partition(rid, name)
        _check_int(from_pass, "from_pass", rid, minimum=0)
        if not isinstance(metadata, CurrentForwardConductorMetadata):
            raise ValidationError(
                "metadata must be a CurrentForwardConductorMetadata",
                request_id=rid,
                key=key,
                field="metadata",
            )
        encoded = self._partition.encode_field("metadata", metadata, request_id=rid, key=key)
        wgs = list(worker_graph_ids)
        self._partition.encode_field("current_worker_graph_ids", set(wgs), request_id=rid, key=key)
        topology = self._topology(rid)
        keys = [key, self.keys.ops(rid), self.keys.lease(rid)]
        keys += [self.keys.connection(rid, c) for c in topology.outgoing(name)]
        op = f"advance:{op_id or self._new_op_id()}"
        if fence is not None and fence.partition != name:
            raise ValidationError(
                f"a lease on partition {fence.partition!r} cannot fence {name!r}", request_id=rid
            )
        args = [
            _VERSION, from_pass, op, *self._window(), encoded["metadata"],
            "1" if done else "0", name, fence.token if fence else "", *wgs,
        ]  # fmt: skip
        reply = self._run(rid, "advance_partition", keys, args, PartitionNotFound, fence)
        if reply[0] == b"STALE":
            raise StalePassError(from_pass, int(reply[1]), request_id=rid, key=key)
        return int(reply[1]) if reply[0] == b"OK" else from_pass + 1

    # -- published info -----------------------------------------------------------------

    def merge_publish_info(
        self,
        request_id: str,
        partition_name: str,
        other: Mapping[str, PublishedInfo],
        *,
        op_id: str | None = None,
        returning: bool = True,
    ) -> Mapping[str, PublishedInfo]:
        """``merge_publish_info`` on the stored partition, applied once, all labels or none.

        KV and position infos (exactly those types) are merged by the server in one script:
        no WATCH, no retry, however many replicas merge at once (see store/published.py).
        Any other kind runs as an optimistic transaction: WATCH the publish-info hash (and
        the request's meta, so a deleted request is not written to), read it, fold ``other``
        in with each kind's own ``update``, write in MULTI/EXEC, retried with jittered
        backoff on conflict. Returns the merged infos of the labels in ``other``, as stored
        right after this merge (a server-side merge decodes them on first access);
        ``returning=False`` skips reading them back and returns an empty mapping.
        """
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        pub = self.keys.publish_info(rid, name)
        labels = sorted(other)
        if not labels:
            return {}
        for label in labels:
            check_label(label, request_id=rid, key=pub)
            info = other[label]
            if self.codec.registry.name_of(type(info)) is None:  # fail before any round trip
                self.codec.encode_kind(info, request_id=rid, key=pub, field=label)
        part, ops = self.keys.partition(rid, name), self.keys.ops(rid)
        op = f"merge:{op_id or self._new_op_id()}"
        server = self._published.server_merge(other, request_id=rid, key=pub)
        if server is not None:
            reads = [("HGETALL", pub)] if returning else []
            keys = [part, pub, ops, self.keys.merging(rid, name)]
            args = [_VERSION, op, *self._window(), *server.args]
            for waited in range(self.retry.max_attempts):
                reply, *read = self._run(
                    rid, "merge_parts", keys, args, PartitionNotFound, reads=reads
                )
                if reply[0] != b"BUSY":
                    break
                time.sleep(self.retry.delay(waited + 1))  # an optimistic merge goes first
            else:
                raise TransactionConflictError(self.retry.max_attempts, request_id=rid, key=pub)
            if reply[0] != b"KIND":
                self.stats.server_merges += 1
                if not returning:
                    return {}
                wanted = {label.encode() for label in labels}
                fields = {
                    f: v for f, v in hash_reply(read[0]).items() if f.partition(b"[")[0] in wanted
                }
                decode = self._published.decode
                return MergedInfos(lambda: decode(fields, request_id=rid, key=pub))
            # A label holds another kind, or this kind stored whole: the kind's own update
            # decides, in the optimistic path.
        merged = self._merge_optimistic(rid, name, other, labels, op)
        return merged if returning else {}

    def _merge_optimistic(
        self,
        rid: str,
        name: str,
        other: Mapping[str, PublishedInfo],
        labels: list[str],
        op: str,
    ) -> dict[str, PublishedInfo]:
        meta, part = self.keys.meta(rid), self.keys.partition(rid, name)
        pub, ops = self.keys.publish_info(rid, name), self.keys.ops(rid)
        claim, token = self.keys.merging(rid, name), self._new_op_id()
        claimed = False
        now, window = self._window()

        def on_retry(failed: int) -> None:
            # Server-side merges commit far faster than a read-merge-write round: after a few
            # lost rounds, ask them to wait (for at most _CLAIM_MS) so this one gets through.
            nonlocal claimed
            if failed >= _CLAIM_AFTER:
                claimed = claimed or bool(self.client.set(claim, token, nx=True, px=_CLAIM_MS))

        reads = [
            ("HGETALL", pub),
            ("HGET", part, VERSION_FIELD),
            ("EXISTS", meta),
            ("ZSCORE", ops, op),
        ]

        def body(replies: list[Any]) -> Plan[dict[str, PublishedInfo]]:
            flat, version, request_held, seen = replies
            if version is None:
                if not request_held:
                    raise RequestNotFound("no such request", request_id=rid)
                raise PartitionNotFound(f"no partition {name!r}", request_id=rid, key=part)
            self._check_version(rid, part, version)
            held_fields = hash_reply(flat)
            merged = self._published.decode(held_fields, labels, request_id=rid, key=pub)
            if seen is not None:  # this very merge committed before a lost reply
                return Plan([], merged)
            for label in labels:
                held_info = merged.get(label)
                if held_info is None:
                    merged[label] = other[label]
                    continue
                try:
                    held_info.update(other[label])
                except (TypeError, ValueError) as e:
                    raise ValidationError(
                        f"cannot merge: {e}", request_id=rid, key=pub, field=label
                    ) from e
            fields: dict[str, bytes] = {}
            for label in labels:
                fields.update(self._published.encode(label, merged[label], request_id=rid, key=pub))
            # A label stored whole now that was stored in parts before loses its parts.
            wanted = {label.encode() for label in labels}
            written = {f.encode("utf-8", "surrogateescape") for f in fields}
            stale = [f for f in held_fields if f.partition(b"[")[0] in wanted and f not in written]
            writes: list[tuple[Any, ...]] = [("HSET", pub, *_pairs(fields))]
            if stale:
                writes.append(("HDEL", pub, *stale))
            writes += [
                ("ZADD", ops, now, op),
                ("ZREMRANGEBYSCORE", ops, "-inf", now - window),
            ]
            return Plan(writes, merged)

        def run() -> Outcome[dict[str, PublishedInfo]]:
            return optimistic(
                self.client, [pub, meta], reads, body, self.retry, on_retry,
                request_id=rid, key=pub,
            )  # fmt: skip

        try:
            try:
                outcome = run()
            except RecordOutdated:  # the body wrote nothing: upgrade the partition, merge again
                upgrade_stored(self.client, self.keys, rid, [part], self.retry)
                outcome = run()
        finally:
            if claimed:  # let server-side merges go on (it also lapses by itself)
                with self._redis_errors(rid):
                    self.client.delete(claim)
        self.stats.transactions += 1
        self.stats.attempts += outcome.attempts
        assert outcome.result is not None
        return outcome.result

    # -- leases and recovery ------------------------------------------------------------

    def claim_step(self, request_id: str, partition_name: str, replica_id: str) -> Lease | None:
        """Take over a partition's next step if no live lease covers it; else None.

        Raises the request's fencing token, so every write fenced with an earlier lease is
        rejected from now on. The claimer reads the partition and redoes whatever the old
        driver may not have done (advance, if ``pass_number`` is still the completed pass;
        then send the pass): each of those is safe to repeat.
        """
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        holder = _check_replica_id(replica_id, rid)
        if not holder:
            raise ValidationError("claim_step needs a replica id", request_id=rid)
        now = time.time()
        keys = [self.keys.lease(rid), self.keys.partition(rid, name)]
        try:
            reply = self._run(
                rid, "claim_step", keys, [_VERSION, name, holder, now, self.lease_ttl],
                PartitionNotFound,
            )  # fmt: skip
        except NotFoundError:
            # A recovery entry that outlived its request (scheduled by a replica racing
            # the delete): drop it, or due_steps would return it forever.
            with self._redis_errors(rid):
                self.client.zrem(self.keys.deadlines, _deadline_member(rid, name))
            raise
        if reply[0] != b"OK":
            return None
        lease = Lease(rid, name, holder, int(reply[1]), int(reply[2]), now + self.lease_ttl)
        self._schedule(rid, name, lease.expires_at)
        return lease

    def release_lease(self, lease: Lease, *, check_at: float | None = None) -> None:
        """Record that the lease's step was sent; the lease ends.

        ``check_at`` is when recovery should look at the partition again if no report moves
        it on (the pass deadline); None takes it off the recovery index (partition done).
        Raises ``FencedError`` if the lease was superseded.
        """
        rid = lease.request_id
        keys = [self.keys.lease(rid)]
        self._run(
            rid, "release_lease", keys, [lease.partition, lease.token], RequestNotFound, lease
        )
        if check_at is None:
            with self._redis_errors(rid):
                self.client.zrem(self.keys.deadlines, _deadline_member(rid, lease.partition))
        else:
            self._schedule(rid, lease.partition, check_at)

    def renew_lease(self, lease: Lease, ttl: float | None = None) -> Lease:
        """Extend a lease still held; raises ``FencedError`` if it was superseded."""
        expires = time.time() + (ttl or self.lease_ttl)
        rid = lease.request_id
        self._run(
            rid, "renew_lease", [self.keys.lease(rid)], [lease.partition, lease.token, expires],
            RequestNotFound, lease,
        )  # fmt: skip
        self._schedule(rid, lease.partition, expires)
        return Lease(rid, lease.partition, lease.holder, lease.token, lease.pass_number, expires)

    def schedule_check(self, request_id: str, partition_name: str, at: float) -> None:
        """Ask recovery to look at the partition at ``at`` unless something moves it first."""
        rid = validate_request_id(request_id)
        name = validate_name(partition_name, what="partition name", request_id=rid)
        self._schedule(rid, name, at)

    def due_steps(self, *, now: float | None = None, limit: int = 100) -> list[tuple[str, str]]:
        """(request id, partition) pairs whose check time has passed, oldest first.

        Costs O(log n + returned), read from the recovery index; never a SCAN.
        """
        with self._redis_errors(None):
            members = self.client.zrangebyscore(
                self.keys.deadlines, "-inf", now or time.time(), start=0, num=limit
            )
        out = []
        for member in members:
            rid, _, name = member.decode().partition(" ")
            out.append((rid, name))
        return out

    def leases(self, request_id: str) -> dict[str, Lease]:
        """The live and lapsed leases held on the request's partitions, by partition."""
        rid = validate_request_id(request_id)
        with self._redis_errors(rid):
            raw = self.client.hgetall(self.keys.lease(rid))
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        out = {}
        for field, holder in fields.items():
            if field.startswith("holder[") and field.endswith("]"):
                name = field[7:-1]
                out[name] = Lease(
                    rid,
                    name,
                    holder,
                    int(fields.get(f"token[{name}]", 0)),
                    int(fields.get(f"pass[{name}]", 0)),
                    float(fields.get(f"expires[{name}]", 0)),
                )
        return out

    def finish_request(
        self, request_id: str, *, fence: Lease | None = None, keep_for: float | None = None
    ) -> None:
        """The request is done: delete it, or keep it ``keep_for`` seconds for inspection.

        Either way it leaves the recovery index; a kept request expires by TTL on every key.
        """
        rid = validate_request_id(request_id)
        topology = self._topology(rid)
        if keep_for is None:
            if fence is not None:
                self.release_lease(fence)
            self.delete_request(rid)
        else:
            self._update_fields(
                rid, self.keys.meta(rid), self._record, {"finished_at": time.time()},
                RequestNotFound, fence,
            )  # fmt: skip
            partitions = list(topology.partitions)
            keys = self.keys.request_keys(rid, partitions, list(topology.connections))
            with self._redis_errors(rid):
                pipe = self.client.pipeline(transaction=False)
                for key in keys:
                    pipe.expire(key, max(1, int(keep_for)))
                pipe.execute()
                members = [_deadline_member(rid, p) for p in partitions]
                self.client.zrem(self.keys.deadlines, *members)

    def reap(self, *, max_age: float, limit: int = 1000) -> list[str]:
        """Delete requests created more than ``max_age`` seconds ago (abandoned, or kept
        finished ones whose keys expired) and drop their index entries; returns their ids.
        """
        with self._redis_errors(None):
            old = self.client.zrangebyscore(
                self.keys.index, "-inf", time.time() - max_age, start=0, num=limit
            )
        reaped = []
        for raw in old:
            rid = raw.decode()
            self.delete_request(rid)
            reaped.append(rid)
        return reaped

    # -- internals ------------------------------------------------------------------------

    def _schedule(self, rid: str, partition: str, at: float) -> None:
        with self._redis_errors(rid):
            self.client.zadd(self.keys.deadlines, {_deadline_member(rid, partition): at})

    def _new_op_id(self) -> str:
        """A process-unique id: a random prefix per process (renewed after a fork) and a count."""
        pid = os.getpid()
        if pid != self._op_pid:
            self._op_pid, self._op_prefix = pid, uuid.uuid4().hex
        return f"{self._op_prefix}.{next(self._op_count)}"

    def _window(self) -> tuple[float, float]:
        return time.time(), self.dedupe_window

    @contextmanager
    def _redis_errors(self, rid: str | None, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StoreConnectionError(f"Redis unreachable: {e}", request_id=rid, key=key) from e
        except redis.ResponseError as e:
            raise StoreError(f"Redis refused a command: {e}", request_id=rid, key=key) from e

    def _run(
        self,
        rid: str,
        script: str,
        keys: list[str],
        args: list[Any],
        missing: type[StoreError],
        fence: Lease | None = None,
        *,
        reads: Sequence[tuple[Any, ...]] = (),
        upgraded: bool = False,
    ) -> Any:
        """Run a script; turn its NOKEY, SCHEMA and FENCED statuses into typed errors.

        A record older than the code (SCHEMA) is upgraded in Redis with the other records
        among ``keys``, and the script runs once more. With ``reads``, returns the script's
        reply followed by theirs (run right after it, atomically).
        """
        replies = self._scripts.run(script, keys, args, reads, request_id=rid, key=keys[0])
        reply = replies[0]
        status = reply[0]
        if status == b"NOKEY":
            key = reply[1].decode()
            kind = ConnectionNotFound if ":conn:" in key else missing
            self._raise_not_found(rid, kind, "no such record", key=key)
        if status == b"FENCED":
            token = fence.token if fence else 0
            raise FencedError(token, int(reply[1]), request_id=rid, key=self.keys.lease(rid))
        if status == b"SCHEMA":
            try:
                self._check_version(rid, reply[1].decode(), reply[2])
            except RecordOutdated:
                if upgraded:  # old again right after its upgrade: a writer of older code
                    raise
                # The script stopped before its first write, so running it again is safe.
                upgrade_stored(self.client, self.keys, rid, keys, self.retry)
                return self._run(
                    rid, script, keys, args, missing, fence, reads=reads, upgraded=True
                )
            raise CorruptRecordError(  # a current version reported as outdated
                f"script {script!r} refused schema version {reply[2]!r}", request_id=rid
            )
        return [list(reply), *replies[1:]] if reads else list(reply)

    def _raise_not_found(
        self, rid: str, kind: type[StoreError], message: str, key: str | None = None
    ) -> Any:
        if kind is not RequestNotFound and not self.client.exists(self.keys.meta(rid)):
            kind, message = RequestNotFound, "no such request"
        raise kind(message, request_id=rid, key=key)

    def _check_version(self, rid: str, key: str, raw: bytes | None) -> None:
        """Pass a current record; raise ``RecordOutdated`` for an older one (the caller
        upgrades it in Redis), ``SchemaVersionError`` for a newer one, corrupt otherwise."""
        if raw == _VERSION:
            return
        found = parse_version(raw, request_id=rid, key=key)
        raise RecordOutdated(found, request_id=rid, key=key)

    def _load_hashes(self, rid: str, keys: list[str]) -> list[dict[bytes, bytes]]:
        replies = self._scripts("load_hashes", keys, [], request_id=rid, key=keys[0])
        return [dict(zip(flat[::2], flat[1::2], strict=True)) for flat in replies]

    def _decode_record(self, rid: str, raw: dict[bytes, bytes]) -> RequestRecord:
        key = self.keys.meta(rid)
        raw, _ = to_current(RecordKind.META, raw, request_id=rid, key=key)
        record = self._record.decode(raw, request_id=rid, key=key)
        self._remember(rid, _Topology(tuple(record.partitions), tuple(record.connections)))
        return record

    def _decode_partition(
        self, rid: str, name: str, part: dict[bytes, bytes], pub: dict[bytes, bytes]
    ) -> PartitionState:
        key = self.keys.partition(rid, name)
        if not part:
            raise PartitionNotFound(f"no partition {name!r}", request_id=rid, key=key)
        part, pub = to_current(RecordKind.PARTITION, part, pub, request_id=rid, key=key)
        pub_key = self.keys.publish_info(rid, name)
        infos = self._published.decode(pub, request_id=rid, key=pub_key)
        state = self._partition.decode(
            part, extra={"resource_publish_info": infos}, request_id=rid, key=key
        )
        if state.partition_name != name:
            raise CorruptRecordError(
                f"partition stored as {name!r} is named {state.partition_name!r}",
                request_id=rid,
                key=key,
                field="partition_name",
            )
        return state

    def _decode_connection(
        self, rid: str, name: str, raw: dict[bytes, bytes]
    ) -> StreamingConnectionState:
        key = self.keys.connection(rid, name)
        if not raw:
            raise ConnectionNotFound(f"no connection {name!r}", request_id=rid, key=key)
        raw, _ = to_current(RecordKind.CONNECTION, raw, request_id=rid, key=key)
        return self._connection.decode(raw, request_id=rid, key=key)

    def _encode_infos(
        self, rid: str, key: str, infos: Mapping[str, PublishedInfo]
    ) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for label, info in infos.items():
            check_label(label, request_id=rid, key=key)
            out.update(self._published.encode(label, info, request_id=rid, key=key))
        return out

    def _topology(self, rid: str) -> _Topology:
        topology = self._topologies.get(rid)
        if topology is None:
            topology = self._load_topology(rid)
        return topology

    def _load_topology(self, rid: str) -> _Topology:
        record = self.load_record(rid)
        return _Topology(tuple(record.partitions), tuple(record.connections))

    def _remember(self, rid: str, topology: _Topology) -> None:
        self._topologies[rid] = topology
        self._topologies.move_to_end(rid)
        while len(self._topologies) > self._topology_cache_size:
            self._topologies.popitem(last=False)


def _pairs(fields: Mapping[str, bytes]) -> list[Any]:
    out: list[Any] = []
    for field, value in fields.items():
        out += [field, value]
    return out


def _deadline_member(rid: str, partition: str) -> str:
    # Request ids hold no spaces (validated), so the first space splits the member.
    return f"{rid} {partition}"


def _fence_args(fence: Lease | None) -> list[Any]:
    return [fence.partition, fence.token] if fence else ["", ""]


def _check_replica_id(replica_id: Any, rid: str) -> str:
    if replica_id is None:
        return ""
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= MAX_NAME_LENGTH:
        raise ValidationError(
            f"replica id must be a str of 1 to {MAX_NAME_LENGTH} characters", request_id=rid
        )
    return replica_id


def _check_int(value: Any, what: str, rid: str, *, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValidationError(f"{what} must be an int >= {minimum}, got {value!r}", request_id=rid)
