"""Optional accelerated ops, each with a pure-torch reference (``kernels.reference``) used on CPU
and as the oracle in tests. :func:`create_attention_backend` is the one selection point: the
runner receives a backend object and never branches on the device itself.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels.base import AttentionBackend, AttentionInputs
from kernels.reference import ReferenceAttention

ATTENTION_BACKENDS = ("auto", "reference", "triton", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
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


def triton_interpret() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int | None = None, windowed: bool = False) -> str | None:
    """Why backend ``name`` cannot run with KV buffers on ``device`` (of ``dtype`` and
    ``head_dim`` when given, for a model with sliding-window layers or attention-logit
    soft-capping when ``windowed``); None when it can."""
    if name == "reference":
        return None
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'sgl-adapters[kernels]')"
        if device.type != "cuda" and not triton_interpret():
            return "the KV pool is not on a CUDA device (TRITON_INTERPRET=1 runs it on CPU)"
        return None
    if name == "flashinfer":
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed (pip install flashinfer-python)"
        if device.type != "cuda":
            return "FlashInfer needs the KV pool on a CUDA device"
        if dtype is not None and dtype not in FLASHINFER_DTYPES:
            return f"FlashInfer's kernels run float16/bfloat16, not {dtype}"
        if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
            return f"FlashInfer's kernels are built for head_dim 64/128/256, not {head_dim}"
        if windowed:
            return ("sliding windows and logit soft-capping are not wired into the FlashInfer "
                    "backend yet")
        return None
    return f"unknown attention backend {name!r}"


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                              head_dim: int | None = None, windowed: bool = False) -> str:
    """The concrete backend for ``name`` on ``device`` (for a KV ``dtype`` and ``head_dim``,
    when given). "auto": FlashInfer, else Triton, on a CUDA device where installed and able
    (FlashInfer: fp16/bf16, head_dim 64/128/256); the reference everywhere else (including CPU
    with Triton's interpreter, which is for tests, not speed). Raises ValueError for an
    unknown name or an unavailable backend, saying why."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            for candidate in ("flashinfer", "triton"):
                if unavailable_reason(candidate, device, dtype, head_dim, windowed) is None:
                    return candidate
        return "reference"
    reason = unavailable_reason(name, device, dtype, head_dim, windowed)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} is unavailable: {reason}")
    return name


def create_attention_backend(name: str, k_buffers: list[torch.Tensor],
                             v_buffers: list[torch.Tensor],
                             windowed: bool = False) -> AttentionBackend:
    """Build attention backend ``name`` (see :func:`resolve_attention_backend`) over the pool's
    per-layer buffers ([capacity, num_kv_heads, head_dim] each); ``windowed``: the model calls
    ``attend`` with sliding windows or soft-capping. Raises ValueError for an unknown or
    unavailable backend."""
    name = resolve_attention_backend(name, k_buffers[0].device, k_buffers[0].dtype,
                                     k_buffers[0].shape[-1], windowed)
    if name == "triton":
        from kernels.triton import TritonAttention

        return TritonAttention(k_buffers, v_buffers)
    if name == "flashinfer":
        from kernels.flashinfer import FlashInferAttention

        return FlashInferAttention(k_buffers, v_buffers)
    return ReferenceAttention(k_buffers, v_buffers)


__all__ = ["AttentionBackend", "AttentionInputs", "create_attention_backend", "ATTENTION_BACKENDS",
           "cpu_has_native_bf16", "resolve_attention_backend", "triton_interpret"]
