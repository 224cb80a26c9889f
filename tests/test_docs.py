"""The docs site's checks (``docs/hooks.py``), run without MkDocs: every public name of
``store`` has a docstring and an API page, the command line's reference covers every
subcommand, and the changelog page stands with or without ``CHANGELOG.md``."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

import store
from store.cli.main import COMMAND_MODULES, build_parser

pytestmark = pytest.mark.fake

ROOT = Path(__file__).resolve().parent.parent


def load_hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = load_hooks()


def test_every_public_name_and_method_has_a_docstring() -> None:
    assert hooks.undocumented(store) == []


def test_a_missing_docstring_is_found() -> None:
    class Documented:
        """Has one."""

        def method(self) -> None:
            """Has one too."""

        def bare(self) -> None:
            pass

        @property
        def value(self) -> int:
            return 1

    class Bare:
        pass

    def function() -> None:
        pass

    for thing in (Documented, Bare, function):
        thing.__module__ = "store.example"  # the check looks at the project's own classes
    module = types.SimpleNamespace(
        __all__=["Documented", "Bare", "function"],
        Documented=Documented,
        Bare=Bare,
        function=function,
    )
    assert hooks.undocumented(module) == ["Documented.bare", "Documented.value", "Bare", "function"]


def test_every_public_name_is_on_an_api_page() -> None:
    assert hooks.unrendered(store) == []


def test_a_name_on_no_api_page_is_found(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text("# API\n\n::: store.RequestStore\n")
    module = types.SimpleNamespace(__all__=["RequestStore", "Replica"])
    assert hooks.unrendered(module, tmp_path) == ["Replica"]


def test_the_cli_reference_has_every_subcommand_help() -> None:
    reference = hooks.cli_reference()
    names = list(hooks._subcommands(build_parser()))
    assert len(names) >= len(COMMAND_MODULES)  # a module adds one subcommand or more
    for name in names:
        assert f"\n### {name}\n" in reference
        assert f"usage: mstar-store {name} " in reference
    assert "usage: mstar-store [-h] [--version] COMMAND" in reference


def test_the_changelog_page_with_and_without_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changelog = tmp_path / "CHANGELOG.md"
    monkeypatch.setattr(hooks, "CHANGELOG", changelog)
    assert "no `CHANGELOG.md` yet" in hooks.changelog()
    changelog.write_text("# Changelog\n\n## [0.1.0]\n")
    page = hooks.on_page_markdown("<!-- changelog -->\n", page=None, config=None, files=None)
    assert page == "# Changelog\n\n## [0.1.0]\n\n"


def test_the_docs_extra_installs_the_site_builders() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0] for dep in extras["docs"]}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings[python]"} <= names


def load_with(*names: str) -> tuple[Any, Any]:
    """``store`` as griffe inspects it for the API pages: without docs/griffe_store.py's
    extensions, and with those named."""
    griffe = pytest.importorskip("griffe")  # the `docs` extra
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import griffe_store
    finally:
        sys.path.remove(str(ROOT / "docs"))

    def load(*extensions: object) -> Any:
        return griffe.load(
            "store",
            force_inspection=True,
            extensions=griffe.load_extensions(*extensions),
            search_paths=[str(ROOT), *sys.path],
        )

    return load(), load(*(getattr(griffe_store, name)() for name in names))


def test_the_api_pages_show_store_methods_as_their_callers_call_them() -> None:
    """No ``core`` parameter, the operation's result unwrapped."""
    bare, shown = load_with("StoreMethods")
    before = bare["RequestStore"]["take_step"]
    after = shown["RequestStore"]["take_step"]
    assert [p.name for p in before.parameters][:2] == ["core", "lease"]  # what it fixes
    assert [p.name for p in after.parameters] == ["lease", "step", "check_in"]
    assert str(after.returns) == "int"


def test_the_api_pages_show_no_docstring_of_a_values_type() -> None:
    bare, shown = load_with("NoTypeDocstrings")
    assert bare["KeySpace"]["namespace"].docstring.value.startswith("str(")
    assert shown["KeySpace"]["namespace"].docstring is None
    assert shown["KeySpace"]["index"].docstring.value.startswith("``<ns>:requests``")
