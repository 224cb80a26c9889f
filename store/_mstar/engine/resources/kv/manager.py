"""What a KV cache publishes per request (mstar.engine.resources.kv.manager)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..base import PublishedInfo


@dataclass
class KVSequenceInfo:
    """One cache label's sequence on one rank; the transfer info tells others how to read it."""

    seq_len: int
    latest_kv_transfer_info: Any
    page_indices: list[int] = field(default_factory=list)


@dataclass
class PublishedKVInfo(PublishedInfo):
    """KV-cache shards: tensor-parallel rank -> cache label -> sequence info."""

    info: dict[int, dict[str, KVSequenceInfo]] = field(default_factory=dict)
    world_size: int = 1

    @classmethod
    def build_for_rank(
        cls, rank: int, world_size: int, seq_info: dict[str, KVSequenceInfo]
    ) -> PublishedKVInfo:
        """One rank's shard, as a worker publishes it."""
        return cls(info={rank: seq_info}, world_size=world_size)

    def update(self, other: PublishedKVInfo) -> None:  # type: ignore[override]  # as the engine
        """Take each rank of ``other``: a new rank's dict as it is (by reference), a held one
        as a new dict with ``other``'s labels winning. ``world_size`` never changes."""
        for key, val in other.info.items():
            if key not in self.info:
                self.info[key] = val
                continue
            self.info[key] = {**self.info[key], **val}

    def get(self, rank: int) -> dict[str, KVSequenceInfo]:
        """The labels of one rank (empty when it published none)."""
        return self.info.get(rank, {})
