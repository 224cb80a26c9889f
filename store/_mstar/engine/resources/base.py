"""What a resource publishes per request after a forward pass (mstar.engine.resources.base)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class PublishedInfo(ABC):
    """State one resource publishes per request; ``update`` folds another of its kind in."""

    @abstractmethod
    def update(self, other: PublishedInfo) -> None: ...
