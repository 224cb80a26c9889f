"""How records become bytes: msgpack values and kind envelopes, records as hash fields.

``values`` encodes one value of a declared type (msgspec MessagePack, no pickle), ``kinds``
is the registry of storable ``PublishedInfo`` / ``ResourceReqConfig`` kinds, ``layout``
turns a dataclass record into hash fields and back, ``published`` lays out published infos.
"""

from store.codec.kinds import KindRegistry, default_registry, register_kind
from store.codec.values import Codec

__all__ = ["Codec", "KindRegistry", "default_registry", "register_kind"]
