"""A temporary ``git worktree`` of another revision, for same-run references (``--legacy``).

Removed when the run ends, also on error or Ctrl-C. Everything that can go wrong (no git, no
such revision, a tree without a ``store`` package) comes back as a reason to skip, not as a
failed run.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Tree:
    rev: str
    commit: str = ""
    path: Path | None = None
    skipped: str = ""  # why there is no tree


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"git {args[0]} exited {done.returncode}")
    return done.stdout.strip()


@contextmanager
def checkout(rev: str, log: Callable[[str], None]) -> Iterator[Tree]:
    """``git worktree add --detach <tmp> rev`` for the duration of the block."""
    tree = Tree(rev)
    tmp = Path(tempfile.mkdtemp(prefix="mstar-bench-legacy-"))
    path = tmp / "tree"
    added = False
    try:
        try:
            try:
                tree.commit = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
            except RuntimeError:
                raise RuntimeError(f"no commit {rev!r} in {REPO}") from None
            _git("worktree", "add", "--detach", str(path), tree.commit)
            added = True
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            tree.skipped = f"no worktree of {rev!r}: {type(e).__name__}: {e}"
        if added and not (path / "store" / "__init__.py").is_file():
            tree.skipped = f"{rev} has no store package"
        if not tree.skipped:
            tree.path = path
            log(f"legacy tree: {rev} ({tree.commit[:12]}) at {path}")
        yield tree
    finally:
        if added:
            try:
                _git("worktree", "remove", "--force", str(path))
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"warning: could not remove the worktree {path}: {e}; pruning")
                shutil.rmtree(path, ignore_errors=True)
                # Else the next `git worktree prune` cleans it up.
                with contextlib.suppress(OSError, RuntimeError, subprocess.TimeoutExpired):
                    _git("worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)
