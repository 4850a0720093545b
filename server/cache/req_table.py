"""ReqToTokenTable: request row -> KV slot of each position.

A [max_requests, max_context] int64 tensor. A running request owns one row; column p holds the
pool slot of its position p for every position whose slot was assigned. Attention kernels read
rows directly, so the table lives on the model's device. On a GPU a host copy mirrors it: the
scheduler and the radix cache read slots from the mirror (no device-to-host sync), and writes
go to both, the device copy through a pinned non-blocking transfer (no sync either).
"""

from __future__ import annotations

import torch


class NoFreeRowError(RuntimeError):
    """All rows are taken (more running requests than ``max_requests``)."""


class ReqToTokenTable:
    """Args: max_requests rows, max_context columns (tokens), device of the tensor."""

    def __init__(self, max_requests: int, max_context: int, device: str | torch.device = "cpu"):
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
        self.host = (self.table if self.table.device.type == "cpu"
                     else torch.zeros((max_requests, max_context), dtype=torch.int64))
        self.max_requests = max_requests
        self.max_context = max_context
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._host_np = self.host.numpy()  # the same memory, for a decode step's writes

    @property
    def num_free_rows(self) -> int:
        """Rows no running request holds."""
        return len(self._free_rows)

    def alloc_row(self) -> int:
        """Take a free row. Raises NoFreeRowError."""
        if not self._free_rows:
            raise NoFreeRowError(f"all {self.max_requests} request rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        """Give ``row`` back (its slot entries are left as they are: ignored until rewritten)."""
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set positions [start, start + len(slots)) of ``row`` to ``slots`` (int64, any
        device)."""
        end = start + slots.numel()
        self.host[row, start:end] = slots
        if self.host is not self.table:
            src = self.host[row, start:end].pin_memory()
            self.table[row, start:end].copy_(src, non_blocking=True)

    def write_one_each(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Set ``table[rows[i], cols[i]] = slots[i]`` for every i (a decode step: one new slot
        per request), with one transfer for the whole batch on a GPU. slots: [B] int64 (CPU).
        The host copy is written through NumPy: 1.9 us for one row where two index tensors and
        torch's index_put took 6.2 (py-spy put this call at ~1% of a one-stream decode)."""
        self._host_np[rows, cols] = slots.numpy()
        if self.host is not self.table:
            r = torch.tensor(rows, dtype=torch.int64)
            c = torch.tensor(cols, dtype=torch.int64)
            packed = torch.stack((r, c, slots.to(torch.int64).cpu())).pin_memory()
            packed = packed.to(self.table.device, non_blocking=True)
            self.table[packed[0], packed[1]] = packed[2]

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of ``row`` ([end - start] int64, on the host; a
        view: clone it to keep it past the next write)."""
        return self.host[row, start:end]
