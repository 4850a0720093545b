"""CUDA graphs for decode: one captured graph per batch-size bucket, padded and replayed.

A decode step of a large model at small batch is bound by kernel launches on the host (about
10 kernels a layer, each a few microseconds of Python and driver time), not by the GPU. Capturing
the whole step (embedding, every layer, final norm, logits) once per bucket and replaying it
costs one launch. The technique is SGLang's ``CudaGraphRunner`` and vLLM's ``CUDAGraphRunner``
(sgl-project/sglang python/sglang/srt/model_executor/cuda_graph_runner.py); this is our own.

How a step is replayed:
  * The batch (B requests) runs in the smallest bucket bs >= B. Rows B..bs-1 are padding: token
    0 at position 0 of request-table row 0 with KV length 1, writing its K/V into slot 0 (the
    pool's reserved padding slot), so padding never touches a live request's KV.
  * Per-step inputs (token ids, positions, KV slots, request rows, KV lengths) are staged in one
    pinned host buffer and copied to one static device buffer with a single non-blocking copy;
    the captured kernels read them there.
  * The attention backend prepares its per-step metadata outside the graph
    (``begin_graph_decode``: nothing for Triton, whose kernels read the static buffers; a plan
    into the bucket's static page table for FlashInfer).
  * Replay writes logits [bs, vocab] float32 into the graph's output; the runner returns the
    first B rows, which stay on the device for sampling.

Backends opt in with ``supports_cuda_graph``; the reference backend (dynamic shapes, Python
lists per batch) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

from kernels.base import AttentionInputs

log = logging.getLogger("server.model")

# Batch-size buckets: fine-grained where small batches are common, then steps of 32.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
           320, 384, 448, 512)
_IDS, _POS, _LOC, _ROWS, _SEQ = range(5)
_PAD = (0, 0, 0, 0, 1)  # token, position, slot, request row, KV length of a padding row


def buckets_up_to(max_bs: int) -> list[int]:
    """The capture sizes for a largest decode batch of ``max_bs`` (which is always one)."""
    sizes = [b for b in BUCKETS if b < max_bs]
    return sizes + [max_bs]


class CudaGraphRunner:
    """Captured decode steps for batch sizes 1..max_bs.

    Args:
        forward: ``forward(input_ids [bs] int64, positions [bs] int64) -> logits [bs, V]
            float32``, the whole decode step; it must call the backend's ``store_kv``/``attend``
            and nothing that syncs with the host.
        attention: a backend with ``supports_cuda_graph`` (``init_cuda_graph``,
            ``begin_graph_decode``).
        req_to_token: the request table [R, max_context] int64 on the device.
        max_bs: largest batch replayed; larger decode batches must run eagerly.
        num_q_heads, scale, dtype: what the backend plans with (query heads, softmax scale,
            query dtype).
        max_kv_tokens: most page indices one step can read (sum of KV lengths: a shared prefix
            counts once per sequence), sizing FlashInfer's static page table.

    Raises RuntimeError when capture fails (the caller may fall back to eager decode).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 attention, req_to_token: torch.Tensor, *, max_bs: int, num_q_heads: int,
                 scale: float, dtype: torch.dtype, max_kv_tokens: int):
        self.device = req_to_token.device
        self.forward = forward
        self.attention = attention
        self.req_to_token = req_to_token
        self.max_bs = max_bs
        self.buckets = buckets_up_to(max_bs)
        self.static = torch.zeros(5, max_bs, dtype=torch.int64, device=self.device)
        self.staging = torch.zeros(5, max_bs, dtype=torch.int64).pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        attention.init_cuda_graph(max_bs, max_kv_tokens, num_q_heads, scale, dtype)
        start = time.perf_counter()
        self._capture_all()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.buckets),
                 max_bs, self.capture_seconds)

    def bucket(self, batch_size: int) -> int:
        """Smallest captured size >= batch_size. Raises ValueError above max_bs."""
        if not 1 <= batch_size <= self.max_bs:
            raise ValueError(f"decode batch {batch_size} outside 1..{self.max_bs}")
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def _prepare(self, bs: int, host_rows: list[int], host_seq: list[int]) -> None:
        """Let the backend read this step's metadata (static tensors, or a plan)."""
        inputs = AttentionInputs(is_decode=True, req_to_token=self.req_to_token,
                                 req_rows=host_rows, prefix_lens=[s - 1 for s in host_seq],
                                 extend_lens=[1] * bs, out_cache_loc=self.static[_LOC, :bs])
        self.attention.begin_graph_decode(inputs, self.static[_ROWS, :bs],
                                          self.static[_SEQ, :bs])

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for i, value in enumerate(_PAD):
            self.static[i].fill_(value)
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
            self._prepare(bs, [0] * bs, [1] * bs)
            ids, pos = self.static[_IDS, :bs], self.static[_POS, :bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside capture (lazy init, autotuning)
                    self.forward(ids, pos)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(ids, pos)
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               out_cache_loc: torch.Tensor, req_rows: list[int],
               seq_lens: list[int]) -> torch.Tensor:
        """One decode step of B = len(req_rows) sequences (host tensors [B] int64 for ids,
        positions and KV slots). Returns logits [B, vocab] float32 on the device, a view of
        the graph's output that the next replay overwrites."""
        b = len(req_rows)
        bs = self.bucket(b)
        host = self.staging
        host[_IDS, :b] = input_ids
        host[_POS, :b] = positions
        host[_LOC, :b] = out_cache_loc
        host[_ROWS, :b] = torch.tensor(req_rows, dtype=torch.int64)
        host[_SEQ, :b] = torch.tensor(seq_lens, dtype=torch.int64)
        if bs > b:
            host[:, b:bs] = torch.tensor(_PAD, dtype=torch.int64)[:, None]
        # The previous step's results were read on the host before this call, so the last
        # non-blocking copy out of the staging buffer has finished. (The whole buffer: one
        # contiguous 5 x max_bs copy.)
        self.static.copy_(host, non_blocking=True)
        self._prepare(bs, req_rows + [0] * (bs - b), seq_lens + [1] * (bs - b))
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
