"""Fused Triton kernels around attention: writing new K/V into their pool slots, RMSNorm, and
rotary embeddings. Each replaces several torch launches (and their temporaries) with one and
matches the reference in ``kernels.reference`` (same formulas, same rounding points).

* :func:`store_kv`: K and V rows of T tokens into slots ``loc`` of the pool, one launch.
* :func:`rms_norm`: Zhang & Sennrich (2019); like HF ``LlamaRMSNorm``: normalize in float32,
  cast to x's dtype, then scale by the weight.
* :func:`apply_rope`: Su et al. (2021) with HF's half-split ``rotate_half`` layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K_new, V_new, K_buf, V_buf, loc, stride_kt, stride_vt, stride_kc, stride_kh,
                     stride_vc, stride_vh, D: tl.constexpr, ROW: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    head, d = offs // D, offs % D  # the pool's heads may be strided (a head-major CPU pool)
    tl.store(K_buf + slot * stride_kc + head * stride_kh + d,
             tl.load(K_new + t * stride_kt + offs, mask=mask), mask=mask)
    tl.store(V_buf + slot * stride_vc + head * stride_vh + d,
             tl.load(V_new + t * stride_vt + offs, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_buffer, v_buffer: [C, Hkv, D] (same dtype; any slot and head
    strides, each head's D elements contiguous); loc: [T] int slots. Writes in place."""
    if k.shape[0] == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0],)](k, v, k_buffer, v_buffer, loc, k.stride(0), v.stride(0),
                                    k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
                                    v_buffer.stride(1), D=k.shape[2], ROW=row,
                                    BLOCK=triton.next_power_of_2(row))


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N: tl.constexpr, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    # Round the normalized row to x's dtype first, as the reference does; the product is then
    # taken in fp32 and rounded once (what torch does for a 16-bit product).
    y = w * (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(Y + t * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] fp16/bf16/fp32 (rows contiguous); weight: [H] same dtype. Returns [T, H]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)
    if x.shape[0]:
        n = x.shape[-1]
        _rms_norm_kernel[(x.shape[0],)](x, weight, y, x.stride(0), y.stride(0), N=n, eps=eps,
                                        BLOCK=triton.next_power_of_2(n))
    return y


@triton.jit
def _rope_kernel(X, Y, COS, SIN, stride_xt, stride_xh, stride_yt, stride_yh, stride_ct,
                 stride_st, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x_base = X + t * stride_xt + h * stride_xh
    # fp32 arithmetic, one rounding at the store
    x1 = tl.load(x_base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_st + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    y_base = Y + t * stride_yt + h * stride_yh
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    tl.store(y_base + offs, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_base + HALF + offs, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (D even, last dim contiguous); cos/sin: [T, D] in x's dtype.
    Returns the rotated [T, heads, D]."""
    y = torch.empty_like(x)
    if x.shape[0]:
        half = x.shape[-1] // 2
        _rope_kernel[(x.shape[0], x.shape[1])](
            x, y, cos, sin, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0),
            sin.stride(0), HALF=half, BLOCK=triton.next_power_of_2(half))
    return y
