"""Graph-execution bookkeeping shared by the conductor and the workers."""
