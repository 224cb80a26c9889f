"""The files a newcomer or a package index reads: LICENSE, CHANGELOG.md, CONTRIBUTING.md and
the package's metadata agree with each other and with the code."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fake

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
KEEP_A_CHANGELOG = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_the_license_is_apache_2_as_the_metadata_says() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    # An SPDX expression and a License :: classifier together are an error to setuptools.
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])


def test_metadata_names_authors_urls_keywords_and_the_pythons_it_runs_on() -> None:
    assert PROJECT["readme"] == "README.md" and (ROOT / "README.md").exists()
    assert PROJECT["authors"] and PROJECT["keywords"]
    assert all(url.startswith("https://") for url in PROJECT["urls"].values())
    floor = PROJECT["requires-python"].removeprefix(">=")
    versions = [c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]  # fmt: skip
    assert versions and min(versions, key=lambda v: int(v.split(".")[1])) == floor


def test_the_changelog_keeps_a_changelog() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(.+?)\]", text, re.MULTILINE)
    assert releases and releases[0] == "Unreleased"
    sections = set(re.findall(r"^### (.+)$", text, re.MULTILINE))
    assert sections and sections <= KEEP_A_CHANGELOG


def test_the_commands_contributing_names_exist() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    modules = set(re.findall(r"python -m (benchmarks\.\w+)", text))
    assert modules
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    named = set(re.findall(r"pytest -m (\w+)", text))
    assert named and named <= markers
    assert "pytest -m fake" in text and "ruff check ." in text and "mypy " in text
