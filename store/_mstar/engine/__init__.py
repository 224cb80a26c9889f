"""The engine's resources, without the engine (the engine's own package imports torch here)."""
