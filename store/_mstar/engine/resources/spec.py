"""Per-request resource configuration (mstar.engine.resources.spec)."""

from __future__ import annotations

from typing import Any


class ResourceReqConfig:
    """Per-request parameters for one resource, keyed by resource key on the request."""

    def apply_conductor_config(self, **kwargs: Any) -> None:
        """Take settings the conductor decides at ingest; none by default."""
        return
