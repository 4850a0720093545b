"""Cache hints for batches that arrive as independent calls.

DSPy's ``Module.batch`` / ``dspy.Parallel`` / ``Evaluate`` and LangChain's ``batch`` call the
model from many threads at once with prompts that share a prefix (instructions, field skeleton,
few-shot demos). :class:`PrefixHints` makes the first caller with a given prefix send it once as
a prefill-only request; concurrent callers with the same prefix wait for that hint instead of
each computing the prefix, then all find it in the radix cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from sgl_adapters.backends.base import Backend


class PrefixHints:
    """Send each distinct prefix (at least ``min_chars`` characters) once.

    Args:
        backend: where ``cache_prefix`` goes.
        capacity: prefixes remembered (LRU); a forgotten one is simply hinted again.
        min_chars: shorter prefixes are not worth a request.
    Errors of the hint request are swallowed: a hint is an optimisation, and the real request
    reports the same failure.
    """

    def __init__(self, backend: Backend, capacity: int = 256, min_chars: int = 64):
        self.backend, self.capacity, self.min_chars = backend, capacity, min_chars
        self._done: OrderedDict[str, threading.Event] = OrderedDict()
        self._lock = threading.Lock()
        self.sent = 0

    def ensure(self, prefix: str) -> None:
        """Return once ``prefix`` has been hinted (by this call or a concurrent one)."""
        if len(prefix) < self.min_chars:
            return
        with self._lock:
            event = self._done.get(prefix)
            owner = event is None
            if owner:
                event = self._done[prefix] = threading.Event()
                while len(self._done) > self.capacity:
                    self._done.popitem(last=False)
            else:
                self._done.move_to_end(prefix)
        if not owner:
            event.wait()
            return
        try:
            self.backend.cache_prefix(prefix)
            self.sent += 1
        except Exception:  # noqa: BLE001 - see the class docstring
            pass
        finally:
            event.set()
