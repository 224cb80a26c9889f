"""The reading side of ``tests/test_fuzz_records.py``, run as ``python -m tests.fuzz_worker``.

It reads damaged requests in a process of its own, under a memory limit (``RLIMIT_AS``, its
size at start plus ``--headroom`` MiB) and a CPU-time limit per case, so that a reader that
allocates without bound or spins is caught as such instead of taking the test run down.

Protocol, on stdin and stdout: frames of a 4-byte big-endian length and a msgpack value (no
pickle). The first frame is the valid request, ``{"rid", "namespace", "hashes": {key: {field:
value}}}``; each further frame is a case ``{"key", "field", "value"}`` (``value`` None deletes
the field); the worker stores the request with that one field damaged (HSET, as a buggy
writer would), runs every reader of that key, and answers with one outcome per reader:

    {"reader", "outcome": "value" | "store_error" | "escape", "error", "message",
     "request_id", "key", "field", "cpu", "problem"}

"value" means the read succeeded, every lazy part was then read too, and the value passed
the checks of ``_check_value`` (``problem`` says what failed, else None); "escape" is any
exception that is not a ``StoreError``, with its traceback in ``message``.
"""

from __future__ import annotations

import argparse
import resource
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import fakeredis
import msgspec

from store import Codec, RequestStore, StoreError
from store.codec.layout import RecordLayout
from store.codec.leases import decode_leases
from store.codec.published import PublishLayout
from store.records import RequestRecord
from store.types import PartitionState, StreamingConnectionState
from tests.strategies import user_registry

CPU_SECONDS_PER_CASE = 1.0
MAX_PAYLOAD_BYTES = 1 << 20  # 1 MiB: a value over it must be refused before it is decoded
Hashes = dict[str, dict[bytes, bytes]]


class CaseTimeout(BaseException):
    """Raised by the CPU timer: a case ran longer than its limit (not a StoreError)."""


def _on_timer(signum: int, frame: Any) -> None:
    raise CaseTimeout(f"over {CPU_SECONDS_PER_CASE} s of CPU time")


def read_frame(stream: BinaryIO) -> Any:
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack(">I", header)
    return msgspec.msgpack.decode(stream.read(size))


def write_frame(stream: BinaryIO, value: Any) -> None:
    data = msgspec.msgpack.encode(value)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


class Worker:
    def __init__(self, setup: Mapping[str, Any]) -> None:
        self.rid: str = setup["rid"]
        self.hashes: Hashes = {k: dict(v) for k, v in setup["hashes"].items()}
        self.client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        codec = Codec(user_registry(), max_payload_bytes=MAX_PAYLOAD_BYTES)
        self.store = RequestStore(self.client, namespace=setup["namespace"], codec=codec)
        self.keys = self.store.keys
        self.layouts: dict[str, RecordLayout[Any]] = {
            "meta": RecordLayout(RequestRecord, codec),
            "part": RecordLayout(PartitionState, codec, exclude=("resource_publish_info",)),
            "conn": RecordLayout(StreamingConnectionState, codec),
        }
        self.published = PublishLayout(codec)
        for key in self.hashes:
            self._restore(key)

    def _restore(self, key: str) -> None:
        self.client.delete(key)
        if self.hashes[key]:
            self.client.hset(key, mapping=self.hashes[key])  # type: ignore[arg-type]

    def run(self, case: Mapping[str, Any]) -> list[dict[str, Any]]:
        key, field, value = case["key"], case["field"], case["value"]
        if value is None:
            self.client.hdel(key, field)
        else:
            self.client.hset(key, field, value)
        try:
            return [self._read(name, read, key, field, value) for name, read in self._readers(key)]
        finally:
            self._restore(key)

    def _readers(self, key: str) -> list[tuple[str, Callable[[], Any]]]:
        rid, store = self.rid, self.store
        rest = key.removeprefix(self.keys.request_prefix(rid))
        whole = ("load_request", lambda: store.load_request(rid))
        if rest == "meta":
            return [("load_record", lambda: store.load_record(rid)), whole]
        if rest.startswith(("part:", "pub:")):
            name = rest.partition(":")[2]
            return [("load_partition", lambda: store.load_partition(rid, name)), whole]
        if rest.startswith("conn:"):
            name = rest.partition(":")[2]
            return [("load_connection", lambda: store.load_connection(rid, name)), whole]
        if rest == "lease":
            return [("leases", lambda: decode_leases(self.client.hgetall(key), rid, key))]
        raise ValueError(f"no reader for {key}")

    def _read(
        self, name: str, read: Callable[[], Any], key: str, field: bytes, value: bytes | None
    ) -> dict[str, Any]:
        started = time.process_time()
        signal.setitimer(signal.ITIMER_VIRTUAL, CPU_SECONDS_PER_CASE)
        out: dict[str, Any] = {"reader": name, "problem": None}
        try:
            result = read()
            builtins = msgspec.to_builtins(result, order="deterministic")  # reads lazy parts
            out["outcome"] = "value"
            out["problem"] = self._check_value(result, builtins, key, field, value)
        except StoreError as e:
            out.update(
                outcome="store_error", error=type(e).__name__, message=str(e)[:500],
                request_id=e.request_id, key=e.key, field=e.field,
            )  # fmt: skip
        except (Exception, CaseTimeout) as e:  # any other error is what the test looks for
            out.update(
                outcome="escape", error=type(e).__name__, message=traceback.format_exc()[-3000:]
            )
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        out["cpu"] = time.process_time() - started
        return out

    def _check_value(
        self, result: Any, builtins: Any, key: str, field: bytes, value: bytes | None
    ) -> str | None:
        """Why a value read from damaged data is not the right value, or None.

        Whatever is read must be what the store would write: every record encodes again
        (within its domains) and decodes to the same thing. A field held in plain text
        (numbers, flags, names) must then encode to exactly the bytes stored: there is one
        way to write each value, so any other bytes that read back are a wrong reading.
        """
        records: list[tuple[str, Any]] = []
        if hasattr(result, "record"):
            records.append((self.keys.meta(self.rid), result.record))
            records += [(self.keys.partition(self.rid, n), p) for n, p in result.partitions.items()]
            records += [
                (self.keys.connection(self.rid, n), c) for n, c in result.connections.items()
            ]
        elif isinstance(result, dict):  # leases
            return None
        else:
            records.append((key if ":pub:" not in key else key.replace(":pub:", ":part:"), result))
        for record_key, record in records:
            kind = _kind_of(record_key, self.rid, self.keys.request_prefix(self.rid))
            layout = self.layouts[kind]
            try:
                fields = {k.encode(): v for k, v in layout.encode(record).items()}
                again = layout.decode(fields, extra=_extra(record))
                published: dict[bytes, bytes] = {}
                if kind == "part":
                    for label, info in record.resource_publish_info.items():
                        for k, v in self.published.encode(label, info).items():
                            published[k.encode()] = v
                    again.resource_publish_info = self.published.decode(published)
            except StoreError as e:
                return f"{record_key} does not encode again: {type(e).__name__}: {e}"
            # Equal by ``==`` (an int default reads back as the float its field declares)
            # or byte for byte (NaN is not equal to itself).
            if again != record and _plain(again) != _plain(record):
                return f"{record_key} reads back otherwise after encoding again"
            if not _same_record(record_key, key):
                continue
            written = (published if ":pub:" in key else fields).get(field)
            if _is_text(kind, key, field) and None not in (value, written) and written != value:
                return f"{field!r} = {value[:60]!r} read as {written[:60]!r}"
            if ":pub:" in key and written is not None:
                problem = _kv_part_problem(field, value)
                if problem:
                    return problem
        return None


def _kind_of(record_key: str, rid: str, prefix: str) -> str:
    rest = record_key.removeprefix(prefix)
    return rest.partition(":")[0]


def _same_record(record_key: str, key: str) -> bool:
    return record_key == key.replace(":pub:", ":part:")


_TEXT_ATTRIBUTES = {
    "meta": {"request_id", "max_output_tokens", "seed", "partitions", "connections"},
    "part": {
        "partition_name", "fwd_pass_number", "random_seed", "is_done",
        "completed_worker_graph_ids", "current_worker_graph_ids", "wg_rank_completions",
        "num_output_tokens", "curr_forward_outputs",
    },
    "conn": {
        "from_partition", "to_partition", "edge_name", "token_count", "consumed_count",
        "producer_done",
    },
}  # fmt: skip


def _is_text(kind: str, key: str, field: bytes) -> bool:
    """Whether ``field`` holds plain text (one way to write each value), not msgpack."""
    name = field.partition(b"[")[0].decode("utf-8", "replace")
    if ":pub:" in key:
        # Parts of numbers and rank markers are text; a KV sequence or an envelope is not.
        return b"[" in field and b":" not in field.partition(b"[")[2]
    return name in _TEXT_ATTRIBUTES.get(kind, set())


def _kv_part_problem(field: bytes, value: bytes | None) -> str | None:
    """A KV part must hold every one of its fields: a missing one is damage, not a default."""
    if value is None:
        return f"{field!r} was deleted and read as a default" if b"[world_size]" in field else None
    if b":" not in field.partition(b"[")[2]:
        return None
    held = msgspec.msgpack.decode(value)
    names = ("seq_len", "latest_kv_transfer_info", "page_indices")
    short = len(held) < 3 if isinstance(held, list) else bool(set(names) - set(held))
    if short:
        return f"{field!r} = {value[:60]!r} lacks fields and was read with defaults"
    return None


def _extra(record: Any) -> dict[str, Any]:
    return {"resource_publish_info": {}} if isinstance(record, PartitionState) else {}


def _plain(value: Any) -> bytes:
    """A comparable form; bytes compare NaN equal to itself, which ``==`` does not."""
    return msgspec.msgpack.encode(msgspec.to_builtins(value, order="deterministic"))


def _memory_now() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headroom", type=int, default=512, help="MiB above the start size")
    args = parser.parse_args()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(stdin)
    worker = Worker(setup)
    limit = _memory_now() + args.headroom * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGVTALRM, _on_timer)
    write_frame(stdout, {"ready": True, "limit": limit})
    while (case := read_frame(stdin)) is not None:
        write_frame(stdout, worker.run(case))


if __name__ == "__main__":
    main()
