"""The resource layer's declarations that a request's state holds.

As in the engine, the published infos themselves are reached by their own paths
(``kv.manager``, ``position.manager``); only declarations are re-exported here.
"""

from .base import PublishedInfo
from .kv.config import KVLayout, KVReqConfig
from .sampler.config import SamplingReqConfig
from .spec import ResourceReqConfig

__all__ = ["KVLayout", "KVReqConfig", "PublishedInfo", "ResourceReqConfig", "SamplingReqConfig"]
