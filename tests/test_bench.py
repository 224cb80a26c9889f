"""The benchmark's harness and its stall and drift detectors (no timing is asserted)."""

from __future__ import annotations

import pytest
import redis

from benchmarks import report, stalls
from benchmarks.harness import REFERENCE_KEY, Bench, Pool, Row, Spec, arrange
from benchmarks.scenarios import aio, baseline, store_ops
from benchmarks.scenarios.legacy import fastest_ratio
from tests.conftest import redis_url_for_tests


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
    commands = aio.parse_commands(b"".join(bytes(chunk) for chunk in packed))
    assert commands == [[b"EVALSHA", b"ab12", b"2", b"k1", b"k2", b"7", b"\x00\r\n"], [b"PING"]]


@pytest.mark.real
def test_the_harness_measures_rows_with_ordered_percentiles(real_redis_error: str | None) -> None:
    if real_redis_error is not None:
        pytest.skip(real_redis_error)
    pool = Pool(2)
    bench = Bench(redis_url_for_tests(), own_server=False, quick=True, pools={"": pool})
    try:
        specs = [
            Spec("baseline", baseline.MODULE, "bare HSET", 2, "distinct"),
            Spec("store", store_ops.MODULE, store_ops.REPORT, 1, "one", "", store_ops.prepare),
            Spec("aio", aio.MODULE, aio.RAW, 1, "distinct", "", aio.prepare, requests=4, tasks=4),
        ]
        rows = bench.measure_group(specs, rounds=2, duration=0.2)
        reference = bench.finish()
    finally:
        left = list(bench.client.scan_iter(match=f"{bench.root}:*", count=1000))
        bench.cleanup(bench.root)
        bench.client.close()
        pool.close()
    assert left == []  # every row deleted its keys
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
    assert raw_row.details["outcomes"] == {}  # every raw EVALSHA applied


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
