"""The ``exclusive`` marker holds: under pytest-xdist, no test runs beside an exclusive one.

A child pytest on 3 workers runs 2 exclusive tests and 12 others, each writing when it
started and ended; no other test's span may overlap an exclusive one's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, time
import pytest

LOG = os.environ["PROBE_LOG"]


def span(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(json.dumps({"name": name, "start": start, "end": time.time()}) + "\\n")


@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(2))
def test_exclusive(i):
    span(f"exclusive-{i}", 0.5)


@pytest.mark.parametrize("i", range(12))
def test_shared(i):
    span(f"shared-{i}", 0.2)
"""


@pytest.mark.slow
def test_no_test_runs_beside_an_exclusive_one(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.exclusive import share_the_machine  # noqa: F401\n"
    )
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    exclusive: runs alone\n")
    log = tmp_path / "spans.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider",
         str(tmp_path)],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                           "PROBE_LOG": str(log)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    spans = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(spans) == 14
    exclusive = [s for s in spans if s["name"].startswith("exclusive")]
    beside = [
        (x["name"], s["name"])
        for x in exclusive
        for s in spans
        if s is not x and s["start"] < x["end"] and s["end"] > x["start"]
    ]
    assert beside == []
    # and the others did run side by side (the probe would show nothing otherwise)
    shared = [s for s in spans if s["name"].startswith("shared")]
    assert any(
        a["start"] < b["end"] and a["end"] > b["start"]
        for a in shared
        for b in shared
        if a is not b
    )
