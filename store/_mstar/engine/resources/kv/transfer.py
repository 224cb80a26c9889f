"""How another engine reaches a request's KV pages (mstar.engine.resources.kv.transfer).

Only the descriptors a published ``KVSequenceInfo`` carries; the KV manager compares them
with ``==``, so they must come back from the store as these classes, not as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import KVLayout


@dataclass
class MooncakeKVTransferInfo:
    """Pages reachable through a Mooncake transfer engine."""

    entity_id: str
    session_id: str
    data_ptr: int
    layout: KVLayout


@dataclass
class CudaIpcKVTransferInfo:
    """Pages shared through a CUDA IPC handle (``torch``'s ``_share_cuda_`` tuple)."""

    cuda_share: tuple  # type: ignore[type-arg]
    size: tuple  # type: ignore[type-arg]
    stride: tuple  # type: ignore[type-arg]
    offset: int
    dtype: str
    requires_grad: bool
    layout: KVLayout
