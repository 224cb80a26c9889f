"""What every operation shares: the store's settings, layouts, scripts and small caches.

``Core`` holds no connection and does no I/O. Its helpers that need Redis (running a
script and turning its status into a typed error, reading hashes, learning a request's
topology) are operations themselves: generators of effects, like every public operation.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from store import scripts as script_files
from store.codec import domains
from store.codec.layout import RecordLayout
from store.codec.published import PublishLayout, check_label
from store.conductor.layout import StoredCache
from store.errors import (
    ConnectionNotFound,
    CorruptRecordError,
    FencedError,
    PartitionNotFound,
    RequestNotFound,
    StoreError,
    ValidationError,
)
from store.keys import KeySpace
from store.migrations import RecordKind
from store.observe import Instruments
from store.ops import damage
from store.ops.calls import (
    BusyWait,
    ScriptCall,
    Scripts,
    Where,
    hash_reply,
    needs_resend,
    raise_error_replies,
    raise_wrong_type,
    script,
    send,
)
from store.ops.effects import Command, Disconnected, ErrorReply, Op, Send, SendMany
from store.ops.settings import Settings, StoreStats
from store.records import Lease, RequestRecord
from store.schema import SCHEMA_VERSION
from store.types import (
    CurrentForwardConductorMetadata,
    PartitionState,
    PublishedInfo,
    StreamingConnectionState,
)
from store.upgrade import RecordOutdated, parse_version, to_current, upgrade_stored

SCRIPT_NAMES = (
    "create_request",
    "finish_request",
    "delete_request",
    "report",
    "step",
    "advance_partition",
    "add_tokens",
    "raise_field",
    "update_fields",
    "claim_step",
    "renew_lease",
    "merge_parts",
    "merge_claim",
    "hint",
    "due_steps",
    "replicas",
    "conductor_write",
    "claim_conductor",
)
VERSION = str(SCHEMA_VERSION).encode()
# Script statuses that refuse and write nothing (the caller raises or retries on them): a
# replicated store does not check their WAIT, so a lagging replica does not turn a refusal
# into a ReplicationTimeoutError that says "applied". A DUP is checked: it confirms (on its
# connection) the first application. Core.run raises NOKEY, FENCED, RANGE, SCHEMA first.
WROTE_NOTHING = frozenset(
    {b"STALE", b"NOWG", b"EXISTS", b"SHAPE", b"BUSY", b"KIND", b"NOTDUE", b"HELD", b"DONE"}
)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """A request's partitions and streaming connections, as created."""

    partitions: tuple[str, ...]
    connections: tuple[str, ...]

    def outgoing(self, partition: str) -> tuple[str, ...]:
        return self._ends[0].get(partition, ())

    def incoming(self, partition: str) -> tuple[str, ...]:
        return self._ends[1].get(partition, ())

    def consumers(self, partition: str) -> list[str]:
        """The partitions ``partition`` streams to."""
        return [conn.split("->", 1)[1] for conn in self.outgoing(partition)]

    @cached_property
    def _ends(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        out: dict[str, tuple[str, ...]] = {}
        into: dict[str, tuple[str, ...]] = {}
        for conn in self.connections:
            source, target = conn.split("->")
            out[source] = (*out.get(source, ()), conn)
            into[target] = (*into.get(target, ()), conn)
        return out, into


class Core:
    """One store's settings, layouts, scripts and caches, shared by its operations."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = KeySpace(settings.namespace)
        self.codec = settings.codec
        self.retry = settings.retry
        self.lease_ttl = settings.lease_ttl
        self.dedupe_window = settings.dedupe_window
        self.reconnect = settings.reconnect
        self.durability = settings.durability
        self.wait = settings.durability.wait_command()  # after each write script, or None
        self.history_cap = str(settings.history_cap)
        self.instruments = settings.instruments or Instruments(settings.namespace)
        self.stats = StoreStats()
        self.partition_layout = RecordLayout(
            PartitionState, self.codec, exclude=("resource_publish_info",)
        )
        self.connection_layout = RecordLayout(StreamingConnectionState, self.codec)
        self.record_layout = RecordLayout(RequestRecord, self.codec)
        self.published = PublishLayout(self.codec)
        self.scripts = Scripts({name: script_files.source(name) for name in SCRIPT_NAMES})
        self.conductor_records = StoredCache()
        self._topologies: OrderedDict[str, Topology] = OrderedDict()
        self._topology_lock = threading.Lock()
        self._op_pid, self._op_prefix, self._op_count = 0, "", itertools.count()
        # How the store reaches Redis (set by the store from its client, for doctor):
        # "standalone", "sentinel" or "cluster", and how errors and findings name it.
        self.deployment = "standalone"
        self.server_name = "the server"
        self.open_check_pending = False  # from_url: look at the eviction policy first

    @property
    def scripts_write_index(self) -> bool:
        """On one server the lease scripts write the recovery index themselves; on a
        cluster it lives in a slot of its own and the store writes it (store/ops/leases.py).
        """
        return self.deployment != "cluster"

    def index_key(self, rid: str) -> str:
        """The key a lease script gets for the recovery index: the index itself where the
        script can reach it, else the request's lease key, which says "leave it to me"."""
        return self.keys.deadlines if self.scripts_write_index else self.keys.lease(rid)

    def take_open_check(self) -> bool:
        """True once, for the first call after ``open_check_pending`` was set."""
        with self._topology_lock:
            pending, self.open_check_pending = self.open_check_pending, False
        return pending

    # -- ids ------------------------------------------------------------------------------

    def new_op_id(self) -> str:
        """A process-unique id: a random prefix per process (renewed after a fork) and a count."""
        pid = os.getpid()
        if pid != self._op_pid:
            self._op_pid, self._op_prefix = pid, uuid.uuid4().hex
        return f"{self._op_prefix}.{next(self._op_count)}"

    # -- sending --------------------------------------------------------------------------

    def send(self, key: str, commands: Sequence[Command], where: Where) -> Op[list[Any]]:
        """``commands`` to ``key``'s server, with this store's reconnect policy; a script
        the server lacks (NOSCRIPT: it restarted or flushed its cache) is loaded and that
        command alone sent again."""
        replies = yield from send(key, commands, where, self.reconnect)
        replies = yield from self._load_missing(key, commands, replies, where)
        raise_wrong_type(commands, replies, where)
        return replies

    def _load_missing(
        self, key: str, commands: Sequence[Command], replies: list[Any], where: Where
    ) -> Op[list[Any]]:
        for i, reply in enumerate(replies):
            for _ in range(2):  # loaded; and without its flag line where the server lacks it
                if not (isinstance(reply, ErrorReply) and reply.kind == "NOSCRIPT") and not (
                    self.scripts.lacks_flags(reply)
                ):
                    break
                (reply,) = yield from send(
                    key, [self.scripts.loaded(commands[i])], where, self.reconnect
                )
                replies[i] = reply
        return replies

    def send_all(self, sends: Sequence[Send], where: Where) -> Op[list[list[Any]]]:
        """Several sends in one round trip (one write per server); a send that met a lost
        connection or a redirect is sent again on its own, as ``send`` would."""
        results = yield SendMany(sends)
        out = []
        for one, replies in zip(sends, results, strict=True):
            if isinstance(replies, Disconnected) or needs_resend(replies):
                replies = yield from self.send(one.key, one.commands, where)
            else:
                replies = yield from self._load_missing(one.key, one.commands, replies, where)
                raise_wrong_type(one.commands, replies, where)
            out.append(replies)
        return out

    def busy_waiting(self, key: str, *, request_id: str) -> BusyWait:
        """How a script that answered BUSY waits for the optimistic merge before it."""
        return BusyWait(self.retry, {"request_id": request_id, "key": key})

    def script(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        where: Where,
        reads: Sequence[Command] = (),
        alongside: Sequence[ScriptCall] = (),
        wait: Command | None = None,
    ) -> Op[list[Any]]:
        return script(self.scripts, name, keys, args, where, reads, self.reconnect, alongside, wait)

    # -- scripts --------------------------------------------------------------------------

    def run(
        self,
        rid: str,
        name: str,
        keys: list[str],
        args: list[Any],
        missing: type[StoreError],
        fence: Lease | None = None,
        *,
        reads: Sequence[Command] = (),
        alongside: Sequence[ScriptCall] = (),
        upgraded: bool = False,
    ) -> Op[Any]:
        """Run a write script; turn its NOKEY, SCHEMA, FENCED and RANGE statuses into typed
        errors, then (replicated durability) too few replicas into ``ReplicationTimeoutError``.

        A record older than the code (SCHEMA) is upgraded in Redis with the other records
        among ``keys``, and the script runs once more. With ``reads``, returns the script's
        reply followed by theirs (run right after it, atomically); ``alongside`` go out
        with the first try (see ``store.ops.calls.script``).
        """
        where = {"request_id": rid, "key": keys[0]}
        try:
            replies = yield from self.script(name, keys, args, where, reads, alongside, self.wait)
        except CorruptRecordError as e:  # the script stopped on damage: find which key
            found = yield from damage.locate(self, rid, keys)
            if found is None:
                raise
            raise found from e
        waited = replies.pop() if self.wait is not None else None
        reply = replies[0]
        status = reply[0]
        if status == b"NOKEY":
            key = reply[1].decode()
            kind = ConnectionNotFound if ":conn:" in key else missing
            yield from self.raise_not_found(rid, kind, "no such record", key=key)
        if status == b"FENCED":
            self.instruments.count("fenced")
            log.info("%s refused for request %s: fenced (current token %s)", name, rid, reply[1])
            lease_key = self.keys.lease(rid)
            current = damage.stored_int(
                reply[1], domains.FENCING_TOKEN, request_id=rid, key=lease_key, field="token"
            )
            if fence is None:  # an unfenced write while a replica drives the partition
                partition = reply[2].decode(errors="replace") if len(reply) > 2 else None
                raise FencedError(0, current, request_id=rid, key=lease_key, partition=partition)
            raise FencedError(fence.token, current, request_id=rid, key=lease_key)
        if status == b"CORRUPT":  # the script found a stored value out of its domain
            raise damage.refused_value(reply[1], request_id=rid, key=keys[0])
        if status == b"RANGE":
            field = reply[1].decode()
            raise ValidationError(
                f"{field} would reach 2**53, beyond what the store counts exactly",
                request_id=rid, key=keys[0], field=field,
            )  # fmt: skip
        if status == b"SCHEMA":
            try:
                self.check_version(rid, reply[1].decode(), reply[2])
            except RecordOutdated:
                if upgraded:  # old again right after its upgrade: a writer of older code
                    raise
                # The script stopped before its first write, so running it again is safe.
                yield from upgrade_stored(
                    self.keys, rid, keys, self.retry, reconnect=self.reconnect
                )
                result = yield from self.run(
                    rid, name, keys, args, missing, fence, reads=reads, upgraded=True
                )  # the hints alongside went out with the first try
                return result
            raise CorruptRecordError(  # a current version reported as outdated
                f"script {name!r} refused schema version {reply[2]!r}", request_id=rid
            )
        if self.wait is not None and status not in WROTE_NOTHING:
            self.durability.check(waited, **where)
        return [list(reply), *replies[1:]] if reads else list(reply)

    def raise_not_found(
        self, rid: str, kind: type[StoreError], message: str, key: str | None = None
    ) -> Op[None]:
        """Raise ``kind``, or ``RequestNotFound`` when the whole request is gone."""
        if kind is not RequestNotFound:
            meta = self.keys.meta(rid)
            (held,) = yield from self.send(meta, [("EXISTS", meta)], {"request_id": rid})
            if not held:
                kind, message = RequestNotFound, "no such request"
        raise kind(message, request_id=rid, key=key)

    def check_version(self, rid: str, key: str, raw: bytes | None) -> None:
        """Pass a current record; raise ``RecordOutdated`` for an older one (the caller
        upgrades it in Redis), ``SchemaVersionError`` for a newer one, corrupt otherwise."""
        if raw == VERSION:
            return
        found = parse_version(raw, request_id=rid, key=key)
        raise RecordOutdated(found, request_id=rid, key=key)

    def load_hashes(self, rid: str, keys: list[str]) -> Op[list[dict[bytes, bytes]]]:
        """The hashes at ``keys`` (one request's) as one consistent snapshot: HGETALLs in
        one MULTI..EXEC, which costs the server less than the same reads inside Lua."""
        where = {"request_id": rid, "key": keys[0]}
        if len(keys) == 1:  # atomic alone; and Redis queues nothing in a MULTI at maxmemory
            replies = yield from self.send(keys[0], [("HGETALL", keys[0])], where)
            raise_error_replies(replies, where)
            return [hash_reply(replies[0])]
        commands: list[Command] = [("MULTI",), *(("HGETALL", k) for k in keys), ("EXEC",)]
        replies = yield from self.send(keys[0], commands, where)
        raise_error_replies(replies, where)
        return [hash_reply(flat) for flat in replies[-1]]

    # -- decoding -------------------------------------------------------------------------

    def decode_record(self, rid: str, raw: dict[bytes, bytes]) -> RequestRecord:
        key = self.keys.meta(rid)
        raw, _ = to_current(RecordKind.META, raw, request_id=rid, key=key)
        record = self.record_layout.decode(raw, request_id=rid, key=key)
        self.remember(rid, Topology(tuple(record.partitions), tuple(record.connections)))
        return record

    def decode_partition(
        self, rid: str, name: str, part: dict[bytes, bytes], pub: dict[bytes, bytes]
    ) -> PartitionState:
        key = self.keys.partition(rid, name)
        if not part:
            raise PartitionNotFound(f"no partition {name!r}", request_id=rid, key=key)
        part, pub = to_current(RecordKind.PARTITION, part, pub, request_id=rid, key=key)
        infos = (  # none: a partition read without them (a consumer), or one without any
            self.published.decode(pub, request_id=rid, key=self.keys.publish_info(rid, name))
            if pub
            else {}
        )
        state = self.partition_layout.decode(
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

    def decode_connection(
        self, rid: str, name: str, raw: dict[bytes, bytes]
    ) -> StreamingConnectionState:
        key = self.keys.connection(rid, name)
        if not raw:
            raise ConnectionNotFound(f"no connection {name!r}", request_id=rid, key=key)
        raw, _ = to_current(RecordKind.CONNECTION, raw, request_id=rid, key=key)
        return self.connection_layout.decode(raw, request_id=rid, key=key)

    def encode_step(
        self, rid: str, key: str, metadata: Any, worker_graph_ids: Sequence[str]
    ) -> tuple[bytes, list[str]]:
        """A step's metadata as its stored field value, and its worker graph ids, checked."""
        if not isinstance(metadata, CurrentForwardConductorMetadata):
            raise ValidationError(
                "metadata must be a CurrentForwardConductorMetadata",
                request_id=rid,
                key=key,
                field="metadata",
            )
        layout = self.partition_layout
        encoded = layout.encode_field("metadata", metadata, request_id=rid, key=key)
        wgs = list(worker_graph_ids)
        for wg in wgs:
            if type(wg) is not str:  # the layout's check says what is wrong
                layout.encode_field("current_worker_graph_ids", set(wgs), request_id=rid, key=key)
        return encoded["metadata"], wgs

    def encode_infos(
        self, rid: str, key: str, infos: Mapping[str, PublishedInfo]
    ) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for label, info in infos.items():
            check_label(label, request_id=rid, key=key)
            out.update(self.published.encode(label, info, request_id=rid, key=key))
        return out

    # -- topologies -----------------------------------------------------------------------

    def cached_topology(self, rid: str) -> Topology | None:
        return self._topologies.get(rid)

    def topology(self, rid: str) -> Op[Topology]:
        """The request's topology, from the cache or read from its record."""
        topology = self._topologies.get(rid)
        if topology is None:
            topology = yield from self.load_topology(rid)
        return topology

    def load_topology(self, rid: str) -> Op[Topology]:
        (raw,) = yield from self.load_hashes(rid, [self.keys.meta(rid)])
        if not raw:
            raise RequestNotFound("no such request", request_id=rid)
        record = self.decode_record(rid, raw)
        return Topology(tuple(record.partitions), tuple(record.connections))

    def remember(self, rid: str, topology: Topology) -> None:
        with self._topology_lock:  # a sync store is shared by threads
            self._topologies[rid] = topology
            self._topologies.move_to_end(rid)
            while len(self._topologies) > self.settings.topology_cache_size:
                self._topologies.popitem(last=False)

    def forget(self, rid: str) -> None:
        with self._topology_lock:
            self._topologies.pop(rid, None)


def window(core: Core) -> tuple[float, float]:
    """(now, dedupe window): how long the scripts remember an applied op id."""
    return time.time(), core.dedupe_window
