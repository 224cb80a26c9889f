"""What replicated durability costs a write: latency with ``WAIT 1``, against the default.

    python -m benchmarks.durability            # about 20 s
    python -m benchmarks.durability --quick    # about 5 s

Starts a private master and one replica (``tests.servers``, free ports, temporary
directory; both stopped at the end), and one request per store. Then, in interleaved
slices so that drift on a shared machine hits both alike, the same writes through a
store with the default durability ("master", the baseline) and one with
``durability="replicated", replicas=1``: a field write (``update_partition``: one
script) and a step (a report completing the pass, then the advance: two scripts). Prints
the latency per call (p50, p90, p99, mean) of each, the added microseconds and the ratio
replicated / master. A script, not a timed test: the figures go in docs/guarantees.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from store import RequestStore
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.servers import RedisServer

MD = CurrentForwardConductorMetadata(graph_walk="decode", is_prefill=False)
MODES = ("master", "replicated")


def synced(master: RedisServer, replica: RedisServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with master.client() as m, replica.client() as r:
        while True:
            info = r.info("replication")
            if (
                info["master_link_status"] == "up"
                and info["slave_repl_offset"] == m.info("replication")["master_repl_offset"]
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica did not sync: {info}")
            time.sleep(0.05)


class Writer:
    """One store and its request; each call one measured operation."""

    def __init__(self, store: RequestStore, rid: str) -> None:
        self.store, self.rid, self.passes, self.seeds = store, rid, 0, 0
        state = PartitionState("llm", MD, current_worker_graph_ids={"wg"})
        store.create_request(rid, partitions={"llm": state}, connections={},
                             max_output_tokens=1 << 40)  # fmt: skip

    def field(self) -> None:
        self.seeds += 1
        self.store.update_partition(self.rid, "llm", random_seed=self.seeds)

    def step(self) -> None:
        p, store = self.passes, self.store
        store.record_worker_report(self.rid, "llm", fwd_pass=p, worker_graph_id="wg", rank=0,
                                   num_ranks=1)  # fmt: skip
        store.advance_partition(self.rid, "llm", from_pass=p, metadata=MD,
                                worker_graph_ids=["wg"])  # fmt: skip
        self.passes += 1


def timed(call: Callable[[], None], n: int, into: list[float]) -> None:
    for _ in range(n):
        started = time.perf_counter()
        call()
        into.append(time.perf_counter() - started)


def figures(samples: list[float]) -> tuple[float, float, float, float]:
    """p50, p90, p99 and mean, in microseconds."""
    cuts = statistics.quantiles(samples, n=100)
    return cuts[49] * 1e6, cuts[89] * 1e6, cuts[98] * 1e6, statistics.fmean(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer slices")
    args = parser.parse_args()
    slices, per_slice = (4, 100) if args.quick else (12, 200)
    with tempfile.TemporaryDirectory() as tmp:
        master = RedisServer(Path(tmp) / "master").start()
        replica = None
        try:
            replica = RedisServer(
                Path(tmp) / "replica", None, "--replicaof", master.host, str(master.port)
            ).start()
            synced(master, replica)
            writers = {
                mode: Writer(
                    RequestStore(master.client(), namespace=f"bench-{mode}", durability=mode),
                    f"r-{mode}",
                )
                for mode in MODES
            }
            samples = {(op, mode): [] for op in ("field", "step") for mode in MODES}
            for writer in writers.values():  # warm up: connections, scripts loaded
                timed(writer.field, 50, [])
                timed(writer.step, 50, [])
            for _ in range(slices):
                for mode, writer in writers.items():
                    timed(writer.field, per_slice, samples["field", mode])
                    timed(writer.step, per_slice, samples["step", mode])
            for writer in writers.values():
                writer.store.close()
        finally:
            for server in (replica, master):
                if server is not None:
                    server.stop()
    print(f"{slices * per_slice} calls per row, a master and 1 replica on this machine; µs")
    print(f"{'operation':<36}{'p50':>9}{'p90':>9}{'p99':>9}{'mean':>9}")
    for op, label in (("field", "field write (1 script)"), ("step", "step (2 scripts)")):
        base = figures(samples[op, "master"])
        repl = figures(samples[op, "replicated"])
        for mode, row in (("master", base), ("replicated", repl)):
            print(f"{label + ', ' + mode:<36}" + "".join(f"{v:>9.0f}" for v in row))
        added = [r - b for r, b in zip(repl, base, strict=True)]
        print(f"{'  added by WAIT':<36}" + "".join(f"{v:>9.0f}" for v in added))
        ratio = [r / b for r, b in zip(repl, base, strict=True)]
        print(f"{'  ratio replicated/master':<36}" + "".join(f"{v:>9.2f}" for v in ratio))


if __name__ == "__main__":
    main()
