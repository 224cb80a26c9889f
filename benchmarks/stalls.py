"""Pure detectors of runs whose figures cannot be trusted: a stalled call, a drifting machine.

A p99 hides a call that hung for minutes once in 100,000; the max does not. And ratios between
rows assume the machine stayed the same through the run: the bare PING reference, measured in
slices spread over the whole run, tells whether it did.

Thresholds, and why (figures from --quick runs on this shared 2-core machine):

- ``DRIFT_FACTOR`` 1.5: while the machine holds steady the reference's p50 stays within
  about 15 % from slice to slice (21.8-25.0 µs over 13 slices of one run); when it changes it
  moves by 2-5x (the same run's last slices: 100-109 µs). On this VM the usual cause is where
  the scheduler puts the client: on redis-server's core a PING takes 25 µs, on the other one
  about 100 µs (measured with taskset); a neighbour's load does the same. Such a shift changes
  every store-to-bare ratio. 1.5x is well clear of the noise and well below shifts that size.
- ``STALL_FACTOR`` 100x p50, but only from ``STALL_FLOOR_US`` 50 ms: a process descheduled
  for a time slice or two is ordinary here (1-process rows with a p50 of 25-50 µs show maxes
  of 3-8 ms, 120-170x; 16-process rows up to 36 ms, at 15x their p50); a call held for 50 ms
  and 100x the typical call is not a scheduling hiccup but a blocked server, a lost packet's
  retransmit or a fork for a snapshot.
- ``STALL_ABSOLUTE_US`` 1 s: whatever the p50, a call that took a second stalled.
"""

from __future__ import annotations

from collections.abc import Sequence

DRIFT_FACTOR = 1.5
STALL_FACTOR = 100.0
STALL_FLOOR_US = 50_000.0
STALL_ABSOLUTE_US = 1_000_000.0


def duration(us: float) -> str:
    """``us`` microseconds, in the unit a reader takes in at a glance."""
    if us >= 1e6:
        return f"{us / 1e6:,.1f} s"
    if us >= 1e3:
        return f"{us / 1e3:,.1f} ms"
    return f"{us:,.0f} µs"


def stall(
    p50_us: float,
    max_us: float,
    *,
    factor: float = STALL_FACTOR,
    floor_us: float = STALL_FLOOR_US,
    absolute_us: float = STALL_ABSOLUTE_US,
) -> str | None:
    """Why the row's slowest call counts as a stall, or None if it does not."""
    if max_us >= absolute_us:
        return f"stall: max {duration(max_us)} (>= {duration(absolute_us)})"
    if max_us >= floor_us and max_us > factor * p50_us:
        return f"stall: max {duration(max_us)} = {max_us / p50_us:,.0f}x p50"
    return None


def drift(slice_p50s_us: Sequence[float], *, factor: float = DRIFT_FACTOR) -> str | None:
    """Why the reference's p50 changed too much between its slices, or None if it held."""
    if len(slice_p50s_us) < 2:
        return None
    low, high = min(slice_p50s_us), max(slice_p50s_us)
    if high <= factor * low:
        return None
    return (
        f"drift: p50 {duration(low)} to {duration(high)} between slices "
        f"({high / low:.2f}x > {factor:.2f}x)"
    )
