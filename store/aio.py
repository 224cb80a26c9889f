"""``AsyncRequestStore``: the ``RequestStore`` contract on ``redis.asyncio``, awaited.

Every method is the same operation of ``store.ops`` as the sync store's, run by the asyncio
executor: same name, arguments, results and errors. Many tasks may call one store at once;
each call takes its own pooled connection for its round trip.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from store.backoff import RetryPolicy
from store.codec import Codec
from store.durability import Durability, durability_of
from store.facade import async_method
from store.io.aio import AsyncExecutor
from store.io.connect import aclose_client, async_client_from_url
from store.io.wire import describe_client
from store.observe import Instruments
from store.ops import conductor as conductor_ops
from store.ops import deployments, fields, lifecycle, merges, reads, reports, server
from store.ops import leases as lease_ops
from store.ops.calls import Reconnect
from store.ops.core import Core
from store.ops.settings import DEFAULT_TOPOLOGY_CACHE_SIZE
from store.store import StoreSettings, settings_from, split_options


class AsyncRequestStore(StoreSettings):
    """The conductor's per-request state on Redis, for asyncio programs.

    ``client`` is a ``redis.asyncio.Redis`` (or its Sentinel master, or a
    ``redis.asyncio.cluster.RedisCluster``) with bytes replies. ``async with`` closes it.
    ``durability``, ``replicas`` and ``wait_ms``: as for ``RequestStore``.
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
        self._executor = AsyncExecutor(client)
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
    def from_url(cls, url: str, *, namespace: str = "mstar", **options: Any) -> AsyncRequestStore:
        """A store on the Redis at ``url`` (the URL forms of ``RequestStore.from_url``)."""
        url, store_options = split_options(url, options)
        client = async_client_from_url(url, **options)
        store = cls(client, namespace=namespace, **store_options)
        store._core.open_check_pending = True  # see RequestStore.from_url
        return store

    async def aclose(self) -> None:
        """Close the client's connections."""
        await aclose_client(self.client)

    async def __aenter__(self) -> AsyncRequestStore:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- create, list, finish, delete
    create_request = async_method(lifecycle.create_request)
    list_requests = async_method(lifecycle.list_requests)
    request_exists = async_method(lifecycle.request_exists)
    delete_request = async_method(lifecycle.delete_request)
    force_delete_request = async_method(lifecycle.force_delete_request)
    finish_request = async_method(lifecycle.finish_request)
    kept_until = async_method(lifecycle.kept_until)
    reap = async_method(lifecycle.reap)
    # -- reads
    load_request = async_method(reads.load_request)
    load_record = async_method(reads.load_record)
    load_partition = async_method(reads.load_partition)
    load_partitions = async_method(reads.load_partitions)
    load_connection = async_method(reads.load_connection)
    topology = async_method(reads.topology)
    # -- field writes
    update_partition = async_method(fields.update_partition)
    set_producer_done = async_method(fields.set_producer_done)
    set_final_output = async_method(fields.set_final_output)
    add_tokens = async_method(fields.add_tokens)
    raise_consumed_count = async_method(fields.raise_consumed_count)
    # -- the forward pass
    record_worker_report = async_method(reports.record_worker_report)
    record_worker_reports = async_method(reports.record_worker_reports)
    advance_partition = async_method(reports.advance_partition)
    merge_publish_info = async_method(merges.merge_publish_info)
    # -- leases and recovery
    claim_step = async_method(lease_ops.claim_step)
    take_step = async_method(lease_ops.take_step)
    take_steps = async_method(lease_ops.take_steps)
    release_lease = async_method(lease_ops.release_lease)
    renew_lease = async_method(lease_ops.renew_lease)
    schedule_check = async_method(lease_ops.schedule_check)
    due_steps = async_method(lease_ops.due_steps)
    leases = async_method(lease_ops.leases)
    # -- a request as the engine's Conductor keeps it (store.conductor)
    ingest_request = async_method(conductor_ops.ingest_request)
    apply_worker_graphs_done = async_method(conductor_ops.apply_worker_graphs_done)
    complete_pass = async_method(conductor_ops.complete_pass)
    conclude_request = async_method(conductor_ops.conclude_request)
    apply_conductor_steps = async_method(conductor_ops.apply_conductor_steps)
    abort_request = async_method(conductor_ops.abort_request)
    fail_request = async_method(conductor_ops.fail_request)
    reads_done = async_method(conductor_ops.reads_done)
    expire_teardown = async_method(conductor_ops.expire_teardown)
    load_conductor_request = async_method(conductor_ops.load_conductor_request)
    list_conductor_requests = async_method(conductor_ops.list_conductor_requests)
    claim_conductor_request = async_method(conductor_ops.claim_conductor_request)
    save_conductor_request = async_method(conductor_ops.save_conductor_request)
    drop_conductor_request = async_method(conductor_ops.drop_conductor_request)
    save_conductor_requests = async_method(conductor_ops.save_conductor_requests)
    drop_conductor_requests = async_method(conductor_ops.drop_conductor_requests)
    start_deployment = async_method(deployments.start_deployment)
    attach_deployment = async_method(deployments.attach_deployment)
    deployment_epoch = async_method(deployments.deployment_epoch)
    # -- the server
    check_server = async_method(server.check_server)
    check_eviction = async_method(server.check_eviction)
