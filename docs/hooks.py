"""MkDocs hooks: pages made from the code, and the checks that make `--strict` fail.

- ``<!-- cli-reference -->`` in a page becomes the ``--help`` of ``mstar-store`` and of each
  subcommand, rendered from the argparse parser the command line itself builds.
- ``<!-- changelog -->`` becomes ``CHANGELOG.md`` at the repository root, or a note that
  there is none yet.
- Before the build, every name of ``store.__all__`` and every public method of those classes
  must have a docstring, and every name must be rendered by an API page (``::: store.NAME``);
  each miss is logged as a warning, which ``mkdocs build --strict`` turns into a failure.

Nothing here imports MkDocs, so ``tests/test_docs.py`` runs the same checks without it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHANGELOG = ROOT / "CHANGELOG.md"
API_PAGES = DOCS / "api"
# A logger under "mkdocs": MkDocs counts its warnings, and --strict fails on any.
log = logging.getLogger("mkdocs.hooks.store_docs")

_DIRECTIVE = re.compile(r"^::: store\.(\w+)\s*$", re.MULTILINE)
# The width the help is wrapped at, so that the page does not depend on the terminal.
HELP_COLUMNS = "96"


# -- the checks --------------------------------------------------------------------------------


def _methods(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties ``cls`` has from the project's own classes."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in {"store", "mstar"}:
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, staticmethod | classmethod):
                yield name, value.__func__
            elif isinstance(value, property):
                yield name, value.fget
            elif inspect.isfunction(value) or _non_data_descriptor(value):
                yield name, value


def _non_data_descriptor(value: Any) -> bool:
    """A method made by a descriptor (the stores' ``sync_method``), not a field (a
    dataclass's or msgspec Struct's member, which can be set)."""
    kind = type(value)
    return hasattr(kind, "__get__") and not hasattr(kind, "__set__") and not isinstance(value, type)


def _has_doc(obj: Any) -> bool:
    return bool((getattr(obj, "__doc__", None) or "").strip())


def undocumented(module: Any) -> list[str]:
    """Every public name of ``module.__all__`` (and public method of its classes) that has
    no docstring, as ``name`` or ``Class.method``."""
    missing: list[str] = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            if not _has_doc(obj):  # a class's __doc__ is its own, never inherited
                missing.append(name)
            missing.extend(f"{name}.{m}" for m, f in _methods(obj) if not _has_doc(f))
        elif not _has_doc(obj if callable(obj) else type(obj)):  # an instance: its class's
            missing.append(name)
    return missing


def unrendered(module: Any, pages: Path = API_PAGES) -> list[str]:
    """The names of ``module.__all__`` that no ``::: store.NAME`` of an API page renders."""
    rendered = {
        match for page in pages.glob("*.md") for match in _DIRECTIVE.findall(page.read_text())
    }
    return [name for name in module.__all__ if name not in rendered]


# -- generated pages ---------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    with _columns(HELP_COLUMNS):
        return parser.format_help()


@contextlib.contextmanager
def _columns(width: str) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_reference() -> str:
    """Markdown: ``mstar-store --help``, then one section per subcommand with its help."""
    from store.cli.main import build_parser

    with _columns(HELP_COLUMNS), contextlib.redirect_stdout(io.StringIO()):
        parser = build_parser()
    parts = ["### mstar-store", "", "```text", _help(parser).rstrip(), "```", ""]
    for name, sub in _subcommands(parser).items():
        parts += [f"### {name}", "", "```text", _help(sub).rstrip(), "```", ""]
    return "\n".join(parts)


def changelog() -> str:
    """``CHANGELOG.md`` as it is, or a page saying it is not written yet."""
    if CHANGELOG.is_file():
        return CHANGELOG.read_text()
    return "# Changelog\n\nThis tree has no `CHANGELOG.md` yet.\n"


# -- MkDocs events -----------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    import store

    for name in undocumented(store):
        log.warning("public name without a docstring: store.%s", name)
    for name in unrendered(store):
        log.warning("public name on no API page: store.%s (add '::: store.%s')", name, name)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- changelog -->" in markdown:
        markdown = markdown.replace("<!-- changelog -->", changelog())
    return markdown
