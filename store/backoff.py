"""How long to wait between tries of an optimistic transaction that met a concurrent writer."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded tries with exponential backoff and full jitter.

    Full jitter (a uniform draw below the exponential ceiling) spreads writers that collided
    apart instead of letting them collide again in lock step; the ceiling keeps a starved
    writer from sleeping long. Defaults hold 16 writers on one key without running out.
    """

    max_attempts: int = 64
    base_delay: float = 0.0002
    max_delay: float = 0.02
    # How long a merge may step aside for another holding its claim (a queue that moves on,
    # each merge in turn, starts it again: only a claim that does not change is a stall).
    max_wait: float = 5.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ValueError("need 0 <= base_delay <= max_delay")
        if self.max_wait < 0:
            raise ValueError("max_wait must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed try number ``attempt`` (1-based)."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** min(attempt - 1, 30)))
        return self.rng.uniform(0, ceiling)
