"""M* domain types that the conductor keeps per request; they know nothing of storage."""
