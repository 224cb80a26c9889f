"""The one place to import the engine's types that the store keeps.

Write ``from store.types import PartitionState``. Today every name here comes from the
bundled reference copy in ``mstar/``.
"""

from mstar.conductor.request_info import (
    CurrentForwardConductorMetadata,
    CurrentForwardPassInfo,
    PartitionDefinition,
    PartitionState,
    StreamingConnectionState,
    merge_publish_info,
)
from mstar.engine.resources import (
    KVSequenceInfo,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    ResourceReqConfig,
    SamplingReqConfig,
)
from mstar.graph.loop_indices import NestedLoopIndices

__all__ = [
    "CurrentForwardConductorMetadata",
    "CurrentForwardPassInfo",
    "KVSequenceInfo",
    "NestedLoopIndices",
    "PartitionDefinition",
    "PartitionState",
    "PublishedInfo",
    "PublishedKVInfo",
    "PublishedPositionInfo",
    "ResourceReqConfig",
    "SamplingReqConfig",
    "StreamingConnectionState",
    "merge_publish_info",
]
