"""TokenKVPool: per-layer K/V buffers with a slot allocator; a page is one token.

Slot 0 is reserved as a padding target (attention kernels may read it for masked positions), so
``capacity`` usable slots are numbered 1..capacity. Buffers are allocated uninitialized (no
page zeroing of gigabytes at startup): a slot is always written before it is read, except slot
0, which is zeroed so masked reads never see NaN. Allocation takes arbitrary counts from a free
list; since every page is one token there is no fragmentation to manage.

The free list is last in, first out: freed slots are the next ones handed out. On a CPU the
buffers' pages become resident when first written, so the resident KV memory follows the most
tokens held at once, not every slot ever handed out. With a first-in-first-out list each
rejected draft (jump-forward, n-gram) took fresh slots and a server's RSS crept towards the
whole pool: `a{1000000}` with 200 tokens, whose 32-token drafts were verified and rejected every
step, grew the scheduler by ~260 MB per request. Recently written slots are also the ones still
in the CPU caches.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """Fewer free slots than requested; nothing was allocated."""


class TokenKVPool:
    """K/V storage for ``capacity`` tokens and its slot free list.

    Args:
        capacity: usable token slots.
        num_layers, num_kv_heads, head_dim: buffer shapes; ``num_layers=0`` gives an allocator
            with no buffers (scheduler tests with a fake runner).
        dtype, device: of the buffers.

    Attributes:
        k_buffers, v_buffers: per layer, [capacity + 1, num_kv_heads, head_dim].
    """

    def __init__(self, capacity: int, num_layers: int = 0, num_kv_heads: int = 1,
                 head_dim: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        shape = (capacity + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers):
            buf[0].zero_()
        self._free = torch.arange(1, capacity + 1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        """Slots (tokens) not owned by a request or the cache."""
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` slots; returns [n] int64 slot ids (CPU). Raises OutOfSlotsError."""
        if n > self._free.numel():
            raise OutOfSlotsError(f"requested {n} KV slots, {self._free.numel()} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the front of the free list (the next :meth:`alloc` takes them first).
        The caller guarantees each is currently allocated."""
        if slots.numel():
            self._free = torch.cat((slots.to(torch.int64).cpu(), self._free))

    def bytes_per_token(self) -> int:
        """K+V bytes one slot takes over all layers."""
        if not self.k_buffers:
            return 0
        b = self.k_buffers[0]
        return 2 * len(self.k_buffers) * b.shape[1] * b.shape[2] * b.element_size()
