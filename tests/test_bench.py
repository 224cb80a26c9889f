"""The benchmark's harness and its stall and drift detectors (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from benchmarks import client_cost, report, server, server_cost, stalls, wire
from benchmarks.harness import REFERENCE_KEY, Bench, Check, Pool, Row, Spec, arrange, fastest_ratio
from benchmarks.scenarios import aio, baseline, fastpath, runtime, store_ops
from store import RequestStore
from store.ops.effects import Collect, Commit, Disconnected, Send, SendMany, Sleep, Watch, Write
from tests.conftest import redis_url_for_tests
from tests.servers import RedisServer


def test_a_call_stalled_for_minutes_is_flagged_while_p99_looks_normal() -> None:
    assert stalls.stall(p50_us=45.0, max_us=180e6) is not None  # 3 minutes
    assert stalls.stall(p50_us=20_000.0, max_us=1.2e6) is not None  # over 1 s, whatever p50
    assert stalls.stall(p50_us=45.0, max_us=60_000.0) is not None  # 60 ms = 1,333x p50


def test_scheduling_hiccups_and_contention_are_not_stalls() -> None:
    assert stalls.stall(p50_us=24.0, max_us=3_700.0) is None  # 150x, but a 4 ms time slice
    assert stalls.stall(p50_us=16_000.0, max_us=190_000.0) is None  # contended: 12x p50


def test_a_steady_reference_does_not_drift_and_a_shifted_one_does() -> None:
    steady = [23.7, 21.8, 23.8, 23.4, 25.0, 24.1]
    assert stalls.drift(steady) is None
    assert stalls.drift([*steady, 109.3, 101.8]) is not None
    assert stalls.drift([30.0]) is None  # one slice: nothing to compare


def test_flag_marks_the_stalled_row_and_the_drifting_reference() -> None:
    stalled = Row("store", "record_worker_report", 1, "one", p50_us=45.0, max_us=120e6)
    steady = Row("store", "load_request", 1, "one", p50_us=220.0, p99_us=400.0, max_us=990.0)
    ping = Row("baseline", "bare PING", 1, "one", p50_us=24.0, max_us=3_000.0)
    ping.details["slice_p50_us"] = [24.0, 23.0, 80.0]
    assert ping.key == REFERENCE_KEY
    warnings = report.flag([stalled, steady, ping])
    assert len(warnings) == 2
    assert "record_worker_report 1p one" in warnings[0] and "stall" in stalled.notes
    assert "bare PING 1p one" in warnings[1] and "drift" in ping.notes
    assert steady.notes == "" and "stall" not in steady.details


def test_commands_are_read_back_from_what_redis_py_writes() -> None:
    connection = redis.Connection()
    packed = connection.pack_commands(
        [("EVALSHA", "ab12", 2, "k1", "k2", 7, b"\x00\r\n"), ("PING",)]
    )
    commands = wire.parse_commands(b"".join(bytes(chunk) for chunk in packed))
    assert commands == [[b"EVALSHA", b"ab12", b"2", b"k1", b"k2", b"7", b"\x00\r\n"], [b"PING"]]


def test_commands_queued_in_a_transaction_are_not_sent_at_top_level() -> None:
    sent = [
        [b"EVALSHA", b"ab12", b"1", b"k"],
        [b"MULTI"],
        [b"EVALSHA", b"cd34", b"1", b"k"],
        [b"HGETALL", b"k"],
        [b"EXEC"],
        [b"zadd", b"d", b"1", b"m"],
    ]
    # Run by the server under EXEC, the queued EVALSHA and HGETALL are counted there.
    assert wire.top_level(sent) == {"evalsha": 1, "multi": 1, "exec": 1, "zadd": 1}


def test_round_trips_count_a_send_many_once_per_server() -> None:
    one, other = Send("a", [("PING",)]), Send("b", [("PING",)], node=("10.0.0.2", 6379))
    assert wire.round_trips([one, Sleep(0.1), SendMany([one, one])]) == 2  # one server
    assert wire.round_trips([SendMany([one, other])]) == 2  # two servers: two writes
    assert wire.round_trips([Watch("a", [("WATCH", "a")]), Commit([("EXEC",)])]) == 2


def test_round_trips_count_pipelined_writes_once_per_wait() -> None:
    one, other = Send("a", [("PING",)]), Send("b", [("PING",)], node=("10.0.0.2", 6379))
    chunks = [Write([one]), Write([one, other]), Collect(0), Collect(1)]
    assert wire.round_trips(chunks) == 2  # two servers, written to before the first wait
    assert wire.round_trips([*chunks, Write([one]), Collect(2), Collect(2)]) == 3


def _ping() -> Generator[Any, Any, Any]:
    return (yield Send("k", [("PING",)]))


def test_the_recording_client_counts_pipelined_writes_as_one_round(
    real_client: Any, namespace: str
) -> None:
    from store.io.sync import SyncExecutor

    recorded_client, recorded = wire.recording_client(redis_url_for_tests())
    try:

        def op() -> Generator[Any, Any, Any]:
            tickets, replies = [], []
            for i in range(3):
                tickets.append((yield Write([Send(namespace, [("ECHO", str(i))])])))
            for ticket in tickets:
                replies.append((yield Collect(ticket)))
            again = yield Send(namespace, [("PING",)])
            return replies, again

        executor = SyncExecutor(recorded_client)
        executor.run(_ping())  # connected (the handshake's writes), then counted from here
        recorded.clear()
        replies, again = executor.run(op())
        assert replies == [[[b"0"]], [[b"1"]], [[b"2"]]] and again == [b"PONG"]
        assert len(recorded.writes) == 4 and recorded.rounds == 2
    finally:
        recorded_client.close()


def test_the_effect_tap_keeps_effects_and_passes_replies_and_errors_through() -> None:
    server = fakeredis.FakeServer()
    store = RequestStore(fakeredis.FakeRedis(server=server), namespace="tap")
    executor = store._executor
    tap = wire.tap_effects(store)
    assert tap is not None and store._executor is tap and tap.inner is executor

    def op() -> Generator[Any, Any, tuple[Any, str]]:
        both = yield SendMany([Send("k", [("PING",)]), Send("k", [("ECHO", "x")])])
        server.connected = False  # the next send meets a lost connection, thrown in
        try:
            yield Send("k", [("PING",)])
        except Disconnected as e:
            return both, type(e).__name__
        return both, "no error"

    assert tap.run(op()) == ([[b"PONG"], [b"x"]], "Disconnected")
    assert [type(e).__name__ for e in tap.effects] == ["SendMany", "Send"]
    assert tap.trips == 2  # the SendMany reaches one server: one round trip, and the Send
    assert wire.tap_effects(object()) is None  # a store with no executor (an older tree)


def test_commandstats_count_script_calls_once_and_shared_names_by_share() -> None:
    before = server.parse_info(
        {"used_cpu_sys": 1.0, "used_cpu_user": 2.0, "cmdstat_evalsha": {"calls": 5, "usec": 50}}
    )
    after = server.parse_info(
        {
            "used_cpu_sys": 1.0004,
            "used_cpu_user": 2.0006,
            "cmdstat_evalsha": {"calls": 15, "usec": 650},  # 10 scripts: 600 µs in all
            "cmdstat_hset": {"calls": 30, "usec": 90},  # inside the scripts only
            "cmdstat_zadd": {"calls": 40, "usec": 80},  # 10 sent, 30 from scripts
        }
    )
    moved = server.difference(before, after)
    assert moved["calls:evalsha"] == 10 and moved["cpu_us"] == 1000
    # Per call of 10: the scripts' 60 µs (their HSETs not again), 10 of 40 ZADDs at 2 µs.
    figures = server.per_call(moved, {"evalsha": 1, "zadd": 1}, calls=10)
    assert figures == pytest.approx({"cmdstat_us": 62.0, "cpu_us": 100.0})
    assert server.top_level_usec(moved, {"ping": 3}) == 0.0  # never seen: nothing


def test_fastpath_checks_read_the_per_pass_figures_against_the_targets() -> None:
    def row(op: str, p50: float, **per_pass: float) -> Row:
        made = Row("fastpath", op, 1, fastpath.TARGET, p50_us=p50)
        made.details["per_pass"] = per_pass
        return made

    rows = [
        row(fastpath.STEP, 150.0, rtt_wire=3, rtt_effects=3, cmdstat_us=90.0, cpu_us=150.0,
            client_cpu_us=120.0),
        row(fastpath.IN_REPORT, 90.0, rtt_wire=2, rtt_effects=2, cmdstat_us=80.0, cpu_us=95.0,
            client_cpu_us=70.0),
        row(fastpath.NO_HISTORY, 140.0, cmdstat_us=75.0, cpu_us=140.0),
        row(fastpath.LEGACY, 400.0, rtt_wire=8, cmdstat_us=300.0, cpu_us=500.0),
        row(fastpath.PINGS[1], 30.0, client_cpu_us=20.0),
        row(fastpath.PINGS[2], 60.0, client_cpu_us=40.0),
        row(fastpath.PINGS[3], 90.0, client_cpu_us=60.0),
    ]  # fmt: skip
    bench = Bench.__new__(Bench)
    bench.own_server = True
    got = {c.target: c for c in fastpath.checks(rows, bench)}
    rtt = got[f"{fastpath.STEP}: round trips <= 3"]
    assert rtt.met is True and "legacy 8" in rtt.measured
    assert got[f"{fastpath.STEP}: p50 <= 4 PING p50s (same turns)"].met is False  # 5 PINGs
    assert got[f"{fastpath.IN_REPORT}: p50 <= 4 PING p50s (same turns)"].met is True
    cpu = got[f"{fastpath.STEP}: Redis server CPU per pass <= 100 µs"]
    assert cpu.met is False and "0.30x" in cpu.measured  # 150 of the legacy's 500
    client = [c for t, c in got.items() if t.startswith(f"{fastpath.STEP}: client CPU")]
    assert client[0].met is False and "120 vs 60 µs of 3 PINGs" in client[0].measured
    history = next(c for t, c in got.items() if t.startswith("history"))
    assert history.met is False and history.measured.startswith("1.20x")  # 90 vs 75 µs
    bench.own_server = False  # another server's clients count too: shown, never checked
    shared = {c.target: c for c in fastpath.checks(rows, bench)}
    assert shared[cpu.target].met is None and "shared server" in shared[cpu.target].measured


def test_an_info_line_is_shown_as_info_not_as_a_target() -> None:
    lines = report.render([], [("T", [Check("steps/s", None, "1.00x", info=True)])], {}, [], [])
    assert "[ info  ] steps/s: 1.00x" in lines


def _measure(specs: list[Spec], *, processes: int, rounds: int) -> tuple[list[Row], Row | None]:
    """Rows measured on the test Redis at 0.2 s each, and the reference; no key left."""
    if not redis_url_for_tests().startswith(("redis://", "rediss://", "unix://")):
        pytest.skip("the benchmark measures one server: its rows take a redis:// URL")
    pool = Pool(processes)
    bench = Bench(redis_url_for_tests(), own_server=False, quick=True, pools={"": pool})
    try:
        rows = bench.measure_group(specs, rounds=rounds, duration=0.2)
        reference = bench.finish()
    finally:
        left = list(bench.client.scan_iter(match=f"{bench.root}:*", count=1000))
        bench.cleanup(bench.root)
        bench.client.close()
        pool.close()
    assert left == []  # every row deleted its keys
    return rows, reference


@pytest.mark.real
def test_the_harness_measures_rows_with_ordered_percentiles(real_redis_error: str | None) -> None:
    if real_redis_error is not None:
        pytest.skip(real_redis_error)
    specs = [
        Spec("baseline", baseline.MODULE, "bare HSET", 2, "distinct"),
        Spec("store", store_ops.MODULE, store_ops.REPORT, 1, "one", "", store_ops.prepare),
        Spec("aio", aio.MODULE, aio.RAW, 1, "distinct", "", aio.prepare, requests=4, tasks=4),
    ]
    rows, reference = _measure(specs, processes=2, rounds=2)
    assert reference is not None and reference.key == REFERENCE_KEY
    assert len(reference.details["slice_p50_us"]) == 2  # one slice per round
    for row in [*rows, reference]:
        assert row.details["calls"] > 0
        assert row.p50_us is not None and row.p99_us is not None and row.max_us is not None
        assert 0 < row.p50_us <= row.p99_us <= row.max_us, row
    report_row, raw_row = rows[1], rows[2]
    assert report_row.details["verified"] is True  # every applied report counted once
    assert raw_row.details["verified"] is True
    assert raw_row.details["info"]["captured"] == 4  # one real call per request captured
    assert raw_row.details["info"]["sha_script"] == aio.REPORT_SCRIPT
    assert raw_row.details["outcomes"] == {}  # every raw EVALSHA applied
    assert all(row.details["client_cpu_us"] > 0 for row in rows)


@pytest.mark.real
def test_fastpath_rows_count_round_trips_twice_and_the_servers_work(
    real_redis_error: str | None,
) -> None:
    if real_redis_error is not None:
        pytest.skip(real_redis_error)
    specs = [
        Spec("fastpath", fastpath.MODULE, op, 1, "one", "", fastpath.prepare)
        for op in (fastpath.STEP, fastpath.IN_REPORT, fastpath.PINGS[2])
    ]
    rows, _ = _measure(specs, processes=1, rounds=1)
    for row in rows:
        fastpath.add_figures(row)
        per_pass, counters = row.details["per_pass"], row.details["counters"]
        assert counters["cpu_us"] > 0
        if row.operation == fastpath.PINGS[2]:
            assert counters["calls:ping"] >= 2 * row.details["calls"]  # the server saw them
        else:
            # The wire and the store's own effects agree on what a pass costs.
            assert per_pass["rtt_wire"] == per_pass["rtt_effects"] > 0, row.operation
            assert row.details["verified"] is True  # one pass per committed call
            assert set(row.details["info"]["sent"]) == {"evalsha"}  # the client sends scripts
            assert counters["calls:evalsha"] >= row.details["calls"] * 2
            assert per_pass["cmdstat_us"] > 0


@pytest.mark.real
def test_runtime_rows_drive_every_request_and_measure_the_servers_share(
    real_redis_error: str | None,
) -> None:
    if real_redis_error is not None:
        pytest.skip(real_redis_error)
    n = 2 * runtime.BATCH
    specs = [
        Spec("runtime", runtime.MODULE, op, 1, "distinct", "", runtime.prepare, requests=n)
        for op in (runtime.EACH, runtime.BATCHED)
    ]
    rows, _ = _measure(specs, processes=1, rounds=1)
    for row in rows:
        runtime.add_figures(row)
        d = row.details
        assert d["verified"] is True, row  # every request at its warm pass + the passes counted
        assert d["outcomes"] == {}, row
        assert d["counters"]["passes"] >= n  # at least one pass of every request was timed
        assert d["passes_per_s"] > 0 and d["redis_cpu_us_per_pass"] > 0
        assert 0 < d["redis_cpu_share"] < 2  # one Redis process: at most a core, and noise
        assert d["client_cpu_us_per_pass"] > 0


def test_a_row_set_beside_another_runs_with_it() -> None:
    def spec(op: str, beside: str = "") -> Spec:
        return Spec("s", "m", op, 1, "one", beside=beside)

    # Declared before its partner, it still runs after it; a missing partner keeps its place.
    specs = [spec("a (legacy)", "a|1|one"), spec("a"), spec("b"), spec("c", "missing|1|one")]
    assert [[s.op for s in group] for group in arrange(specs)] == [
        ["a", "a (legacy)"],
        ["b"],
        ["c"],
    ]


def test_legacy_is_compared_in_the_machines_fast_state_whatever_the_mix_of_states() -> None:
    current = Row("store", "record_worker_report", 1, "one", p50_us=110.0, ops_per_s=9e3)
    legacy = Row("legacy", "record_worker_report (legacy)", 1, "one", p50_us=49.0, ops_per_s=1e4)
    current.details["slice_p50_us"] = [113.0, 117.0, 50.0, 112.0]  # mostly the slow state
    legacy.details["slice_p50_us"] = [48.0, 114.0, 49.0, 49.0]  # mostly the fast one
    ratio, fast_current, fast_legacy = fastest_ratio(current, legacy)
    assert (fast_current, fast_legacy) == (50.0, 48.0)
    assert ratio == pytest.approx(50.0 / 48.0)  # whole rows: 2.24x


@pytest.mark.servers
def test_script_costs_replays_every_variant_and_every_rank_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each probe of ``report.lua`` still finds its anchor, each variant's passes go on
    (the tool checks every reply), and every row is printed with its figures."""
    from benchmarks import script_costs

    assert script_costs.main(["--rounds", "1", "--per-round", "3", "--reports", "5"]) == 0
    out = capsys.readouterr().out
    for name in (script_costs.BASELINE, script_costs.HISTORY_OFF, *script_costs.PROBES):
        assert re.search(rf"{re.escape(name)}\s+\d+\.\d\s+[+-]\d+\.\d µs", out), (name, out)
    for n in script_costs.RANK_COUNTS:
        assert re.search(rf"{n:,} ranks\s+\d+\.\d\s+\d+\.\d\dx", out), (n, out)


@pytest.mark.servers
def test_conductor_pass_runs_every_form_and_prints_its_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The quick run checks every pass (rank 1 completes it, the previous tensors are
    unpersisted), and prints each form's row, the ratios and a verdict per conductor form;
    the round trips are the protocol's, whatever the timing."""
    from benchmarks import conductor_pass as cp

    assert cp.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for name, rtt in ((cp.UNBATCHED, 3), (cp.BATCHED, 1), (cp.BASELINE, 2), (cp.PING, 1)):
        assert re.search(rf"{re.escape(name)}\s+{rtt}\s+(\d|-)", out), (name, out)
    for name in (cp.UNBATCHED, cp.BATCHED):
        assert re.search(rf"{re.escape(name)}(\s+\d+\.\d\dx){{6}}", out), (name, out)
    assert re.search(rf"{re.escape(cp.BATCHED)}\s+round trips 1 <= 2: PASS", out), out
    assert re.search(rf"{re.escape(cp.UNBATCHED)}\s+round trips 3 <= 2: FAIL", out), out
    assert "MEMORY USAGE" in out


def test_client_cost_counts_one_unit_as_the_difference_of_two_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each workload runs for ``lo`` and ``hi`` units; a unit's cost is the difference over
    ``hi - lo``, and each row's ratio is to its reference (fake callgrind output)."""
    per = {"ping2": 100, "ping3": 150, "in_report": 250, "take_step": 330, "singles": 9000}
    per |= {"batched": 3000, "runtime": 18000, "pickle": 1500, "codec": 600}
    calls: list[tuple[str, int]] = []

    def fake(command: list[str], env: dict[str, str]) -> str:
        what, units = command[-3], int(command[-2])
        assert command[:2] == ["valgrind", "--tool=callgrind"] and env["PYTHONHASHSEED"] == "0"
        calls.append((what, units))
        return f"==1== Events    : Ir\n==1== Collected : {7_000_000 + per[what] * units}\n"

    assert client_cost.main([], run=fake) == 0
    out = capsys.readouterr().out
    assert re.search(r"pass: report\+report\(then_step\)\s+250\s+2\.50x", out), out
    assert re.search(r"pass: report\+report\+take_step\s+330\s+2\.20x", out), out
    assert re.search(r"64 passes, batched\s+3,000\s+0\.33x", out), out
    assert re.search(r"async runtime, 64 passes\s+18,000\s+2\.00x", out), out
    assert re.search(r"codec: PartitionState msgspec\s+600\s+0\.40x", out), out
    assert ("batched", 1) in calls and ("batched", 5) in calls and ("ping2", 220) in calls
    with pytest.raises(RuntimeError, match="no 'Collected' line"):
        client_cost.collected("valgrind: command not found")


@pytest.mark.servers
@pytest.mark.parametrize(
    "what", sorted({w.child for w in [*client_cost.WORKLOADS, *server_cost.WORKLOADS]})
)
def test_client_cost_workloads_run_on_this_tree(what: str, tmp_path: Path) -> None:
    """What the counts measure still runs (checked passes), without valgrind: the child
    as client_cost starts it, on this tree's store."""
    with RedisServer(tmp_path) as server:
        command = client_cost.child_command(what, 2, server.url)
        done = subprocess.run(
            command, env=client_cost.child_env(client_cost.REPO), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        left = redis.Redis.from_url(server.url).dbsize()
        assert left == 0, f"{left} keys left behind"


class CountingRedis(RedisServer):
    """A plain server whose log ends, as callgrind's would, with a count: here the commands
    it ran (INFO commandstats), so one unit of a workload is the commands it costs."""

    def stop(self) -> None:
        if self.running:
            with self.client() as c:
                calls = sum(v["calls"] for v in c.info("commandstats").values())
            with open(self.logfile, "a") as log:
                log.write(f"==1== Collected : {calls}\n")
        super().stop()


@pytest.mark.servers
def test_server_cost_counts_a_unit_on_servers_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A server per count, the workload's child run against it, the difference over the
    units: two PINGs cost a server two commands, a pass more (without valgrind)."""
    assert server_cost.main(["--quick"], start=CountingRedis) == 0
    out = capsys.readouterr().out
    assert re.search(r"ping x2\s+2\s", out), out
    found = re.search(r"pass: report\+report\(then_step\)\s+([\d,]+)\s", out)
    assert found and int(found.group(1).replace(",", "")) > 2, out
    # With history on, the pass's scripts also append to the stream: more commands.
    priced = re.search(r"pass: report\+report\+take_step\s+[\d,]+\s+(\d+\.\d\d)x", out)
    assert priced and float(priced.group(1)) > 1.0, out
