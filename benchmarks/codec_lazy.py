"""Encode + decode of the benchmark's partition against pickle, with and without reading pages.

    python -m benchmarks.codec_lazy [--seconds 0.05] [--rounds 15]

The partition is ``benchmarks.bench.codec_partition()`` (4 ranks x 2 cache labels of KV
sequences, 3,072 page indices, and a position info). Two paths, each timed as encode then
decode, as the codec rows of ``benchmarks/bench.py`` are:

- ``codec``: the whole value, ``Codec.encode(state)`` / ``Codec.decode(data, PartitionState)``;
- ``hash``: what ``load_partition`` decodes, the partition hash (``RecordLayout``) and its
  publish-info hash (``PublishLayout``); bytes count field names and values.

"+ pages" rows read every page index after decoding (what a caller that uses them pays);
pickle builds every index either way. Timings are the fastest of interleaved batches, so
that pickle and the codec meet the same machine load; ratios are against pickle in the same
run. Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Callable
from typing import Any

from benchmarks.bench import _micro, codec_partition
from mstar.conductor.request_info import PartitionState
from mstar.engine.resources import PublishedKVInfo
from store.codec.layout import RecordLayout
from store.codec.published import PublishLayout
from store.codec.values import Codec

Hashes = tuple[dict[bytes, bytes], dict[bytes, bytes]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.05, help="per batch (default 0.05)")
    parser.add_argument("--rounds", type=int, default=15, help="batches per timer (default 15)")
    args = parser.parse_args()

    state = codec_partition()
    codec = Codec()
    layout = RecordLayout(PartitionState, codec, exclude=("resource_publish_info",))
    published = PublishLayout(codec)

    def hash_encode() -> Hashes:
        part = {k.encode(): v for k, v in layout.encode(state).items()}
        pub = {
            k.encode(): v
            for label, info in state.resource_publish_info.items()
            for k, v in published.encode(label, info).items()
        }
        return part, pub

    def hash_decode(data: Hashes) -> PartitionState:
        infos = published.decode(data[1])
        return layout.decode(data[0], extra={"resource_publish_info": infos})

    paths: dict[str, tuple[Callable[[], Any], Callable[[Any], PartitionState], int]] = {}
    pickled = pickle.dumps(state)
    paths["pickle"] = (lambda: pickle.dumps(state), pickle.loads, len(pickled))
    paths["codec"] = (
        lambda: codec.encode(state),
        lambda b: codec.decode(b, PartitionState),
        len(codec.encode(state)),
    )
    hashes = hash_encode()
    paths["hash"] = (
        hash_encode,
        hash_decode,
        sum(len(k) + len(v) for h in hashes for k, v in h.items()),
    )

    timers: dict[str, Callable[[], Any]] = {}
    for name, (encode, decode, _) in paths.items():
        data = encode()
        assert decode(data) == state, f"{name} does not round-trip"
        timers[name] = lambda e=encode, d=decode: d(e())
        timers[f"{name} + pages"] = lambda e=encode, d=decode: _read_pages(d(e()))
        timers[f"{name} encode"] = encode
        timers[f"{name} decode"] = lambda d=decode, x=data: d(x)
    best = _micro(timers, args.seconds, args.rounds)

    base = best["pickle"]
    pages = sum(
        len(seq.page_indices)
        for info in state.resource_publish_info.values()
        if isinstance(info, PublishedKVInfo)
        for labels in info.info.values()
        for seq in labels.values()
    )
    print(f"PartitionState with {pages:,} KV page indices; encode + decode, fastest batch")
    print(f"{'path':16} {'µs':>8} {'x pickle':>9} {'bytes':>8} {'x pickle':>9}")
    for name, micros in best.items():
        if name.endswith(("encode", "decode")):
            continue
        size = paths[name.split(" ")[0]][2]
        ratio = micros / base
        size_ratio = size / paths["pickle"][2]
        split = ""
        if not name.endswith("pages"):
            split = (
                f"   (encode {best[name + ' encode']:.1f} + decode {best[name + ' decode']:.1f})"
            )
        print(f"{name:16} {micros:8.1f} {ratio:9.2f} {size:8,} {size_ratio:9.3f}{split}")


def _read_pages(state: PartitionState) -> int:
    total = 0
    for info in state.resource_publish_info.values():
        if isinstance(info, PublishedKVInfo):
            for labels in info.info.values():
                for seq in labels.values():
                    total += len(seq.page_indices)
    return total


if __name__ == "__main__":
    main()
