"""The conductor's per-request state."""
