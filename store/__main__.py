"""``python -m store``: the ``mstar-store`` command line, where its script is not on PATH."""

import sys

from store.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
