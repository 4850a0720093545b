"""TokenKVPool: per-layer K/V buffers with a slot allocator; a page is one token.

Slot 0 is reserved as a padding target (attention kernels may read it for masked positions), so
``capacity`` usable slots are numbered 1..capacity; it is zeroed so masked reads never see NaN,
and every other slot is written before it is read. Allocation takes arbitrary counts from a
free list; since every page is one token there is no fragmentation to manage.

On a CPU the buffers are written once when the pool is made (zeros), so all their pages are
resident from the start: the pool is the memory the operator sized it to be (``--mem-fraction``,
``--max-total-tokens``). Why: a prefill whose K/V went to slots never written before ran 5-15%
slower than one into slots already written once, by an earlier pass or at start-up (2-core
Zen 5 VM, 2026-11-27: 32 unshared 530-token prompts, in-process, five rounds into fresh slots
4,013-4,782 prompt tokens/s, into slots written at start-up 4,727-4,976; writing each slot's
pages just before its first pass did not help). In the peers' noshare benchmark the later
repetitions, which reached fresh slots, ran 11% slower than the first. The writes cost ~0.2-0.9
s a GB at start-up (the default pool, 5% of the memory: ~1.1 GB and +0.3-1.1 s here).

On a CPU each layer's K (and V) is stored head-major, [num_kv_heads, capacity + 1, head_dim],
and exposed as the [capacity + 1, num_kv_heads, head_dim] view every user indexes (the native
kernels read the strides). Why: a decode work item reads one KV head's rows for a run of
positions, which head-major storage lays out contiguously when the slots are consecutive (as a
fresh pool hands a long prompt); slot-major, it read 128 of every 384 bytes (SmolLM2's 3 heads
of 64). 2-core Zen 4, 2026-11-28, decode attention over 30 layers' bf16 pools from DRAM,
alternated five times: 1 x (4096 + 1) in slot order 0.127-0.142 -> 0.111-0.116 ms a layer,
16 x (512 + 1) 0.251-0.282 -> 0.222-0.252; shuffled slots unchanged (0.105-0.123). CUDA pools
stay slot-major (FlashInfer's paged kernels take contiguous [C, H, D] pages).

The free list is last in, first out: freed slots are the next ones handed out, so the slots in
use stay few and recently written ones, still in the CPU caches. (Before the pool was written
at start-up, a first-in-first-out list also let a server's RSS creep towards the whole pool:
each rejected jump-forward or n-gram draft took fresh slots.)
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
        k_buffers, v_buffers: per layer, [capacity + 1, num_kv_heads, head_dim] of ``dtype``;
            on a CPU a view of head-major storage (stride 1 within a head's row only).
    """

    def __init__(self, capacity: int, num_layers: int = 0, num_kv_heads: int = 1,
                 head_dim: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        def buffer() -> torch.Tensor:
            if self.device.type == "cpu":  # head-major storage (see the module docstring)
                return torch.empty((num_kv_heads, capacity + 1, head_dim), dtype=dtype,
                                   device=device).permute(1, 0, 2)
            return torch.empty((capacity + 1, num_kv_heads, head_dim), dtype=dtype, device=device)

        self.k_buffers = [buffer() for _ in range(num_layers)]
        self.v_buffers = [buffer() for _ in range(num_layers)]
        for buf in (*self.k_buffers, *self.v_buffers):
            # CPU: every page written now (see the module docstring); CUDA: slot 0 only
            (buf if self.device.type == "cpu" else buf[0]).zero_()
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
