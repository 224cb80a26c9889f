"""Redis's cost of a pass in instructions: the server's side of ``benchmarks.client_cost``.

    python -m benchmarks.server_cost [--only NAME ...] [--against REV] [--quick]   # ~1 min

The issue's Redis target is time (``INFO commandstats`` per pass, ``benchmarks.bench``), and on
a shared machine that time moves by a quarter between runs, more than a change to a script
gains or loses (``benchmarks.script_costs`` replays one tree's scripts, pinned, and still
moves that much). So this counts the instructions the ``redis-server`` process executes
under ``valgrind --tool=callgrind``: the same for the same scripts, arguments and data, run
after run. For each workload and tree a private server is started under callgrind, the
workload's child (``benchmarks.client_cost_child``, the bench's own passes) runs ``lo`` units
against it, the server stops, and the same again for ``hi`` units: the difference over
``hi - lo`` is one unit's cost, start-up and set-up cancelled out. The server's own timer
(``serverCron``, ten times a second) counts too, so a run slowed by a loaded machine counts
a few thousand more per pass: compare within one run, or on a quiet machine.

Workloads: ``ping x2`` (the floor: what two round trips cost Redis without a script), and
the fastpath scenario's 2-rank pass, ``report+report(then_step)`` (no reference ratio:
Redis's target is absolute) and ``report+report+take_step``, against the same pass with
history off (what the history stream costs: issue 12's target of at most 1.10x, in a count
that does not move). With
``--against REV`` the same runs on a worktree of ``REV`` (its own store and scripts) and a
second ratio says how this tree compares.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path

from benchmarks.client_cost import (
    QUICK_SCALE,
    Workload,
    child_command,
    child_env,
    chosen,
    collected,
    log,
    measure,
    parse_args,
    table,
)
from tests.servers import RedisServer

NO_HISTORY = "pass: report+report+take_step, history off"
WORKLOADS = [
    Workload("ping x2", "ping2", 20, 220, None),
    Workload("pass: report+report(then_step)", "in_report", 20, 220, None),
    Workload(NO_HISTORY, "take_step_no_history", 20, 220, None),
    Workload("pass: report+report+take_step", "take_step", 20, 220, NO_HISTORY),
]

# Starts a server (under callgrind) in a folder and gives it back: the default, or a stand-in.
Serve = Callable[[Path], RedisServer]


class CallgrindRedis(RedisServer):
    """A ``redis-server`` run under callgrind; its log ends with the instruction count."""

    def command(self) -> list[str]:
        valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        return [*valgrind, *super().command()]


def serve(workdir: Path) -> RedisServer:
    return CallgrindRedis(workdir)


def per_unit(
    workload: Workload, tree: Path, workdir: Path, scale: int = 1, start: Serve = serve
) -> float:
    """Instructions Redis spent on one unit of ``workload`` run with ``tree``'s store: the
    count of a server that served ``hi`` units less that of one that served ``lo``."""
    lo = workload.lo
    hi = lo + max(1, (workload.hi - lo) // scale)
    counts = []
    for units in (lo, hi):
        folder = Path(tempfile.mkdtemp(prefix=f"{workload.child}-{units}-", dir=workdir))
        server = start(folder).start()
        try:
            done = subprocess.run(
                child_command(workload.child, units, server.url), env=child_env(tree),
                capture_output=True, text=True, check=False,
            )  # fmt: skip
        finally:
            server.stop()  # callgrind writes its count as the server exits
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-5:]
            raise RuntimeError(f"{workload.child} {units} exited {done.returncode}: {tail}")
        counts.append(collected(server.logfile.read_text(errors="replace")))
    return (counts[1] - counts[0]) / (hi - lo)


def main(argv: Iterable[str] | None = None, start: Serve = serve) -> int:
    args = parse_args(
        argv, prog="python -m benchmarks.server_cost", doc=__doc__, workloads=WORKLOADS
    )
    if start is serve and shutil.which("valgrind") is None:
        log("valgrind is not installed: it counts the instructions")
        return 2
    workloads = chosen(args.only, WORKLOADS)
    scale = QUICK_SCALE if args.quick else 1
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="server-cost-")))
        counts, other = measure(
            stack, workloads, args.against,
            lambda w, tree: per_unit(w, tree, workdir, scale, start),
        )  # fmt: skip
    units = "instructions per pass (per pair of PINGs), redis-server process"
    print(table(workloads, counts, other, units))
    return 0 if all(isinstance(v, float) for v in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
