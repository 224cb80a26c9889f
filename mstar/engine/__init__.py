"""Engine-side resources: what they publish and how they are configured per request."""
