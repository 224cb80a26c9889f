"""The sync path against the tree before this session's refactor, in the same run.

The rule: the sync path does not get slower; report and merge p50 within 1.05x of the legacy
tree's (``--legacy REV``, default f8f2fd5), measured in the same run. The rows here are the
store rows' own operations (scenarios/store_ops.py, which uses only the public API), run by a
pool process whose ``sys.path`` starts with a temporary worktree of REV, so it imports that
tree's ``store``. They join the interleaved table, each slice right after the current
row's, in alternating turns, so the two trees meet the same load; the check compares their
fastest turns (``harness.fastest_ratio`` says why).
Each legacy worker creates its own request (the parent only holds the current store).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import Bench, Case, Check, Row, Scenario, Spec, Verify, fastest_ratio
from benchmarks.scenarios import store_ops
from benchmarks.scenarios.store_ops import MERGE, MERGE_NO_READ, REPORT

TREE = "legacy"
ROWS = (
    (REPORT, "sync report"),
    (MERGE, "sync merge"),
    (MERGE_NO_READ, "sync merge (no read-back)"),
)
LIMIT = 1.05


def legacy_name(op: str) -> str:
    return f"{op} (legacy)"


def _prepare(bench: Bench, case: Case) -> Verify | None:
    check = store_ops.prepare(bench, case)  # case.create: the legacy worker creates the request
    root = Path(bench.trees[TREE]["path"])

    def verify(row: Row, c: Case, results: list[dict[str, Any]]) -> None:
        if check is not None:
            check(row, c, results)
        sources = [Path(s) for s in row.details["store_from"]]
        row.details["tree_ok"] = all(s.is_relative_to(root) for s in sources)
        rev = bench.trees[TREE]["rev"]
        row.note(f"tree {rev}" if row.details["tree_ok"] else f"NOT tree {rev}: {sources}")

    return verify


def table(bench: Bench) -> list[Spec]:
    tree = bench.trees.get(TREE, {})
    if not tree.get("path"):
        return []
    return [
        Spec(
            TREE,
            store_ops.MODULE,
            op,
            1,
            "one",
            "",
            _prepare,
            tree=TREE,
            create=True,
            name=legacy_name(op),
            beside=f"{op}|1|one",  # each slice right after the current row's
        )
        for op, _ in ROWS
    ]


def _compare(text: str, current: Row, legacy: Row) -> Check:
    ratio, fast_current, fast_legacy = fastest_ratio(current, legacy)
    turns = len(current.details["slice_p50_us"])
    p50 = current.p50_us / legacy.p50_us  # type: ignore[operator]
    ops = current.ops_per_s / legacy.ops_per_s  # type: ignore[operator]
    return Check(
        text,
        ratio <= LIMIT,
        f"current/legacy p50 {ratio:.2f}x in the fastest of {turns} turns each "
        f"({fast_current:,.1f} vs {fast_legacy:,.1f} µs); whole rows: p50 {p50:.2f}x "
        f"({current.p50_us:,.1f} vs {legacy.p50_us:,.1f} µs), ops/s {ops:.2f}x "
        f"({current.ops_per_s:,.0f} vs {legacy.ops_per_s:,.0f})",
    )


def checks(rows: list[Row], bench: Bench) -> list[Check]:
    tree = bench.trees.get(TREE, {})
    by_key = {r.key: r for r in rows}
    out = []
    for op, what in ROWS:
        text = f"{what} p50 <= {LIMIT:.2f}x legacy"
        current, legacy = by_key.get(f"{op}|1|one"), by_key.get(f"{legacy_name(op)}|1|one")
        if not tree.get("path"):
            out.append(Check(text, None, tree.get("skipped", "not run")))
        elif current is None or legacy is None:
            out.append(Check(text, None, "not measured (needs the store scenario too)"))
        elif not legacy.details.get("tree_ok"):
            out.append(Check(text, False, "the legacy row did not run the legacy tree"))
        else:
            out.append(_compare(text, current, legacy))
    return out


def _title(bench: Bench) -> str:
    tree = bench.trees.get(TREE, {})
    return f"Same-run legacy reference ({tree.get('rev', 'none')}, 1 process, uncontended)"


SCENARIO = Scenario(
    TREE, order=(MERGE, REPORT), table=table, checks=checks, title=_title, trees=(TREE,)
)
