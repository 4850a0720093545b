"""Continuous batching: the request state (``request``), pure ordering policies (``policy``) and
the scheduler mechanics (``scheduler``): ``step() -> ForwardBatch``, ``update(batch, out)``."""
