"""Native CPU kernels: the ``sgl_cpu`` operator library (C++ in ``csrc/``) and the
``sgl_cpu_vnni`` one (``csrc_vnni/``), built at install time by :mod:`kernels.cpu.build`, each
behind a capability probe.

Linear-layer kernels (:data:`LINEAR_KERNELS`; shapes in each docstring below):
  * ``"avx2"``: :func:`int4_linear` / :func:`int8_linear`, each weight dequantized to float32
    in AVX2 registers and multiplied with the float32 (or widened bfloat16) activations by FMA
    (``csrc/quant_linear.cpp``). Integer dot products on int8 activations were measured and not
    kept on AVX2 (docs/benchmarks.md, "Native CPU linear layers").
  * ``"avx512_vnni"``: :func:`vnni_int4_linear` / :func:`vnni_int8_linear`, the activations
    quantized per row to int8 in blocks of 32 and multiplied with the weights by AVX-512 VNNI
    integer dot products (``csrc_vnni/vnni_linear.cpp``, llama.cpp's Q4_1 x Q8_1 scheme): 3-8x
    the "avx2" kernels and faster than oneDNN's dense bf16 matmul at every row count on an
    AVX512-BF16 CPU (docs/benchmarks.md, "Native CPU linear layers").
Both compute every output row bitwise independently of the other rows of the batch.
  * ``"amx"`` (prefill only): :func:`amx_int4_linear`, the VNNI int4 layout dequantized to bf16
    panels once a call and multiplied with the bf16 activations on AMX tiles
    (``csrc_vnni/amx_linear.cpp``), and :func:`amx_int4_linear_silu` for a fused [gate; up]
    weight; :func:`amx_available` says whether they run here. Rows are independent of each
    other, but not the VNNI kernel's bits.
Attention kernels (:data:`ATTENTION_KERNELS`, :mod:`kernels.cpu.attention`), one driver
(``csrc/attention_impl.h``) over four chunk kernels: "avx2" (``sgl_cpu::attention``),
"avx512_vnni" (``sgl_cpu_vnni::attention``: float32 FMAs on 16 lanes), "avx512_bf16"
(``sgl_cpu_vnni::attention_bf16``: bf16 dot products where q and K/V are bfloat16 and head_dim
is a multiple of 32, else the float32 AVX-512 path) and "amx" (``sgl_cpu_vnni::attention_amx``:
the same inputs on AMX bf16 tiles, where :func:`amx_available`); :func:`attention_kernel`
picks. The fused decoder-layer ops (RMSNorm, residual add + RMSNorm, RoPE + K/V store, SiLU * up) come in both
libraries (``csrc/fused.cpp``, ``csrc_vnni/fused512.cpp``); a model runs those of the library
its attention kernel is in. ``sgl_cpu::sample_tempered`` (``csrc/sample.cpp``) draws the sampler's
temperature / min-p rows (:class:`server.model.sampling.Sampler` with ``native``).

Selection: :func:`unavailable_reason` says why a library cannot be used here (not built, or
the CPU lacks its instructions); :func:`linear_kernel` picks the best linear kernel for a
configured CPU class (``--cpu-isa``, ``SGL_CPU_ISA``: "none" keeps torch's own ops, "avx2"
runs the AVX2 kernels on a bigger machine). The kernels that stream K/V rows and weight blocks
prefetch them into L2 on AMD family 19h and into L1 elsewhere (``csrc/prefetch.h``);
``SGL_CPU_PREFETCH=l1|l2`` overrides that (the same bits either way; another value is an error
at the first call).
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.cpu_features import at_least, detected_isa

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.join(HERE, "_build")
LIBRARY = os.path.join(BUILD_DIR, "sgl_cpu.so")  # kernels.cpu.build writes both
VNNI_LIBRARY = os.path.join(BUILD_DIR, "vnni", "sgl_cpu_vnni.so")
BLOCK = 32  # activation quantization block (weights per int4 scale, too)
LINEAR_KERNELS = ("avx2", "avx512_vnni")
ATTENTION_KERNELS = ("avx2", "avx512_vnni", "avx512_bf16", "amx")
# per attention kernel: (its library's linear-kernel key, the CPU class it needs, op name)
_ATTENTION_OPS = {"avx2": ("avx2", "avx2", "sgl_cpu::attention"),
                  "avx512_vnni": ("avx512_vnni", "avx512_vnni", "sgl_cpu_vnni::attention"),
                  "avx512_bf16": ("avx512_vnni", "avx512_bf16", "sgl_cpu_vnni::attention_bf16"),
                  "amx": ("avx512_vnni", "amx", "sgl_cpu_vnni::attention_amx")}
# library file and the CPU class its instructions need, per linear kernel
_LIBRARIES = {"avx2": (LIBRARY, "avx2"), "avx512_vnni": (VNNI_LIBRARY, "avx512_vnni")}


def unavailable_reason(kernel: str = "avx2") -> str | None:
    """Why the library of ``kernel`` (one of :data:`LINEAR_KERNELS`; "avx2" is the library
    with attention and the fused ops too) cannot run on this machine, or None when it can
    (whether it should is the caller's choice: the configured CPU class, ``SGL_CPU_ISA``)."""
    path, isa = _LIBRARIES[kernel]
    if not at_least(isa, detected_isa()):
        return f"the CPU lacks {isa} (detected {detected_isa()!r})"
    if not os.path.isfile(path):
        return (f"{path} is not built (make install builds it; or run "
                "python -m kernels.cpu.build)")
    return _load(path)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> str | None:
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        return f"loading {path} failed: {exc}"
    return None


def available(kernel: str = "avx2") -> bool:
    """True when :func:`unavailable_reason` is None (and the library is loaded)."""
    return unavailable_reason(kernel) is None


def require(kernel: str = "avx2") -> None:
    """Load the library of ``kernel``; raises RuntimeError saying why it cannot be used here."""
    reason = unavailable_reason(kernel)
    if reason is not None:
        raise RuntimeError(f"the {kernel} kernels are unavailable: {reason}")


def linear_kernel(cpu_isa: str) -> str | None:
    """The fastest linear kernel for CPU class ``cpu_isa`` that this machine can run:
    "avx512_vnni" from that class up, else "avx2" from avx2 up, else None (torch's ops)."""
    for kernel in reversed(LINEAR_KERNELS):
        if at_least(_LIBRARIES[kernel][1], cpu_isa) and available(kernel):
            return kernel
    return None


def attention_kernel(cpu_isa: str | None = None) -> str:
    """The fastest attention kernel (:data:`ATTENTION_KERNELS`) for CPU class ``cpu_isa``
    (default: probed) that this machine runs; "avx2" at the least (the caller checks that the
    "avx2" library is available). Each computes a token's output bitwise the same in any batch;
    they differ from each other in the last bits (their sums run in different orders)."""
    isa = detected_isa() if cpu_isa is None else cpu_isa
    for kernel in reversed(ATTENTION_KERNELS):
        library, needs, _ = _ATTENTION_OPS[kernel]
        if at_least(needs, isa) and at_least(needs, detected_isa()) and available(library) \
                and (kernel != "amx" or amx_available()):
            return kernel
    return "avx2"


def attention_op(kernel: str):
    """The torch op of attention kernel ``kernel`` (signature: ``sgl_cpu::attention``'s, see
    :class:`kernels.cpu.attention.CPUAttention`). Raises RuntimeError when this machine cannot
    run it (its library, or the CPU lacks the instructions)."""
    library, needs, name = _ATTENTION_OPS[kernel]
    require(library)
    if not at_least(needs, detected_isa()) or (kernel == "amx" and not amx_available()):
        raise RuntimeError(f"the {kernel} attention kernel needs {needs} (and for amx, "
                           f"tiles the OS grants, {AMX_OVERRIDE} not 0); the CPU is "
                           f"{detected_isa()!r}")
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op)


def k_multiple(kernel: str, kind: str) -> int:
    """in_features must be a multiple of this for ``kernel``'s ``kind`` ("int4"/"int8")."""
    return BLOCK if kernel == "avx512_vnni" or kind == "int4" else 8


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


def vnni_pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Repack an int4 weight for :func:`vnni_int4_linear`. q: [N, K] uint8 in [0, 15]; scale,
    zero: [N, K // 32] float32 with ``w = (q - 8) * scale + zero``. Returns
    [ceil(N / 16), K // 32 * 320] uint8: per tile of 16 output features and block of 32
    inputs, 16 fp16 scales d and offsets m (w = d * q + m, the values :func:`pack_int4` keeps)
    and the nibbles in VNNI order (``csrc_vnni/packed_layout.h``). Raises RuntimeError for bad
    shapes."""
    require("avx512_vnni")
    return torch.ops.sgl_cpu_vnni.pack_int4(q, scale, zero)


AMX_OVERRIDE = "SGL_CPU_AMX"  # "0": never the AMX kernel (tests run the dense copies' path)


def amx_available() -> bool:
    """True when :func:`amx_int4_linear` runs here: the VNNI library loads, the CPU has
    AMX-BF16 (and AVX512-BF16 / VBMI) and the OS grants the tile state, and ``$SGL_CPU_AMX`` is
    not "0"."""
    if os.environ.get(AMX_OVERRIDE, "").strip() == "0" or not available("avx512_vnni"):
        return False
    return bool(torch.ops.sgl_cpu_vnni.amx_available())


def amx_int4_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] bfloat16 (float32 is rounded to bfloat16 first; contiguous, K % 32 == 0) @ the
    weight [N, K] that :func:`vnni_pack_int4` packed, transposed -> [M, N] in x's dtype: each
    weight tile dequantized to bf16 (w = d * q + m, rounded once), float32 sums on AMX tiles.
    For prefill-sized M (the dequantization is paid once a call). Raises RuntimeError for bad
    shapes/dtypes, or where :func:`amx_available` is false."""
    return torch.ops.sgl_cpu_vnni.amx_int4_linear(x, packed, out_features)


def amx_int4_linear_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] (as :func:`amx_int4_linear`) @ a fused [gate; up] weight [N = 2 I, K] that
    :func:`vnni_pack_int4` packed (I % 16 == 0) -> silu(gate) * up [M, I] in x's dtype, bitwise
    ``silu_mul(amx_int4_linear(x, packed, N))`` without the [M, N] intermediate. Raises
    RuntimeError as :func:`amx_int4_linear` does, or for N not a multiple of 32."""
    return torch.ops.sgl_cpu_vnni.amx_int4_linear_silu(x, packed, out_features)


def vnni_pack_int8(w: torch.Tensor) -> torch.Tensor:
    """Repack an int8 weight [N, K] (K % 32 == 0) for :func:`vnni_int8_linear`: returns
    [ceil(N / 16), K // 32 * 512] uint8 (w + 128 in VNNI order). Raises RuntimeError."""
    require("avx512_vnni")
    return torch.ops.sgl_cpu_vnni.pack_int8(w)


def vnni_int8_rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` [T] int64 of the int8 weight [N, K] that :func:`vnni_pack_int8` packed
    into ``packed``, as [T, K] int8 (an embedding lookup from a tied lm_head's layout: chunk c
    of block g of tile n // 16 holds the row's inputs 32g + 4c .. 32g + 4c + 3 at bytes
    4 (n % 16) ..., each stored as w + 128)."""
    tiles = packed.view(packed.shape[0], in_features // BLOCK, 8, 16, 4)
    rows = tiles[ids // 16, :, :, ids % 16, :].reshape(ids.numel(), in_features)
    return (rows ^ 0x80).view(torch.int8)


def vnni_int4_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32/bfloat16 (contiguous, K % 32 == 0) @ the packed weight [N, K]
    transposed -> [M, N] in x's dtype. x is quantized per row in blocks of 32 to int8
    (scale max|x| / 127, round to nearest even); block sums are exact int32, scaled and added
    in float32. Raises RuntimeError for bad shapes/dtypes."""
    return torch.ops.sgl_cpu_vnni.int4_linear(x, packed, out_features)


def vnni_int4_linear_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The gate/up projection and SiLU * up in one pass: x [M, K] float32/bfloat16 and a fused
    [gate; up] weight [2 I, K] packed by :func:`vnni_pack_int4` (``out_features`` = 2 I, I a
    multiple of 16) -> silu(x @ gate.T) * (x @ up.T) [M, I] in x's dtype, bitwise
    ``silu_mul(vnni_int4_linear(x, packed, 2 I))`` without the [M, 2 I] intermediate (on an
    AVX512-BF16 CPU the bfloat16 roundings are the CPU's ``vcvtneps2bf16``: the same bits
    except for denormals, flushed to zero, and NaN payloads). Raises RuntimeError for bad
    shapes/dtypes."""
    return torch.ops.sgl_cpu_vnni.int4_linear_silu(x, packed, out_features)


def vnni_int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32/bfloat16 @ (w [N, K] int8 * scale [N] float32) transposed -> [M, N]
    in x's dtype, w packed by :func:`vnni_pack_int8`; x quantized as in
    :func:`vnni_int4_linear`. Raises RuntimeError for bad shapes/dtypes."""
    return torch.ops.sgl_cpu_vnni.int8_linear(x, packed, scale)
