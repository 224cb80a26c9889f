"""What resources publish after a forward pass, and their per-request configuration.

Merging published state is each resource's own business (``PublishedInfo.update``), so a
store must hold any kind without knowing it; the two kinds the serving system has today are
here, together with the sampling configuration as the example ``ResourceReqConfig``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


class PublishedInfo(abc.ABC):
    """State one resource publishes per request after a forward pass."""

    @abc.abstractmethod
    def update(self, other: PublishedInfo) -> None:
        """Fold ``other`` (the same kind) into ``self`` in place."""


class ResourceReqConfig:
    """Per-request parameters of one resource, keyed by resource label on the request."""

    def apply_conductor_config(self, **kwargs: Any) -> None:
        """Take settings the conductor decides (a seed, say); ignores them by default."""


def _same_kind(info: PublishedInfo, other: PublishedInfo) -> None:
    if type(other) is not type(info):
        raise TypeError(
            f"cannot fold {type(other).__name__} into {type(info).__name__}: "
            "published info merges only with its own kind"
        )


@dataclass
class KVSequenceInfo:
    """One cache label's sequence on one tensor-parallel rank."""

    seq_len: int = 0
    latest_kv_transfer_info: Any = None
    page_indices: list[int] = field(default_factory=list)


@dataclass
class PublishedKVInfo(PublishedInfo):
    """KV-cache shards: tensor-parallel rank -> cache label -> sequence info."""

    info: dict[int, dict[str, KVSequenceInfo]] = field(default_factory=dict)
    world_size: int = 1

    def update(self, other: PublishedInfo) -> None:
        """Take every rank of ``other``; on a rank held already, ``other`` wins per label.

        ``world_size`` keeps the larger of the two, so a shard from a wider group is never
        described as belonging to a narrower one.
        """
        _same_kind(self, other)
        assert isinstance(other, PublishedKVInfo)
        for rank, labels in other.info.items():
            self.info.setdefault(rank, {}).update(labels)
        self.world_size = max(self.world_size, other.world_size)


@dataclass
class PublishedPositionInfo(PublishedInfo):
    """Next position per label; positions only move forward."""

    counters: dict[str, int] = field(default_factory=dict)

    def update(self, other: PublishedInfo) -> None:
        """Keep, per label, the larger position."""
        _same_kind(self, other)
        assert isinstance(other, PublishedPositionInfo)
        for label, position in other.counters.items():
            held = self.counters.get(label)
            self.counters[label] = position if held is None else max(held, position)


@dataclass
class SamplingReqConfig(ResourceReqConfig):
    """How the sampler picks tokens for one request; the conductor sets the seed."""

    temperature: float = 0.6
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    seed: int | None = None

    def apply_conductor_config(self, **kwargs: Any) -> None:
        """Take the conductor's ``seed``; other settings are not the sampler's."""
        if "seed" in kwargs:
            self.seed = kwargs["seed"]
