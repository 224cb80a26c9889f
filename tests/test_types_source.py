"""Where store.types takes the engine's types from, and what a wrong setting says."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from store import types as store_types
from store.errors import ConfigurationError
from store.types import choose_source, engine_importable

CHECKOUT = Path(__file__).resolve().parents[1]


def test_bundled_is_always_available() -> None:
    assert choose_source("bundled") == "bundled"


def test_auto_follows_the_engine() -> None:
    assert choose_source("auto") == ("engine" if engine_importable() else "bundled")
    assert choose_source("") == choose_source("auto")


def test_a_setting_it_does_not_know_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="MSTAR_STORE_TYPES='Engine'"):
        choose_source("Engine")


def test_asking_for_a_missing_engine_says_how_to_install_it() -> None:
    if engine_importable():
        assert choose_source("engine") == "engine"
        return
    with pytest.raises(ConfigurationError, match=r"mstar-conductor-store\[mstar\]"):
        choose_source("engine")


def _engine_installed() -> bool:
    """The oracle: is the mstar-ai distribution installed (pip's view, not the import path)?"""
    try:
        importlib.metadata.distribution("mstar-ai")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_checkouts_mstar_link_is_not_the_engine() -> None:
    """Run from the checkout, whose ``mstar`` is the reference copy without ``__init__.py``:
    only an installed engine (a regular package) counts."""
    code = (
        "import importlib.util, store.types as t;"
        "spec = importlib.util.find_spec('mstar');"
        "print(spec is not None, t.engine_importable(), t.SOURCE)"
    )
    env = {k: v for k, v in os.environ.items() if k != "MSTAR_STORE_TYPES"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=CHECKOUT, env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    found, importable, source = done.stdout.split()
    installed = _engine_installed()
    assert found == "True"  # the link is seen (as a namespace package where no engine is)
    assert importable == str(installed)
    assert source == ("engine" if installed else "bundled")


def test_every_name_is_exported_and_loaded() -> None:
    """__all__, the module map the names are loaded from, and what the module holds agree."""
    assert set(store_types.__all__) == {"SOURCE", *store_types._MODULES}
    for name in store_types.__all__:
        assert hasattr(store_types, name), name
