"""Optional accelerated ops, each with a pure-torch reference (``kernels.reference``) used on CPU
and as the oracle in tests. :func:`create_attention_backend` is the one selection point: the
runner receives a backend object and never branches on the device itself.
"""

from __future__ import annotations

import torch

from kernels.base import AttentionBackend, AttentionInputs
from kernels.reference import ReferenceAttention

ATTENTION_BACKENDS = ("auto", "reference")


def create_attention_backend(name: str, k_buffers: list[torch.Tensor],
                             v_buffers: list[torch.Tensor]) -> AttentionBackend:
    """Build the attention backend ``name`` ("auto" picks the fastest available; on CPU that is
    the reference). Raises ValueError for an unknown or unavailable backend."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return ReferenceAttention(k_buffers, v_buffers)


__all__ = ["AttentionBackend", "AttentionInputs", "create_attention_backend", "ATTENTION_BACKENDS"]
