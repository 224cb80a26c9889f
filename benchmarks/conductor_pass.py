"""What a 2-rank forward pass costs when the store holds the request as mstar-ai's Conductor
keeps it (``store.conductor``), against today's 2-RTT pass, in one run.

    python -m benchmarks.conductor_pass            # 2,000 passes per form, ~15 s
    python -m benchmarks.conductor_pass --quick    # 200 passes per form

The issue's target: "apply-a-WorkerGraphsDone plus complete-a-pass for a 2-rank pass stays
at or below today's 2 round trips and 100 us of Redis CPU (commandstats)". A script that
prints figures (not a timed test). It starts its own ``redis-server`` (no persistence, a
free port, a temporary directory) pinned to CPU 1 where it can, pins itself to CPU 0 (as
``benchmarks.script_costs``), and runs every form on it, each on 16 requests of its own
taken round-robin (so the store's caches behave as in a conductor driving many requests):

- ``(a) unbatched``: ``apply_worker_graphs_done`` of rank 0, of rank 1 (which completes the
  pass), then ``complete_pass``: three writes;
- ``(b) batched``: one ``apply_conductor_steps([GraphsDone(r0), GraphsDone(r1),
  CompletePass(...)])``, what the engine's run loop does to a request in one turn;
- ``(c) baseline``: today's 2-RTT pass, the fastpath scenario's ``report+report(then_step)``
  (``benchmarks.scenarios.fastpath.current_pass``);
- ``bare PING``: one round trip, the floor of wall time (reference only).

The conductor forms carry the engine's messages in full: a request ingested from
``shapes.pass_request`` (2 partitions, a streaming connection, a sampler config), its
``llm`` partition run by a worker graph of 2 TP ranks; each rank's ``WorkerGraphsDone``
persists one ``TensorPointerInfo`` (its own uuid, ``source_tp_rank``), counts a token on
the edge and sets an output's loop indices; rank 0's (the only one the engine takes)
publishes both ranks' KV shards (as the baseline's two reports do) and position counters.
The ``PassResult`` gives the next metadata, sends the new tensors to both ranks and
unpersists the previous pass's, so a request's state stays the same size pass after pass.
Writes are fenced by the request-level lease (``claim_conductor_request``, once per
request; its renewal is timed apart: a conductor renews per lease period, not per pass).

Per pass, for each form: round trips (on the wire, through a recording client, and in the
store's effects, over a few passes on a request of its own before the timed loop; and the
commands sent per pass in the timed loop, from ``INFO commandstats``, so that a cache miss
there shows), Redis time (``INFO commandstats`` ``usec`` of the commands the client sent,
script calls not counted twice, as ``benchmarks.server``), the server process's CPU
(``INFO cpu``, which also has the socket I/O and the INFO calls), client wall time (p50,
p99) and CPU, and the bytes the client writes. Forms run in alternating rounds, so each
meets the same machine state. Then the Redis memory per request after the run (``MEMORY
USAGE`` of its keys; the conductor hash also keeps the results of its latest 256 op ids).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from benchmarks import server as stats
from benchmarks.scenarios.fastpath import current_pass
from benchmarks.script_costs import _pin, _server
from benchmarks.shapes import HOT, PASS_RANKS, PASS_WG, metadata, pass_request, rank_kv
from benchmarks.wire import Command, recording_client, round_trips, tap_effects, top_level
from store import RequestStore
from store.conductor import ConductorRequest, PassResult, WorkerGraphsDone
from store.ops.conductor import CompletePass, GraphsDone, Step
from store.types import NestedLoopIndices, PublishedPositionInfo, TensorPointerInfo

REQUESTS = 16
PASSES, QUICK_PASSES = 2_000, 200
ROUNDS, QUICK_ROUNDS = 10, 4
CALIBRATION = 4  # passes counted on the wire and in effects, after the warm one
HOLDER = "bench-conductor"
LEASE_TTL = 3600.0
CODEC_WG, EDGE = "codec-wg", "llm->codec"
WORKERS = {PASS_WG: [f"llm-w{rank}" for rank in range(PASS_RANKS)], CODEC_WG: ["codec-w0"]}

# The target.
TARGET_RTT = 2
TARGET_REDIS_US = 100.0

UNBATCHED = "(a) unbatched: 2 x graphs_done + complete_pass"
BATCHED = "(b) batched: apply_conductor_steps"
BASELINE = "(c) baseline: report+report(then_step)"
PING = "bare PING (reference)"

Pass = Callable[[RequestStore, str, int], Callable[[], str | None]]
"""(store, request, pass) -> the pass, ready to run (its messages built outside the timing);
it returns None, or what went wrong."""


# -- the conductor's messages --------------------------------------------------------------


def conductor_request(rid: str) -> ConductorRequest:
    """``shapes.pass_request`` as the engine's Conductor holds it after ingest."""
    shape = pass_request()
    return ConductorRequest(
        request_id=rid,
        persist_signals={},
        persist_signal_ref_cnt={},
        worker_graph_to_workers={wg: list(workers) for wg, workers in WORKERS.items()},
        all_worker_graph_ids=set(WORKERS),
        max_output_tokens=shape.max_output_tokens,
        random_seed=shape.seed,
        resource_configs=shape.resource_configs,
        partition_states=shape.partitions,
        partition_definitions=shape.partition_definitions,
        streaming_connections=shape.connections,
        worker_graph_walks={PASS_WG: {"prefill", "decode"}, CODEC_WG: {"audio_decode"}},
        conductor_ingest_time=time.time(),
    )


def tensor(rid: str, p: int, rank: int) -> TensorPointerInfo:
    """What rank ``rank`` persists in pass ``p``: its hidden states, a uuid of its own."""
    return TensorPointerInfo(
        dims=[1, 4096], dtype="bfloat16", nbytes=8192, address=0x7F00_0000_0000 + 8192 * p,
        stride=[4096, 1], uuid=f"{rid}/{p}/{rank}", source_session_id=f"session-llm-w{rank}",
        source_entity=f"llm-w{rank}", source_tp_size=PASS_RANKS, source_tp_rank=rank,
    )  # fmt: skip


def graphs_done(rid: str, p: int, rank: int, kv: Any) -> WorkerGraphsDone:
    published = {}
    if rank == 0:  # the engine takes the first TP rank's only
        published = {"kv": kv, "position": PublishedPositionInfo(counters={HOT: p + 1})}
    return WorkerGraphsDone(
        request_id=rid,
        worker_graph_ids=[PASS_WG],
        is_first_tp_rank=rank == 0,
        persist_signals={"hidden_states": [tensor(rid, p, rank)]},
        new_token_counts={EDGE: 1},
        resource_publish_info=published,
        partition_name=HOT,
        output_loop_indices={"text": NestedLoopIndices(["decode"], {"decode": p}, p)},
    )


def pass_result(rid: str, p: int) -> PassResult:
    """The next pass's metadata; this pass's tensors sent to both ranks (one reference per
    copy); the previous pass's unpersisted."""
    sent = [tensor(rid, p, rank).uuid for rank in range(PASS_RANKS) for _ in range(PASS_RANKS)]
    previous = [tensor(rid, p - 1, rank) for rank in range(PASS_RANKS)] if p else []
    return PassResult(
        full_metadata=metadata(p + 1), step_metadata={"position": p + 1},
        sent_tensor_uuids=sent, unpersist_tensors=previous,
    )  # fmt: skip


def _checked(rid: str, p: int, outcomes: list[Any]) -> str | None:
    """None when the pass went as the engine's would: rank 1 completed it, the pass moved
    on, and the previous pass's tensors were unpersisted (one message per rank)."""
    rank1, done = outcomes[1], outcomes[2]
    if rank1.done_partitions != (HOT,):
        return f"{rid} pass {p}: rank 1 did not complete it: {rank1}"
    if done.ignored or done.fwd_index != p or len(done.unpersist) != (PASS_RANKS if p else 0):
        return f"{rid} pass {p}: {done}"
    return None


def conductor_pass(*, batched: bool) -> tuple[Callable[[RequestStore, str], None], Pass]:
    kv = rank_kv(0)
    kv.update(rank_kv(1))  # both ranks' shards, as the baseline's two reports publish
    leases: dict[tuple[int, str], Any] = {}

    def setup(store: RequestStore, rid: str) -> None:
        store.ingest_request(conductor_request(rid))
        leases[id(store), rid] = store.claim_conductor_request(rid, HOLDER, ttl=LEASE_TTL)

    def prepare(store: RequestStore, rid: str, p: int) -> Callable[[], str | None]:
        lease = leases[id(store), rid]
        r0, r1 = graphs_done(rid, p, 0, kv), graphs_done(rid, p, 1, kv)
        result = pass_result(rid, p)
        if batched:
            steps: list[Step] = [GraphsDone(r0), GraphsDone(r1), CompletePass(HOT, result)]
            return lambda: _checked(rid, p, store.apply_conductor_steps(rid, steps, lease=lease))

        def run() -> str | None:
            outcomes: list[Any] = [store.apply_worker_graphs_done(m, lease=lease) for m in (r0, r1)]
            outcomes.append(store.complete_pass(rid, HOT, result, lease=lease))
            return _checked(rid, p, outcomes)

        return run

    return setup, prepare


def baseline_pass() -> tuple[Callable[[RequestStore, str], None], Pass]:
    run = current_pass(then_step=True)

    def setup(store: RequestStore, rid: str) -> None:
        pass_request().create(store, rid)

    return setup, lambda store, rid, p: lambda: run(store, rid, p)


def ping_pass() -> tuple[Callable[[RequestStore, str], None], Pass]:
    def prepare(store: RequestStore, rid: str, p: int) -> Callable[[], str | None]:
        client = store.client
        return lambda: None if client.ping() else "no PONG"

    return lambda store, rid: None, prepare


W = 46  # the width of a form's name in the tables

FORMS = {
    UNBATCHED: conductor_pass(batched=False),
    BATCHED: conductor_pass(batched=True),
    BASELINE: baseline_pass(),
    PING: ping_pass(),
}


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Form:
    name: str
    setup: Callable[[RequestStore, str], None]
    prepare: Pass
    store: RequestStore
    rids: list[str]
    done: int = 0  # passes run, the warm ones not counted
    wall_ns: list[int] = field(default_factory=list)
    cpu_ns: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    calibration: dict[str, Any] = field(default_factory=dict)

    def next_pass(self) -> tuple[str, int]:
        """Requests round-robin; pass 0 of each was the warm one."""
        return self.rids[self.done % len(self.rids)], 1 + self.done // len(self.rids)


def resp_size(command: Command) -> int:
    """Bytes of ``command`` as RESP (what redis-py writes)."""
    size = len(f"*{len(command)}\r\n")
    return size + sum(len(f"${len(arg)}\r\n") + len(arg) + 2 for arg in command)


def calibrate(form: Form, url: str, namespace: str) -> None:
    """Round trips (wire and effects), commands sent and bytes written per pass, on a
    request of its own, after a warm pass (connected, scripts loaded, caches filled)."""
    client, recorded = recording_client(url)
    try:
        store = RequestStore(client, namespace=f"{namespace}-calibration")
        tap = tap_effects(store)
        form.setup(store, "calibration")
        for p in range(1 + CALIBRATION):
            if p == 1:
                recorded.clear()
                if tap is not None:
                    tap.effects.clear()
            failed = form.prepare(store, "calibration", p)()
            if failed:
                raise SystemExit(f"{form.name}: calibration: {failed}")
        commands = recorded.commands
        form.calibration = {
            "rtt_wire": recorded.rounds / CALIBRATION,
            "rtt_effects": round_trips(tap.effects) / CALIBRATION if tap and tap.effects else None,
            "sent": {n: c / CALIBRATION for n, c in top_level(commands).items()},
            "bytes": sum(map(resp_size, commands)) / CALIBRATION,
        }
    finally:
        client.close()


def run_round(form: Form, passes: int, info: redis.Redis) -> None:
    before = stats.snapshot(info)
    cpu = time.process_time_ns()
    for _ in range(passes):
        rid, p = form.next_pass()
        run = form.prepare(form.store, rid, p)
        start = time.perf_counter_ns()
        failed = run()
        form.wall_ns.append(time.perf_counter_ns() - start)
        if failed:
            raise SystemExit(f"{form.name}: {failed}")
        form.done += 1
    form.cpu_ns += time.process_time_ns() - cpu
    form.counters.update(stats.difference(before, stats.snapshot(info)))


def figures(form: Form) -> dict[str, float]:
    """Per pass (see the module docstring)."""
    cal, n = form.calibration, form.done
    sent = cal["sent"]
    timed_calls = sum(form.counters.get(f"calls:{name}", 0) for name in sent)
    wall = sorted(form.wall_ns)
    return {
        "rtt": cal["rtt_wire"],
        "rtt_effects": cal["rtt_effects"] if cal["rtt_effects"] is not None else float("nan"),
        "cmds_timed": timed_calls / n,
        **stats.per_call(form.counters, sent, n),
        "p50_us": statistics.median(wall) / 1e3,
        "p99_us": wall[min(len(wall) - 1, int(len(wall) * 0.99))] / 1e3,
        "client_cpu_us": form.cpu_ns / n / 1e3,
        "bytes": cal["bytes"],
    }


def claim_cost(store: RequestStore, rid: str, info: redis.Redis, calls: int) -> str:
    """A renewal of the request-level lease (not per pass: per lease period)."""
    before = stats.snapshot(info)
    start = time.perf_counter_ns()
    for _ in range(calls):
        if store.claim_conductor_request(rid, HOLDER, ttl=LEASE_TTL) is None:
            raise SystemExit("the lease renewal was refused")
    wall = (time.perf_counter_ns() - start) / calls / 1e3
    moved = stats.difference(before, stats.snapshot(info))
    redis_us = stats.per_call(moved, {"evalsha": 1.0}, calls)["cmdstat_us"]
    return (f"claim_conductor_request (a renewal, per lease period, not per pass): "
            f"{moved.get('calls:evalsha', 0) / calls:g} command, {redis_us:.1f} µs Redis, "
            f"{wall:.0f} µs wall (mean)")  # fmt: skip


def memory(client: redis.Redis, form: Form) -> str:
    """Redis memory per request (MEMORY USAGE of each of its keys), and for the conductor
    hash the bytes of the request's own fields against the op ids and results it keeps."""
    total, keys, state, ops, results = 0, 0, 0, 0, 0
    for rid in form.rids:
        prefix = form.store.keys.request_prefix(rid)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            total += client.memory_usage(key, samples=0) or 0
            keys += 1
        held = cast(dict[bytes, bytes], client.hgetall(form.store.keys.conductor(rid)))
        for name, value in held.items():
            if name.startswith(b"o:"):
                results += 1
                ops += len(name) + len(value)
            elif name == b"ops":
                ops += len(name) + len(value)
            else:
                state += len(name) + len(value)
    n = len(form.rids)
    line = f"  {form.name:{W}}  {total / n:7,.0f} B in {keys / n:g} keys"
    if results:
        line += (f"; its hash's fields: request {state / n:,.0f} B, "
                 f"{results / n:g} op ids and results {ops / n:,.0f} B")  # fmt: skip
    return line


# -- the report ------------------------------------------------------------------------------

COLUMNS = (
    ("rtt", "RTT", "{:g}"),
    ("rtt_effects", "effects", "{:g}"),
    ("cmds_timed", "cmds", "{:.2f}"),
    ("cmdstat_us", "Redis µs", "{:.1f}"),
    ("cpu_us", "srv CPU µs", "{:.1f}"),
    ("p50_us", "p50 µs", "{:.0f}"),
    ("p99_us", "p99 µs", "{:.0f}"),
    ("client_cpu_us", "cli CPU µs", "{:.0f}"),
    ("bytes", "bytes out", "{:,.0f}"),
)
RATIOS = ("rtt", "cmdstat_us", "cpu_us", "p50_us", "client_cpu_us", "bytes")


def table(rows: dict[str, dict[str, float]]) -> list[str]:
    head = f"{'per pass':{W}}" + "".join(f"  {title:>10}" for _, title, _ in COLUMNS)
    lines = [head]
    for name, row in rows.items():
        cells = "".join(f"  {fmt.format(row[key]):>10}" for key, _, fmt in COLUMNS)
        lines.append(f"{name:{W}}{cells}".replace("nan", "  -"))
    base = rows[BASELINE]
    titles = {key: title for key, title, _ in COLUMNS}
    lines += ["", f"{'x baseline':{W}}" + "".join(f"  {titles[k]:>10}" for k in RATIOS)]
    for name in (UNBATCHED, BATCHED):
        cells = "".join(f"  {rows[name][k] / base[k]:9.2f}x" for k in RATIOS)
        lines.append(f"{name:{W}}{cells}")
    return lines


def verdicts(rows: dict[str, dict[str, float]]) -> list[str]:
    base_rtt = rows[BASELINE]["rtt"]
    lines = [
        f"target: a WorkerGraphsDone applied plus a pass completed (2 ranks) <= today's "
        f"{TARGET_RTT} round trips (baseline measured: {base_rtt:g}) and <= "
        f"{TARGET_REDIS_US:g} µs Redis (commandstats)"
    ]
    for name in (UNBATCHED, BATCHED):
        row = rows[name]
        rtt = max(row["rtt"], row["rtt_effects"], row["cmds_timed"])
        rtt_ok, us_ok = rtt <= TARGET_RTT, row["cmdstat_us"] <= TARGET_REDIS_US
        lines.append(
            f"  {name:{W}}  round trips {rtt:g} <= {TARGET_RTT}: {'PASS' if rtt_ok else 'FAIL'}; "
            f"Redis {row['cmdstat_us']:.1f} µs <= {TARGET_REDIS_US:g}: "
            f"{'PASS' if us_ok else 'FAIL'}  => {'PASS' if rtt_ok and us_ok else 'FAIL'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 passes per form, not 2,000")
    options = parser.parse_args(argv)
    passes = QUICK_PASSES if options.quick else PASSES
    rounds = QUICK_ROUNDS if options.quick else ROUNDS
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mstar-conductor-pass-") as workdir:
        server = _server(Path(workdir))
        try:
            _pin(0)
            client = server.client()
            forms = []
            for i, (name, (setup, prepare)) in enumerate(FORMS.items()):
                namespace = f"mstar-bench-cp{i}"
                form = Form(name, setup, prepare, RequestStore(client, namespace=namespace),
                            [f"req-{k:02d}" for k in range(REQUESTS)])  # fmt: skip
                calibrate(form, server.url, namespace)
                for rid in form.rids:  # created, and the warm pass 0 (outside the timing)
                    form.setup(form.store, rid)
                    if failed := form.prepare(form.store, rid, 0)():
                        raise SystemExit(f"{name}: warm pass: {failed}")
                forms.append(form)
            for r in range(rounds):  # each round in another order: none always goes first
                for form in forms[r % len(forms) :] + forms[: r % len(forms)]:
                    run_round(form, passes // rounds, client)
            rows = {form.name: figures(form) for form in forms}
            print("\n".join(table(rows)))
            print()
            print("\n".join(verdicts(rows)))
            print()
            print(claim_cost(forms[1].store, forms[1].rids[0], client, passes))
            print("\nRedis memory per request after the run (MEMORY USAGE of its keys)")
            for form in forms[:3]:
                print(memory(client, form))
            version = client.info("server")["redis_version"]
            print(f"\n(redis {version}; {passes:,} passes per form over {REQUESTS} requests "
                  f"round-robin, in {rounds} alternating rounds)")  # fmt: skip
            cpus, after = os.cpu_count() or 1, os.getloadavg()[0]
            print(f"(load average {load:.2f} before, {after:.2f} after, {cpus} CPUs)")
            if max(load, after) > cpus:
                print("warning: the machine was busier than its CPUs: commandstats counts a "
                      "call's wall time, so a preempted server inflates it; ratios hold better "
                      "than absolute figures")  # fmt: skip
            client.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
