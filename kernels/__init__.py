"""Optional accelerated ops, each with a pure-torch reference (``kernels.reference``) used on CPU
and as the oracle in tests. :func:`create_attention_backend` is the one selection point: the
runner receives a backend object and never branches on the device itself.
"""

from __future__ import annotations

import torch

from kernels.base import AttentionBackend, AttentionInputs
from kernels.reference import ReferenceAttention

ATTENTION_BACKENDS = ("auto", "reference")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU has bf16 arithmetic instructions (AVX512-BF16 or AMX-BF16).

    With them, oneDNN's bf16 matmuls ran 1.8x (batch 1) to 6x (512 rows) faster than fp32 on
    the 2-core development machine; without them bf16 is emulated and slower than fp32.
    """
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return False


def create_attention_backend(name: str, k_buffers: list[torch.Tensor],
                             v_buffers: list[torch.Tensor]) -> AttentionBackend:
    """Build the attention backend ``name`` ("auto" picks the fastest available; on CPU that is
    the reference). Raises ValueError for an unknown or unavailable backend."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return ReferenceAttention(k_buffers, v_buffers)


__all__ = ["AttentionBackend", "AttentionInputs", "create_attention_backend", "ATTENTION_BACKENDS",
           "cpu_has_native_bf16"]
