"""How records become bytes, and how any stored bytes are read back at bounded cost.

``values`` encodes one value of a declared type (msgspec MessagePack, no pickle), ``kinds``
is the registry of storable ``PublishedInfo`` / ``ResourceReqConfig`` kinds, ``layout``
turns a dataclass record into hash fields and back, ``published`` lays out published infos,
``kv`` holds KV sequences compactly with their page indices decoded on first read,
``leases`` reads a request's lease hash. ``domains`` gives every stored number its domain
and the checks the store's operations apply to their arguments; ``bounds`` the limits that
keep a read proportional to its bytes.
"""

from store.codec.kinds import KindRegistry, default_registry, register_kind
from store.codec.values import Codec

__all__ = ["Codec", "KindRegistry", "default_registry", "register_kind"]
