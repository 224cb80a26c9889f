"""One exception tree for the store, rooted at ``StoreError``.

Every error carries the context a user needs to find the record (request id, Redis key,
field) as attributes and in its message; the underlying cause is chained.
"""

from __future__ import annotations


class StoreError(Exception):
    """Root of every error the store raises."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        key: str | None = None,
        field: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.key = key
        self.field = field
        where = ", ".join(
            f"{name} {value!r}"
            for name, value in (("request", request_id), ("key", key), ("field", field))
            if value is not None
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.reason = message

    def locate(self, **where: str | None) -> None:
        """Add where the error happened, unless it names a key or field already.

        An error raised deep inside a nested value knows what failed but not which key and
        field held it; the layer that knows adds that before re-raising.
        """
        if self.key is not None or self.field is not None or not any(where.values()):
            return
        self.request_id = where.get("request_id") or self.request_id
        self.key = where.get("key")
        self.field = where.get("field")
        StoreError.__init__(
            self, self.reason, request_id=self.request_id, key=self.key, field=self.field
        )


class ConfigurationError(StoreError):
    """The store was set up with a client or setting it cannot work with."""


class EvictingServerError(ConfigurationError):
    """The Redis server may evict keys (a ``maxmemory-policy`` other than ``noeviction``),
    and with them requests, index entries and the op ids that stop a resend applying twice.
    A replica refuses to ``run`` on it unless built with ``allow_eviction=True``."""

    def __init__(self, message: str, *, policies: list[str]) -> None:
        self.policies = policies
        super().__init__(message)


class ValidationError(StoreError, ValueError):
    """An argument would break the key layout or a limit: nothing was written."""


class PayloadTooLargeError(ValidationError):
    """An encoded value is over the size limit (checked before writing and before decoding)."""

    def __init__(self, size: int, limit: int, **where: str | None) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"payload of {size} bytes is over the limit of {limit} bytes", **where)


class EncodeError(StoreError, TypeError):
    """A value cannot be encoded (an unregistered kind, an unsupported type)."""


class UnknownKindError(EncodeError):
    """A ``PublishedInfo`` or ``ResourceReqConfig`` kind that is not registered."""

    def __init__(self, kind: str, message: str, **where: str | None) -> None:
        self.kind = kind
        super().__init__(message, **where)


class CorruptRecordError(StoreError):
    """A stored value does not decode: truncated, wrong type, garbage or an unknown kind."""


class UnknownStoredKindError(CorruptRecordError):
    """A stored value names a kind this process has not registered."""

    def __init__(self, kind: str, **where: str | None) -> None:
        self.kind = kind
        super().__init__(
            f"stored value has kind {kind!r}, which is not registered in this process; "
            "register it with store.register_kind",
            **where,
        )


class SchemaVersionError(CorruptRecordError):
    """A record was written by newer code than this; it is never silently downgraded."""

    def __init__(self, found: int, known: int, **where: str | None) -> None:
        self.found = found
        self.known = known
        super().__init__(
            f"record has schema version {found}, newer than {known}, the newest this code "
            "knows; upgrade mstar-conductor-store",
            **where,
        )


class NotFoundError(StoreError, LookupError):
    """The record asked for is not held."""


class RequestNotFound(NotFoundError):
    """No request with that id is held."""


class PartitionNotFound(NotFoundError):
    """The request holds no partition of that name."""


class ConnectionNotFound(NotFoundError):
    """The request holds no streaming connection of that name."""


class RequestExistsError(StoreError):
    """A request with that id is held already; create does not overwrite."""


class StalePassError(StoreError):
    """A report or advance names a forward pass that is no longer current; nothing changed."""

    def __init__(self, expected: int, current: int, **where: str | None) -> None:
        self.expected = expected
        self.current = current
        super().__init__(
            f"forward pass {expected} is not current (the partition is at pass {current})",
            **where,
        )


class UnknownWorkerGraphError(ValidationError):
    """A report names a worker graph that is not part of the current forward pass."""


class FencedError(StoreError):
    """The write was refused because another lease drives the step: nothing written.

    A replica that was paused or cut off past its lease's expiry gets this on its next
    fenced write, and must drop the request: another replica drives it now. An unfenced
    write (``token`` 0) gets it while any replica holds a live lease on ``partition``: the
    step is that replica's to change.
    """

    def __init__(
        self, token: int, current: int, *, partition: str | None = None, **where: str | None
    ) -> None:
        self.token = token
        self.current = current
        self.partition = partition
        if token:
            message = f"lease with fencing token {token} was superseded by token {current}"
        else:
            message = (
                f"unfenced write refused: a replica holds a live lease (token {current}) on "
                f"partition {partition!r}; pass fence= with the lease that drives it"
            )
        super().__init__(message, **where)


class TransactionConflictError(StoreError):
    """An optimistic transaction kept meeting concurrent writers and ran out of tries."""

    def __init__(self, attempts: int, **where: str | None) -> None:
        self.attempts = attempts
        super().__init__(
            f"gave up after {attempts} attempts: the keys kept changing under the transaction; "
            "nothing was written",
            **where,
        )


class StoreFullError(StoreError):
    """Redis refused a command because its used memory is over ``maxmemory`` (with the
    policy ``noeviction``, the only one the store runs on): nothing of it was applied.

    Every write is refused whole, and so is a read of several keys at once (Redis queues
    no command of a MULTI at the limit); single-record reads and deletes still run. Raise
    ``maxmemory`` (``CONFIG SET maxmemory``), free memory, or delete finished requests
    (``delete_request``, ``reap``), then send the call again.
    """

    def __init__(self, said: str, **where: str | None) -> None:
        self.said = said
        super().__init__(
            "Redis refused the command, which changed nothing: its used memory is over "
            "maxmemory. Raise maxmemory, free memory, or delete finished requests "
            f"(Redis said: {said})",
            **where,
        )


class StoreConnectionError(StoreError, ConnectionError):
    """Redis could not be reached, or did not answer, within the store's ``Reconnect``
    bound; ``waited`` (seconds) and ``tries`` say what the call did, where it counted."""

    waited: float | None = None
    tries: int | None = None


class ReplicaDrainingError(StoreError):
    """The replica is draining and takes no more reports: deliver this one to another
    replica (nothing of it was applied)."""


class ReplicationTimeoutError(StoreError):
    """A write of a store with ``durability="replicated"`` was applied on the master, but
    fewer replicas than asked for acknowledged it within the wait.

    The write is not undone: it holds on the master and is readable there, and it will
    reach the replicas unless the master fails first (then a promoted replica may not have
    it). Send it again with the same op id to wait once more: the store applies it once.
    """

    def __init__(self, acknowledged: int, wanted: int, wait_ms: int, **where: str | None) -> None:
        self.acknowledged = acknowledged
        self.wanted = wanted
        self.wait_ms = wait_ms
        self.applied = True  # on the master: WAIT runs after the write
        super().__init__(
            f"the write was applied on the master, but {acknowledged} of the {wanted} "
            f"replicas asked for acknowledged it within {wait_ms} ms; a failover now may "
            "lose it: retry with the same op id (applied once) to wait again",
            **where,
        )
