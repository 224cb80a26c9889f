"""The README's examples run as written, on fakeredis (``from_url`` is pointed at it).

The blocks of one section run in order in one module: the asyncio conductor continues the
sync one, as the README says.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from store import AsyncRequestStore, RequestStore
from store.codec import kinds

pytestmark = pytest.mark.fake

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section titled ``section``."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)


def run_blocks(blocks: list[str], name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run the blocks in order in one module (dataclasses need theirs in sys.modules)."""
    module = types.ModuleType("readme_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for block in blocks:
        exec(compile(block, f"README.md ({name})", "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture
def on_fakeredis(monkeypatch: pytest.MonkeyPatch, namespace: str) -> fakeredis.FakeServer:
    server = fakeredis.FakeServer()
    # Kinds the examples register go to a registry of their own, not the tests' global one.
    monkeypatch.setattr(kinds, "default_registry", kinds.KindRegistry())

    def sync_from_url(cls: type, url: str, **options: Any) -> RequestStore:
        options = {**options, "namespace": namespace}  # the example's own would do as well
        return RequestStore(fakeredis.FakeRedis(server=server), **options)

    def async_from_url(cls: type, url: str, **options: Any) -> AsyncRequestStore:
        options = {**options, "namespace": namespace}
        return AsyncRequestStore(fakeredis.FakeAsyncRedis(server=server), **options)

    monkeypatch.setattr(RequestStore, "from_url", classmethod(sync_from_url))
    monkeypatch.setattr(AsyncRequestStore, "from_url", classmethod(async_from_url))
    return server


@pytest.mark.parametrize("section", ["Using the library", "Running several replicas"])
def test_the_readme_examples_run(
    on_fakeredis: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch, section: str
) -> None:
    blocks = python_blocks(section)
    assert blocks, f"no python block in {section!r}"
    run_blocks(blocks, section, monkeypatch)


def test_the_conductor_example_finished_both_requests(
    on_fakeredis: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scope = run_blocks(python_blocks("Running several replicas"), "conductor", monkeypatch)
    store = RequestStore.from_url("redis://unused")
    for rid in ("req-1", "req-2"):
        record = store.load_record(rid)
        assert record.finished_at > 0 and record.final_outputs == {"tokens": 3}
    assert scope["replica"].draining
