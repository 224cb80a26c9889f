"""The simulated models and their workers, as pure functions of (seed, request, partition, pass).

Two models: "tts", an LLM partition ("llm", tensor parallel 2: both ranks report every
forward pass and publish their own KV shard, rank 0 also a position counter and the new
tokens) streaming over "llm->codec" to an audio codec partition ("codec", one rank); and
"text", a single partition ("default"). The codec runs one pass per fixed chunk of
``CODEC_CHUNK`` streamed tokens once the stream holds the whole chunk, so its passes and
their consumed counts are the same whenever the tokens arrive. Nothing here reads a clock
or a shared random source: every replica, and the crash-free reference, computes the same
reports, next passes and final outputs, which is what makes final states comparable.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store.records import RequestState, Step
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

TTS, TEXT = "tts", "text"
LLM, CODEC, DEFAULT = "llm", "codec", "default"
STREAM = "llm->codec"
LLM_WG, CODEC_WG, TEXT_WG = "llm-tp2", "codec-wg", "text-wg"
LLM_RANKS = 2
CODEC_CHUNK = 4  # streamed tokens the codec decodes per pass
FRAMES_PER_TOKEN = 2  # audio frames the codec emits per token it decodes
KV_PAGE_SIZE = 16


@dataclass(frozen=True)
class RequestSpec:
    """One simulated request: its model, prompt and the tokens emitted per producer pass."""

    request_id: str
    model: str
    seed: int
    prompt_tokens: int
    chunks: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.chunks)

    @property
    def producer(self) -> str:
        return LLM if self.model == TTS else DEFAULT

    @property
    def partitions(self) -> tuple[str, ...]:
        return (LLM, CODEC) if self.model == TTS else (DEFAULT,)

    @property
    def codec_passes(self) -> int:
        return math.ceil(self.total_tokens / CODEC_CHUNK) if self.model == TTS else 0

    @property
    def passes(self) -> int:
        """Forward passes the whole request runs (each dispatched at least once)."""
        return len(self.chunks) + self.codec_passes


@dataclass(frozen=True)
class Report:
    """One worker-graph rank's report of one forward pass, as a worker would send it."""

    request_id: str
    partition: str
    fwd_pass: int
    worker_graph_id: str
    rank: int
    num_ranks: int
    new_tokens: int = 0
    output_names: tuple[str, ...] = ()
    consumed: dict[str, int] = field(default_factory=dict)
    kv_seq_len: int = 0  # 0: publishes no KV shard
    positions: dict[str, int] = field(default_factory=dict)

    @property
    def report_id(self) -> str:
        """Stable across resends: a redelivered report is recognised by the store."""
        return (
            f"{self.request_id}/{self.partition}/{self.fwd_pass}/{self.worker_graph_id}/{self.rank}"
        )

    def published(self) -> dict[str, PublishedInfo]:
        infos: dict[str, PublishedInfo] = {}
        if self.kv_seq_len:
            pages = math.ceil(self.kv_seq_len / KV_PAGE_SIZE)
            shard = KVSequenceInfo(
                seq_len=self.kv_seq_len,
                latest_kv_transfer_info={"rank": self.rank, "pass": self.fwd_pass},
                page_indices=[self.rank * 1000 + page for page in range(pages)],
            )
            infos["kv"] = PublishedKVInfo(
                info={self.rank: {self.partition: shard}}, world_size=self.num_ranks
            )
        if self.positions:
            infos["position"] = PublishedPositionInfo(counters=dict(self.positions))
        return infos


def request_ids(count: int) -> list[str]:
    return [f"req-{i:04d}" for i in range(count)]


def spec(seed: int, request_id: str) -> RequestSpec:
    """The request's plan, from the run's seed and its id alone."""
    rng = random.Random(f"{seed}:{request_id}")
    model = TEXT if rng.random() < 1 / 3 else TTS
    decode_passes = rng.randint(2, 6)
    return RequestSpec(
        request_id=request_id,
        model=model,
        seed=rng.randrange(1 << 30),
        prompt_tokens=rng.randint(8, 64),
        chunks=(1, *(rng.randint(1, 6) for _ in range(decode_passes))),
    )


# -- ingest -------------------------------------------------------------------------------


def initial_request(spec: RequestSpec) -> dict[str, Any]:
    """Keyword arguments of ``RequestStore.create_request`` for this request."""
    sampling = SamplingReqConfig(temperature=0.7, top_p=0.95)
    sampling.apply_conductor_config(seed=spec.seed)
    producer = spec.producer
    wg = LLM_WG if producer == LLM else TEXT_WG
    partitions = {
        producer: PartitionState(
            producer, _metadata(producer, 0), random_seed=spec.seed, current_worker_graph_ids={wg}
        )
    }
    definitions = {
        producer: PartitionDefinition(producer, {"prefill", "decode"}, initial_walk="prefill")
    }
    connections = {}
    if spec.model == TTS:
        partitions[CODEC] = PartitionState(
            CODEC, _metadata(CODEC, 0), random_seed=spec.seed, current_worker_graph_ids={CODEC_WG}
        )
        definitions[CODEC] = PartitionDefinition(
            CODEC, {"audio_decode"}, initial_walk="audio_decode", producer_partitions=[LLM]
        )
        connections[STREAM] = StreamingConnectionState(LLM, CODEC, STREAM)
    return {
        "partitions": partitions,
        "connections": connections,
        "max_output_tokens": spec.total_tokens,
        "seed": spec.seed,
        "resource_configs": {"sampler": sampling},
        "partition_definitions": definitions,
    }


# -- workers ------------------------------------------------------------------------------


def reports(spec: RequestSpec, partition: str, fwd_pass: int) -> list[Report]:
    """What the workers report for one forward pass (the same every time it is run)."""
    rid = spec.request_id
    if partition == CODEC:
        start, end = _codec_span(spec, fwd_pass)
        frames = (end - start) * FRAMES_PER_TOKEN
        return [
            Report(
                rid, CODEC, fwd_pass, CODEC_WG, 0, 1,
                new_tokens=frames, output_names=("audio",), consumed={STREAM: end},
                positions={CODEC: end * FRAMES_PER_TOKEN},
            )
        ]  # fmt: skip
    if fwd_pass >= len(spec.chunks):
        return []  # the partition is done: a resend of its last pass reaches no worker
    seq_len = spec.prompt_tokens + sum(spec.chunks[: fwd_pass + 1])
    ranks, wg = (LLM_RANKS, LLM_WG) if partition == LLM else (1, TEXT_WG)
    out = []
    for rank in range(ranks):
        lead = rank == 0  # only rank 0 carries tokens, outputs and the position counter
        out.append(
            Report(
                rid, partition, fwd_pass, wg, rank, ranks,
                new_tokens=spec.chunks[fwd_pass] if lead else 0,
                output_names=("text",) if lead else (),
                kv_seq_len=seq_len,
                positions={partition: seq_len} if lead else {},
            )
        )  # fmt: skip
    return out


def ready(
    spec: RequestSpec,
    partition: str,
    fwd_pass: int,
    connections: Mapping[str, StreamingConnectionState],
) -> bool:
    """Can the pass run now? The codec waits until its whole chunk has been streamed."""
    if partition != CODEC:
        return True
    return connections[STREAM].token_count >= _codec_span(spec, fwd_pass)[1]


# -- the conductor's decisions -----------------------------------------------------------


def next_step(spec: RequestSpec, partition: str, completed_pass: int) -> Step:
    """The pass after ``completed_pass``: the last chunk's pass finishes the partition."""
    if partition == CODEC:
        done = completed_pass + 1 >= spec.codec_passes
        wgs: tuple[str, ...] = (CODEC_WG,)
    else:
        done = completed_pass + 1 >= len(spec.chunks)
        wgs = (LLM_WG,) if partition == LLM else (TEXT_WG,)
    return Step(_metadata(partition, completed_pass + 1), () if done else wgs, done=done)


def final_outputs(spec: RequestSpec, state: RequestState) -> dict[str, Any]:
    """The request's outputs, read from its finished state."""
    producer = state.partitions[spec.producer]
    outputs: dict[str, Any] = {"text": {"tokens": producer.num_output_tokens}}
    if spec.model == TTS:
        outputs["audio"] = {"frames": state.partitions[CODEC].num_output_tokens}
    return outputs


def _codec_span(spec: RequestSpec, fwd_pass: int) -> tuple[int, int]:
    """The streamed tokens [start, end) codec pass ``fwd_pass`` decodes."""
    start = min(fwd_pass * CODEC_CHUNK, spec.total_tokens)
    return start, min(start + CODEC_CHUNK, spec.total_tokens)


def _metadata(partition: str, fwd_pass: int) -> CurrentForwardConductorMetadata:
    if partition == CODEC:
        return CurrentForwardConductorMetadata(
            graph_walk="audio_decode", is_prefill=False, input_modalities=["text"],
            output_modalities=["audio"], kwargs={"chunk": fwd_pass},
        )  # fmt: skip
    prefill = fwd_pass == 0
    return CurrentForwardConductorMetadata(
        graph_walk="prefill" if prefill else "decode", is_prefill=prefill,
        input_modalities=["text"], output_modalities=["text"], kwargs={"step": fwd_pass},
    )  # fmt: skip
