"""Weight-only quantization kept in memory: int4 (group-wise, asymmetric) and int8 (per output
channel, symmetric) linear weights that run on torch's packed CPU matmul ops.

Formats (``w`` is the float weight [N, K], N output features, K input features):
  * int4: ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``, ``g = k // 32``, ``q`` in
    [0, 15]. This is the convention of torch's ``_weight_int4pack_mm_for_cpu`` (the "tinygemm"
    layout torchao's ``Int4WeightOnlyConfig`` builds on), and GGUF's 4-bit block types map onto
    it exactly: Q4_0 (``d * (q - 8)``: scale d, zero 0), Q4_1 (``d * q + m``: scale d,
    zero m + 8d) and Q4_K (sub-blocks of 32 with 6-bit scale/min codes: scale d*sc,
    zero 8*d*sc - dmin*m). Layouts: ggml ``ggml-common.h`` ``block_q4_0``/``block_q4_1``/
    ``block_q4_K``; the byte parsing mirrors the ``gguf`` package's ``dequantize_blocks``.
  * int8: ``w[n, k] = q[n, k] * scale[n]``, ``q`` in [-127, 127] (torch ``_weight_int8pack_mm``).
    GGUF types with more than 4 bits (Q8_0, Q5_*, Q6_K...) have no per-block int8 op in torch, so
    they are dequantized with ``gguf`` and re-quantized per output channel: the error is at most
    half a step of the row's scale (max |w[n]| / 254).

The packed ops take bfloat16 activations and scales (AVX-512/AVX2 vectorized; their float32
variants are 10-40x slower), so :class:`QuantLinear` computes in bfloat16 with float32
accumulation inside the op and returns the caller's dtype.

Modes (``--quantization``): "none" dequantizes everything (the reference path); "int4"/"int8"
quantize every linear weight and the token embedding; "auto" keeps a GGUF file's own
quantization and leaves float checkpoints as they are.

Errors: :class:`QuantizationError` (a ``ValueError``) names an unsupported mode, type or shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from server.config import QUANTIZATION_MODES  # noqa: F401 - re-exported: the CLI's one list

INT4_GROUP = 32  # weights per (scale, zero) pair; every GGUF 4-bit type uses 32-weight groups
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # kept exactly as int4
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # dense in the file: dense in memory under "auto"
COMPUTE_DTYPE = torch.bfloat16


class QuantizationError(ValueError):
    """An unsupported quantization mode, GGUF type or weight shape."""


@dataclass
class QuantizedWeight:
    """An unpacked quantized weight: what the loader yields and the model concatenates.

    Attributes:
        kind: "int4" or "int8".
        q: int4: [N, K] uint8 in [0, 15]; int8: [N, K] int8.
        scale: int4: [N, K // 32] float32; int8: [N] float32.
        zero: int4: [N, K // 32] float32; int8: None.
        source: where it came from ("Q4_1", "Q8_0 -> int8", "float -> int4"...), for reports.
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    source: str

    @property
    def shape(self) -> torch.Size:
        """The weight's [out_features, in_features]."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        if self.kind == "int8":
            return self.q.float() * self.scale[:, None]
        n, k = self.q.shape
        q = self.q.float().view(n, k // INT4_GROUP, INT4_GROUP)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def permute_rows(self, perm: torch.Tensor) -> "QuantizedWeight":
        """Reorder output rows (e.g. undo llama.cpp's Q/K permutation)."""
        return QuantizedWeight(self.kind, self.q[perm], self.scale[perm],
                               None if self.zero is None else self.zero[perm], self.source)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Concatenate weights of one kind along N (fused qkv / gate_up projections)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise QuantizationError(f"cannot fuse weights of kinds {sorted(kinds)}")
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return QuantizedWeight(parts[0].kind, torch.cat([p.q for p in parts]),
                           torch.cat([p.scale for p in parts]), zero,
                           "+".join(sorted({p.source for p in parts})))


# ---------------------------------------------------------------------------- from floats
QUANTIZE_ROWS = 4096  # rows quantized at a time: float32 temporaries stay ~100 MB a chunk


def _by_rows(fn, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn`` (float32 [m, K] -> a tuple of per-row tensors) over at most QUANTIZE_ROWS rows of
    ``w`` [N, K] at a time, the parts concatenated. The arithmetic is per row, so the result
    equals ``fn(w.float())``, while a 128k-row embedding no longer holds several 1 GB float32
    temporaries at once."""
    parts = [fn(w[i:i + QUANTIZE_ROWS].float()) for i in range(0, w.shape[0], QUANTIZE_ROWS)]
    return tuple(torch.cat(t) for t in zip(*parts))


def _int4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    q = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(-1) / 127
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    return (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, source: str = "float -> int4") -> QuantizedWeight:
    """Min/max asymmetric int4 with groups of 32 along K (Q4_1's rule). w: [N, K] float."""
    k = w.shape[1]
    if k % INT4_GROUP:
        raise QuantizationError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
    q, scale, lo = _by_rows(_int4_rows, w)
    return QuantizedWeight("int4", q, scale, lo + 8 * scale, source)


def quantize_int8(w: torch.Tensor, source: str = "float -> int8") -> QuantizedWeight:
    """Symmetric int8 per output row. w: [N, K] float."""
    q, scale = _by_rows(_int8_rows, w)
    return QuantizedWeight("int8", q, scale, None, source)


def quantize(w: torch.Tensor | QuantizedWeight, kind: str) -> QuantizedWeight:
    """Bring a float or quantized weight to ``kind`` ("int4"/"int8"), re-quantizing if needed."""
    if isinstance(w, QuantizedWeight):
        if w.kind == kind:
            return w
        return (quantize_int4 if kind == "int4" else quantize_int8)(
            w.dequantize(), f"{w.source} -> {kind}")
    return quantize_int4(w) if kind == "int4" else quantize_int8(w)


# ---------------------------------------------------------------------------- from GGUF blocks
def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] values: low nibbles first, then high (ggml order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def gguf_int4(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Q4_0 / Q4_1 / Q4_K raw bytes (the reader's [N, bytes per row] uint8) -> exact int4.

    ``shape`` is [N, K] (rows, weights per row). Raises QuantizationError for other types.
    """
    n, k = shape
    rows = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name == "Q4_0":  # d:f16, qs[16]
        b = rows.reshape(n, k // 32, 18)
        d = _f16(b[..., 0:2])
        q = _nibbles(b[..., 2:])
        scale, zero = d, np.zeros_like(d)
    elif type_name == "Q4_1":  # d:f16, m:f16, qs[16]
        b = rows.reshape(n, k // 32, 20)
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 4:])
        scale, zero = d, m + 8 * d
    elif type_name == "Q4_K":  # d:f16, dmin:f16, scales[12] (6-bit sc/m x 8), qs[128]
        from gguf.quants import Q4_K

        b = rows.reshape(n * (k // 256), 144)
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 32)  # chunk c: sub-block 2c (low), 2c+1 (high nibbles)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        scale = d * sc.astype(np.float32)
        zero = 8 * scale - dmin * mn.astype(np.float32)
        q, scale, zero = (q.reshape(n, k // 32, 32), scale.reshape(n, k // 32),
                          zero.reshape(n, k // 32))
    else:
        raise QuantizationError(f"GGUF type {type_name} has no exact int4 form "
                                f"(int4 types: {', '.join(INT4_TYPES)})")
    return QuantizedWeight("int4", torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                           torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                           torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)),
                           type_name)


# ---------------------------------------------------------------------------- modules
def int4_supported(n: int, k: int) -> bool:
    """torch's int4 CPU packing needs N % 16 == 0 and K % 32 == 0."""
    return n % 16 == 0 and k % INT4_GROUP == 0


class QuantLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` packed for torch's weight-only CPU ops.

    Args:
        weight: the unpacked :class:`QuantizedWeight` [N, K] (packed here, then dropped).
        bias: [N] float or None.
        dense_min_rows: also keep the dequantized weight in bfloat16 and use it (a dense
            oneDNN matmul) for inputs of at least this many rows; None = packed only. On CPUs
            with native bf16 dot products (AVX512-BF16/AMX) a dense bf16 matmul of 256+ rows ran
            1.9-2.6x faster than the packed int4 kernel, which computes with fp32 FMAs, while
            below ~32 rows (decode) the packed weight wins by reading 4x fewer bytes. Int4 on
            "avx512_vnni" where :func:`kernels.cpu.amx_available`: no copy, AMX tiles instead.
        native: the ``kernels.cpu`` linear kernel to run on instead of torch's packed ops
            (bfloat16 activations), or None: "avx2" (:func:`kernels.cpu.int4_linear` /
            :func:`kernels.cpu.int8_linear`: float32 FMAs over weights dequantized in
            registers, float32 or bfloat16 activations as given) or "avx512_vnni"
            (:func:`kernels.cpu.vnni_int4_linear` / :func:`kernels.cpu.vnni_int8_linear`:
            activations quantized per row to int8 in blocks of 32, integer dot products).
            Either computes every row independently of the batch. The caller checks that the
            kernel is available (:func:`kernels.cpu.linear_kernel`).

    forward: x [..., K] any float dtype -> [..., N] in x's dtype.
    Raises QuantizationError for an int4 shape the kernel cannot pack (see
    :func:`int4_supported`).
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dense_min_rows: int | None = None, native: str | None = None):
        super().__init__()
        n, k = weight.shape
        self.dense_min_rows = dense_min_rows
        self.amx = False  # long extends on AMX tiles over the packed weight, no dense copy
        if dense_min_rows is not None and native == "avx512_vnni" and weight.kind == "int4":
            from kernels import cpu as native_kernels

            self.amx = native_kernels.amx_available()
        self.register_buffer("dense", None if dense_min_rows is None or self.amx
                             else weight.dequantize().to(COMPUTE_DTYPE), persistent=False)
        self.kind, self.in_features, self.out_features = weight.kind, k, n
        self.source = weight.source
        self.native = native
        if native:
            from kernels import cpu as native_kernels

            multiple = native_kernels.k_multiple(native, weight.kind)
            if k % multiple:
                raise QuantizationError(f"the {native} kernels need in_features a multiple of "
                                        f"{multiple} ({weight.kind}), got [{n}, {k}]")
            scales = torch.empty(0)
            if native == "avx512_vnni" and weight.kind == "int4":
                packed = native_kernels.vnni_pack_int4(weight.q, weight.scale, weight.zero)
            elif native == "avx512_vnni":
                packed = native_kernels.vnni_pack_int8(weight.q)
                scales = weight.scale.float().contiguous()
            elif weight.kind == "int4":
                packed = native_kernels.pack_int4(weight.q, weight.scale, weight.zero)
            else:
                packed, scales = weight.q.contiguous(), weight.scale.float().contiguous()
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros", scales, persistent=False)
        elif weight.kind == "int4":
            if not int4_supported(n, k):
                raise QuantizationError(f"int4 needs out_features % 16 == 0 and in_features % "
                                        f"{INT4_GROUP} == 0, got [{n}, {k}]")
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32).contiguous(), 1)
            sz = torch.stack([weight.scale, weight.zero], dim=-1)  # [N, G, 2]
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros",
                                 sz.transpose(0, 1).contiguous().to(COMPUTE_DTYPE),
                                 persistent=False)  # [G, N, 2]
        else:
            self.register_buffer("packed", weight.q.contiguous(), persistent=False)
            self.register_buffer("scales_and_zeros", weight.scale.to(COMPUTE_DTYPE),
                                 persistent=False)  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        """Bytes the layer's weights take in memory (packed, scales, any dense copy)."""
        return sum(b.nbytes for b in (self.packed, self.scales_and_zeros, self.dense)
                   if b is not None)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would cast the bf16 buffers, which the ops require as they are.
        keep = {n: getattr(self, n) for n in ("packed", "scales_and_zeros", "dense")}
        out = super()._apply(fn, recurse)
        for n, t in keep.items():
            setattr(self, n, None if t is None else t.to(self.packed.device))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for x [..., in_features] (float32 or bfloat16) -> [..., out_features]
        in x's dtype: the native kernel, a dense bf16 copy for long extends where one is kept,
        else torch's packed op."""
        shape = x.shape
        if self.native:
            dense = self.dense
            if dense is None or x.numel() < self.dense_min_rows * self.in_features:
                return self._native_forward(x)
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.dense is not None and x2.shape[0] >= self.dense_min_rows:
            y = F.linear(x2, self.dense)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP,
                                                           self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales_and_zeros)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _native_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decode path: ~120 calls a step, so no op is issued that would change nothing (a
        # reshape of a 2-D input, a cast to the same dtype, contiguous() of a contiguous one).
        two_d = x.dim() == 2
        x2 = x if two_d else x.reshape(-1, self.in_features)
        if x2.dtype is not torch.float32 and x2.dtype is not torch.bfloat16:
            x2 = x2.float()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.amx and x2.shape[0] >= self.dense_min_rows:  # as sgl_cpu::DecoderStack calls it
            y = torch.ops.sgl_cpu_vnni.amx_int4_linear(x2, self.packed, self.out_features)
        elif self.native == "avx512_vnni":
            y = (torch.ops.sgl_cpu_vnni.int4_linear(x2, self.packed, self.out_features)
                 if self.kind == "int4" else
                 torch.ops.sgl_cpu_vnni.int8_linear(x2, self.packed, self.scales_and_zeros))
        elif self.kind == "int4":
            y = torch.ops.sgl_cpu.int4_linear(x2, self.packed, self.out_features)
        else:
            y = torch.ops.sgl_cpu.int8_linear(x2, self.packed, self.scales_and_zeros)
        if y.dtype is not x.dtype:
            y = y.to(x.dtype)
        if not two_d:
            y = y.view(*x.shape[:-1], self.out_features)
        bias = self.bias
        return y if bias is None else y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        """Shapes, kind and where the weights came from, for print(model)."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kind={self.kind}, source={self.source}, native={self.native}")


class QuantEmbedding(nn.Module):
    """A token embedding [V, H] kept quantized; rows are dequantized on lookup.

    ``forward(ids [T] int64) -> [T, H]`` in ``dtype``. For tied embeddings, :attr:`as_linear`
    is the lm_head ``QuantLinear`` over the same weight (int8 shares the tensor, or on the
    "avx512_vnni" kernel reads its rows from the head's packed layout; int4 keeps a second,
    packed copy because that packed layout cannot be indexed by row).
    """

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: bool,
                 native: str | None = None):
        super().__init__()
        self.kind, self.dtype, self.source = weight.kind, dtype, weight.source
        v, h = weight.shape
        if weight.kind == "int4":  # two values per byte, group scales/zeros in float32
            q = weight.q.view(v, h // 2, 2)
            self.register_buffer("q", (q[..., 0] | (q[..., 1] << 4)).contiguous(), persistent=False)
            self.register_buffer("zero", weight.zero.contiguous(), persistent=False)
        elif tied and native == "avx512_vnni":  # rows are read from the head's VNNI layout
            self.q = self.zero = None
        else:
            self.register_buffer("q", weight.q.contiguous(), persistent=False)
            self.zero = None
        self.register_buffer("scale", weight.scale.contiguous(), persistent=False)
        self.as_linear = QuantLinear(weight, native=native) if tied else None
        if self.as_linear is not None and self.q is not None and weight.kind == "int8":
            self.as_linear.packed = self.q  # the same int8 tensor

    def _apply(self, fn, recurse=True):
        # as QuantLinear: follow device moves, never dtype casts of the scales
        keep = {n: getattr(self, n) for n in ("q", "scale", "zero")}
        out = super()._apply(fn, recurse)
        for n, t in keep.items():
            setattr(self, n, None if t is None else t.to(self.scale.device))
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token ids ``ids`` ([T] int64) -> [T, H] in ``dtype``,
        dequantized from their int8 or int4 rows."""
        if self.q is None:
            from kernels.cpu import vnni_int8_rows

            q = vnni_int8_rows(self.as_linear.packed, ids, self.as_linear.in_features)
        else:
            q = self.q.index_select(0, ids)
        if self.kind == "int8":
            return (q.float() * self.scale.index_select(0, ids)[:, None]).to(self.dtype)
        t = ids.numel()
        vals = torch.stack([q & 0x0F, q >> 4], dim=-1).view(t, -1, INT4_GROUP).float()
        w = (vals - 8) * self.scale.index_select(0, ids)[..., None] \
            + self.zero.index_select(0, ids)[..., None]
        return w.view(t, -1).to(self.dtype)

