"""Integrations of the store with the programs that use it. ``mstar``: mstar-ai's own
``Conductor`` with its request state in the store (importable where mstar-ai is)."""
