"""The store against the floor: one run, one table, every ratio against a baseline of that run.

    python -m benchmarks.bench [--redis-url URL] [--quick] [--only a,b] [--json out.json]
                               [--legacy REV|none] [--compare OLD NEW]

Starts its own throw-away redis-server (unless ``--redis-url``), runs the scenarios of
benchmarks/scenarios/ (bare redis-py baselines, the naive pickle design, the store's
operations at 1, 4 and 16 processes, the same sync rows on a legacy tree, the codec against
pickle, latency against requests held, an asyncio process with 64 calls in flight), then
prints one table, stall and drift warnings, and every scenario's checks. See
benchmarks/README.md.

Only keys under the run's own namespace are ever written or deleted on a server the
benchmark did not start. This module imports nothing of ``store`` or ``mstar`` at module
level: spawned workers import it as their main module (see benchmarks.harness).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis

from benchmarks import report, stalls
from benchmarks.harness import Bench, Pool, Scenario
from benchmarks.worktree import Tree, checkout

DEFAULT_JSON = Path(__file__).parent / "results" / "latest.json"
DEFAULT_LEGACY = "f8f2fd5"  # the last commit before the sans-IO refactor of the store
POOL_SIZE = 16  # the most processes a row uses


def parse_args(names: list[str], argv: Iterable[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--redis-url",
        help="use this Redis instead of starting one (only the "
        "run's own namespace is written and deleted)",
    )
    parser.add_argument("--quick", action="store_true", help="0.7 s per row, 10,000 held")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    parser.add_argument(
        "--only",
        default=",".join(names),
        help=f"comma-separated scenarios to run, of {','.join(names)}",
    )
    parser.add_argument(
        "--legacy",
        default=DEFAULT_LEGACY,
        metavar="REV",
        help="git revision whose store the legacy rows run (a temporary worktree); "
        f"'none' skips them (default {DEFAULT_LEGACY})",
    )
    parser.add_argument(
        "--flat-tolerance",
        type=float,
        default=1.25,
        help="p50 at the most requests held over p50 at 1 that counts as flat",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="print per-row ratios of two JSON results and exit",
    )
    return parser.parse_args(argv)


def _legacy_tree(stack: ExitStack, rev: str, log: Any) -> Tree:
    if rev.lower() == "none":
        return Tree(rev, skipped="--legacy none")
    return stack.enter_context(checkout(rev, log))


def run(args: argparse.Namespace, scenarios: list[Scenario], log: Any) -> tuple[Bench, Any]:
    """Measure every scenario; the bench (rows, memory, skips) and the server's INFO."""
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mstar-bench-")))
        tree = Tree("none", skipped="not selected")
        if any("legacy" in s.trees for s in scenarios):
            tree = _legacy_tree(stack, args.legacy, log)
        url = args.redis_url
        if url is None:
            from tests.servers import RedisServer  # only needed when we start one

            server = RedisServer(tmp).start()
            stack.callback(server.stop)
            url = server.url
        pools = {"": Pool(POOL_SIZE)}
        stack.callback(pools[""].close)
        if tree.path is not None:
            pools["legacy"] = Pool(1, path_first=tree.path)
            stack.callback(pools["legacy"].close)
        bench = Bench(url, args.redis_url is None, args.quick, pools)
        if args.redis_url is not None:  # also after an error or Ctrl-C: a shared server
            stack.callback(bench.cleanup, bench.root)
        bench.options["flat_tolerance"] = args.flat_tolerance
        bench.trees["legacy"] = {
            "rev": tree.rev,
            "commit": tree.commit,
            "path": str(tree.path) if tree.path else "",
            "skipped": tree.skipped,
        }
        if tree.skipped and tree.skipped != "not selected":
            bench.skip("legacy rows", tree.skipped)
        info = bench.client.info("server")
        specs = [spec for s in scenarios if s.table is not None for spec in s.table(bench)]
        if specs:
            log(f"{len(specs)} rows, interleaved in {bench.rounds} rounds")
            bench.measure_group(specs, rounds=bench.rounds)
        for scenario in scenarios:
            if scenario.measure is not None:
                scenario.measure(bench)
        bench.finish()
    return bench, info


def main(argv: Iterable[str] | None = None) -> int:
    from benchmarks import scenarios as registry  # imports the store: not at module level

    everything = registry.load()
    names = [s.name for s in everything]
    args = parse_args(names, argv)
    if args.compare:
        print(report.compare(*args.compare))
        return 0
    chosen = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = chosen - set(names)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {names}")
    scenarios = [s for s in everything if s.name in chosen]
    started = time.perf_counter()
    load_before = os.getloadavg()[0]

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    bench, info = run(args, scenarios, log)
    report.sort_rows(bench.rows, everything)
    report.add_ratios(bench.rows)
    warnings = report.flag(bench.rows)
    checks = [
        (s.title(bench) if callable(s.title) else s.title, s.checks(bench.rows, bench))
        for s in scenarios
        if s.checks is not None
    ]
    merged: dict[str, list[Any]] = {}  # scenarios sharing a heading list their checks together
    for title, group in checks:
        merged.setdefault(title, []).extend(group)
    print(report.render(bench.rows, list(merged.items()), bench.memory, warnings, bench.skipped))
    elapsed = time.perf_counter() - started
    load = (load_before, os.getloadavg()[0])
    cpus = os.cpu_count() or 1
    import msgspec

    print(
        f"\n(run took {elapsed:.0f} s; {'--quick' if args.quick else 'full'}; "
        f"redis {info['redis_version']}, redis-py {redis.__version__}, "
        f"msgspec {msgspec.__version__}, Python {platform.python_version()}, "
        f"{cpus} CPUs, load average {load[0]:.1f} before and {load[1]:.1f} after)"
    )
    if max(load) > cpus:
        print(
            "warning: the machine was busy with other work (load average above the CPU count); "
            "absolute figures are low and ratios noisy: run again when it is quiet"
        )
    for line in warnings:
        log(line)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": args.quick,
        "duration_per_row_s": bench.duration,
        "rounds": bench.rounds,
        "elapsed_s": elapsed,
        "redis": info["redis_version"],
        "redis_py": redis.__version__,
        "msgspec": msgspec.__version__,
        "python": platform.python_version(),
        "cpus": cpus,
        "load_average": load,
        "own_server": bench.own_server,
        "scenarios": [s.name for s in scenarios],
        "legacy": bench.trees["legacy"],
        "thresholds": {
            "drift_factor": stalls.DRIFT_FACTOR,
            "stall_factor": stalls.STALL_FACTOR,
            "stall_floor_us": stalls.STALL_FLOOR_US,
            "stall_absolute_us": stalls.STALL_ABSOLUTE_US,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    result = {
        "meta": meta,
        "rows": [r.__dict__ for r in bench.rows],
        "memory": bench.memory,
        "checks": [dict(c.__dict__, group=title) for title, group in checks for c in group],
        "warnings": warnings,
        "skipped": bench.skipped,
    }
    out.write_text(json.dumps(result, indent=1))
    log(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
