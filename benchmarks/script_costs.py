"""Where a pass's Redis time goes, inside the report script; and what a report costs as its
pass fills with ranks.

    python -m benchmarks.script_costs [--rounds N] [--per-round M] [--reports R]   # ~10 s

Starts its own ``redis-server`` (no persistence) pinned to one CPU and pins itself to
another where it can, so that the server's time is not the client's. Redis time is ``INFO
commandstats`` (EVALSHA's microseconds), read around each slice. Two tables:

- **pass**: the fastpath scenario's 2-rank pass with the step in the completing report
  (``current_pass(then_step=True)``), recorded once through the store, then its two
  EVALSHAs sent again with the store's own arguments for pass after pass, each variant of
  ``report.lua`` in alternating rounds of ``--per-round`` passes (so each meets the same
  machine state). The variants are the script as stored (the baseline), the same with
  history off (its cap argument ``0``), and probes that do one piece of work twice (the
  partition's read, a history entry) or nothing at all: the difference from the baseline is
  that piece's cost. Each variant's result is checked: the pass went on.
- **ranks**: one ``record_worker_report`` into a pass that holds N ranks already (a worker
  graph of 2**40 ranks), Redis time per call, against the same at 2 ranks: since v5.1 the
  ranks of a pass are one field, read and rewritten by each report.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from benchmarks.scenarios.fastpath import current_pass, open_store
from benchmarks.wire import recording_client
from store import RequestStore, scripts
from store.types import CurrentForwardConductorMetadata, PartitionState
from tests.servers import RedisServer

NAMESPACE = "mstar-bench-costs"
RANK_COUNTS = (2, 200, 1_000, 5_000, 20_000)
HUGE_RANKS = 2**40

BASELINE = "report.lua as stored (baseline)"
HISTORY_OFF = "history off (cap 0)"
EMPTY = "an empty body (returns at once)"

# report.lua's anchors the probes change (each must be found exactly once).
PARTITION_READ = "local held = redis.call('HMGET', part,"
REPORT_HISTORY = (
    "history(KEYS[5], cap, part, {'op', 'report', 'partition', p, 'pass', ARGV[2], "
    "'rank', ARGV[4],\n"
)


def _twice(anchor: str, upto: str) -> Callable[[str], str]:
    """A probe: the statement from ``anchor`` to the next ``upto`` (inclusive) run twice."""

    def change(body: str) -> str:
        if body.count(anchor) != 1:
            raise SystemExit(f"report.lua changed: {anchor.strip()!r} is not there once")
        start = body.index(anchor)
        end = body.index(upto, start) + len(upto)
        statement = body[start:end]
        again = statement.replace("local held =", "held =", 1)
        return body[:end] + "\n" + again + body[end:]

    return change


PROBES: dict[str, Callable[[str], str]] = {
    "the partition's read (HMGET, 12 fields) twice": _twice(PARTITION_READ, "'random_seed')"),
    "the report's history entry (XADD) twice": _twice(REPORT_HISTORY, "})\n"),
    EMPTY: lambda body: "return {'OK'}\n",
}


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def _server(workdir: Path) -> RedisServer:
    taskset = shutil.which("taskset")
    server = RedisServer(workdir)
    if taskset and (os.cpu_count() or 1) > 1:
        # Started through taskset: the server on CPU 1, this process on CPU 0.
        command = server.command
        server.command = lambda: [taskset, "-c", "1", *command()]  # type: ignore[method-assign]
    return server.start()


def _recorded_pass(url: str) -> list[list[bytes]]:
    """The two EVALSHAs of one pass (pass 1 of a request of its own), as the store sent them."""
    client, recorded = recording_client(url)
    store = open_store(client, NAMESPACE, {}, "pass")
    run = current_pass(then_step=True)
    run(store, "pass", 0)  # scripts loaded, topology cached
    recorded.clear()
    if run(store, "pass", 1) is not None:
        raise SystemExit("the recorded pass did not go on")
    client.close()
    return [c for c in recorded.commands if c[0].upper() == b"EVALSHA"]


def _at_pass(command: list[bytes], fwd_pass: int, *, history: bool = True) -> list[bytes]:
    """``command`` (a report's EVALSHA) for pass ``fwd_pass``: ARGV[2] is the pass, ARGV[12]
    the history cap."""
    first_arg = 3 + int(command[2])
    out = list(command)
    out[first_arg + 1] = str(fwd_pass).encode()
    if not history:
        out[first_arg + 11] = b"0"
    return out


def pass_table(client: redis.Redis, url: str, rounds: int, per_round: int) -> list[str]:
    calls = _recorded_pass(url)
    body = (Path(scripts.__file__).parent / "report.lua").read_text()
    variants: list[tuple[str, list[list[bytes]], bool]] = [
        (BASELINE, calls, True),
        (HISTORY_OFF, calls, False),
    ]
    for name, change in PROBES.items():
        probe = change(body)
        sha = client.script_load(scripts.assemble(probe))
        variants.append((name, [[c[0], sha.encode(), *c[2:]] for c in calls], True))
    usec: collections.Counter[str] = collections.Counter()
    passes: collections.Counter[str] = collections.Counter()
    at = 2
    for _ in range(rounds):
        for name, commands, history in variants:
            client.config_resetstat()
            for _ in range(per_round):
                replies = [
                    client.execute_command(*_at_pass(c, at, history=history))  # type: ignore[no-untyped-call]
                    for c in commands
                ]
                if name == EMPTY:
                    continue  # it changes nothing: the next variant takes the same pass
                if replies[1][0] != b"OK" or int(replies[1][6]) != at + 1:
                    raise SystemExit(f"{name}: the pass did not go on: {replies}")
                at += 1
            stats = client.info("commandstats")["cmdstat_evalsha"]
            usec[name] += stats["usec"]
            passes[name] += stats["calls"] / len(commands)
    base = usec[variants[0][0]] / passes[variants[0][0]]
    lines = [f"{'pass (report + completing report with its step)':52}  Redis µs/pass  vs baseline"]
    for name, _, _ in variants:
        per_pass = usec[name] / passes[name]
        lines.append(f"  {name:50}  {per_pass:13.1f}  {per_pass - base:+10.1f} µs")
    return lines


def ranks_table(client: redis.Redis, reports: int) -> list[str]:
    store = RequestStore(client, namespace=NAMESPACE)
    meta = CurrentForwardConductorMetadata("decode", False)
    lines = [f"{'report into a pass holding N ranks':52}  Redis µs/call  x at 2 ranks"]
    base = None
    for n in RANK_COUNTS:
        rid = f"ranks-{n}"
        part = PartitionState("p", meta, current_worker_graph_ids={"wg"})
        store.create_request(rid, partitions={"p": part}, connections={}, max_output_tokens=1)

        def report(rank: int, rid: str = rid) -> Any:
            return store.record_worker_report(
                rid, "p", fwd_pass=0, worker_graph_id="wg", rank=rank, num_ranks=HUGE_RANKS
            )

        marks = ",".join(str(r) for r in range(n))
        # n ranks reported at once, in the field as the script writes it; a report of one
        # of them must be a duplicate, or the table would measure nothing (the format moved)
        client.hset(store.keys.partition(rid, "p"), "_reports[wg]", f",{marks},")
        if report(n - 1).applied:
            raise SystemExit("report.lua no longer keeps a pass's ranks in _reports[<wg>]")
        client.config_resetstat()
        for rank in range(n, n + reports):
            if not report(rank).applied:
                raise SystemExit(f"rank {rank} at {n} ranks was not applied")
        per_call = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        base = base or per_call
        lines.append(f"  {f'{n:,} ranks':50}  {per_call:13.1f}  {per_call / base:11.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (10)")
    parser.add_argument("--per-round", type=int, default=400, help="passes per round (400)")
    parser.add_argument(
        "--reports", type=int, default=1000, help="reports timed per number of ranks (1000)"
    )
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mstar-costs-") as workdir:
        server = _server(Path(workdir))
        try:
            _pin(0)
            client = server.client()
            print("\n".join(pass_table(client, server.url, options.rounds, options.per_round)))
            print()
            print("\n".join(ranks_table(client, options.reports)))
            info = client.info("server")
            print(f"\n(redis {info['redis_version']}, {options.rounds} rounds of "
                  f"{options.per_round} passes per variant)")  # fmt: skip
            client.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
