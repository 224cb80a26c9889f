"""A one-line progress bar on a terminal stream, redrawn in place (no dependency)."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """``[#########.........]  9/20 finished  kills 1/2  4.2s``, at most ten redraws a second."""

    def __init__(self, stream: TextIO, total: int, *, width: int = 30) -> None:
        self.stream = stream
        self.total = max(1, total)
        self.width = width
        self._last = 0.0
        self._shown = False

    def update(self, finished: int, detail: str, elapsed: float, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * min(finished, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r[{bar}] {finished:>{len(str(self.total))}}/{self.total} finished  {detail}"
        self.stream.write(f"{line}  {elapsed:5.1f}s ")
        self.stream.flush()
        self._shown = True

    def interrupt(self, message: str, out: TextIO) -> None:
        """Print ``message`` on a line of its own; the bar is redrawn below it."""
        self.close()
        self._shown = False
        print(message, file=out, flush=True)

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
