"""FlashInfer (Ye et al., 2025; flashinfer-ai/flashinfer) paged attention over the token pool.

The pool is FlashInfer's paged KV cache with page size 1: buffer ``[C, Hkv, D]`` viewed as
``[C, 1, Hkv, D]`` pages in the NHD layout, and a sequence's page list is its slot-index row.
Per forward pass ``begin`` builds the CSR page table (``indptr`` [B+1], ``indices`` [sum of
KV lengths], ``last_page_len`` [B] = 1) on the device and the wrappers ``plan`` once (at the
first layer, when the softmax scale is known); every layer then calls ``run``. Prefill uses
FlashInfer's causal mask, which is aligned to the end of the KV (query i of n attends to KV
positions <= prefix + i), the same rule as :func:`kernels.reference.extend_attention`.

Needs ``flashinfer`` (PyPI ``flashinfer-python``) and CUDA buffers; :mod:`kernels` only offers
this backend when both are present. Rotary and norm ops stay the Triton ones when Triton is
importable, else the reference ones.
"""

from __future__ import annotations

import torch

from kernels.base import AttentionInputs

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented default workspace


class FlashInferAttention:
    """:class:`kernels.base.AttentionBackend` on FlashInfer's page-size-1 paged wrappers."""

    name = "flashinfer"

    def __init__(self, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]):
        import flashinfer

        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        self.device = k_buffers[0].device
        self.num_kv_heads, self.head_dim = k_buffers[0].shape[1], k_buffers[0].shape[2]
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph = None
        self._pages = [(k.unsqueeze(1), v.unsqueeze(1)) for k, v in zip(k_buffers, v_buffers)]
        self.inputs: AttentionInputs | None = None
        self._planned = False
        try:
            from kernels.triton import fused
            self.rms_norm, self.apply_rope = fused.rms_norm, fused.apply_rope
        except ImportError:
            from kernels import reference
            self.rms_norm, self.apply_rope = reference.rms_norm, reference.apply_rope

    def begin(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        dev = self.device
        # indptr arrays on the host (plan() schedules on the CPU); indices on the device.
        self._kv_indptr = _indptr(inputs.seq_lens)
        self._qo_indptr = _indptr(inputs.extend_lens)
        rows = torch.tensor(inputs.req_rows, dtype=torch.int64).to(dev, non_blocking=True)
        lens = torch.tensor(inputs.seq_lens, dtype=torch.int64).to(dev, non_blocking=True)
        starts = self._kv_indptr[:-1].to(dev, non_blocking=True)
        # Concatenated slot rows: position p of sequence b at kv_indptr[b] + p. Sizes come from
        # the host-side lists, so building them needs no device-to-host sync.
        total = sum(inputs.seq_lens)
        seq = torch.repeat_interleave(torch.arange(len(inputs.req_rows), device=dev), lens,
                                      output_size=total)
        pos = torch.arange(total, device=dev) - starts[seq]
        self._kv_indices = inputs.req_to_token[rows[seq], pos].to(torch.int32)
        # On the host: plan() reads last_page_len back to the CPU (a device sync if it were
        # on the GPU) and copies it to the device itself.
        self._last_page_len = torch.ones(len(inputs.req_rows), dtype=torch.int32)
        self._planned = False
        self._graph = None

    supports_cuda_graph = True

    def init_cuda_graph(self, max_bs: int, max_kv_tokens: int, num_q_heads: int, scale: float,
                        dtype: torch.dtype) -> None:
        """Allocate what captured decodes share: the page-index buffer ([max_kv_tokens] int32,
        the pool's capacity) and the plan arguments. Each batch-size bucket gets its own
        ``use_cuda_graph`` decode wrapper on first use (FlashInfer fixes the batch size of a
        graph wrapper)."""
        self._graph_indices = torch.zeros(max_kv_tokens, dtype=torch.int32, device=self.device)
        self._graph_wrappers: dict[int, object] = {}
        self._graph_plan = dict(num_qo_heads=num_q_heads, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim, page_size=1, sm_scale=scale,
                                q_data_type=dtype, kv_data_type=self.k_buffers[0].dtype)

    def begin_graph_decode(self, inputs: AttentionInputs, req_rows: torch.Tensor,
                           seq_lens: torch.Tensor) -> None:
        """Plan the bucket's graph wrapper for this step (host-side scheduling plus
        non-blocking copies into its static buffers), before capture or replay."""
        import flashinfer

        bs = len(inputs.req_rows)
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32,
                                                         device=self.device))
            self._graph_wrappers[bs] = wrapper
        self.begin(inputs)
        wrapper.plan(self._kv_indptr, self._kv_indices, self._last_page_len, **self._graph_plan)
        self._graph, self._planned = wrapper, True

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        loc = self.inputs.out_cache_loc
        self.k_buffers[layer][loc] = k
        self.v_buffers[layer][loc] = v

    def _plan(self, q: torch.Tensor, scale: float) -> None:
        common = dict(num_qo_heads=q.shape[1], num_kv_heads=self.num_kv_heads,
                      page_size=1, sm_scale=scale, q_data_type=q.dtype,
                      kv_data_type=self.k_buffers[0].dtype)
        if self.inputs.is_decode:
            self._decode.plan(self._kv_indptr, self._kv_indices, self._last_page_len,
                              head_dim=self.head_dim, **common)
        else:
            self._prefill.plan(self._qo_indptr, self._kv_indptr, self._kv_indices,
                               self._last_page_len, head_dim_qk=self.head_dim, causal=True,
                               **common)
        self._planned = True

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        if window or softcap:  # create_attention_backend never picks this backend for them
            raise NotImplementedError("sliding windows and logit soft-capping are not wired "
                                      "into the FlashInfer backend (use triton)")
        if not self._planned:
            self._plan(q, scale)
        wrapper = self._graph or (self._decode if self.inputs.is_decode else self._prefill)
        return wrapper.run(q.contiguous(), self._pages[layer])


def _indptr(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 exclusive-then-inclusive cumsum, on the host."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)
