"""Triton kernels (:mod:`kernels.triton.attention`, :mod:`kernels.triton.fused`) and the
:class:`TritonAttention` backend built from them.

Importing this package needs ``triton``; running its kernels needs a CUDA device, or
``TRITON_INTERPRET=1`` (set before triton is first imported), which runs them on CPU tensors
through Triton's interpreter: slow, but the same kernel code, which is how CI tests them.
"""

from __future__ import annotations

import torch

from kernels.base import AttentionInputs
from kernels.triton import fused
from kernels.triton.attention import decode_attention, extend_attention


class TritonAttention:
    """:class:`kernels.base.AttentionBackend` on Triton kernels (also provides the fused
    ``rms_norm`` and ``apply_rope`` the model calls through its backend).

    ``begin`` copies the batch metadata to the device once per forward pass (one host-to-device
    copy of a [5, B] int32 tensor; no device-to-host reads), so a decode step adds no host sync.
    """

    name = "triton"
    rms_norm = staticmethod(fused.rms_norm)
    apply_rope = staticmethod(fused.apply_rope)

    def __init__(self, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]):
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        self.device = k_buffers[0].device
        self.inputs: AttentionInputs | None = None

    def begin(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        starts, total = [], 0
        for n in inputs.extend_lens:
            starts.append(total)
            total += n
        meta = torch.tensor([inputs.req_rows, inputs.prefix_lens, inputs.extend_lens,
                             inputs.seq_lens, starts], dtype=torch.int32)
        if self.device.type == "cuda":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
        self._rows, self._prefix, self._extend, self._seq, self._starts = meta.unbind(0)
        self._max_extend = max(inputs.extend_lens, default=0)
        self._loc = inputs.out_cache_loc

    supports_cuda_graph = True

    def init_cuda_graph(self, max_bs: int, max_kv_tokens: int, num_q_heads: int, scale: float,
                        dtype: torch.dtype) -> None:
        """Nothing to allocate: a captured decode reads the graph runner's static buffers."""

    def begin_graph_decode(self, inputs: AttentionInputs, req_rows: torch.Tensor,
                           seq_lens: torch.Tensor) -> None:
        """Point decode at static device buffers ([bs] int64 rows and KV lengths, and
        ``inputs.out_cache_loc``), the same tensors at capture and at every replay, so the
        captured kernels read each step's values."""
        self.inputs = inputs
        self._rows, self._seq, self._loc = req_rows, seq_lens, inputs.out_cache_loc

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        fused.store_kv(k, v, self.k_buffers[layer], self.v_buffers[layer], self._loc)

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        k, v = self.k_buffers[layer], self.v_buffers[layer]
        if self.inputs.is_decode:
            return decode_attention(q, k, v, self.inputs.req_to_token, self._rows, self._seq,
                                    scale, window=window, softcap=softcap)
        return extend_attention(q, k, v, self.inputs.req_to_token, self._rows, self._prefix,
                                self._extend, self._starts, self._max_extend, scale,
                                window=window, softcap=softcap)


__all__ = ["TritonAttention", "decode_attention", "extend_attention", "fused"]
