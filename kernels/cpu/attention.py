""":class:`CPUAttention`: the attention backend on the native ``sgl_cpu::attention`` kernel.

Decode and extend passes (mixed ones too) go through one kernel (AVX2, AVX-512 or AVX512-BF16,
by CPU class: :func:`kernels.cpu.attention_kernel`) that reads each sequence's K/V rows in place
through its slot indices: no gathered copy of the prefix, no padded batch,
no mask tensor. Partitions of 512 positions run as separate work items (flash-decoding), so a
single long sequence uses every core, and a token's output does not depend on the rest of the
batch (see ``csrc/attention_impl.h``). The backend also offers the decoder layer fused ops
(``fused = True``): RMSNorm, residual add + RMSNorm, RoPE + K/V store, SiLU * up
(``csrc/fused.cpp``, or ``csrc_vnni/fused512.cpp`` with the AVX-512 attention kernels).
"""

from __future__ import annotations

import torch

from kernels import cpu as native
from kernels.base import AttentionInputs
from kernels.reference import apply_rope, rms_norm


class CPUAttention:
    """:class:`kernels.base.AttentionBackend` over float32/bfloat16 KV buffers on the CPU
    (``k_buffers[layer]``, ``v_buffers[layer]``: [capacity, num_kv_heads, head_dim], head_dim a
    multiple of 8 up to 256, at most 16 query heads per KV head); activations float32 or
    bfloat16, in either KV dtype. ``kernel``: one of :data:`kernels.cpu.ATTENTION_KERNELS`
    (:func:`kernels.cpu.attention_kernel` picks). Raises RuntimeError when it cannot run here."""

    name = "cpu"
    apply_rope = staticmethod(apply_rope)
    fused = True  # rope_store, add_rms_norm, silu_mul (server.model.llama uses them)

    def __init__(self, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                 kernel: str = "avx2"):
        self._attention = native.attention_op(kernel)
        # the norms, RoPE + K/V store and SiLU * up of the library the attention kernel is in
        self._ops = torch.ops.sgl_cpu if kernel == "avx2" else torch.ops.sgl_cpu_vnni
        self.kernel = kernel
        self.k_buffers = k_buffers
        self.v_buffers = v_buffers
        self.inputs: AttentionInputs | None = None
        self._meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        self._meta = (torch.tensor(inputs.req_rows, dtype=torch.int64),
                      torch.tensor(inputs.prefix_lens, dtype=torch.int64),
                      torch.tensor(inputs.extend_lens, dtype=torch.int64))

    def stack_inputs(self) -> tuple[torch.Tensor, ...]:
        """This pass's attention metadata as ``sgl_cpu::DecoderStack.forward`` takes it:
        (req_to_token, req_rows, prefix_lens, extend_lens, out_cache_loc)."""
        rows, prefix, extend = self._meta
        return self.inputs.req_to_token, rows, prefix, extend, self.inputs.out_cache_loc

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, H] (float32/bfloat16, weight [H] in x's dtype), as the reference;
        on the library where the attention runs (its 16-lane op on the AVX-512 kernels)."""
        if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
            return rms_norm(x, weight, eps)
        return self._ops.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` in place, then returns RMSNorm(residual); [T, H] each."""
        if residual.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
            residual += x
            return rms_norm(residual, weight, eps)
        return self._ops.add_rms_norm(x.contiguous(), residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2I] (the halves). Returns [T, I], on the library
        where the attention runs."""
        return self._ops.silu_mul(gate_up.contiguous())

    def rope_store(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_q: int, num_kv: int, head_dim: int) -> torch.Tensor:
        """RoPE on the q and k heads of qkv [T, (num_q + 2 num_kv) * head_dim] in place and
        k, v stored into this layer's pool slots (rounded to nearest even where the pool is
        narrower than qkv); returns q [T, num_q, head_dim] (a view)."""
        self._ops.rope_store(qkv, cos, sin, num_q, num_kv, head_dim, self.k_buffers[layer],
                             self.v_buffers[layer], self.inputs.out_cache_loc)
        return qkv[:, :num_q * head_dim].view(-1, num_q, head_dim)

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        loc = self.inputs.out_cache_loc
        kb, vb = self.k_buffers[layer], self.v_buffers[layer]
        kb.index_copy_(0, loc, k.to(kb.dtype))
        vb.index_copy_(0, loc, v.to(vb.dtype))

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        rows, prefix, extend = self._meta
        if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
            q = q.contiguous()
        return self._attention(q, self.k_buffers[layer], self.v_buffers[layer],
                               self.inputs.req_to_token, rows, prefix, extend, scale, window,
                               softcap)
