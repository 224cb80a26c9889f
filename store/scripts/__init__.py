"""The store's Lua scripts, each prefixed with the shared helpers of ``_lib.lua``."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def source(name: str) -> str:
    """The full source of script ``name`` (file ``<name>.lua``), helpers included."""
    folder = resources.files(__name__)
    helpers = folder.joinpath("_lib.lua").read_text()
    return helpers + "\n" + folder.joinpath(f"{name}.lua").read_text()
