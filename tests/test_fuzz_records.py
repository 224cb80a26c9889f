"""Damaged stored values, every field of every record: a typed error or the right value.

A valid request (every record type, every registered kind, a lease) is written with the
public ``RequestStore`` on fakeredis; then, case by case, one of its fields is damaged with a
raw HSET (or deleted) and the request is read back with every reader of that key, in a
worker process (``tests/fuzz_worker.py``) that runs under a memory limit (512 MiB above its
size at start) and a CPU-time limit of one second per case. Each read must end in a
``StoreError`` naming the request, or in a value the store would write itself (see the
worker's ``_check_value``). Anything else (another exception, a wrong value, running out of
memory or time, the worker dying) fails the test with the case that did it.

The damage: random bytes, valid msgpack of the wrong type, headers that claim gigabytes
(arrays, maps, strings, bins, exts; list length fields), deep nesting, numbers outside their
domains, non-UTF-8 names and values, envelopes of every kind holding the wrong payload, and
mutations of the stored value (truncated, a byte changed, bytes appended). ``-m slow`` runs
the random part with ten times as many examples.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakeredis
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import Codec, RequestStore
from store.schema import SCHEMA_VERSION
from store.types import (
    CurrentForwardConductorMetadata,
    KVSequenceInfo,
    PartitionDefinition,
    PartitionState,
    PublishedKVInfo,
    PublishedPositionInfo,
    SamplingReqConfig,
    StreamingConnectionState,
)
from tests.fuzz_worker import MAX_PAYLOAD_BYTES, read_frame, write_frame
from tests.strategies import (
    BeamConfig,
    BundleInfo,
    ScoreInfo,
    SumInfo,
    json_like,
    user_registry,
)

RID = "fuzz-1"
NAMESPACE = "fuzz"
WALL_SECONDS_PER_CASE = 30.0  # a hang, not slowness: the worker limits CPU time itself
encode = msgspec.msgpack.encode
pytestmark = pytest.mark.fake


# -- the valid request ------------------------------------------------------------------------


def valid_request() -> dict[str, dict[bytes, bytes]]:
    """Every hash of one request that holds every record type and registered kind."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    registry = user_registry()
    store = RequestStore(
        client, namespace=NAMESPACE, codec=Codec(registry, max_payload_bytes=MAX_PAYLOAD_BYTES)
    )
    transfer = {"host": "10.0.3.17", "port": 18515, "slots": [1, 2]}
    kv = PublishedKVInfo(
        {
            0: {
                "decoder": KVSequenceInfo(32, transfer, [5, 900, 70000]),
                "draft": KVSequenceInfo(2, None),
            },
            1: {"decoder": KVSequenceInfo(32, None, [6, 901])},
        },
        world_size=2,
    )
    metadata = CurrentForwardConductorMetadata(
        "decode", False, ["text"], ["audio"], {"step": 3, "opts": {"beam": [1, 2]}}
    )
    llm = PartitionState(
        "llm",
        metadata,
        fwd_pass_number=0,
        random_seed=-7,
        current_worker_graph_ids={"wg", "aux"},
        resource_publish_info={
            "kv": kv,
            "pos": PublishedPositionInfo({"a": 5, "b": 7}),
            "score": ScoreInfo({"x": 1.5}, {"t"}, "note"),
            "bundle": BundleInfo(
                PublishedPositionInfo({"p": 1}),
                {"e": SumInfo(3)},
                kv,
                [ScoreInfo(tags={"h"})],
            ),
            "sum": SumInfo(9),
        },
    )
    store.create_request(
        RID,
        partitions={
            "llm": llm,
            "codec": PartitionState(
                "codec", metadata, resource_publish_info={"pos": PublishedPositionInfo({"a": 1})}
            ),
        },
        connections={"llm->codec": StreamingConnectionState("llm", "codec", "audio")},
        max_output_tokens=64,
        seed=11,
        resource_configs={
            "sampler": SamplingReqConfig(0.7, _seed=3),
            "beam": BeamConfig(2, {1: 0.5}),
        },
        partition_definitions={
            "llm": PartitionDefinition("llm", {"decode"}, "decode"),
            "codec": PartitionDefinition("codec", {"decode"}, None, ["llm"]),
        },
    )
    for rank in (0, 1):
        store.record_worker_report(
            RID, "llm", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=2,
            new_tokens=4 if rank == 0 else 0, output_names=["text"] if rank == 0 else (),
            replica_id="replica-1",
        )  # fmt: skip
    store.set_final_output(RID, "text", {"tokens": [1, 2], "more": {"a": [None, 1.5]}})
    assert store.claim_step(RID, "codec", "replica-2") is not None  # a lease to damage
    hashes = {}
    for raw_key in client.scan_iter(match=f"{NAMESPACE}:*"):
        if client.type(raw_key) == b"hash":
            hashes[raw_key.decode()] = client.hgetall(raw_key)
    assert len(hashes) == 7  # meta, 2 partitions and their publish infos, connection, lease
    return hashes


# -- the worker -------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the cases ended in, for the summary printed at the end of the module."""

    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    cases: int = 0
    most_cpu: float = 0.0
    cpu: float = 0.0


class Reader:
    """The worker process, fed one case at a time."""

    def __init__(self, hashes: dict[str, dict[bytes, bytes]]) -> None:
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz_worker"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        self.hashes = hashes
        self.tally = Tally()
        assert self.process.stdin and self.process.stdout
        write_frame(self.process.stdin, {"rid": RID, "namespace": NAMESPACE, "hashes": hashes})
        ready = self._answer()
        assert ready["ready"]

    def _answer(self) -> Any:
        assert self.process.stdout
        readable, _, _ = select.select([self.process.stdout], [], [], WALL_SECONDS_PER_CASE)
        if not readable:
            self.process.kill()
            raise AssertionError(f"the worker gave no answer in {WALL_SECONDS_PER_CASE} s")
        answer = read_frame(self.process.stdout)  # type: ignore[arg-type]
        if answer is None:
            code = self.process.wait()
            raise AssertionError(f"the worker died (exit code {code})")
        return answer

    def check(self, key: str, field_name: bytes, value: bytes | None) -> None:
        """Damage one field, read the request back; fail unless every read is right."""
        assert self.process.stdin
        write_frame(self.process.stdin, {"key": key, "field": field_name, "value": value})
        outcomes = self._answer()
        self.tally.cases += 1
        shown = f"{key} {field_name!r} = {value[:80] if value is not None else None!r}"
        for out in outcomes:
            self.tally.outcomes[out["outcome"]] += 1
            self.tally.most_cpu = max(self.tally.most_cpu, out["cpu"])
            self.tally.cpu += out["cpu"]
            if out["outcome"] == "escape":
                raise AssertionError(f"{out['reader']}: {shown}: escaped\n{out['message']}")
            if out["outcome"] == "value":
                assert out["problem"] is None, f"{out['reader']}: {shown}: {out['problem']}"
            else:
                self.tally.errors[out["error"]] += 1
                assert out["request_id"] == RID, f"{out['reader']}: {shown}: {out['message']}"
                assert out["key"] in self.hashes or out["error"].endswith("NotFound"), (
                    f"{out['reader']}: {shown}: names no key of the request: {out['message']}"
                )

    def close(self) -> None:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.process.stdout.close()


@pytest.fixture(scope="module")
def hashes() -> dict[str, dict[bytes, bytes]]:
    return valid_request()


@pytest.fixture(scope="module")
def reader(hashes: dict[str, dict[bytes, bytes]]) -> Iterator[Reader]:
    worker = Reader(hashes)
    yield worker
    worker.close()
    tally = worker.tally
    print(
        f"\nfuzz: {tally.cases} cases, reads by outcome {dict(tally.outcomes)}, "
        f"errors {dict(tally.errors.most_common())}, reading CPU {tally.cpu:.1f} s, "
        f"most per case {tally.most_cpu:.3f} s"
    )


# -- what to damage, and with what ----------------------------------------------------------------

DEEP = b"\x91" * 100_000 + b"\xc0"
HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\xdc\xff\xff" + b"\x01" * 10,  # array16 with too few items
]
NUMBERS = [
    b"", b"0", b"1", b"-1", b"-0", b"01", b"+1", b" 1", b"1.5", b"1e3", b"true",
    str(2**53 - 1).encode(), str(2**53).encode(), str(2**63 - 1).encode(), str(2**63).encode(),
    str(-(2**63) - 1).encode(), b"9" * 20, b"9" * 100_000, b"100000000",
]  # fmt: skip
TEXT = [b"\xff\xfe", b"ok\x80", b"\xed\xa0\x80", b"x" * (MAX_PAYLOAD_BYTES + 1)]
KINDS = ["kv", "position", "sampling", "test.score", "test.bundle", "test.sum", "test.beam"]


def envelopes(kind: str) -> list[bytes]:
    v = SCHEMA_VERSION
    return [
        encode([v, kind, {}]), encode([v, kind, None]), encode([v, kind, [1, 2]]),
        encode([v, kind, {"info": {"0": {}}, "world_size": -1, "counters": {"a": -1}}]),
        encode([v, kind, {"primary": encode([v, kind, {}])}]),
        encode([v + 1, kind, {}]), encode([0, kind, {}]), encode([-1, kind, {}]),
        encode([2**64 - 1, kind, {}]), encode([v, kind]), encode([v, kind, {}, "extra"]),
        b"\x93" + encode(v) + encode(kind) + DEEP,
        b"\x93" + encode(v) + encode(kind) + HUGE_HEADERS[1],
    ]  # fmt: skip


KV_PARTS = [
    encode([1, None, encode([1, 2])]), encode([1, None, encode([1, 2]), "later field"]),
    encode([-1, None, b"\x90"]), encode([2**63, None, b"\x90"]), encode([True, None, b"\x90"]),
    encode([1, None, b"\xdd\xff\xff\xff\xff"]), encode([1, None, encode(["x"])]),
    encode([1, None, encode([2**64 - 1, -(2**63)])]), encode([1, None, b""]),
    encode([1, None, [1, 2]]), encode([1, None]), encode({"seq_len": 1}),
    encode({"seq_len": 1, "latest_kv_transfer_info": None, "page_indices": [1]}),
    encode([1, b"\x91" * 70 + b"\xc0", b"\x90"])[:-1], b"\x93\x01" + b"\x91" * 70 + b"\xc0\x90",
]  # fmt: skip
SHAPES = [
    encode(None), encode(5), encode(-1), encode(2**64 - 1), encode(1.5), encode("x"),
    encode([]), encode({}), encode([1, 2]), encode({"a": 1}), encode(b"bin"),
    b"\xc1", b"\x91" * 100 + b"\xc0", DEEP, b"\x81\xa1k" * 1000 + b"\xc0",
]  # fmt: skip


def nasty_values(key: str, name: bytes, original: bytes) -> list[bytes | None]:
    """Every damage to try on one field that held ``original``."""
    values: list[bytes | None] = [None, *NUMBERS, *TEXT, *SHAPES, *HUGE_HEADERS]
    if ":pub:" in key or name.startswith(b"resource_configs["):
        values += KV_PARTS
        for kind in KINDS:
            values += envelopes(kind)
    if original:
        values += [original[:-1], original[: len(original) // 2], original + b"\x00"]
        values += [bytes([original[0] ^ 0x10]) + original[1:], original[:-1] + b"\xc1"]
    return values


def _attribute(key: str, name: bytes) -> bytes:
    """What a field holds, for trying all damage once per kind of field."""
    head, bracket, rest = name.partition(b"[")
    if ":pub:" not in key or not bracket:
        return head + bracket
    if rest == b"world_size]" or rest.isdigit():
        return head + b"[" + rest.strip(b"0123456789")
    return head + (b"[:" if b":" in rest else b"[")


def few_values(original: bytes) -> list[bytes | None]:
    """For a field of an attribute tried in full on another of its fields."""
    return [None, b"", b"-1", str(2**53).encode(), b"\xff\xfe", DEEP, HUGE_HEADERS[0],
            original[:-1], original + b"\x00"]  # fmt: skip


def new_fields(key: str) -> list[bytes]:
    """Fields a buggy writer might add: of known attributes, unknown ones, bad names."""
    common = [b"\xff", b"bogus", b"bogus[", b"x]", b"[", b"_v2"]
    if key.endswith(":meta"):
        return [*common, b"partitions[2]", b"partitions[-1]", b"resource_configs[new]",
                b"final_outputs[\xff]", b"partition_definitions[x]"]  # fmt: skip
    if ":part:" in key:
        return [*common, b"curr_forward_outputs[1]", b"curr_forward_outputs[01]",
                b"wg_rank_completions[new]", b"current_worker_graph_ids[\xfe]",
                b"completed_worker_graph_ids[wg]", b"metadata[x]"]  # fmt: skip
    if ":pub:" in key:
        return [*common, b"kv[2]", b"kv[0:new]", b"kv[new]", b"kv[-1]", b"kv[0:\xff]",
                b"pos[z]", b"pos[\xff]", b"new", b"new[x]", b"kv[world_size",
                b"\xff[0]"]  # fmt: skip
    if ":conn:" in key:
        return [*common, b"token_count[x]"]
    return [*common, b"holder[x]", b"token[llm]x", b"holder[\xff]"]


def all_fields(hashes: dict[str, dict[bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """(key, field, value held) for every stored field, and every field a writer might add."""
    out = [(key, f, v) for key, held in hashes.items() for f, v in sorted(held.items())]
    out += [(key, f, b"") for key in hashes for f in new_fields(key)]
    return out


# -- the tests ------------------------------------------------------------------------------------


def test_every_field_of_every_record_with_every_kind_of_damage(
    reader: Reader, hashes: dict[str, dict[bytes, bytes]]
) -> None:
    """Each attribute of each record gets every damage on one of its fields, and its other
    fields (each worker graph, rank, label...) a sample of them."""
    tried: set[tuple[str, bytes]] = set()
    for key, name, original in all_fields(hashes):
        attribute = (key, _attribute(key, name))
        full = attribute not in tried
        tried.add(attribute)
        for value in nasty_values(key, name, original) if full else few_values(original):
            reader.check(key, name, value)


RANDOM = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(RANDOM, max_examples=RANDOM.max_examples * 10)


def _field_of(hashes: dict[str, dict[bytes, bytes]]) -> st.SearchStrategy[tuple[str, bytes, bytes]]:
    return st.sampled_from(all_fields(hashes))


@st.composite
def damage(draw: st.DrawFn, hashes: dict[str, dict[bytes, bytes]]) -> tuple[str, bytes, bytes]:
    """A field, and random damage to it: bytes, msgpack, envelopes, or a mutated original."""
    key, name, original = draw(_field_of(hashes))
    how = draw(st.sampled_from(["bytes", "msgpack", "envelope", "kv part", "mutation", "name"]))
    if how == "bytes":
        value = draw(st.binary(max_size=64))
    elif how == "msgpack":
        value = encode(draw(json_like))
    elif how == "envelope":
        value = encode([draw(st.integers(-2, SCHEMA_VERSION + 1)), draw(st.sampled_from(KINDS)),
                        draw(json_like)])  # fmt: skip
    elif how == "kv part":
        value = encode([draw(json_like), draw(json_like), draw(st.binary(max_size=16) | json_like)])
    elif how == "name":
        name = draw(st.binary(min_size=1, max_size=12))
        value = draw(st.sampled_from([b"", b"1", original]))
    else:
        data = bytearray(original or b"\x00")
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
        value = bytes(data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)
    return key, name, value


def test_random_damage(reader: Reader, hashes: dict[str, dict[bytes, bytes]]) -> None:
    @RANDOM
    @given(case=damage(hashes))
    def run(case: tuple[str, bytes, bytes]) -> None:
        reader.check(*case)

    run()


@pytest.mark.slow
def test_random_damage_at_length(
    reader: Reader, hashes: dict[str, dict[bytes, bytes]], request: pytest.FixtureRequest
) -> None:
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("ten times the random cases: run with -m slow")

    @SLOW
    @given(case=damage(hashes))
    def run(case: tuple[str, bytes, bytes]) -> None:
        reader.check(*case)

    run()


def test_the_worker_catches_what_it_is_there_to_catch() -> None:
    """The limits are real: an allocation beyond them fails as such, without killing tests."""
    code = (
        "import resource, sys\n"
        "limit = 64 * 1024 * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "try:\n    bytearray(256 * 1024 * 1024)\nexcept MemoryError:\n    sys.exit(3)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 3
