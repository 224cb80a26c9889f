"""Tests against the M* engine itself (mstar-ai): they run in the engine job (.ci/engine)."""
