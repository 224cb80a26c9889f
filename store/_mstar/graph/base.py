"""Pointers to tensors that workers hold for a request (mstar.graph.base).

Only ``TensorPointerInfo``: what the conductor keeps of a persisted signal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TensorPointerInfo:
    """Where one (shard of a) tensor lives, so that another worker can read it."""

    dims: list[int]
    dtype: str
    nbytes: int
    address: int
    stride: list[int]
    uuid: str
    source_session_id: str
    source_entity: str
    offset: int = 0
    source_tp_size: int = 1
    source_tp_rank: int = 0
    shm_segment: str | None = None
    shm_offset: int = 0
    _source_node_name: str | None = None
    _source_graph_walk: str | None = None

    def clone(self) -> TensorPointerInfo:
        """A copy whose lists are not shared."""
        return TensorPointerInfo(
            dims=self.dims[:],
            dtype=self.dtype,
            nbytes=self.nbytes,
            address=self.address,
            stride=self.stride[:],
            uuid=self.uuid,
            source_session_id=self.source_session_id,
            source_entity=self.source_entity,
            offset=self.offset,
            source_tp_size=self.source_tp_size,
            source_tp_rank=self.source_tp_rank,
            shm_segment=self.shm_segment,
            shm_offset=self.shm_offset,
            _source_node_name=self._source_node_name,
            _source_graph_walk=self._source_graph_walk,
        )
