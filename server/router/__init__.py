"""Data parallelism: a cache-aware router in front of several servers (:mod:`.app`)."""
