"""The store's settings, checked once, and its counters: what ``Core`` is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

from store.backoff import RetryPolicy
from store.codec import Codec
from store.durability import MASTER, Durability
from store.errors import ConfigurationError
from store.observe import Instruments
from store.ops.calls import DEFAULT_RECONNECT, Reconnect


@dataclass
class StoreStats:
    """Counters of merges: optimistic transactions (with their tries) and server-side merges."""

    transactions: int = 0
    attempts: int = 0
    server_merges: int = 0

    @property
    def retries(self) -> int:
        return self.attempts - self.transactions

    @property
    def merges(self) -> int:
        """Merges committed, by either path."""
        return self.transactions + self.server_merges


# Requests whose partitions and connections a store remembers (about 500 bytes each; the
# one remembered longest ago goes first): a replica's reports need them, so it should hold
# every request in flight; at 4,096 and 10,000 requests in flight at random, 0.6 more round
# trips went to re-reading them per pass.
DEFAULT_TOPOLOGY_CACHE_SIZE = 16384


@dataclass
class Settings:
    """The store's settings, checked once."""

    namespace: str = "mstar"
    codec: Codec = field(default_factory=Codec)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    dedupe_window: float = 3600.0
    lease_ttl: float = 10.0
    topology_cache_size: int = DEFAULT_TOPOLOGY_CACHE_SIZE
    reconnect: Reconnect = DEFAULT_RECONNECT
    history_cap: int = 1000  # entries kept per request's history stream; 0 turns it off
    instruments: Instruments | None = None  # default: OpenTelemetry's global providers
    durability: Durability = MASTER  # what a write waits for (store/durability.py)

    def __post_init__(self) -> None:
        if self.dedupe_window <= 0 or self.lease_ttl <= 0:
            raise ConfigurationError("dedupe_window and lease_ttl must be positive")
        if self.topology_cache_size < 0:
            raise ConfigurationError("topology_cache_size must be >= 0")
        if type(self.history_cap) is not int or self.history_cap < 0:
            raise ConfigurationError("history_cap must be an int >= 0 (0 turns history off)")


SETTING_NAMES = (
    "codec",
    "retry",
    "dedupe_window",
    "lease_ttl",
    "topology_cache_size",
    "reconnect",
    "history_cap",
    "instruments",
    "durability",
)
