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
delete_request             one script: UNLINK of the request's keys,   idempotent by nature
                           fenced (``force_delete_request``: not)
=========================  ==========================================  ======================

An op id is generated per call unless the caller passes one; a caller that may deliver the
same operation again (after a crash, say) passes a stable id so the repeat is recognised.

The operations themselves live in ``store.ops`` (one module per concern, no I/O); this
class runs them on a redis-py client, ``store.aio.AsyncRequestStore`` on ``redis.asyncio``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from store.backoff import RetryPolicy
from store.codec import Codec
from store.durability import MASTER, Durability, durability_of, split_url
from store.facade import Facade, sync_method
from store.io.connect import client_from_url, close_client, timeouts
from store.io.sync import SyncExecutor
from store.io.wire import describe_client
from store.keys import KeySpace
from store.observe import Instruments
from store.ops import conductor as conductor_ops
from store.ops import deployments, fields, lifecycle, merges, reads, reports, server
from store.ops import leases as lease_ops
from store.ops.calls import DEFAULT_RECONNECT, Reconnect
from store.ops.core import Core
from store.ops.settings import DEFAULT_TOPOLOGY_CACHE_SIZE, SETTING_NAMES, Settings, StoreStats


class StoreSettings(Facade):
    """What both stores expose of their settings (read-only views of ``Core``)."""

    @property
    def keys(self) -> KeySpace:
        """The key layout of this store's namespace."""
        return self._core.keys

    @property
    def codec(self) -> Codec:
        """The codec that encodes and decodes stored values."""
        return self._core.codec

    @property
    def retry(self) -> RetryPolicy:
        """The backoff of optimistic transactions (merges of kinds of your own)."""
        return self._core.retry

    @property
    def lease_ttl(self) -> float:
        """Seconds a lease on a step lasts before recovery may claim it."""
        return self._core.lease_ttl

    @property
    def dedupe_window(self) -> float:
        """Seconds an applied op id is remembered, so that a resend is recognised."""
        return self._core.dedupe_window

    @property
    def durability(self) -> Durability:
        """When a write counts as done: applied on the master (``"master"``, the default),
        or acknowledged by ``replicas`` replicas too (``"replicated"``); see
        ``store.durability``."""
        return self._core.durability

    @property
    def stats(self) -> StoreStats:
        """This store's cumulative counters (retries, conflicts, duplicates, ...)."""
        return self._core.stats


def settings_from(
    namespace: str,
    codec: Codec | None,
    retry: RetryPolicy | None,
    dedupe_window: float,
    lease_ttl: float,
    topology_cache_size: int,
    reconnect: Reconnect | None,
    history_cap: int = 1000,
    instruments: Instruments | None = None,
    durability: Durability = MASTER,
) -> Settings:
    return Settings(
        namespace=namespace,
        codec=codec or Codec(),
        retry=retry or RetryPolicy(),
        dedupe_window=dedupe_window,
        lease_ttl=lease_ttl,
        topology_cache_size=topology_cache_size,
        reconnect=reconnect or DEFAULT_RECONNECT,
        history_cap=history_cap,
        instruments=instruments,
        durability=durability,
    )


def split_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Take the store's own settings out of ``from_url``'s URL query and options (an option
    passed wins over the URL's); the rest go to redis-py, with the connect and read
    timeouts that ``reconnect``'s bound needs, unless given."""
    url, from_query = split_url(url)
    names = (*SETTING_NAMES, "replicas", "wait_ms")
    settings = {**from_query, **{k: options.pop(k) for k in names if k in options}}
    for name, seconds in timeouts(settings.get("reconnect")).items():
        options.setdefault(name, seconds)
    return url, settings


class RequestStore(StoreSettings):
    """The conductor's per-request state on Redis (single server, Sentinel or Cluster).

    ``durability="replicated"`` makes every write that changes a request (create, report,
    step, merge, claim, lease renewal, field write, finish, delete) wait until ``replicas``
    replicas (default 1) acknowledged it, at most ``wait_ms`` milliseconds (default 500):
    ``WAIT`` goes out right after the write, in the same round trip, to the master that
    holds the request. Fewer acknowledgements raise ``ReplicationTimeoutError``: the
    write was applied on the master; a retry with the same op id is applied once and waits
    again. A write so acknowledged survives the master's failover to one of the replicas
    that acknowledged it; in the default ``"master"`` mode a write acknowledged in the
    last moments before the master died may be missing on the promoted replica
    (docs/guarantees.md has the numbers). ``durability`` also takes a ``Durability``.
    """

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "mstar",
        codec: Codec | None = None,
        retry: RetryPolicy | None = None,
        dedupe_window: float = 3600.0,
        lease_ttl: float = 10.0,
        topology_cache_size: int = DEFAULT_TOPOLOGY_CACHE_SIZE,
        reconnect: Reconnect | None = None,
        history_cap: int = 1000,
        instruments: Instruments | None = None,
        durability: str | Durability = "master",
        replicas: int | None = None,
        wait_ms: int | None = None,
    ) -> None:
        self._executor = SyncExecutor(client)
        wanted = durability_of(durability, replicas, wait_ms)
        wanted.check_client(client)
        self._core = Core(
            settings_from(
                namespace,
                codec,
                retry,
                dedupe_window,
                lease_ttl,
                topology_cache_size,
                reconnect,
                history_cap,
                instruments,
                wanted,
            )
        )
        self.client = client
        self._core.deployment, self._core.server_name = describe_client(client)

    @classmethod
    def from_url(cls, url: str, *, namespace: str = "mstar", **options: Any) -> RequestStore:
        """A store on the Redis at ``url`` (see ``store.io.connect`` for the URL forms).

        Its first call also asks the server's ``maxmemory-policy`` (one round trip, once)
        and logs a warning if the server may evict keys; ``check_server`` says more.
        ``reconnect=Reconnect(give_up_after=S)`` bounds how long any call waits on a server
        that does not answer (default 6 s): the client's timeouts are set to fit it. The
        URL's query may set the durability: ``?durability=replicated&replicas=1&wait_ms=500``.
        """
        url, store_options = split_options(url, options)
        store = cls(client_from_url(url, **options), namespace=namespace, **store_options)
        store._core.open_check_pending = True  # warn of an evicting server at the first call
        return store

    def close(self) -> None:
        """Close the client's connections."""
        close_client(self.client)

    def __enter__(self) -> RequestStore:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- create, list, finish, delete
    create_request = sync_method(lifecycle.create_request)
    list_requests = sync_method(lifecycle.list_requests)
    request_exists = sync_method(lifecycle.request_exists)
    delete_request = sync_method(lifecycle.delete_request)
    force_delete_request = sync_method(lifecycle.force_delete_request)
    finish_request = sync_method(lifecycle.finish_request)
    kept_until = sync_method(lifecycle.kept_until)
    reap = sync_method(lifecycle.reap)
    # -- reads
    load_request = sync_method(reads.load_request)
    load_record = sync_method(reads.load_record)
    load_partition = sync_method(reads.load_partition)
    load_partitions = sync_method(reads.load_partitions)
    load_connection = sync_method(reads.load_connection)
    topology = sync_method(reads.topology)
    # -- field writes
    update_partition = sync_method(fields.update_partition)
    set_producer_done = sync_method(fields.set_producer_done)
    set_final_output = sync_method(fields.set_final_output)
    add_tokens = sync_method(fields.add_tokens)
    raise_consumed_count = sync_method(fields.raise_consumed_count)
    # -- the forward pass
    record_worker_report = sync_method(reports.record_worker_report)
    record_worker_reports = sync_method(reports.record_worker_reports)
    advance_partition = sync_method(reports.advance_partition)
    merge_publish_info = sync_method(merges.merge_publish_info)
    # -- leases and recovery
    claim_step = sync_method(lease_ops.claim_step)
    take_step = sync_method(lease_ops.take_step)
    take_steps = sync_method(lease_ops.take_steps)
    release_lease = sync_method(lease_ops.release_lease)
    renew_lease = sync_method(lease_ops.renew_lease)
    schedule_check = sync_method(lease_ops.schedule_check)
    due_steps = sync_method(lease_ops.due_steps)
    leases = sync_method(lease_ops.leases)
    # -- a request as the engine's Conductor keeps it (store.conductor)
    ingest_request = sync_method(conductor_ops.ingest_request)
    apply_worker_graphs_done = sync_method(conductor_ops.apply_worker_graphs_done)
    complete_pass = sync_method(conductor_ops.complete_pass)
    conclude_request = sync_method(conductor_ops.conclude_request)
    apply_conductor_steps = sync_method(conductor_ops.apply_conductor_steps)
    abort_request = sync_method(conductor_ops.abort_request)
    fail_request = sync_method(conductor_ops.fail_request)
    reads_done = sync_method(conductor_ops.reads_done)
    expire_teardown = sync_method(conductor_ops.expire_teardown)
    load_conductor_request = sync_method(conductor_ops.load_conductor_request)
    list_conductor_requests = sync_method(conductor_ops.list_conductor_requests)
    claim_conductor_request = sync_method(conductor_ops.claim_conductor_request)
    save_conductor_request = sync_method(conductor_ops.save_conductor_request)
    drop_conductor_request = sync_method(conductor_ops.drop_conductor_request)
    save_conductor_requests = sync_method(conductor_ops.save_conductor_requests)
    drop_conductor_requests = sync_method(conductor_ops.drop_conductor_requests)
    start_deployment = sync_method(deployments.start_deployment)
    attach_deployment = sync_method(deployments.attach_deployment)
    deployment_epoch = sync_method(deployments.deployment_epoch)
    # -- the server
    check_server = sync_method(server.check_server)
    check_eviction = sync_method(server.check_eviction)
