"""The ``mstar-store`` command and ``python -m store``: the CLI, on the bundled engine types.

The CLI reads and writes records, which name their kinds and never a module, so the bundled
copy of the engine's types reads and writes every record exactly as the engine's classes
would, without importing the engine and torch (about 3 s and 0.8 GB) for each command.
``MSTAR_STORE_TYPES=engine`` makes it use the installed engine's classes instead.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Choose the types, then run the CLI (``store.cli.main``)."""
    os.environ.setdefault("MSTAR_STORE_TYPES", "bundled")
    from store.cli.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
