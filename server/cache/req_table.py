"""ReqToTokenTable: request row -> KV slot of each position.

A [max_requests, max_context] int64 tensor. A running request owns one row; column p holds the
pool slot of its position p for every position whose slot was assigned. Attention kernels read
rows directly, so the table lives on the model's device.
"""

from __future__ import annotations

import torch


class NoFreeRowError(RuntimeError):
    """All rows are taken (more running requests than ``max_requests``)."""


class ReqToTokenTable:
    """Args: max_requests rows, max_context columns (tokens), device of the tensor."""

    def __init__(self, max_requests: int, max_context: int, device: str | torch.device = "cpu"):
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
        self.max_requests = max_requests
        self.max_context = max_context
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        """Take a free row. Raises NoFreeRowError."""
        if not self._free_rows:
            raise NoFreeRowError(f"all {self.max_requests} request rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set positions [start, start + len(slots)) of ``row`` to ``slots``."""
        self.table[row, start:start + slots.numel()] = slots.to(self.table.device)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) of ``row`` ([end - start] int64)."""
        return self.table[row, start:end]
