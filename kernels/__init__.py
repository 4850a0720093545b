"""Optional accelerated ops, each with a pure-torch reference (``kernels.reference``) used on CPU
and as the oracle in tests. :func:`create_attention_backend` is the one selection point: the
runner receives a backend object and never branches on the device itself.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.base import AttentionBackend, AttentionInputs, triton_interpret
from kernels.cpu_features import at_least, cpu_flags, isa_from_flags, native_bf16
from kernels.reference import ReferenceAttention

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
CPU_DTYPES = (torch.float32, torch.bfloat16)


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU (as ``cpuinfo_path`` describes it) has bf16 dot products
    (AVX512-BF16 or AMX; :func:`kernels.cpu_features.native_bf16`)."""
    return native_bf16(isa_from_flags(cpu_flags(cpuinfo_path)))


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int | None = None, windowed: bool = False,
                       cpu_isa: str | None = None) -> str | None:
    """Why backend ``name`` cannot run with KV buffers on ``device`` (of ``dtype`` and
    ``head_dim`` when given, for a model with sliding-window layers or attention-logit
    soft-capping when ``windowed``, on a CPU of class ``cpu_isa``, default the probed one);
    None when it can."""
    if name == "reference":
        return None
    if name == "cpu":
        from kernels import cpu as native

        if device.type != "cpu":
            return "the native CPU kernel needs the KV pool in host memory"
        if not at_least("avx2", cpu_isa):
            return f"the CPU class {cpu_isa!r} is below avx2"
        if dtype is not None and dtype not in CPU_DTYPES:
            return f"the native CPU kernel runs float32/bfloat16 KV, not {dtype}"
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            return f"the native CPU kernel needs head_dim a multiple of 8 up to 256, not {head_dim}"
        return native.unavailable_reason()
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
                              head_dim: int | None = None, windowed: bool = False,
                              cpu_isa: str | None = None) -> str:
    """The concrete backend for ``name`` on ``device`` (for a KV ``dtype`` and ``head_dim``,
    when given). "auto": FlashInfer, else Triton, on a CUDA device where installed and able
    (FlashInfer: fp16/bf16, head_dim 64/128/256); on a CPU the native kernel ("cpu") where it
    is built and ``cpu_isa`` (default: probed) is avx2 or above; the reference everywhere
    else (including CPU with Triton's interpreter, which is for tests, not speed). Raises
    ValueError for an unknown name or an unavailable backend, saying why."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        candidates = ("flashinfer", "triton") if device.type == "cuda" else ("cpu",)
        for candidate in candidates:
            if unavailable_reason(candidate, device, dtype, head_dim, windowed, cpu_isa) is None:
                return candidate
        return "reference"
    reason = unavailable_reason(name, device, dtype, head_dim, windowed, cpu_isa)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} is unavailable: {reason}")
    return name


def create_attention_backend(name: str, k_buffers: list[torch.Tensor],
                             v_buffers: list[torch.Tensor],
                             windowed: bool = False, cpu_isa: str | None = None) -> AttentionBackend:
    """Build attention backend ``name`` (see :func:`resolve_attention_backend`) over the pool's
    per-layer buffers ([capacity, num_kv_heads, head_dim] each); ``windowed``: the model calls
    ``attend`` with sliding windows or soft-capping; ``cpu_isa``: the configured CPU class
    (default: probed), which picks the "cpu" backend's kernel
    (:func:`kernels.cpu.attention_kernel`). Raises ValueError for an unknown or unavailable
    backend."""
    name = resolve_attention_backend(name, k_buffers[0].device, k_buffers[0].dtype,
                                     k_buffers[0].shape[-1], windowed, cpu_isa)
    if name == "triton":
        from kernels.triton import TritonAttention

        return TritonAttention(k_buffers, v_buffers)
    if name == "flashinfer":
        from kernels.flashinfer import FlashInferAttention

        return FlashInferAttention(k_buffers, v_buffers)
    if name == "cpu":
        from kernels import cpu as native
        from kernels.cpu.attention import CPUAttention

        return CPUAttention(k_buffers, v_buffers, native.attention_kernel(cpu_isa))
    return ReferenceAttention(k_buffers, v_buffers)


__all__ = ["AttentionBackend", "AttentionInputs", "create_attention_backend", "ATTENTION_BACKENDS",
           "cpu_has_native_bf16", "resolve_attention_backend", "triton_interpret"]
