"""Every ```python block of the README and of docs/ runs on its own, prints, and type-checks.

Each block is run alone, in a module of its own, once on fakeredis (``[fake]``) and once on
the real Redis (``[real]``). The blocks connect with ``RequestStore.from_url(...)`` (or the
async store's): that is the one setup the test supplies, pointing ``from_url`` at the
test's backend and at a fresh namespace of its own, which it deletes afterwards; a block's
kinds register into a fresh registry. A block followed by the line "It prints:" and a
```text block must print exactly that. Shell commands and output use other fences and are
not run.

Every block is also checked with ``mypy --strict`` on its own, and no two blocks may create
requests with the same id (a reader runs them one after another, in one namespace).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from store import AsyncRequestStore, RequestStore
from store.codec import kinds, values
from tests.backends import masters, redis_url_for_tests

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A fence opening a block, its body, and what follows it up to the next fence.
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
_PRINTS = "It prints:"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    source: str
    prints: str | None  # what it must print, when the page says

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    """The python blocks of ``page`` (or of ``text``, as if it were the page's), each with
    the output the page says it prints."""
    text = page.read_text() if text is None else text
    fences = list(_FENCE.finditer(text))
    found = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        prints = None
        following = fences[i + 1] if i + 1 < len(fences) else None
        between = text[fence.end() : following.start()] if following else ""
        if following and following.group(1) == "text" and between.strip() == _PRINTS:
            prints = following.group(2)
        line = text.count("\n", 0, fence.start()) + 2  # the block's first line of code
        found.append(Block(page, line, fence.group(2), prints))
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


@pytest.mark.fake
def test_the_pages_have_blocks() -> None:
    """The pattern still finds the blocks (it would otherwise pass on nothing)."""
    pages = {block.page.name for block in BLOCKS}
    assert {"README.md", "getting-started.md", "usage.md", "replicas.md"} <= pages
    assert all(block.prints for block in BLOCKS if block.page.name == "README.md")


@pytest.mark.fake
def test_the_prints_rule_is_read() -> None:
    page = "```python\nprint(1)\n```\n\nIt prints:\n\n```text\n1\n```\n\n```python\nx = 1\n```\n"
    path = ROOT / "docs" / "example.md"
    with_prints, without = blocks_of(path, page)
    assert (with_prints.prints, without.prints) == ("1\n", None)
    assert (with_prints.line, without.line) == (2, 12)


def request_ids(block: Block) -> list[str]:
    """The literal request ids the block creates (``create_request`` / ``submit``)."""
    ids = []
    for node in ast.walk(ast.parse(block.source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"create_request", "submit"}
        ):
            first = node.args[0] if node.args else None
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                f"{block.name}: a request id written out, so readers see whose it is"
            )
            ids.append(first.value)
    return ids


@pytest.mark.fake
def test_no_two_blocks_create_the_same_request() -> None:
    owner: dict[str, str] = {}
    for block in BLOCKS:
        for rid in request_ids(block):
            assert owner.setdefault(rid, block.name) == block.name, (
                f"request {rid!r} is created by {owner[rid]} and {block.name}"
            )
    assert owner, "no block creates a request"


# -- running each block ----------------------------------------------------------------------


def run_block(block: Block) -> str:
    """Run the block alone in a module of its own; what it printed."""
    module = types.ModuleType("docs_block")  # dataclasses look their module up
    sys.modules[module.__name__] = module
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block.source, block.name, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return out.getvalue()


@pytest.fixture
def opened(
    client: Any, namespace: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> list[str]:
    """``from_url`` of both stores made to open the test's backend, in ``namespace``; the
    URLs the block asked for, one per store it opened."""
    fake = isinstance(client, fakeredis.FakeRedis)
    urls: list[str] = []
    server = request.getfixturevalue("fake_server") if fake else None
    real_sync, real_async = RequestStore.from_url, AsyncRequestStore.from_url

    def sync_from_url(cls: type, url: str, **options: Any) -> RequestStore:
        urls.append(url)
        options["namespace"] = namespace
        if fake:
            return RequestStore(fakeredis.FakeRedis(server=server), **options)
        return real_sync(redis_url_for_tests(), **options)

    def async_from_url(cls: type, url: str, **options: Any) -> AsyncRequestStore:
        urls.append(url)
        options["namespace"] = namespace
        if fake:
            return AsyncRequestStore(fakeredis.FakeAsyncRedis(server=server), **options)
        return real_async(redis_url_for_tests(), **options)

    monkeypatch.setattr(RequestStore, "from_url", classmethod(sync_from_url))
    monkeypatch.setattr(AsyncRequestStore, "from_url", classmethod(async_from_url))
    registry = kinds.KindRegistry()  # a copy: a block's kinds do not reach the suite's
    for name, kind in kinds.default_registry.names().items():
        registry.register(kind, name)
    monkeypatch.setattr(kinds, "default_registry", registry)
    monkeypatch.setattr(values, "default_registry", registry)
    return urls


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_block_runs_alone_and_prints(
    block: Block, opened: list[str], client: redis.Redis, namespace: str
) -> None:
    printed = run_block(block)
    # A block that connects does so through from_url, so it ran on the test's backend.
    assert len(opened) == block.source.count(".from_url(")
    assert printed.strip(), f"{block.name} printed nothing"
    if block.prints is not None:
        assert printed == block.prints
    # Whatever the block created, it wrote under the test's namespace, not its own.
    for node in masters(client):
        assert not [*node.scan_iter(match="docs:*"), *node.scan_iter(match="readme:*")]


@pytest.mark.fake
def test_a_failing_block_fails() -> None:
    """The runner raises what a block raises (a block that breaks cannot pass)."""
    broken = Block(ROOT / "README.md", 1, "print('x')\nraise KeyError('boom')\n", None)
    with pytest.raises(KeyError, match="boom"):
        run_block(broken)


# -- mypy --strict on each block ----------------------------------------------------------------


@pytest.mark.fake
def test_every_block_is_mypy_strict_clean(tmp_path: Path) -> None:
    mypy_api = pytest.importorskip("mypy.api")
    files = []
    for i, block in enumerate(BLOCKS):
        # one package per block, so that two blocks' names never meet
        folder = tmp_path / f"block{i}"
        folder.mkdir()
        (folder / "__init__.py").write_text("")
        path = folder / "example.py"
        path.write_text(block.source)
        files.append((str(path), block))
    # A cache of its own: a shared one replays old errors under the old files' paths.
    out, err, status = mypy_api.run(
        ["--strict", "--no-error-summary", "--cache-dir", str(tmp_path / "mypy-cache"),
         *(path for path, _ in files)]
    )  # fmt: skip
    where = {path: block for path, block in files}

    def on_the_page(match: re.Match[str]) -> str:
        block = where[match.group(1)]
        return f"{block.page.relative_to(ROOT)}:{block.line + int(match.group(2)) - 1}:"

    report = re.sub(r"^(\S+\.py):(\d+):", on_the_page, out, flags=re.MULTILINE)
    assert status == 0, report + err
