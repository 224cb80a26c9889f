"""Where each of a request's streams has reached (mstar.engine.resources.position.manager)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import PublishedInfo


@dataclass
class PublishedPositionInfo(PublishedInfo):
    """Label -> next position."""

    counters: dict[str, int] = field(default_factory=dict)

    def update(self, other: PublishedPositionInfo) -> None:  # type: ignore[override]  # as the engine
        """Take a label's position only when it is larger than the held one (an absent label
        counts as 0, so a new label at 0 or below is not added)."""
        for label, position in other.counters.items():
            if position > self.counters.get(label, 0):
                self.counters[label] = position
