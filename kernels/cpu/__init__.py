"""Native CPU kernels: the ``sgl_cpu`` operator library (C++ in ``csrc/``, built at install time
by :mod:`kernels.cpu.build`), behind a capability probe.

Ops (``torch.ops.sgl_cpu.*``; shapes in each docstring below):
  * :func:`int4_linear` / :func:`int8_linear`: weight-quantized linear layers, each weight
    dequantized to float32 in AVX2 registers and multiplied with the float32 (or widened
    bfloat16) activations by FMA (``csrc/quant_linear.cpp``); every output row is bitwise
    independent of the other rows. Integer dot products on int8 activations were measured and
    not kept on AVX2 (README, "Native CPU linear layers").
  * ``attention`` and the fused decoder-layer ops: :mod:`kernels.cpu.attention`.

Selection: :func:`unavailable_reason` says why the library cannot be used here (not built, or a
CPU below AVX2); callers also honour the configured CPU class (``--cpu-isa``, ``SGL_CPU_ISA``:
"none" keeps torch's own ops) and fall back to torch's own ops.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.cpu_features import at_least, detected_isa

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(HERE, "_build", "sgl_cpu.so")
BLOCK = 32  # activation quantization block (weights per int4 scale, too)


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run on this machine, or None when they can (whether they
    should is the caller's choice: the configured CPU class, ``SGL_CPU_ISA``)."""
    if not at_least("avx2", detected_isa()):
        return f"the CPU lacks AVX2/FMA (detected {detected_isa()!r})"
    if not os.path.isfile(LIBRARY):
        return (f"{LIBRARY} is not built (make install builds it; or run "
                "python -m kernels.cpu.build)")
    return _load()


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    try:
        torch.ops.load_library(LIBRARY)
    except OSError as exc:
        return f"loading {LIBRARY} failed: {exc}"
    return None


def available() -> bool:
    """True when :func:`unavailable_reason` is None (and the library is loaded)."""
    return unavailable_reason() is None


def require() -> None:
    """Load the library; raises RuntimeError saying why it cannot be used here."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the sgl_cpu kernels are unavailable: {reason}")


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Repack an int4 weight for :func:`int4_linear`. q: [N, K] uint8 in [0, 15]; scale, zero:
    [N, K // 32] float32 with ``w = (q - 8) * scale + zero`` (the convention of
    :mod:`server.model.quantization`). Returns [N, K // 32 * 20] uint8: per block of 32 weights
    an fp16 scale d, an fp16 offset m (w = d * q + m) and 16 bytes of nibbles (GGUF Q4_1's
    block). Raises RuntimeError for bad shapes."""
    require()
    return torch.ops.sgl_cpu.pack_int4(q, scale, zero)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32/bfloat16 (contiguous, K % 32 == 0) @ the packed weight [N, K] transposed
    -> [M, N] in x's dtype (float32 accumulation). Raises RuntimeError for bad shapes/dtypes."""
    return torch.ops.sgl_cpu.int4_linear(x, packed, out_features)


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32/bfloat16 @ (w [N, K] int8 in [-127, 127] * scale [N] float32)
    transposed -> [M, N] in x's dtype. Raises RuntimeError for bad shapes/dtypes."""
    return torch.ops.sgl_cpu.int8_linear(x, w, scale)
