"""Triton attention that reads K/V directly through per-sequence slot-index rows of the
token-granular pool (page size 1), with no gathered copy of the KV.

Algorithm: FlashAttention-2's online softmax (Dao, 2023, Algorithm 1) over blocks of KV
positions; the block's K/V rows are loaded by slot index (``req_to_token[row, pos]``), as in
SGLang's ``decode_attention.py`` / ``extend_attention.py`` (sgl-project/sglang,
python/sglang/srt/layers/attention/triton_ops). Differences from those: the extend kernel reads
the new tokens' K/V from the pool too (``store_kv`` runs first), and decode is one stage (no
split-KV reduction).

* :func:`decode_attention`: grid (batch, kv_heads). One program serves all query heads of one
  KV head (GQA group), so each K/V row is loaded once per group, not once per query head.
* :func:`extend_attention`: grid (batch, q_heads, query blocks). Query i of a sequence with
  prefix p attends to positions [0, p + i] (causal over the new tokens, full over the prefix).
* Sliding-window layers (``window`` W: positions (p - W, p]) start their KV loop at the
  window, so they read O(W) K/V rows, not the whole sequence; attention-logit soft-capping
  (Gemma 2) is applied to the scores before the mask.

Scores and the softmax are float32 whatever the KV dtype; fp16/bf16 operands go to ``tl.dot``
with float32 accumulation, fp32 operands use IEEE precision (no TF32). Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the correctness tests do that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.base import triton_interpret


@triton.jit
def _attend_rows(q, q_pos, K, V, req_to_token, row, kv_head, lo, end, scale, window, softcap,
                 stride_kc, stride_kh, stride_vc, stride_vh, stride_r2t, offs_d, d_mask,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Online softmax of query rows q [ROWS, BLOCK_D] over KV positions [lo, end) of request
    table row ``row``; query r sees positions <= q_pos[r] (and > q_pos[r] - window when
    WINDOWED). With SOFTCAP scores are capped to ``softcap * tanh(s / softcap)``. Returns
    [ROWS, BLOCK_D] float32 (zeros for rows that see nothing)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(lo, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0)
        slots = slots.to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kc + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_N]
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1 (no tanh in triton.language)
            s = softcap * (2.0 * tl.sigmoid(s * (2.0 / softcap)) - 1.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOWED:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet (a window starting past this block) keeps m = -inf;
        # subtracting 0 instead keeps exp() at 0 rather than NaN (-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vc + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only for rows seeing nothing


@triton.jit
def _decode_kernel(Q, K, V, Out, req_to_token, req_rows, seq_lens, scale, window, softcap,
                   stride_qt, stride_qh, stride_kc, stride_kh, stride_vc, stride_vh,
                   stride_ot, stride_oh, stride_r2t,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(req_rows + b).to(tl.int64)
    length = tl.load(seq_lens + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.full([BLOCK_H], 0, tl.int32) + length - 1  # the new token sees everything
    lo = 0  # ... or, in a window layer, its last ``window`` positions
    if WINDOWED:
        lo = tl.maximum(length - window, 0)
    out = _attend_rows(q, q_pos, K, V, req_to_token, row, kv_head, lo, length, scale, window,
                       softcap, stride_kc, stride_kh, stride_vc, stride_vh, stride_r2t, offs_d,
                       d_mask, BLOCK_H, BLOCK_D, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP)
    tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _extend_kernel(Q, K, V, Out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts, scale,
                   window, softcap, stride_qt, stride_qh, stride_kc, stride_kh, stride_vc,
                   stride_vh, stride_ot, stride_oh, stride_r2t,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    kv_head = head // GROUP
    row = tl.load(req_rows + b).to(tl.int64)
    prefix = tl.load(prefix_lens + b)
    n_new = tl.load(extend_lens + b)
    q_start = tl.load(q_starts + b).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < n_new
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Last KV position any query of this block may see; 0 (no iterations) for an empty block.
    end = tl.where(block * BLOCK_M < n_new, prefix + tl.minimum(n_new, (block + 1) * BLOCK_M), 0)
    lo = 0  # first KV position the block's first query sees
    if WINDOWED:
        lo = tl.maximum(prefix + block * BLOCK_M - window + 1, 0)
    out = _attend_rows(q, prefix + offs_m, K, V, req_to_token, row, kv_head, lo, end, scale,
                       window, softcap, stride_kc, stride_kh, stride_vc, stride_vh, stride_r2t,
                       offs_d, d_mask, BLOCK_M, BLOCK_D, BLOCK_N, PRECISION, UPCAST, WINDOWED,
                       SOFTCAP)
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _precision(dtype: torch.dtype) -> dict:
    """Dot-product settings: fp32 operands in IEEE precision (no TF32). Triton 3.9's
    interpreter computes bf16 ``tl.dot`` wrongly (garbage of order 1e10), so under
    ``TRITON_INTERPRET=1`` bf16 operands are upcast to fp32 first; compiled kernels use bf16
    tensor-core dots with fp32 accumulation."""
    upcast = dtype == torch.bfloat16 and triton_interpret()
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32",
            "UPCAST": upcast}


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    return hq // hkv, q.shape[2]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, block_n: int = 64, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """One new token per sequence over its whole KV (its last ``window`` positions when
    ``window`` > 0; scores soft-capped as ``softcap * tanh(s / softcap)`` when ``softcap`` > 0).

    Args:
        q: [B, Hq, D] fp16/bf16/fp32.
        k_cache, v_cache: [C, Hkv, D] pool buffers (Hq % Hkv == 0), same dtype as q.
        req_to_token: [R, max_context] int32/int64 slot rows; req_rows: [B] rows of the batch.
        seq_lens: [B] int32 KV length of each sequence (>= 1, including the new token).
        scale: softmax scale (usually D ** -0.5).
    Returns [B, Hq, D] in q's dtype. Raises ValueError on mismatched heads or strides.
    """
    group, d = _check(q, k_cache, v_cache)
    out = torch.empty_like(q)
    _decode_kernel[(q.shape[0], k_cache.shape[1])](
        q, k_cache, v_cache, out, req_to_token, req_rows, seq_lens, scale, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n, WINDOWED=window > 0,
        SOFTCAP=softcap > 0, **_precision(q.dtype))
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int,
                     scale: float, block_m: int = 32, block_n: int = 32, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """New tokens (any number per sequence) over the cached prefix and causally each other;
    ``window`` and ``softcap`` as in :func:`decode_attention` (a window layer's query blocks
    start reading at their first query's window).

    Args:
        q: [T, Hq, D], the sequences' new tokens back to back (T = sum(extend_lens)).
        k_cache, v_cache: [C, Hkv, D], already holding the new tokens' K/V.
        req_to_token, req_rows: as in :func:`decode_attention`.
        prefix_lens, extend_lens, q_starts: [B] int32; q_starts = exclusive cumsum of
            extend_lens (the first row of each sequence in q).
        max_extend: max(extend_lens), sizes the grid.
    Returns [T, Hq, D] in q's dtype. Raises ValueError on mismatched heads or strides.
    """
    group, d = _check(q, k_cache, v_cache)
    out = torch.empty_like(q)
    grid = (prefix_lens.shape[0], q.shape[1], triton.cdiv(max(max_extend, 1), block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts,
        scale, window, softcap, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=block_n, WINDOWED=window > 0, SOFTCAP=softcap > 0, **_precision(q.dtype))
    return out
