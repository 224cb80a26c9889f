"""Hypothesis strategies for every stored type, and user kinds registered outside the store.

Values stay in what the store promises to keep exactly: numbers of the store's own types in
their domains (``store/codec/domains.py``: counts and pass numbers from 0 to below 2**53,
which Lua compares exactly), other integers in the signed 64-bit range (what Redis counts
with), floats without NaN (NaN != NaN would make equality meaningless), and plain data fields
(``kwargs``, ``step_metadata``, ``latest_kv_transfer_info``) JSON-like: no tuples (MessagePack
has one array type, so a tuple comes back a list) and str map keys.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from store.codec.kinds import KindRegistry
from store.types import (
    CurrentForwardConductorMetadata,
    CurrentForwardPassInfo,
    KVSequenceInfo,
    NestedLoopIndices,
    PartitionDefinition,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    ResourceReqConfig,
    SamplingReqConfig,
    StreamingConnectionState,
)

# Pure codec properties are cheap; store properties pay round trips on two backends.
CODEC_SETTINGS = settings(max_examples=75, deadline=None, database=None)
STORE_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- user kinds: what a resource outside this project would register -----------------------


@dataclass
class ScoreInfo(PublishedInfo):
    """A user kind with a set, floats and an optional field."""

    scores: dict[str, float] = field(default_factory=dict)
    tags: set[str] = field(default_factory=set)
    note: str | None = None

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, ScoreInfo)
        self.scores.update(other.scores)
        self.tags |= other.tags


@dataclass
class BundleInfo(PublishedInfo):
    """A user kind that holds other published infos of any kind."""

    primary: PublishedInfo
    extras: dict[str, PublishedInfo] = field(default_factory=dict)
    fallback: PublishedInfo | None = None
    history: list[PublishedInfo] = field(default_factory=list)

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, BundleInfo)
        self.extras.update(other.extras)


@dataclass
class SumInfo(PublishedInfo):
    """Not idempotent: merging the same info twice is visible in ``total``."""

    total: int = 0

    def update(self, other: PublishedInfo) -> None:
        assert isinstance(other, SumInfo)
        self.total += other.total


@dataclass
class BeamConfig(ResourceReqConfig):
    """A user ``ResourceReqConfig`` kind."""

    width: int = 1
    lengths: dict[int, float] = field(default_factory=dict)


def user_registry() -> KindRegistry:
    """A fresh registry with the built-in kinds and the user kinds above.

    A fresh one per use, so the process-wide default registry never learns test kinds.
    """
    registry = KindRegistry()
    registry.register(PublishedKVInfo, "kv")
    registry.register(PublishedPositionInfo, "position")
    registry.register(SamplingReqConfig, "sampling")
    registry.register(ScoreInfo, "test.score")
    registry.register(BundleInfo, "test.bundle")
    registry.register(SumInfo, "test.sum")
    registry.register(BeamConfig, "test.beam")
    return registry


# -- scalars ----------------------------------------------------------------------------

int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
counts = st.integers(min_value=0, max_value=2**31)
# The domains of store/codec/domains.py.
lua_counts = st.integers(min_value=0, max_value=2**53 - 1)  # passes, tokens, positions
non_negative64 = st.integers(min_value=0, max_value=2**63 - 1)  # KV ranks, sequence lengths
times = st.floats(min_value=0, max_value=2**53, exclude_max=True)
floats = st.floats(allow_nan=False)
text = st.text(max_size=12)
# Resource labels name publish-info hash fields "<label>[<part>]" (store/published.py),
# so they hold no '[' and do not start with '_' (the store's own prefix).
labels = st.text(min_size=1, max_size=12).filter(lambda s: "[" not in s and s[0] != "_")
# Partition names fit the key layout: letters, digits, '_', '.', '-' and no '->'.
names = st.text(
    alphabet=string.ascii_letters + string.digits + "_.-", min_size=1, max_size=12
).filter(lambda s: "->" not in s)

json_like: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | int64 | floats | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
json_dicts = st.dictionaries(text, json_like, max_size=3)

# -- domain types -------------------------------------------------------------------------

metadata = st.builds(
    CurrentForwardConductorMetadata,
    graph_walk=text,
    is_prefill=st.booleans(),
    input_modalities=st.lists(text, max_size=3),
    output_modalities=st.lists(text, max_size=3),
    kwargs=json_dicts,
)

kv_sequence = st.builds(
    KVSequenceInfo,
    seq_len=non_negative64,
    latest_kv_transfer_info=json_like,
    page_indices=st.lists(int64, max_size=5),
)

kv_info = st.builds(
    PublishedKVInfo,
    info=st.dictionaries(
        non_negative64, st.dictionaries(text, kv_sequence, max_size=2), max_size=3
    ),
    world_size=lua_counts,
)

position_info = st.builds(
    PublishedPositionInfo, counters=st.dictionaries(text, lua_counts, max_size=4)
)

sampling_config = st.builds(
    SamplingReqConfig,
    temperature=floats,
    top_k=int64,
    top_p=floats,
    ignore_eos=st.booleans(),
    repetition_penalty=floats,
    _seed=int64,
)

score_info = st.builds(
    ScoreInfo,
    scores=st.dictionaries(text, floats, max_size=3),
    tags=st.sets(text, max_size=3),
    note=st.none() | text,
)

sum_info = st.builds(SumInfo, total=int64)

beam_config = st.builds(BeamConfig, width=int64, lengths=st.dictionaries(int64, floats, max_size=3))

builtin_infos: st.SearchStrategy[PublishedInfo] = kv_info | position_info
flat_user_infos: st.SearchStrategy[PublishedInfo] = builtin_infos | score_info | sum_info
bundle_info = st.builds(
    BundleInfo,
    primary=flat_user_infos,
    extras=st.dictionaries(text, flat_user_infos, max_size=2),
    fallback=st.none() | flat_user_infos,
    history=st.lists(flat_user_infos, max_size=2),
)
# Every kind of ``user_registry()``, nesting included.
user_infos: st.SearchStrategy[PublishedInfo] = flat_user_infos | bundle_info
user_configs: st.SearchStrategy[ResourceReqConfig] = sampling_config | beam_config

loop_indices = st.builds(
    NestedLoopIndices,
    loop_name_order=st.lists(text, max_size=3),
    loop_indices=st.dictionaries(text, int64, max_size=3),
    wg_fwd_pass_idx=int64,
)


def forward_pass_infos(
    infos: st.SearchStrategy[PublishedInfo] = builtin_infos,
    configs: st.SearchStrategy[ResourceReqConfig] = sampling_config,
) -> st.SearchStrategy[CurrentForwardPassInfo]:
    return st.builds(
        CurrentForwardPassInfo,
        request_id=text,
        graph_walk=text,
        fwd_index=int64,
        random_seed=int64,
        max_tokens=int64,
        resource_configs=st.dictionaries(text, configs, max_size=3),
        step_metadata=json_dicts,
        resource_publish_info=st.dictionaries(text, infos, max_size=4),
        partition_name=text,
        loop_stop_times=st.dictionaries(text, loop_indices, max_size=3),
        dynamic_loop_iter_counts=st.dictionaries(text, int64, max_size=3),
    )


partition_definitions = st.builds(
    PartitionDefinition,
    name=names,
    graph_walks=st.sets(text, max_size=4),
    initial_walk=st.none() | text,
    producer_partitions=st.lists(names, max_size=3),
)


def partition_states(
    name: st.SearchStrategy[str] = names,
    infos: st.SearchStrategy[PublishedInfo] = builtin_infos,
) -> st.SearchStrategy[PartitionState]:
    return st.builds(
        PartitionState,
        partition_name=name,
        metadata=metadata,
        fwd_pass_number=lua_counts,
        random_seed=st.integers(-(2**63), 2**63 - 2**53 - 1),
        is_done=st.booleans(),
        completed_worker_graph_ids=st.sets(text, max_size=3),
        current_worker_graph_ids=st.sets(text, max_size=3),
        wg_rank_completions=st.dictionaries(text, lua_counts, max_size=3),
        num_output_tokens=lua_counts,
        curr_forward_outputs=st.lists(text, max_size=4),
        resource_publish_info=st.dictionaries(labels, infos, max_size=3),
    )


def connection_states(
    from_partition: st.SearchStrategy[str] = names, to_partition: st.SearchStrategy[str] = names
) -> st.SearchStrategy[StreamingConnectionState]:
    return st.builds(
        StreamingConnectionState,
        from_partition=from_partition,
        to_partition=to_partition,
        edge_name=text,
        token_count=lua_counts,
        consumed_count=lua_counts,
        producer_done=st.booleans(),
    )
