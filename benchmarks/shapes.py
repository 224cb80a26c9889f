"""The realistic values every scenario measures with: KV shards, partitions, whole requests.

The shapes of issue 5: KV caches with two cache labels on a 4-way tensor-parallel worker
graph. A merge publishes one rank's shard (768/4 page indices per label); the codec measures
a whole partition with 768 page indices per rank.

Imported in the worker processes after their ``sys.path`` is set, so a legacy tree's store
can take these values too: only the domain types and ``RequestStore.create_request`` are used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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
)

HOT = "llm"  # the partition every store operation works on
WORKER_GRAPH = "wg0"
HUGE_RANKS = 1 << 50  # a worker graph that never completes: every report is a new rank
RANKS = 4
CACHE_LABELS = ("decoder", "draft")
SHARD_PAGES_PER_LABEL = 768 // 4
CODEC_PAGES_PER_RANK = 768


def kv_sequence(rng: random.Random, pages: int) -> KVSequenceInfo:
    return KVSequenceInfo(
        seq_len=pages * 16,
        latest_kv_transfer_info={"host": "10.0.3.17", "port": 18515, "engine": "e7", "slot": 3},
        page_indices=rng.sample(range(1, 60_000), pages),
    )


def kv_shard(
    rank: int, pages_per_label: int = SHARD_PAGES_PER_LABEL, seed: int = 0
) -> PublishedKVInfo:
    """What one rank publishes after a forward pass: its pages for each cache label."""
    rng = random.Random(seed * 1000 + rank)
    labels = {label: kv_sequence(rng, pages_per_label) for label in CACHE_LABELS}
    return PublishedKVInfo(info={rank: labels}, world_size=RANKS)


def kv_all_ranks(pages_per_label: int = SHARD_PAGES_PER_LABEL) -> PublishedKVInfo:
    info = PublishedKVInfo(world_size=RANKS)
    for rank in range(RANKS):
        info.update(kv_shard(rank, pages_per_label))
    return info


def positions(step: int, writer: str | None = None) -> PublishedPositionInfo:
    counters = {label: step for label in CACHE_LABELS}
    if writer is not None:
        counters[writer] = step
    return PublishedPositionInfo(counters=counters)


def metadata(step: int = 0) -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(
        graph_walk="decode",
        is_prefill=False,
        input_modalities=["text", "audio"],
        output_modalities=["text"],
        kwargs={"temperature": 0.6, "step": step},
    )


def partition(name: str, infos: dict[str, PublishedInfo] | None = None) -> PartitionState:
    return PartitionState(
        partition_name=name,
        metadata=metadata(),
        fwd_pass_number=0,
        random_seed=1234,
        current_worker_graph_ids={WORKER_GRAPH, "wg1"},
        wg_rank_completions={},
        resource_publish_info=dict(infos or {}),
    )


def codec_partition() -> PartitionState:
    """The codec rows' partition: 4 ranks of KV shards, 768 page indices per rank."""
    kv = kv_all_ranks(CODEC_PAGES_PER_RANK // len(CACHE_LABELS))
    return partition(HOT, {"kv": kv, "position": positions(512)})


@dataclass
class RequestShape:
    """What ``RequestStore.create_request`` takes, for one request."""

    partitions: dict[str, PartitionState]
    connections: dict[str, StreamingConnectionState]
    max_output_tokens: int = 4096
    seed: int = 1234
    resource_configs: dict[str, Any] = field(default_factory=dict)
    partition_definitions: dict[str, Any] = field(default_factory=dict)

    def create(self, store: Any, rid: str) -> None:
        store.create_request(
            rid,
            partitions=self.partitions,
            connections=self.connections,
            max_output_tokens=self.max_output_tokens,
            seed=self.seed,
            resource_configs=self.resource_configs,
            partition_definitions=self.partition_definitions,
        )


def request_shape(*, with_kv: bool) -> RequestShape:
    """Two partitions and one connection; ``with_kv``: as after the first passes of all ranks."""
    llm_infos: dict[str, PublishedInfo] = {}
    codec_infos: dict[str, PublishedInfo] = {}
    if with_kv:
        llm_infos = {"kv": kv_all_ranks(), "position": positions(512)}
        codec_infos = {"position": positions(64)}
    return RequestShape(
        partitions={"llm": partition("llm", llm_infos), "codec": partition("codec", codec_infos)},
        connections={"llm->codec": StreamingConnectionState("llm", "codec", "audio_tokens")},
        resource_configs={"sampler": SamplingReqConfig(_seed=1234)},
        partition_definitions={
            "llm": PartitionDefinition("llm", {"prefill", "decode"}, "prefill"),
            "codec": PartitionDefinition("codec", {"decode"}, "decode", ["llm"]),
        },
    )


# -- the 2-rank forward pass of the fast-path scenarios (the simulation's "tts" model) ----

PASS_WG = "llm-tp2"  # as store/cli/simulate/model.py: an LLM partition, tensor parallel 2
PASS_RANKS = 2
PASS_PAGES = 16  # KV pages each rank publishes per pass
PAGE_SIZE = 16


def rank_kv(rank: int, pages: int = PASS_PAGES) -> PublishedKVInfo:
    """What one rank of the LLM publishes after a pass: its own KV shard."""
    shard = KVSequenceInfo(
        seq_len=pages * PAGE_SIZE,
        latest_kv_transfer_info={"host": "10.0.3.17", "port": 18515, "rank": rank},
        page_indices=[rank * 1000 + page for page in range(pages)],
    )
    return PublishedKVInfo(info={rank: {HOT: shard}}, world_size=PASS_RANKS)


def pass_request() -> RequestShape:
    """A request as the simulation ingests a "tts" one: the LLM (2 ranks) streaming to an
    audio codec (1 rank), a sampler config, and no published info yet."""
    sampling = SamplingReqConfig(temperature=0.7, top_p=0.95)
    sampling.apply_conductor_config(seed=1234)
    prefill = CurrentForwardConductorMetadata(graph_walk="prefill", is_prefill=True)
    llm = PartitionState(HOT, prefill, random_seed=1234, current_worker_graph_ids={PASS_WG})
    codec = PartitionState(
        "codec",
        CurrentForwardConductorMetadata(graph_walk="audio_decode", is_prefill=False),
        random_seed=1234,
        current_worker_graph_ids={"codec-wg"},
    )
    return RequestShape(
        partitions={HOT: llm, "codec": codec},
        connections={"llm->codec": StreamingConnectionState(HOT, "codec", "llm->codec")},
        max_output_tokens=4096,
        resource_configs={"sampler": sampling},
        partition_definitions={
            HOT: PartitionDefinition(HOT, {"prefill", "decode"}, "prefill"),
            "codec": PartitionDefinition("codec", {"audio_decode"}, "audio_decode", [HOT]),
        },
    )


def naive_request(rid: str) -> dict[str, Any]:
    """The naive design's value: the whole request as one picklable dict."""
    shape = request_shape(with_kv=True)
    return {
        "request_id": rid,
        "max_output_tokens": shape.max_output_tokens,
        "seed": shape.seed,
        "partitions": shape.partitions,
        "connections": shape.connections,
        "resource_configs": shape.resource_configs,
        "merges": 0,
    }
