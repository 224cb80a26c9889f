"""The client's cost of a pass in instructions: repeatable where seconds are not.

    python -m benchmarks.client_cost [--only NAME ...] [--against REV] [--quick]   # ~3 min

Client CPU on a shared machine moves by a third from run to run, more than most changes to
the hot path gain or lose; so this counts the instructions the client process executes
(``valgrind --tool=callgrind``), which stay within about 1% for the same code and inputs
whatever else the machine does. Each workload runs twice under callgrind, for ``lo`` and for
``hi`` units (a unit: one pass, or a pair of PINGs), and the difference over ``hi - lo`` is
the cost of one unit: start-up, imports and set-up cancel out. A private ``redis-server``
answers (the server's work is not counted: it runs in another process).

Workloads (``benchmarks.client_cost_child``), each the bench's own:

- ``ping x2`` / ``ping x3``: bare redis-py PINGs, the floor of a pass of 2 or 3 round trips;
- ``pass: report+report(then_step)`` and ``pass: report+report+take_step``: the fastpath
  scenario's 2-rank pass;
- ``64 passes, batched`` and ``64 passes, one call each``: the batch scenario's pass of 64
  requests (``Passes``), per pass of all 64;
- ``async runtime, 64 passes``: the runtime scenario's pass of 64 requests in flight, each
  through ``AsyncReplica.apply_report`` (asyncio, redis-py's asyncio client), per pass of
  all 64;
- ``codec: PartitionState msgspec`` / ``pickle``: the codec scenario's partition encoded and
  decoded (no Redis), by this tree's ``Codec`` and by pickle.

The table gives instructions per unit and the ratio to its reference (the PINGs of as many
round trips, the sync store's one call each, or pickle). With ``--against REV``, the same
workloads also run on a worktree of ``REV`` (its own store and shapes) and a second ratio
says how this tree compares. Only user-space instructions are counted: the system calls of
the round trips (the same for the store and for a PING) are not, so these ratios are above
the CPU-time ratios of ``benchmarks.bench``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from benchmarks import worktree
from tests.servers import RedisServer

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("client_cost_child.py")


@dataclass(frozen=True)
class Workload:
    name: str
    child: str  # what client_cost_child.py runs
    lo: int
    hi: int
    reference: str | None  # the workload whose units this one is compared with


WORKLOADS = [
    Workload("ping x2", "ping2", 20, 220, None),
    Workload("ping x3", "ping3", 20, 220, None),
    Workload("pass: report+report(then_step)", "in_report", 20, 220, "ping x2"),
    Workload("pass: report+report+take_step", "take_step", 20, 220, "ping x3"),
    Workload("64 passes, one call each", "singles", 1, 5, None),
    Workload("64 passes, batched", "batched", 1, 5, "64 passes, one call each"),
    Workload("async runtime, 64 passes", "runtime", 1, 5, "64 passes, one call each"),
    Workload("codec: PartitionState pickle", "pickle", 20, 220, None),
    Workload("codec: PartitionState msgspec", "codec", 20, 220, "codec: PartitionState pickle"),
]
QUICK_SCALE = 4  # --quick: a quarter of the units between lo and hi

Runner = Callable[[list[str], dict[str, str]], str]


def run_process(command: list[str], env: dict[str, str]) -> str:
    """What ``command`` wrote to stderr (callgrind's summary goes there); fails loudly."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(command[-3:])} exited {done.returncode}: {tail}")
    return done.stderr


def collected(stderr: str) -> int:
    """The instruction count of callgrind's ``Collected : N`` line."""
    found = re.search(r"^==\d+== Collected : (\d+)$", stderr, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no 'Collected' line in callgrind's output: {stderr[-300:]!r}")
    return int(found.group(1))


def child_command(child: str, units: int, url: str) -> list[str]:
    """The child that runs ``units`` of workload ``child`` (under callgrind, in ``per_unit``)."""
    return [sys.executable, str(CHILD), child, str(units), url]


def child_env(tree: Path) -> dict[str, str]:
    """The child's environment: ``tree``'s store and workloads, a fixed hash seed."""
    return {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}


def per_unit(
    workload: Workload, tree: Path, url: str, run: Runner = run_process, scale: int = 1
) -> float:
    """Instructions of one unit of ``workload`` with ``tree``'s store: the count at ``hi``
    units less the count at ``lo``, over ``hi - lo``."""
    lo = workload.lo
    hi = lo + max(1, (workload.hi - lo) // scale)
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    counts = [
        collected(run(valgrind + child_command(workload.child, units, url), child_env(tree)))
        for units in (lo, hi)
    ]
    return (counts[1] - counts[0]) / (hi - lo)


def parse_args(
    argv: Iterable[str] | None,
    *,
    prog: str = "python -m benchmarks.client_cost",
    doc: str | None = __doc__,
    workloads: list[Workload] = WORKLOADS,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    names = [w.name for w in workloads]
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=names, default=None)
    parser.add_argument("--against", metavar="REV", help="also measure a worktree of REV")
    parser.add_argument("--quick", action="store_true", help="a quarter of the units")
    return parser.parse_args(list(argv) if argv is not None else None)


def chosen(only: list[str] | None, workloads: list[Workload] = WORKLOADS) -> list[Workload]:
    """The workloads asked for, and the references their ratios need."""
    if not only:
        return list(workloads)
    wanted = set(only)
    wanted |= {w.reference for w in workloads if w.name in wanted and w.reference}
    return [w for w in workloads if w.name in wanted]


Count = Callable[[Workload, Path], float]  # one unit of a workload with a tree's store


def measure(
    stack: ExitStack, workloads: list[Workload], against: str | None, count: Count
) -> tuple[dict[tuple[str, str], float | str], str | None]:
    """``count`` of each workload on this tree and, with ``against``, on a worktree of that
    revision (left open on ``stack``); the counts by (workload, tree label), and the label of
    the other tree if it was measured."""
    trees = {"this tree": REPO}
    if against:
        other = stack.enter_context(worktree.checkout(against, log))
        if other.path is None:
            log(f"--against skipped: {other.skipped}")
        else:
            trees[against] = other.path
    counts: dict[tuple[str, str], float | str] = {}
    for w in workloads:
        for label, tree in trees.items():
            try:
                counts[w.name, label] = count(w, tree)
            except RuntimeError as e:
                counts[w.name, label] = f"not measured: {e}"
            log(f"  {w.name} ({label}): {_shown(counts[w.name, label])}")
    return counts, against if len(trees) > 1 else None


def main(argv: Iterable[str] | None = None, run: Runner = run_process) -> int:
    args = parse_args(argv)
    if run is run_process and shutil.which("valgrind") is None:
        log("valgrind is not installed: it counts the instructions")
        return 2
    workloads = chosen(args.only)
    scale = QUICK_SCALE if args.quick else 1
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="client-cost-")))
        server = stack.enter_context(RedisServer(workdir))
        counts, other = measure(
            stack, workloads, args.against,
            lambda w, tree: per_unit(w, tree, server.url, run, scale),
        )  # fmt: skip
    units = (
        "instructions per unit (a pass; a pair or triple of PINGs; a pass of each of 64 "
        "requests; an encode+decode), client process, user space"
    )
    print(table(workloads, counts, other, units))
    return 0 if all(isinstance(v, float) for v in counts.values()) else 1


def table(
    workloads: list[Workload],
    counts: dict[tuple[str, str], float | str],
    against: str | None,
    units: str,
) -> str:
    """Instructions per unit, the ratio to the reference, and to ``against``'s tree."""
    width = max([34, *(len(w.name) for w in workloads)])
    head = f"{'workload':<{width}} {'instructions':>14}  {'x reference':>11}"
    if against:
        head += f"  {'x ' + against:>14}"
    lines = [head, "-" * len(head)]
    for w in workloads:
        mine = counts[w.name, "this tree"]
        ref = counts.get((w.reference, "this tree")) if w.reference else None
        row = f"{w.name:<{width}} {_shown(mine):>14}  "
        row += f"{_ratio(mine, ref):>11}" if w.reference else f"{'-':>11}"
        if against:
            row += f"  {_ratio(mine, counts.get((w.name, against))):>14}"
        lines.append(row)
        if isinstance(mine, str):
            lines.append(f"    {mine}")
    return "\n".join([*lines, f"({units}; reference: {_references(workloads)})"])


def log(text: str) -> None:
    print(text, file=sys.stderr)  # stdout holds the table


def _references(workloads: list[Workload]) -> str:
    return "; ".join(f"{w.name} -> {w.reference}" for w in workloads if w.reference) or "none"


def _shown(value: float | str | None) -> str:
    return f"{value:,.0f}" if isinstance(value, float) else "-"


def _ratio(a: float | str | None, b: float | str | None) -> str:
    if isinstance(a, float) and isinstance(b, float) and b > 0:
        return f"{a / b:.2f}x"
    return "-"


if __name__ == "__main__":
    sys.exit(main())
