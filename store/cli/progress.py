"""A progress bar for long commands: drawn in place on a terminal, plain lines elsewhere.

On a terminal, ``[#########.........]  9/20 finished  kills 1/2    4.2s`` is redrawn in
place (``\\r``) at most ten times a second. Written to anything else (a log file, a pipe,
CI's output) the same progress is a plain line every ``every`` seconds and at the end, so
that no ``\\r`` frames pile up in a log.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """The progress of ``total`` things (``label``: what the count counts)."""

    def __init__(
        self,
        stream: TextIO,
        total: int = 1,
        *,
        label: str = "finished",
        width: int = 30,
        every: float = 5.0,
        tty: bool | None = None,
    ) -> None:
        self.stream = stream
        self.total = max(1, total)
        self.label = label
        self.width = width
        self.tty = _isatty(stream) if tty is None else tty
        self._every = 0.1 if self.tty else every
        self._last = float("-inf")
        self._line = ""  # the last line shown
        self._shown = False  # a bar is drawn on the terminal's current line

    def update(
        self,
        done: int,
        detail: str = "",
        elapsed: float | None = None,
        *,
        total: int | None = None,
        force: bool = False,
    ) -> None:
        """Show ``done`` of ``total`` (the one given at construction if None)."""
        if total is not None:
            self.total = max(1, total)
        now = time.monotonic()
        if not force and now - self._last < self._every:
            return
        self._last = now
        count = f"{done:>{len(str(self.total))}}/{self.total} {self.label}"
        text = "  ".join(part for part in (count, detail) if part)
        if elapsed is not None:
            text += f"  {elapsed:5.1f}s"
        if self.tty:
            filled = self.width * min(done, self.total) // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {text} ")
            self._shown = True
        elif text != self._line:
            self.stream.write(f"{text}\n")
        self._line = text
        self.stream.flush()

    def interrupt(self, message: str, out: TextIO) -> None:
        """Print ``message`` on a line of its own; the bar is redrawn below it."""
        self.close()
        print(message, file=out, flush=True)

    def close(self) -> None:
        """End the bar's line (on a terminal); call it before printing anything else."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
