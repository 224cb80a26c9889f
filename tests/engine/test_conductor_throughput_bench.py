"""``python -m benchmarks.conductor_throughput --quick`` runs: both conductors (the engine's
in-memory one and the store-backed one on a private redis-server) carry their requests
through the emulated workers, and the table and both targets' lines are printed. A smoke
test of the benchmark, not of its figures (PASS or FAIL are both fine here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from store.types import engine_importable
from tests.servers import REDIS_SERVER

if not engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.skipif(shutil.which(REDIS_SERVER) is None, reason="no redis-server binary")
def test_the_quick_benchmark_runs_and_prints_its_verdicts() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.conductor_throughput", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for n in (1, 64):
        for form in ("in-memory", "store-backed"):
            assert re.search(rf"^\s+{n}\s+{form}\s+[\d,]+\s", out, re.M), out
    verdicts = re.findall(r"^target: .*\s(PASS|FAIL)$", out, re.M)
    assert len(verdicts) == 2, out
    assert "requests completed" in done.stderr
