"""The engine's own values round-trip through the store as their classes, with ``==``.

These run with whichever types ``store.types`` gives: the bundled copy in the core suite,
mstar-ai's classes in the engine job (``.ci/engine``), where the same values are the real
ones. Nothing here registers a kind: the engine's kinds are known by default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import redis

from store import RequestStore
from store.types import (
    SOURCE,
    CudaIpcKVTransferInfo,
    CurrentForwardConductorMetadata,
    KVLayout,
    KVReqConfig,
    KVSequenceInfo,
    MooncakeKVTransferInfo,
    NestedLoopIndices,
    PartitionDefinition,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    TensorPointerInfo,
    engine_importable,
    merge_publish_info,
)
from tests import backends
from tests.engine.read_back import canonical

MOONCAKE = MooncakeKVTransferInfo("worker-3", "host:18515", 0x7F00_0000_1000, KVLayout.NHD)
CUDA_IPC = CudaIpcKVTransferInfo(
    cuda_share=(0, b"\x01handle", 4096, 0, b"\x02ref", 16, b"\x03event", True),
    size=(2, 16, 8, 64),
    stride=(8192, 512, 64, 1),
    offset=0,
    dtype="torch.bfloat16",
    requires_grad=False,
    layout=KVLayout.NHD,
)
LOOPS = NestedLoopIndices(["frames", "codes"], {"frames": 3, "codes": 1}, wg_fwd_pass_idx=7)
POINTER = TensorPointerInfo([2, 8], "torch.float16", 32, 0xDEAD, [8, 1], "u-1", "host:1", "w0")
PREFILL = CurrentForwardConductorMetadata(
    "prefill", True, ["text"], ["audio"], {"stop": LOOPS, "window": (4, 8), "layout": KVLayout.NHD}
)


def _store(client: redis.Redis, namespace: str) -> RequestStore:
    return RequestStore(client, namespace=namespace)


def create_engine_request(store: RequestStore, rid: str) -> None:
    """A request whose configs and metadata hold the engine's own classes."""
    sampling = SamplingReqConfig(temperature=0.3, top_k=40)
    sampling.apply_conductor_config(seed=1234)
    kv_config = KVReqConfig(
        needed_labels=["main"],
        needed_labels_per_node={"llm": ["main", "draft"]},
        needed_labels_per_node_walk={("llm", "decode"): ["main"], ("codec", "prefill"): []},
    )
    store.create_request(
        rid,
        partitions={"llm": PartitionState("llm", PREFILL, random_seed=1234)},
        max_output_tokens=64,
        seed=1234,
        resource_configs={"sampler": sampling, "kv": kv_config},
        partition_definitions={"llm": PartitionDefinition("llm", {"prefill", "decode"}, "prefill")},
    )


def test_configs_metadata_and_definitions_keep_their_classes(
    client: redis.Redis, namespace: str
) -> None:
    store = _store(client, namespace)
    create_engine_request(store, "r1")
    record = store.load_record("r1")
    sampling, kv_config = record.resource_configs["sampler"], record.resource_configs["kv"]
    assert type(sampling) is SamplingReqConfig and sampling.seed == 1234
    assert type(kv_config) is KVReqConfig
    assert kv_config.get_labels("llm", "decode") == ["main"]
    assert kv_config.get_labels("codec", "prefill") == []
    assert kv_config.get_labels("llm", "prefill") == ["main", "draft"]
    assert kv_config.get_labels("other", "x") == ["main"]
    assert record.partition_definitions["llm"] == PartitionDefinition(
        "llm", {"prefill", "decode"}, "prefill"
    )
    metadata = store.load_partition("r1", "llm").metadata
    assert metadata == PREFILL
    assert type(metadata.kwargs["stop"]) is NestedLoopIndices
    assert type(metadata.kwargs["window"]) is tuple
    assert metadata.kwargs["layout"] is KVLayout.NHD


@pytest.mark.parametrize("transfer", [MOONCAKE, CUDA_IPC, None, {"host": "h"}], ids=repr)
def test_kv_transfer_descriptors_keep_their_classes(
    client: redis.Redis, namespace: str, transfer: Any
) -> None:
    store = _store(client, namespace)
    create_engine_request(store, "r1")
    sequences = {"main": KVSequenceInfo(17, transfer, [3, 4]), "draft": KVSequenceInfo(2, None)}
    published = PublishedKVInfo.build_for_rank(0, 2, sequences)
    merged = store.merge_publish_info("r1", "llm", {"kv": published})
    for held in (merged["kv"], store.load_partition("r1", "llm").resource_publish_info["kv"]):
        assert held == PublishedKVInfo({0: sequences}, world_size=2)
        read = held.get(0)["main"].latest_kv_transfer_info
        assert read == transfer and type(read) is type(transfer)


def test_final_outputs_hold_loop_indices_and_pointers(client: redis.Redis, namespace: str) -> None:
    store = _store(client, namespace)
    create_engine_request(store, "r1")
    store.set_final_output("r1", "audio", LOOPS)
    store.set_final_output("r1", "signals", [POINTER, (1, "two")])
    outputs = store.load_record("r1").final_outputs
    assert outputs == {"audio": LOOPS, "signals": [POINTER, (1, "two")]}
    assert type(outputs["audio"]) is NestedLoopIndices
    assert outputs["audio"].label_context_gt(NestedLoopIndices(["frames"], {"frames": 9}, 6))


def test_server_merges_follow_the_engines_rules(client: redis.Redis, namespace: str) -> None:
    """World size: the first merge's stays; a position is only ever raised, a new label from
    above 0, except in a label's first merge, which is taken whole."""
    store = _store(client, namespace)
    create_engine_request(store, "r1")
    held: dict[str, Any] = {}
    for infos in (
        {"kv": PublishedKVInfo.build_for_rank(0, 1, {"m": KVSequenceInfo(1, MOONCAKE)})},
        {"kv": PublishedKVInfo.build_for_rank(1, 2, {"m": KVSequenceInfo(2, None)})},
        {"pos": PublishedPositionInfo({"a": 0, "b": 5})},
        {"pos": PublishedPositionInfo({"a": 3, "b": 4, "c": 0})},
    ):
        merged = store.merge_publish_info("r1", "llm", infos)
        merge_publish_info(held, infos)
        assert merged == {label: held[label] for label in infos}
    assert held["kv"].world_size == 1
    assert held["pos"].counters == {"a": 3, "b": 5}
    assert store.load_partition("r1", "llm").resource_publish_info == held


@pytest.mark.real
def test_a_record_reads_back_equal_in_a_process_with_the_other_set_of_types(
    real_client: redis.Redis, namespace: str
) -> None:
    """Written here; read in a child that uses the other source: the bundled copy when this
    process has the engine's classes, the engine's when this one has the bundled copy."""
    other = "bundled" if SOURCE == "engine" else "engine"
    if other == "engine" and not engine_importable():
        pytest.skip("the engine is not installed here: the engine job (.ci/engine) runs this")
    store = RequestStore(real_client, namespace=namespace)
    create_engine_request(store, "r1")
    sequences = {"m": KVSequenceInfo(9, CUDA_IPC), "d": KVSequenceInfo(1, MOONCAKE)}
    store.merge_publish_info("r1", "llm", {"kv": PublishedKVInfo.build_for_rank(0, 2, sequences)})
    store.set_final_output("r1", "audio", LOOPS)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.engine.read_back",
            backends.redis_url_for_tests(),
            namespace,
            "r1",
        ],
        env={**os.environ, "MSTAR_STORE_TYPES": other},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    source, _, shape = child.stdout.partition("\n")
    assert source == other
    assert shape.strip() == canonical(store.load_request("r1"))
