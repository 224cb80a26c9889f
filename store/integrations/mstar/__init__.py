"""mstar-ai's ``Conductor`` with its request state in the store (tested with mstar-ai
0.2.1; ``[mstar]`` extra: ``mstar-ai>=0.2.1,<0.3``). Importing this imports the engine."""

from store.integrations.mstar.conductor import FENCED_EXIT, StoreConductor

__all__ = ["FENCED_EXIT", "StoreConductor"]
