"""A request's sampling parameters (mstar.engine.resources.sampler.config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..spec import ResourceReqConfig


@dataclass
class SamplingReqConfig(ResourceReqConfig):
    """How the sampler picks tokens for one request; the conductor sets the seed at ingest."""

    temperature: float = 0.6
    top_k: int = 0
    top_p: float = 1
    ignore_eos: bool = False
    repetition_penalty: float = 1
    _seed: int = 0

    def apply_conductor_config(self, seed: int = 0, **kwargs: Any) -> None:
        """Take the conductor's seed (0 when it gives none); other settings are not ours."""
        self._seed = seed

    @property
    def seed(self) -> int:
        return self._seed
