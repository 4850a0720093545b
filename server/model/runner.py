"""ModelRunner: owns the weights and the attention backend; ``forward(ForwardBatch) -> logits``.

It knows nothing about requests, HTTP or the radix tree: the scheduler hands it a ForwardBatch
whose KV slots are already assigned, and receives logits for the positions it asked for.
"""

from __future__ import annotations

import torch

from kernels import AttentionInputs, create_attention_backend
from server.cache.kv_pool import TokenKVPool
from server.model.forward_batch import ForwardBatch, ForwardMode, RunnerOutput
from server.model.llama import LlamaForCausalLM
from server.model.loader import LoadedModel


class ModelRunner:
    """Args:
        loaded: the model read by :func:`server.model.loader.load_model`.
        kv_pool: the pool whose buffers attention reads and writes (its layer count, KV heads
            and head_dim must match the model).
        dtype, device: compute dtype and device of the weights.
        max_positions: RoPE table size (the resolved context length, tokens).
        attention_backend: name passed to :func:`kernels.create_attention_backend`.
    """

    def __init__(self, loaded: LoadedModel, kv_pool: TokenKVPool, *, dtype: torch.dtype,
                 device: str = "cpu", max_positions: int, attention_backend: str = "auto"):
        arch = loaded.arch
        if len(kv_pool.k_buffers) != arch.num_layers:
            raise ValueError(f"KV pool has {len(kv_pool.k_buffers)} layers, model {arch.num_layers}")
        self.arch = arch
        self.device = torch.device(device)
        # Build on the meta device (no random init of parameters that are overwritten anyway),
        # materialize, load float32 weights, cast once, then compute the float32 RoPE tables.
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, max_positions, loaded.rope_freq_factors)
        model = model.to_empty(device=self.device)
        with torch.no_grad():
            model.load_weights(loaded.weights())
        self.model = model.to(dtype).eval()
        self.model.init_rope_cache()
        self.kv_pool = kv_pool
        self.attention = create_attention_backend(attention_backend, kv_pool.k_buffers,
                                                  kv_pool.v_buffers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        """Run one pass; writes the new tokens' K/V into ``batch.out_cache_loc``.

        Returns logits [len(batch.logits_indices), vocab] float32.
        """
        dev = self.device
        self.attention.begin(AttentionInputs(
            is_decode=batch.mode is ForwardMode.DECODE,
            req_to_token=batch.req_to_token,
            req_rows=batch.req_rows,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc.to(dev),
        ))
        hidden = self.model(batch.input_ids.to(dev), batch.positions.to(dev), self.attention)
        if batch.logits_indices.numel() == 0:
            return RunnerOutput(torch.empty((0, self.arch.vocab_size), dtype=torch.float32))
        logits = self.model.compute_logits(hidden[batch.logits_indices.to(dev)])
        return RunnerOutput(logits.cpu() if dev.type != "cpu" else logits)
