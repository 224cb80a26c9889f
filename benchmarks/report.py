"""From rows to what is printed: order, ratios against baselines, stall and drift flags, the
table, the checks, and the comparison of two saved runs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import stalls
from benchmarks.harness import REFERENCE_KEY, Check, Row, Scenario


def sort_rows(rows: list[Row], scenarios: Sequence[Scenario]) -> None:
    """Sections in run order; within one, by the scenario's operation order, processes, then
    one before distinct. Rows of operations not in the order keep the order measured."""
    sections = [s.name for s in scenarios]
    orders = {s.name: list(s.order) for s in scenarios}

    def key(row: Row) -> tuple[int, int, int, int]:
        section = sections.index(row.section) if row.section in sections else len(sections)
        order = orders.get(row.section, [])
        if not order:
            return (section, 0, 0, 0)
        name = row.operation if row.operation in order else row.operation.split(" (")[0]
        op = order.index(name) if name in order else len(order)
        return (section, op, row.procs or 0, row.target != "one")

    rows.sort(key=key)


def add_ratios(rows: list[Row]) -> None:
    """This row over the row its ``baseline`` names (a key), for rows without ratios yet."""
    by_key = {r.key: r for r in rows}
    for row in rows:
        if row.ratio_p50 is not None or not row.baseline:
            continue
        base = by_key.get(row.baseline)
        if base is None:
            row.baseline = ""  # that row was not run
            continue
        row.baseline = base.label
        row.ratio_ops = row.ops_per_s / base.ops_per_s  # type: ignore[operator]
        row.ratio_p50 = row.p50_us / base.p50_us  # type: ignore[operator]


def flag(rows: list[Row]) -> list[str]:
    """Mark stalled rows and a drifting reference; the warning lines naming them."""
    warnings = []
    for row in rows:
        if row.p50_us is None or row.max_us is None:
            continue
        why = stalls.stall(row.p50_us, row.max_us)
        if why:
            row.note(why)
            row.details["stall"] = why
            warnings.append(f"warning: {row.label}: {why}")
        if row.key == REFERENCE_KEY:
            why = stalls.drift(row.details.get("slice_p50_us", []))
            if why:
                row.note(why)
                row.details["drift"] = why
                warnings.append(
                    f"warning: {row.label} (the reference, {len(row.details['slice_p50_us'])} "
                    f"slices over the run): {why}: the machine changed during the run, so "
                    "ratios between rows measured at different times are suspect"
                )
    return warnings


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times(value: float | None) -> str:
    return _fmt(value, ".2f") + ("x" if value is not None else "")


HEADER = [
    "operation",
    "procs",
    "target",
    "ops/s",
    "p50 µs",
    "p99 µs",
    "max µs",
    "retries/commit",
    "baseline",
    "x ops/s",
    "x p50",
    "notes",
]
RIGHT = {1, 3, 4, 5, 6, 7, 9, 10}


def table(rows: list[Row]) -> list[str]:
    cells = [HEADER]
    breaks = []
    section = None
    for row in rows:
        if row.section != section:
            breaks.append(len(cells))
            section = row.section
        ratio_ops = _times(row.ratio_ops)
        if row.ratio_ops is not None and row.ratio_ops_unit:
            ratio_ops += f" {row.ratio_ops_unit}"
        cells.append(
            [
                row.operation,
                _fmt(row.procs, "d"),
                row.target,
                _fmt(row.ops_per_s, ",.0f"),
                _fmt(row.p50_us, ",.1f" if (row.p50_us or 0) < 100 else ",.0f"),
                _fmt(row.p99_us, ",.0f"),
                _fmt(row.max_us, ",.0f"),
                _fmt(row.retries_per_commit, ".2f"),
                row.baseline,
                ratio_ops,
                _times(row.ratio_p50),
                row.notes,
            ]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADER))]
    lines = []
    for n, line in enumerate(cells):
        if n in breaks and n > 1:
            lines.append("")
        padded = [
            cell.rjust(widths[i]) if i in RIGHT else cell.ljust(widths[i])
            for i, cell in enumerate(line)
        ]
        lines.append("  ".join(padded).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def render(
    rows: list[Row],
    checks: list[tuple[str, list[Check]]],
    memory: dict[str, Any],
    warnings: list[str],
    skipped: list[str],
) -> str:
    lines = table(rows)
    if memory:
        lines.append("")
        for held in memory.values():
            lines.append(
                f"Redis memory per held request ({held['shape']}), {held['requests']:,} held: "
                f"{held['bytes_per_request']:,.0f} B"
            )
    for title, group in checks:
        if not group:
            continue
        lines += ["", f"{title}:"]
        for check in group:
            if check.info:
                state = "info"
            else:
                state = "n/a" if check.met is None else ("met" if check.met else "NOT met")
            lines.append(f"  [{state:^7}] {check.target}: {check.measured}")
    if skipped:
        lines.append("")
        lines += skipped
    if warnings:
        lines.append("")
        lines += warnings
    return "\n".join(lines)


def compare(old_path: str, new_path: str) -> str:
    """Per row present in both runs: ops/s, p50 and max of each, and new/old."""
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    before = {(r["operation"], r["procs"], r["target"]): r for r in old["rows"]}
    lines = [
        f"{'operation':48} {'procs':>5} {'target':14} {'ops/s old':>10} {'ops/s new':>10} "
        f"{'new/old':>8} {'p50 old':>9} {'p50 new':>9} {'new/old':>8} {'max old':>10} "
        f"{'max new':>10}"
    ]
    for r in new["rows"]:
        o = before.get((r["operation"], r["procs"], r["target"]))
        if o is None or not o["ops_per_s"] or not o["p50_us"]:
            continue
        maxes = [_fmt(x.get("max_us"), ",.0f") for x in (o, r)]  # older runs have no max
        lines.append(
            f"{r['operation']:48} {r['procs'] if r['procs'] is not None else '-':>5} "
            f"{r['target']:14} {o['ops_per_s']:>10,.0f} {r['ops_per_s']:>10,.0f} "
            f"{r['ops_per_s'] / o['ops_per_s']:>7.2f}x {o['p50_us']:>9,.1f} {r['p50_us']:>9,.1f} "
            f"{r['p50_us'] / o['p50_us']:>7.2f}x {maxes[0]:>10} {maxes[1]:>10}"
        )
    return "\n".join(lines)
