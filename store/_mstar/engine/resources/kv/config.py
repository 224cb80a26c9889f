"""What a request asks of a KV cache (mstar.engine.resources.kv.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..spec import ResourceReqConfig


class KVLayout(Enum):
    """How a KV page's tensor is laid out; transfer descriptors name it."""

    NHD = "NHD"


@dataclass
class KVReqConfig(ResourceReqConfig):
    """Which cache labels a request needs, overall, per node, or per (node, graph walk)."""

    needed_labels: list[str] | None = None
    needed_labels_per_node: dict[str, list[str]] = field(default_factory=dict)
    needed_labels_per_node_walk: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def get_labels(self, node: str, walk: str) -> list[str]:
        """The most specific labels given: per (node, walk), per node, overall, else ``main``."""
        if (node, walk) in self.needed_labels_per_node_walk:
            return self.needed_labels_per_node_walk[(node, walk)]
        if node in self.needed_labels_per_node:
            return self.needed_labels_per_node[node]
        if self.needed_labels is not None:
            return self.needed_labels
        return ["main"]
