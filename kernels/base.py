"""The interface between the model and an attention implementation.

The model calls, per forward pass, ``begin(inputs)`` once and then, per layer, ``rms_norm``,
``apply_rope``, ``store_kv`` and ``attend``. Implementations (``kernels.reference``,
``kernels.triton``, ``kernels.flashinfer``) read K/V through per-sequence rows of slot indices
into a token-granular pool (page size 1).

This package never imports ``server``: everything crosses as plain tensors and lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch


def triton_interpret() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``): here, so
    the Triton kernels read it without importing their parent package back."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class AttentionInputs:
    """Per-batch attention metadata, shared by every layer of one forward pass.

    Attributes:
        is_decode: True when every sequence has exactly one new token.
        req_to_token: [max_requests, max_context] int64; row r, column p = KV slot of position p
            of the request in row r. Entries past a sequence's length are ignored.
        req_rows: [B] request-table rows of the sequences, in batch order.
        prefix_lens: [B] tokens of each sequence whose KV is already in the pool.
        extend_lens: [B] new tokens of each sequence in this pass (1 for decode).
        out_cache_loc: [T] int64 slot where each new token's K/V is written, T = sum(extend_lens).
    """

    is_decode: bool
    req_to_token: torch.Tensor
    req_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]


class AttentionBackend(Protocol):
    """Attention over a token-indexed KV pool.

    Buffers: ``k_buffers[layer]`` and ``v_buffers[layer]`` are [capacity, num_kv_heads, head_dim].
    Queries are [T, num_heads, head_dim]; outputs have the same shape and dtype.
    """

    def begin(self, inputs: AttentionInputs) -> None:
        """Prepare per-batch metadata (index rows, masks) once, before the first layer."""

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V ([T, num_kv_heads, head_dim]) into slots ``inputs.out_cache_loc``."""

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        """Causal attention of the new tokens over prefix + new KV; returns [T, H, D].

        ``window`` > 0: a token at position p sees only positions (p - window, p] (a
        sliding-window layer). ``softcap`` > 0: scores become ``softcap * tanh(s / softcap)``
        before the softmax (attention-logit soft-capping)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, H] (the backend's fused version, or the reference)."""

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [T, heads, D] with cos/sin [T, D]."""
