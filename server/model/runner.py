"""ModelRunner: owns the weights and the attention backend; ``forward(ForwardBatch) -> logits``.

It knows nothing about requests, HTTP or the radix tree: the scheduler hands it a ForwardBatch
whose KV slots are already assigned, and receives logits for the positions it asked for.
"""

from __future__ import annotations

import os

import torch

from kernels import AttentionInputs, create_attention_backend
from server.cache.kv_pool import TokenKVPool
from server.model.compiled import (
    DEFAULT_CACHE_DIR,
    compile_forward,
    register_backend,
    unregister_backend,
)
from server.model.cpu_threads import AdaptiveThreads
from server.model.cuda_graph import CudaGraphRunner
from server.model.forward_batch import ForwardBatch, ForwardMode, RunnerOutput
from server.model.llama import LlamaForCausalLM
from server.model.loader import LoadedModel
from server.model.lora import LoraBatch, LoraWeights
from server.model.native_stack import build_native_stack
from server.model.parallel import TPGroup
from server.model.tp_group import TensorParallelError, send_batch


class ModelRunner:
    """Args:
        loaded: the model read by :func:`server.model.loader.load_model`.
        kv_pool: the pool whose buffers attention reads and writes (its layer count, KV heads
            and head_dim must match the model).
        dtype, device: compute dtype and device of the weights.
        max_positions: RoPE table size (the resolved context length, tokens).
        attention_backend: name passed to :func:`kernels.create_attention_backend`.
        quantization: "none", "auto", "int4" or "int8" (:mod:`server.model.quantization`);
            :attr:`quant_report` says what was kept quantized.
        compile: run the decoder stack through torch.compile (:mod:`server.model.compiled`);
            CPU only (GPU kernels are launched eagerly).
        compile_cache_dir: inductor's on-disk cache (None = inductor's default).
        cuda_graph_max_bs: on CUDA with a backend that supports it, decode batches up to this
            size replay captured CUDA graphs (:mod:`server.model.cuda_graph`); 0 = eager.
        req_to_token: the request table [R, max_context] int64 (needed for CUDA graphs).
        tp: this rank's :class:`server.model.parallel.TPGroup` under tensor parallelism; rank
            0 broadcasts each batch to the other ranks before running it
            (:mod:`server.model.tp_worker`).
        dense_prefill_rows: quantized linears keep a dense bf16 copy for extend passes of at
            least this many tokens (:class:`server.model.quantization.QuantLinear`); None = off.
        native_linear: the ``kernels.cpu`` linear kernel quantized linears run on ("avx2",
            "avx512_vnni"; :class:`server.model.quantization.QuantLinear`), or None; the caller
            checks availability.
        cpu_isa: the configured CPU class (``--cpu-isa``; None = probed): picks the native
            attention kernel (:func:`kernels.cpu.attention_kernel`).
        cpu_threads: intra-op threads of a CPU pass (one process): N fixed, 0 adapted to the
            load (:class:`server.model.cpu_threads.AdaptiveThreads`) where the thread count
            cannot change a result (:attr:`batch_invariant`), else every core.
        lora_slots, max_lora_rank: keep this many LoRA adapter slots of this rank
            (:class:`server.model.lora.LoraWeights`, :attr:`lora`); 0 = LoRA off.
    """

    def __init__(self, loaded: LoadedModel, kv_pool: TokenKVPool, *, dtype: torch.dtype,
                 device: str = "cpu", max_positions: int, attention_backend: str = "auto",
                 quantization: str = "none", compile: bool = False,
                 compile_cache_dir: str | None = DEFAULT_CACHE_DIR,
                 dense_prefill_rows: int | None = None, native_linear: str | None = None,
                 cpu_isa: str | None = None, cpu_threads: int = 0, cuda_graph_max_bs: int = 0,
                 req_to_token: torch.Tensor | None = None, tp: TPGroup | None = None,
                 lora_slots: int = 0, max_lora_rank: int = 0):
        # assembles the runner (model, backend, compiled stack, CUDA graphs, TP) in dependency
        # order; each part is a call into its own module
        arch = loaded.arch
        if len(kv_pool.k_buffers) != arch.num_layers:
            raise ValueError(f"KV pool has {len(kv_pool.k_buffers)} layers, model {arch.num_layers}")
        self.arch = arch
        self.device = torch.device(device)
        # Build on the meta device: each parameter is allocated (in ``dtype``) or packed
        # quantized when its tensor arrives, so no float copy of a quantized weight is held.
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, max_positions, loaded.rope_freq_factors, tp)
        self.tp = tp
        keep = quantization != "none"
        with torch.no_grad():
            self.quant_report = model.load_weights(loaded.weights(keep_quantized=keep),
                                                   dtype=dtype, device=self.device,
                                                   quantization=quantization,
                                                   dense_min_rows=dense_prefill_rows,
                                                   native=native_linear)
        self.model = model.eval()
        self.lora = (LoraWeights(model, lora_slots, max_lora_rank, dtype, self.device)
                     if lora_slots else None)
        self.vision = None
        if loaded.vision is not None:  # a LLaVA checkpoint: its vision tower and projector
            if tp is not None:
                raise ValueError("multimodal models are not supported with tensor parallelism")
            from server.model.vision import VisionEncoder

            self.vision = VisionEncoder(loaded.vision, dtype, self.device)
            self.vision.load_weights(loaded.weights())
        self.kv_pool = kv_pool
        self.attention = create_attention_backend(attention_backend, kv_pool.k_buffers,
                                                  kv_pool.v_buffers, windowed=arch.windowed,
                                                  cpu_isa=cpu_isa)
        compile = compile and tp is None
        self.compiled = compile and self.device.type == "cpu"
        if not self.compiled and self.device.type == "cpu":
            model.native_stack = build_native_stack(model, self.attention)
        self._hidden = self._eager_hidden
        if self.compiled:
            self._attn_id = register_backend(self.attention)
            stack = compile_forward(self._compiled_stack, compile_cache_dir)
            # every row, then the wanted ones: a data-dependent row count would recompile
            self._hidden = lambda ids, pos, rows: stack(ids, pos)[rows]
        self.graphs: CudaGraphRunner | None = None
        # MoE layers read their per-expert token counts on the host: not capturable.
        if (self.device.type == "cuda" and cuda_graph_max_bs > 0 and req_to_token is not None
                and getattr(self.attention, "supports_cuda_graph", False)
                and not arch.sparse_layers):
            model, attention = self.model, self.attention  # no reference back to the runner

            def decode_logits(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                return model.compute_logits(model(input_ids, positions, attention))

            self.graphs = CudaGraphRunner(
                decode_logits, self.attention, req_to_token, max_bs=cuda_graph_max_bs,
                num_q_heads=arch.num_heads, scale=arch.attention_scale, dtype=dtype,
                # page indices of one step: shared prefixes count once per sequence
                max_kv_tokens=cuda_graph_max_bs * req_to_token.shape[1])
        self.threads = None  # tensor-parallel ranks set their own share of the cores
        if self.device.type == "cpu" and tp is None:
            self.threads = AdaptiveThreads(cpu_threads or (
                0 if self.batch_invariant else len(os.sched_getaffinity(0))))

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits are bitwise the same whatever else is in its pass (batch,
        chunk boundaries, cache hits, verify passes): one CPU process, eager, on the native
        attention and every linear layer on the native kernels (QuantReport.row_invariant),
        no MoE routing, no LoRA slots (their matmuls are torch's). Where True, drafts
        (jump-forward, n-gram) never change an output."""
        return (self.device.type == "cpu" and not self.compiled and self.tp is None
                and self.lora is None
                and self.attention.name == "cpu" and self.quant_report.row_invariant
                and not self.arch.sparse_layers)

    def _eager_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      out_rows: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.attention, out_rows=out_rows)

    def _compiled_stack(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.attention, self._attn_id)

    def _image_embeds(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [M], vectors [M, hidden]) of the batch's image positions; each image is
        encoded the first time a pass needs it (kept on its ImageInput for later chunks)."""
        if self.vision is None:
            raise ValueError("this model takes no images")
        rows, vecs = [], []
        for row, image, lo, hi in batch.images:
            if image.embeds is None:
                image.embeds = self.vision.encode(image.pixel_values)[0]
            rows.append(torch.arange(row, row + hi - lo))
            vecs.append(image.embeds[lo:hi])
        return torch.cat(rows).to(self.device), torch.cat(vecs)

    def _lora_batch(self, batch: ForwardBatch) -> LoraBatch | None:
        """Each new token's adapter slot, or None when the pass has no adapter rows."""
        if self.lora is None or not batch.lora_slots or max(batch.lora_slots) < 0:
            return None
        slots = torch.tensor(batch.lora_slots, dtype=torch.int64).repeat_interleave(
            torch.tensor(batch.extend_lens, dtype=torch.int64))
        return self.lora.batch(slots.to(self.device))

    def close(self) -> None:
        """Release the compiled graph's reference to the attention backend."""
        if self.compiled:
            unregister_backend(self._attn_id)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        """Run one pass; writes the new tokens' K/V into ``batch.out_cache_loc``.

        Returns logits [len(batch.logits_indices), vocab] float32 on the model's device (vocab
        0 for an embedding-only model) and those rows' final hidden states (a decode step on
        CUDA replays a captured graph when one fits the batch: no hidden states).
        """
        if self.tp is not None and self.tp.shard.rank == 0:
            send_batch(self.tp, batch)
            try:
                return self._forward(batch)
            except Exception as exc:  # noqa: BLE001 - a collective failed: a rank is gone
                raise TensorParallelError(f"tensor parallelism: a rank is gone ({exc}); "
                                          "stopping") from exc
        if self.threads is None:
            return self._forward(batch)
        self.threads.before_pass()
        out = self._forward(batch)
        self.threads.after_pass(int(batch.input_ids.numel()),
                                sum(batch.prefix_lens) + sum(batch.extend_lens))
        return out

    def _forward(self, batch: ForwardBatch) -> RunnerOutput:
        dev = self.device
        lora = self._lora_batch(batch)
        if (lora is None and self.graphs is not None and batch.mode is ForwardMode.DECODE
                and batch.batch_size <= self.graphs.max_bs):
            return RunnerOutput(self.graphs.replay(
                batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_rows,
                [p + 1 for p in batch.prefix_lens]))
        self.attention.begin(AttentionInputs(
            is_decode=batch.mode is ForwardMode.DECODE,
            req_to_token=batch.req_to_token,
            req_rows=batch.req_rows,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc.to(dev),
        ))
        # only the logit rows' hidden states: the last layer's o_proj and MLP skip the rest
        rows = batch.logits_indices.to(dev)
        if batch.images or lora is not None:  # image vectors, LoRA adapters: the eager path
            hidden = self.model(batch.input_ids.to(dev), batch.positions.to(dev),
                                self.attention, out_rows=rows, lora=lora,
                                embeds=self._image_embeds(batch) if batch.images else None)
        else:
            hidden = self._hidden(batch.input_ids.to(dev), batch.positions.to(dev), rows)
        if rows.numel() == 0:
            return RunnerOutput(torch.empty((0, self.arch.vocab_size), dtype=torch.float32))
        if self.arch.embedding_only and self.tp is None:  # vectors only: no logits wanted
            return RunnerOutput(torch.empty((rows.numel(), 0), dtype=torch.float32), hidden)
        return RunnerOutput(self.model.compute_logits(hidden), hidden)
