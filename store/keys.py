"""The key layout, defined in one place.

Every key of one request carries the hash tag ``{<request_id>}``, so all of a request's keys
sit in one Redis Cluster slot and every multi-key script or transaction on a request is legal
on a cluster. Only the request index lives outside any request's slot.

    <ns>:requests                         sorted set: request id -> creation time (index)
    <ns>:deadlines                        sorted set: "<rid> <partition>" -> when to look
                                          at it if nothing happens (recovery index:
                                          equal to the check time the request's lease
                                          hash holds, which decides, on one server;
                                          never later than it on a cluster)
    <ns>:finished                         sorted set: request id -> when its keys expire
                                          (finished and kept with a TTL; reap drops both
                                          its entries once that time has passed)
    <ns>:replicas                         sorted set: replica id -> last heartbeat
    <ns>:replica:<replica_id>             hash, expires a few heartbeats after the last:
                                          the replica's cumulative counters, leases held,
                                          requests in flight (``store.stats``)
    <ns>:stats:<epoch minute>             hash, expires after 15 minutes: counter -> events
                                          in that minute, from every replica's heartbeat
    <ns>:{<rid>}:meta                     hash: request-level record (RequestRecord)
    <ns>:{<rid>}:part:<partition>         hash: PartitionState, one field per attribute
    <ns>:{<rid>}:pub:<partition>          hash: resource label -> encoded PublishedInfo
    <ns>:{<rid>}:merging:<partition>      string, short-lived: an optimistic merge that kept
                                          losing asks server-side merges to wait
    <ns>:{<rid>}:merging-queue:<partition>
                                          hash, short-lived: the optimistic merges waiting
                                          for that claim, served in turn
    <ns>:{<rid>}:conn:<from>-><to>        hash: StreamingConnectionState
    <ns>:{<rid>}:ops                      sorted set: applied operation id -> time (dedupe)
    <ns>:{<rid>}:lease                    hash: fencing token, and per partition the lease
                                          on its next step (holder, token, expiry, pass),
                                          its check time and its sends (store/scripts)
    <ns>:{<rid>}:history                  stream, capped: the request's timeline, one entry
                                          per operation (``mstar-store history``)

A history entry's stream id is the time it was written (milliseconds); its fields, each
missing when it does not apply:

    op         the operation: report, merge, advance, step, claim, release, renew, create,
               finish, delete
    partition  the partition it was about
    pass       the forward pass number
    rank       the worker-graph rank (a report)
    wg         the worker graph id (a report)
    replica    the replica that sent it
    outcome    applied, duplicate, stale, fenced or refused
    detail     free text: why it was refused, what changed
    token      the fencing token it ran under, or a claim raised the request's to
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from store.errors import ValidationError

MAX_REQUEST_ID_LENGTH = 200
MAX_NAME_LENGTH = 128
CONNECTION_ARROW = "->"

# Printable ASCII without space and without the braces that delimit the hash tag.
_REQUEST_ID = re.compile(r"[!-z|~]+")
# Partition names end up inside keys and connection names: no separators, no arrow.
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-:]+")
INDEX_SUFFIX = ":requests"  # a namespace's request index: <ns>:requests


def namespace_of_index(key: str) -> str | None:
    """The namespace whose request index ``key`` is; None for any other key."""
    namespace = key.removesuffix(INDEX_SUFFIX)
    if namespace == key or not _NAMESPACE.fullmatch(namespace):
        return None
    return namespace


def validate_request_id(request_id: object) -> str:
    """Return ``request_id`` if it fits the key layout, else raise ``ValidationError``."""
    if not isinstance(request_id, str):
        raise ValidationError(f"request id must be a str, not {type(request_id).__name__}")
    if not request_id:
        raise ValidationError("request id is empty")
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise ValidationError(
            f"request id is {len(request_id)} characters, over the limit of "
            f"{MAX_REQUEST_ID_LENGTH}",
            request_id=request_id[:40] + "...",
        )
    if not _REQUEST_ID.fullmatch(request_id):
        raise ValidationError(
            "request id may hold only printable ASCII without spaces, '{' or '}' "
            "(the braces delimit the Redis Cluster hash tag)",
            request_id=request_id,
        )
    return request_id


def validate_name(name: object, *, what: str, request_id: str | None = None) -> str:
    """Return a partition name if it fits the key layout, else raise ``ValidationError``."""
    if not isinstance(name, str):
        raise ValidationError(
            f"{what} must be a str, not {type(name).__name__}", request_id=request_id
        )
    if not name:
        raise ValidationError(f"{what} is empty", request_id=request_id)
    if len(name) > MAX_NAME_LENGTH:
        raise ValidationError(
            f"{what} is {len(name)} characters, over the limit of {MAX_NAME_LENGTH}",
            request_id=request_id,
        )
    if not _NAME.fullmatch(name) or CONNECTION_ARROW in name:
        raise ValidationError(
            f"{what} {name!r} may hold only letters, digits, '_', '.' and '-' (and no '->')",
            request_id=request_id,
        )
    return name


def connection_name(from_partition: str, to_partition: str) -> str:
    return f"{from_partition}{CONNECTION_ARROW}{to_partition}"


def split_connection_name(name: object, *, request_id: str | None = None) -> tuple[str, str]:
    """``"llm->codec"`` -> ``("llm", "codec")``, validating both partition names."""
    if not isinstance(name, str) or name.count(CONNECTION_ARROW) != 1:
        raise ValidationError(
            f"connection name {name!r} must be '<from_partition>-><to_partition>'",
            request_id=request_id,
        )
    source, target = name.split(CONNECTION_ARROW)
    return (
        validate_name(source, what="connection source partition", request_id=request_id),
        validate_name(target, what="connection target partition", request_id=request_id),
    )


@dataclass(frozen=True)
class KeySpace:
    """Builds every key of one namespace."""

    namespace: str = "mstar"

    def __post_init__(self) -> None:
        if (
            not isinstance(self.namespace, str)
            or not _NAMESPACE.fullmatch(self.namespace)
            or len(self.namespace) > MAX_NAME_LENGTH
        ):
            raise ValidationError(
                f"namespace {self.namespace!r} may hold only letters, digits, '_', '.', '-' "
                f"and ':' (at most {MAX_NAME_LENGTH})"
            )

    @property
    def index(self) -> str:
        """``<ns>:requests``: the request index (request id -> creation time)."""
        return f"{self.namespace}{INDEX_SUFFIX}"

    @property
    def deadlines(self) -> str:
        """``<ns>:deadlines``: the recovery index (``"<rid> <partition>"`` -> check time)."""
        return f"{self.namespace}:deadlines"

    @property
    def finished(self) -> str:
        """``<ns>:finished``: finished requests kept with a TTL (request id -> expiry)."""
        return f"{self.namespace}:finished"

    @property
    def replicas(self) -> str:
        """``<ns>:replicas``: live replicas (replica id -> last heartbeat)."""
        return f"{self.namespace}:replicas"

    def replica_stats(self, replica_id: str) -> str:
        """``<ns>:replica:<replica_id>``: one replica's counters, leases and requests."""
        return f"{self.namespace}:replica:{replica_id}"

    def stats_bucket(self, minute: int) -> str:
        """The counters of one epoch minute (``int(time // 60)``)."""
        return f"{self.namespace}:stats:{minute}"

    def request_prefix(self, request_id: str) -> str:
        """``<ns>:{<rid>}:``, the start of every key of one request (the hash tag)."""
        return f"{self.namespace}:{{{request_id}}}:"

    def meta(self, request_id: str) -> str:
        """``<ns>:{<rid>}:meta``: the request-level record (``RequestRecord``)."""
        return f"{self.request_prefix(request_id)}meta"

    def partition(self, request_id: str, partition: str) -> str:
        """``<ns>:{<rid>}:part:<partition>``: one ``PartitionState``."""
        return f"{self.request_prefix(request_id)}part:{partition}"

    def publish_info(self, request_id: str, partition: str) -> str:
        """``<ns>:{<rid>}:pub:<partition>``: resource label -> published info."""
        return f"{self.request_prefix(request_id)}pub:{partition}"

    def connection(self, request_id: str, name: str) -> str:
        """``<ns>:{<rid>}:conn:<from>-><to>``: one ``StreamingConnectionState``."""
        return f"{self.request_prefix(request_id)}conn:{name}"

    def ops(self, request_id: str) -> str:
        """``<ns>:{<rid>}:ops``: applied operation ids -> time (dedupe)."""
        return f"{self.request_prefix(request_id)}ops"

    def merging(self, request_id: str, partition: str) -> str:
        """``<ns>:{<rid>}:merging:<partition>``: the short-lived merging claim."""
        return f"{self.request_prefix(request_id)}merging:{partition}"

    def merging_queue(self, request_id: str, partition: str) -> str:
        """``<ns>:{<rid>}:merging-queue:<partition>``: merges waiting for that claim."""
        return f"{self.request_prefix(request_id)}merging-queue:{partition}"

    def lease(self, request_id: str) -> str:
        """``<ns>:{<rid>}:lease``: the fencing token and each partition's lease."""
        return f"{self.request_prefix(request_id)}lease"

    def conductor(self, request_id: str) -> str:
        """``<ns>:{<rid>}:conductor``: the request as the engine's Conductor keeps it
        (``store.conductor``)."""
        return f"{self.request_prefix(request_id)}conductor"

    @property
    def conductor_index(self) -> str:
        """``<ns>:conductor-requests``: requests held as the engine's Conductor keeps them
        (request id -> ingest time, by the caller's clock)."""
        return f"{self.namespace}:conductor-requests"

    def history(self, request_id: str) -> str:
        """``<ns>:{<rid>}:history``: the request's capped timeline (a stream)."""
        return f"{self.request_prefix(request_id)}history"

    def redis_type(self, key: str) -> str:
        """The Redis type the store keeps at ``key`` (one of a request's, or an index), as
        ``TYPE`` names it."""
        tail = key.rsplit("}:", 1)[-1] if "}:" in key else key[len(self.namespace) + 1 :]
        if tail.startswith("merging:"):
            return "string"
        if tail in ("ops", "requests", "deadlines", "finished", "replicas", "conductor-requests"):
            return "zset"
        if tail == "history":
            return "stream"
        return "hash"

    def request_keys(
        self, request_id: str, partitions: list[str], connections: list[str]
    ) -> list[str]:
        """Every key a request with this topology may hold."""
        keys = [
            self.meta(request_id),
            self.lease(request_id),
            self.history(request_id),
            self.ops(request_id),
            self.conductor(request_id),
        ]
        for name in partitions:
            keys += [
                self.partition(request_id, name),
                self.publish_info(request_id, name),
                self.merging(request_id, name),
                self.merging_queue(request_id, name),
            ]
        keys += [self.connection(request_id, name) for name in connections]
        return keys
