"""Running ``mstar-store`` in-process for a test: its exit code, stdout and stderr."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import pytest

from store.cli import main as cli


def run(*argv: str) -> tuple[int, str, str]:
    """``mstar-store *argv``; ``--help`` and ``--version`` (which exit) count as exit 0."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exit:
            code = int(exit.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The commands' defaults, not the environment's ($MSTAR_REDIS_URL, $MSTAR_NAMESPACE)."""
    monkeypatch.delenv("MSTAR_REDIS_URL", raising=False)
    monkeypatch.delenv("MSTAR_NAMESPACE", raising=False)
    yield
