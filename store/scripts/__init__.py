"""The store's Lua scripts, each prefixed with the shared helpers of ``_lib.lua`` it uses.

Redis runs a script's whole body on every call, so a helper the script never calls still
costs it a closure per call: only the helpers a script refers to (and those they refer
to) are put in front of it, in the order ``_lib.lua`` defines them.

A script whose file starts with a flag line (``#!lua ...``, Redis 7) keeps it as the very
first line, before the helpers: Redis reads the flags only there.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

# A top-level definition of _lib.lua: "local function name(" or "local name =".
_DEFINITION = re.compile(r"^local (?:function )?([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)


@cache
def source(name: str) -> str:
    """The full source of script ``name`` (file ``<name>.lua``), with the helpers it needs."""
    return assemble(resources.files(__name__).joinpath(f"{name}.lua").read_text())


def assemble(body: str) -> str:
    """A script's text (``body``, as in its file) with the helpers it needs in front of it,
    and its flag line, if any, still first."""
    flags = ""
    if body.startswith("#!"):
        flags, body = body.split("\n", 1)
        flags += "\n"
    return flags + "".join(_helpers_for(body)) + "\n" + body


@cache
def _helpers() -> list[tuple[str, str]]:
    """(name, source) of each top-level definition of _lib.lua, in order."""
    text = resources.files(__name__).joinpath("_lib.lua").read_text()
    starts = [m.start() for m in _DEFINITION.finditer(text)]
    chunks = []
    for start, end in zip(starts, [*starts[1:], len(text)], strict=True):
        chunk = text[start:end]
        match = _DEFINITION.match(chunk)
        assert match is not None
        chunks.append((match.group(1), chunk))
    return chunks


def _helpers_for(body: str) -> list[str]:
    chunks = _helpers()
    needed: set[str] = set()
    grew = True
    while grew:
        grew = False
        text = body + "".join(chunk for name, chunk in chunks if name in needed)
        for name, _ in chunks:
            if name not in needed and re.search(rf"\b{name}\b", text):
                needed.add(name)
                grew = True
    return [chunk for name, chunk in chunks if name in needed]
