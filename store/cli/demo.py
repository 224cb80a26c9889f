"""``mstar-store demo``: the conductor loop of a two-partition model, played on the store.

An LLM partition ("llm", tensor parallel 2: both ranks report every forward pass and each
publishes its own KV shard and a position counter) streams tokens over "llm->codec" to an
audio-codec partition ("codec", one rank). Per request: ingest, worker reports, pass
completion, advance, done, final outputs, delete; every step is a library call, and every
line printed is read back from the store.
"""

from __future__ import annotations

import argparse
import math
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from store.cli.main import (
    DEFAULT_REDIS_URL,
    add_command,
    add_common_options,
    add_durability_options,
    open_store,
    same_place,
)
from store.cli.view import connection_progress
from store.io.connect import redacted
from store.records import RequestState
from store.store import RequestStore
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

LLM, CODEC, STREAM = "llm", "codec", "llm->codec"
LLM_WG, CODEC_WG = "llm-tp2", "codec-wg"
LLM_RANKS = 2
CODEC_TOKENS_PER_PASS = 4  # the codec decodes at most this many streamed tokens a pass
KV_PAGE_SIZE = 16
FIRST_SEED = 1000
DEMO_NAMESPACE = "mstar-demo"  # never the live "mstar" unless asked for with --namespace


@dataclass(frozen=True)
class RequestPlan:
    """What one demo request does: the LLM emits ``llm_chunks[i]`` tokens in pass ``i``."""

    request_id: str
    seed: int
    prompt_tokens: int
    llm_chunks: tuple[int, ...]

    @property
    def max_output_tokens(self) -> int:
        return sum(self.llm_chunks)


def plan(requests: int, tag: str = "") -> list[RequestPlan]:
    """Request ``i``: a one-token prefill, then ``2 + i % 3`` decode passes of 6 tokens."""
    prefix = f"demo-{tag}-" if tag else "demo-"
    return [
        RequestPlan(
            request_id=f"{prefix}{i + 1}",
            seed=FIRST_SEED + i,
            prompt_tokens=17 + 4 * i,
            llm_chunks=(1,) + (6,) * (2 + i % 3),
        )
        for i in range(requests)
    ]


@dataclass
class Totals:
    requests: int = 0
    passes: dict[str, int] = field(default_factory=lambda: {LLM: 0, CODEC: 0})
    tokens: int = 0
    consumed: int = 0
    reports: int = 0


def add_parser(subparsers: Any) -> None:
    parser = add_command(
        subparsers,
        "demo",
        summary="run a few requests through a two-partition model and print the state",
        description=f"""Play the conductor's loop on the store for a two-partition model: an
        {LLM} partition (tensor parallel {LLM_RANKS}: each rank reports every forward pass and
        publishes its KV shard) streams tokens over {STREAM} to an audio {CODEC}. Each request
        is created, driven pass by pass (reports, pass completion, advance, streamed and
        consumed tokens) to done, given its final outputs and deleted, unless --keep; every
        line printed is read back from the store, and a legend explains them. Without
        --redis-url it needs no server (an embedded in-process fakeredis). It writes namespace
        {DEMO_NAMESPACE!r}, never the live one unless told with --namespace.""",
        examples=[
            "mstar-store demo  # three requests on the embedded fakeredis: nothing to set up",
            "mstar-store demo --requests 5 --keep --redis-url redis://127.0.0.1:6379/0"
            "  # five requests on a real Redis, kept; it prints the `ls` and `show` commands"
            " that find them",
        ],
    )
    parser.add_argument(
        "--requests", type=_positive, default=3, metavar="N", help="requests to run (default 3)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the finished requests (for `ls` and `show`)"
    )
    add_common_options(parser, embedded=True, namespace=DEMO_NAMESPACE)
    add_durability_options(parser)
    parser.set_defaults(func=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    where = "an embedded in-process fakeredis (no server)"
    if args.redis_url is not None:
        where = redacted(args.redis_url)
    count = f"{args.requests} request{'s' if args.requests != 1 else ''}"
    started = time.perf_counter()
    totals = Totals()
    with open_store(args, writes=True) as store:
        print(f"mstar-store demo: {count} on {where}, namespace {args.namespace!r}")
        requests = plan(args.requests, tag=secrets.token_hex(3))
        for request in requests:
            _run_request(store, request, totals, keep=args.keep)
        merges, retries = store.stats.merges, store.stats.retries
    elapsed = time.perf_counter() - started
    print("\n".join(LEGEND))
    kept = "kept (see below)" if args.keep else "deleted"
    rows = [
        ("requests", totals.requests, f"created, run to done, {kept}"),
        ("forward passes", sum(totals.passes.values()),
         ", ".join(f"{p} {n}" for p, n in totals.passes.items())),
        ("tokens", totals.tokens, f"streamed {STREAM}, {totals.consumed} consumed"),
        ("worker reports", totals.reports, f"{LLM_RANKS} per {LLM} pass, 1 per {CODEC} pass"),
        ("merges", merges, "publish-info merges (server-side or optimistic)"),
        ("transaction retries", retries, "conflicts retried"),
    ]  # fmt: skip
    print("summary")
    for label, value, note in rows:
        print(f"  {label:<20}{value:>6}  {note}")
    print(f"  {'elapsed':<20}{elapsed:>6.2f}  seconds")
    if args.keep:
        print("\n".join(next_commands(args, requests[0].request_id)))
    return 0


LEGEND_ROWS = (
    ("pass N", "the partition's forward pass number (the first is 0)"),
    ("tokens +A = T", "tokens this pass added, and the partition's total"),
    ("ranks R/N", "worker reports received / ranks of the worker graph (all in: complete)"),
    ("kv ranks .. seq", "the KV shards published, one per LLM rank, and their sequence length"),
    (f"{STREAM} S/C", f"the stream: tokens sent by {LLM} / consumed by {CODEC} so far"),
    ("done", f"(after S/C) {LLM} has sent its last token on the stream"),
    ("-> done", "this pass finished the partition: it runs no more passes"),
)
LEGEND = (
    "legend (one line per forward pass, read back from the store after its last report)",
    *(f"  {term:<16} {meaning}" for term, meaning in LEGEND_ROWS),
)


def next_commands(args: argparse.Namespace, request_id: str) -> list[str]:
    """What to run next to look at the requests a ``--keep`` run kept, with the options
    that find them (``ls`` defaults to another namespace, and to $MSTAR_REDIS_URL)."""
    if args.redis_url is None:
        return [
            "kept in the embedded Redis, which ends with this process; to keep them for "
            "`ls` and `show`, run the demo on a server:",
            f"  mstar-store demo --keep --redis-url {DEFAULT_REDIS_URL}",
        ]
    options = same_place(args)
    lines = [
        "kept; to look at them:",
        f"  mstar-store ls{options}",
        f"  mstar-store show {shlex.quote(request_id)}{options}",
    ]
    if redacted(args.redis_url) != args.redis_url and "--redis-url" in options:
        lines.append("  (with the URL's password in place of ***)")
    return lines


def _run_request(store: RequestStore, request: RequestPlan, totals: Totals, *, keep: bool) -> None:
    rid = request.request_id
    _ingest(store, request)
    print(
        f"request {rid}: prompt {request.prompt_tokens}, max {request.max_output_tokens} "
        f"tokens, seed {request.seed}; {LLM} (tp {LLM_RANKS}) -> {CODEC}"
    )
    llm_pass = codec_pass = 0
    for chunk in request.llm_chunks:
        llm_pass = _llm_pass(store, request, llm_pass, chunk, totals)
        if _unconsumed(store, rid):
            codec_pass = _codec_pass(store, rid, codec_pass, totals)
    while not store.load_partition(rid, CODEC).is_done:
        codec_pass = _codec_pass(store, rid, codec_pass, totals)

    state = store.load_request(rid)
    assert all(p.is_done for p in state.partitions.values())  # the request is done
    store.set_final_output(rid, "text", {"tokens": state.partitions[LLM].num_output_tokens})
    store.set_final_output(rid, "audio", {"frames": state.partitions[CODEC].num_output_tokens})
    outputs = store.load_record(rid).final_outputs
    if not keep:
        store.delete_request(rid)
    totals.requests += 1
    for name, part in state.partitions.items():
        totals.passes[name] += part.fwd_pass_number
    totals.tokens += state.connections[STREAM].token_count
    totals.consumed += state.connections[STREAM].consumed_count
    shown = ", ".join(f"{k}={v}" for k, v in outputs.items())
    print(f"  done: final outputs {shown}; {'kept' if keep else 'deleted'}")


def _ingest(store: RequestStore, request: RequestPlan) -> None:
    sampling = SamplingReqConfig(temperature=0.7, top_p=0.95)
    sampling.apply_conductor_config(seed=request.seed)
    store.create_request(
        request.request_id,
        partitions={
            LLM: PartitionState(
                LLM,
                _llm_metadata(prefill=True),
                random_seed=request.seed,
                current_worker_graph_ids={LLM_WG},
            ),
            CODEC: PartitionState(
                CODEC,
                _codec_metadata(),
                random_seed=request.seed,
                current_worker_graph_ids={CODEC_WG},
            ),
        },
        connections={STREAM: StreamingConnectionState(LLM, CODEC, STREAM)},
        max_output_tokens=request.max_output_tokens,
        seed=request.seed,
        resource_configs={"sampler": sampling},
        partition_definitions={
            LLM: PartitionDefinition(LLM, {"prefill", "decode"}, initial_walk="prefill"),
            CODEC: PartitionDefinition(
                CODEC, {"audio_decode"}, initial_walk="audio_decode", producer_partitions=[LLM]
            ),
        },
    )


def _llm_pass(
    store: RequestStore, request: RequestPlan, fwd_pass: int, tokens: int, totals: Totals
) -> int:
    """Both ranks publish their KV shard and position and report; then advance the pass."""
    rid = request.request_id
    before = store.load_partition(rid, LLM).num_output_tokens
    seq_len = request.prompt_tokens + before + tokens
    pages = math.ceil(seq_len / KV_PAGE_SIZE)
    complete = False
    for rank in range(LLM_RANKS):
        shard = KVSequenceInfo(
            seq_len=seq_len,
            latest_kv_transfer_info={"rank": rank, "pass": fwd_pass},
            page_indices=[rank * 1000 + page for page in range(pages)],
        )
        published: dict[str, PublishedInfo] = {
            "kv": PublishedKVInfo(info={rank: {LLM: shard}}, world_size=LLM_RANKS),
            "position": PublishedPositionInfo(counters={LLM: seq_len}),
        }
        store.merge_publish_info(rid, LLM, published)
        lead = rank == 0  # only rank 0 carries tokens and outputs
        outcome = store.record_worker_report(
            rid,
            LLM,
            fwd_pass=fwd_pass,
            worker_graph_id=LLM_WG,
            rank=rank,
            num_ranks=LLM_RANKS,
            new_tokens=tokens if lead else 0,
            output_names=["text"] if lead else [],
        )
        totals.reports += outcome.applied
        complete = outcome.pass_complete
    assert complete, "the last rank's report completes the pass"
    state = store.load_request(rid)
    part = state.partitions[LLM]
    done = part.num_output_tokens >= request.max_output_tokens
    _print_pass(state, LLM, tokens, LLM_RANKS, done)
    return store.advance_partition(
        rid,
        LLM,
        from_pass=fwd_pass,
        metadata=_llm_metadata(prefill=False),
        worker_graph_ids=[] if done else [LLM_WG],
        done=done,
    )


def _codec_pass(store: RequestStore, rid: str, fwd_pass: int, totals: Totals) -> int:
    """Decode up to CODEC_TOKENS_PER_PASS streamed tokens; done once the stream is drained."""
    conn = store.load_connection(rid, STREAM)
    take = min(conn.token_count - conn.consumed_count, CODEC_TOKENS_PER_PASS)
    consumed = conn.consumed_count + take
    outcome = store.record_worker_report(
        rid,
        CODEC,
        fwd_pass=fwd_pass,
        worker_graph_id=CODEC_WG,
        rank=0,
        num_ranks=1,
        new_tokens=take,
        output_names=["audio"],
        consumed={STREAM: consumed},
    )
    totals.reports += outcome.applied
    assert outcome.pass_complete
    state = store.load_request(rid)
    stream = state.connections[STREAM]
    done = stream.producer_done and stream.consumed_count == stream.token_count
    _print_pass(state, CODEC, take, 1, done)
    return store.advance_partition(
        rid,
        CODEC,
        from_pass=fwd_pass,
        metadata=_codec_metadata(),
        worker_graph_ids=[] if done else [CODEC_WG],
        done=done,
    )


def _unconsumed(store: RequestStore, rid: str) -> int:
    conn = store.load_connection(rid, STREAM)
    return conn.token_count - conn.consumed_count


def _print_pass(state: RequestState, name: str, tokens: int, ranks: int, done: bool) -> None:
    """One line per forward pass, from the stored state after its last report."""
    part = state.partitions[name]
    completions = sum(part.wg_rank_completions.values())
    kv = part.resource_publish_info.get("kv")
    held = ""
    if isinstance(kv, PublishedKVInfo):
        seq = max(labels[LLM].seq_len for labels in kv.info.values())
        held = f"kv ranks {','.join(map(str, sorted(kv.info)))} seq {seq}"
    print(
        f"  {name:<5} pass {part.fwd_pass_number:<2} tokens +{tokens} = {part.num_output_tokens:<3}"
        f" ranks {completions}/{ranks}  {held:<20}  "
        f"{connection_progress(STREAM, state.connections[STREAM])}"
        f"{'  -> done' if done else ''}"
    )


def _llm_metadata(*, prefill: bool) -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(
        graph_walk="prefill" if prefill else "decode",
        is_prefill=prefill,
        input_modalities=["text"],
        output_modalities=["text"],
    )


def _codec_metadata() -> CurrentForwardConductorMetadata:
    return CurrentForwardConductorMetadata(
        graph_walk="audio_decode", is_prefill=False, input_modalities=["text"],
        output_modalities=["audio"],
    )  # fmt: skip
