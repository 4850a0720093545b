"""Llama-family decoder: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2 (tied embeddings),
Qwen2 (QKV bias), Qwen3 (per-head RMSNorm of queries and keys before RoPE), Phi-3/Phi-4 (fused
qkv and gate_up in the checkpoint, LongRoPE), Mistral (sliding window), the
mixture-of-experts Mixtral and Qwen3-MoE (:mod:`server.model.moe`), and Gemma 1/2/3 (HF
``modeling_gemma2``/``modeling_gemma3``: embeddings scaled by sqrt(hidden), (1 + w) RMSNorm
folded into the weights at load, norms before and after attention and the MLP, GeGLU,
query_pre_attn_scalar, tanh soft-capping of attention scores and final logits, interleaved
sliding-window and global layers, Gemma 3's local RoPE base for the window layers).

Batched over a flat token dimension: the forward pass takes [T] token ids and positions of any
mix of sequences and leaves per-sequence structure to the attention backend, which reads and
writes K/V in the token-granular pool. Q/K/V and gate/up projections are fused into one matmul
each. Numerics follow HF transformers' ``modeling_llama`` (RMSNorm in float32, half-split RoPE).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.base import AttentionBackend
from server.model.compiled import attention
from server.model.config import ArchConfig
from server.model.lora import LoraBatch
from server.model.moe import SparseMoE, expert_target
from server.model.parallel import TPGroup
from server.model.quantization import QuantEmbedding, QuantizedWeight
from server.model.rope import rope_tables
from server.model.weight_loading import QuantReport, WeightLoadError, load_weights

__all__ = ["LlamaForCausalLM", "WeightLoadError"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    """One block. ``arch`` holds this rank's head and intermediate counts under tensor
    parallelism (``tp``: the o_proj and down_proj outputs are then summed over the ranks)."""

    def __init__(self, arch: ArchConfig, layer_id: int, tp: TPGroup | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (arch.num_heads, arch.num_kv_heads,
                                                            arch.head_dim)
        self.eps = arch.rms_norm_eps
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=arch.o_bias)
        self.moe = None
        if arch.is_sparse(layer_id):
            self.moe = SparseMoE(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                                 arch.num_experts_per_tok, arch.moe_renormalize)
        else:
            self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size,
                                          bias=arch.mlp_bias)
            self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size,
                                       bias=arch.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        if arch.sandwich_norms:  # Gemma 2/3: post_attention_layernorm normalizes attn output
            self.pre_feedforward_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
            self.post_feedforward_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.sandwich = arch.sandwich_norms
        self.act = _ACTIVATIONS[arch.hidden_act]
        self.split = (q_size, kv_size, kv_size)
        self.scale = arch.attention_scale
        self.window, self.softcap = arch.window(layer_id), arch.attn_logit_softcap
        if arch.qk_norm:  # Qwen3 (HF Qwen3Attention: q_norm / k_norm over head_dim)
            self.q_norm = nn.Parameter(torch.ones(arch.head_dim))
            self.k_norm = nn.Parameter(torch.ones(arch.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, attn_id: int | None = None,
                out_rows: torch.Tensor | None = None, lora: LoraBatch | None = None
                ) -> torch.Tensor:
        """x: [T, hidden] (the residual stream; a backend with fused ops updates it in
        place). Returns the layer's output [T, hidden], or with ``out_rows`` ([N] int64 row
        indices) only those rows' [N, hidden]: every row's K/V is still stored and attended
        from, but the rest of the layer (o_proj, MLP) runs on the N rows alone (the last
        layer of a pass whose other rows' outputs nobody reads). ``lora``: the LoRA
        adapters of the pass's rows (:mod:`server.model.lora`), added to each projection."""
        t = x.shape[0]
        # a backend's fused ops (kernels.cpu: RoPE + K/V store, residual add + RMSNorm,
        # SiLU * up) replace several small ops each; not under torch.compile (its graph
        # fuses them itself)
        fused = attn_id is None and getattr(attn, "fused", False)
        h = attn.rms_norm(x, self.input_layernorm, self.eps)
        qkv = self._project("qkv_proj", h, lora)
        if fused and not hasattr(self, "q_norm"):
            q = attn.rope_store(self.layer_id, qkv, cos, sin, self.num_heads,
                                self.num_kv_heads, self.head_dim)
            o = attn.attend(self.layer_id, q, self.scale, self.window, self.softcap)
        else:
            o = self._attention(qkv, cos, sin, attn, attn_id)
        if out_rows is not None:
            t = out_rows.numel()
            if t == 0:
                return x.new_empty((0, x.shape[1]))
            o, x = o[out_rows], x[out_rows]
            lora = lora.take(out_rows) if lora is not None else None
        o = self._project("o_proj", o.reshape(t, -1), lora)
        if self.tp is not None:
            o = self.tp.all_reduce(o)
        if self.sandwich:
            x = x + attn.rms_norm(o, self.post_attention_layernorm, self.eps)
            h = attn.rms_norm(x, self.pre_feedforward_layernorm, self.eps)
        elif fused:
            h = attn.add_rms_norm(o, x, self.post_attention_layernorm, self.eps)  # x += o
        else:
            x = x + o
            h = attn.rms_norm(x, self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x + self.moe(h)
        gate_up = self._project("gate_up_proj", h, lora)
        if fused and self.act is F.silu:
            act = attn.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.act(gate) * up
        out = self._project("down_proj", act, lora)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.sandwich:
            out = attn.rms_norm(out, self.post_feedforward_layernorm, self.eps)
        return x + out

    def _project(self, name: str, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """Linear layer ``name`` of x [T, in], plus the pass's LoRA adapters' share."""
        y = getattr(self, name)(x)
        return y if lora is None else lora.add_to(self.layer_id, name, x, y)

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attn: AttentionBackend, attn_id: int | None) -> torch.Tensor:
        """RoPE (after Qwen3's per-head norms), K/V store and attention of one layer, op by
        op. qkv: [T, (Hq + 2 Hkv) * D]. Returns [T, Hq, D]."""
        t = qkv.shape[0]
        q_size, kv_size, _ = self.split
        # Q and K heads are adjacent in the fused output: one RoPE call rotates both.
        qk = qkv[:, :q_size + kv_size].view(t, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            d = self.head_dim
            qk = torch.cat((
                attn.rms_norm(qk[:, :self.num_heads].reshape(-1, d), self.q_norm, self.eps)
                .view(t, self.num_heads, d),
                attn.rms_norm(qk[:, self.num_heads:].reshape(-1, d), self.k_norm, self.eps)
                .view(t, self.num_kv_heads, d)), dim=1)
        qk = attn.apply_rope(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return attention(attn, attn_id, self.layer_id, q, k, v, self.scale, self.window,
                         self.softcap)


class LlamaForCausalLM(nn.Module):
    """Args: arch; max_positions (size of the RoPE table, tokens); rope_freq_factors (GGUF);
    tp: this rank's :class:`server.model.parallel.TPGroup` under tensor parallelism (layers
    hold its heads and columns, the embedding and lm_head its vocabulary rows)."""

    def __init__(self, arch: ArchConfig, max_positions: int,
                 rope_freq_factors: torch.Tensor | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.layer_arch = arch if tp is None else tp.shard.local_arch(arch)
        vocab = arch.vocab_size if tp is None else len(tp.shard.vocab)
        # _weight: no random init (on the meta device nn.Embedding's normal_ goes through
        # torch._refs, whose import pulls in torch._dynamo: ~3.5 s of every start)
        self.embed_tokens = nn.Embedding(vocab, arch.hidden_size,
                                         _weight=torch.empty(vocab, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(self.layer_arch, i, tp)
                                    for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, vocab, bias=False))
        self.max_positions = max_positions
        self.rope_freq_factors = rope_freq_factors
        # the layers as one native call (server.model.native_stack), set by the runner where
        # the model and backend allow it; None runs the Python loop below
        self.native_stack = None
        self.init_rope_cache()

    def init_rope_cache(self) -> None:
        """(Re)compute the float32 cos/sin tables [max_positions, head_dim] on the model's
        device (:func:`server.model.rope.rope_tables`; a second pair for Gemma 3's window
        layers); call after moving a meta-initialized model to a real device."""
        device = self.norm.device
        cos, sin = rope_tables(self.arch, self.max_positions, self.rope_freq_factors)
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)
        if self.arch.local_rope_theta is not None:
            cos, sin = rope_tables(self.arch, self.max_positions,
                                   theta=self.arch.local_rope_theta)
            self.register_buffer("cos_local", cos.to(device), persistent=False)
            self.register_buffer("sin_local", sin.to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, attn_id: int | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                out_rows: torch.Tensor | None = None, lora: LoraBatch | None = None
                ) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final-normed hidden states [T, hidden].
        ``attn_id``: the backend's id in :mod:`server.model.compiled` when compiled.
        ``embeds``: (rows [M] int64, vectors [M, hidden]) that replace the token embeddings
        of those rows (a multimodal model's image vectors).
        ``out_rows``: [N] int64 indices of the rows wanted (the runner's logit rows): the
        hidden states [N, hidden] of those rows are returned, and the last layer runs its
        o_proj and MLP on them alone (a 512-token prefill chunk that wants one row's logits
        skips ~1/num_layers of the pass). Rows are computed independently on the native CPU
        kernels, so a row's values do not change (tested). ``lora``: the rows' LoRA adapters
        (:class:`server.model.lora.LoraBatch`)."""
        x = (self.embed_tokens(input_ids) if self.tp is None
             else self.tp.embed(self.embed_tokens, input_ids))
        if self.arch.embed_scale != 1.0:  # Gemma: the scale is rounded to x's dtype first
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        if embeds is not None:  # after the scale, as HF's multimodal models scatter them
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        cos = self.cos_cache[positions].to(x.dtype)
        sin = self.sin_cache[positions].to(x.dtype)
        if self.native_stack is not None and attn_id is None:
            if lora is not None:
                return self.native_stack.forward_lora(x, cos, sin, *attn.stack_inputs(),
                                                      out_rows, *lora.native_args())
            return self.native_stack.forward(x, cos, sin, *attn.stack_inputs(), out_rows)
        local = (self.cos_local[positions].to(x.dtype), self.sin_local[positions].to(x.dtype)) \
            if self.arch.local_rope_theta is not None else (cos, sin)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            c, s = local if layer.window else (cos, sin)
            x = layer(x, c, s, attn, attn_id, out_rows if i == last else None, lora)
        return attn.rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden]. Returns [N, vocab] float32 (soft-capped to
        ``final_logit_softcap * tanh(logits / final_logit_softcap)`` when set: Gemma 2)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(self.embed_tokens, QuantEmbedding):
            logits = self.embed_tokens.as_linear(hidden).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.arch.vocab_size)
        cap = self.arch.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def param_target(self, name: str) -> tuple[str, int, int | None] | None:
        """Where the HF tensor ``name`` goes: (our parameter, first row, rows), or None to skip.
        Q/K/V and gate/up rows are stacked into the fused projections."""
        a = self.layer_arch
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        name = _text_model_name(name)
        if name is None:  # a vision tower or projector of a multimodal checkpoint
            return None
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module in _RENAMED:
                return f"layers.{idx}.{_RENAMED[module]}", 0, None
            if module in ("block_sparse_moe.gate", "mlp.gate") and a.is_sparse(int(idx)):
                return f"layers.{idx}.moe.gate.{kind}", 0, None  # the router
            expert = expert_target(int(idx), rest, a.moe_intermediate_size, a.hidden_size)
            if expert is not None:
                return expert
            if module in _PRE_FUSED:  # Phi-3 checkpoints store them fused, in our order
                return f"layers.{idx}.{_PRE_FUSED[module]}.{kind}", 0, None
            fused = _FUSED.get(module)
            if fused is None:
                return f"layers.{idx}.{module}", 0, None
            target, offset, rows = fused(q, kv, inter)
            return f"layers.{idx}.{target}.{kind}", offset, rows
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight", 0, None
        if name == "model.norm.weight":
            return "norm", 0, None
        if name == "lm_head.weight":
            return None if self.arch.tie_word_embeddings else ("lm_head.weight", 0, None)
        if name.endswith("rotary_emb.inv_freq"):
            return None
        return name, 0, None  # not ours: load_weights reports it as unexpected

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], *,
                     dtype: torch.dtype, device: torch.device,
                     quantization: str = "none",
                     dense_min_rows: int | None = None, native: str | None = None) -> QuantReport:
        """Materialize this meta-device model from HF-named tensors (see
        :func:`server.model.weight_loading.load_weights`), then build the RoPE tables.
        Norm weights get ``arch.norm_offset`` added (Gemma's (1 + w), folded in once).
        Raises WeightLoadError, QuantizationError."""
        if self.arch.norm_offset:
            offset = self.arch.norm_offset
            weights = ((n, w + offset if n.endswith("norm.weight") else w) for n, w in weights)
        if self.tp is not None:  # this rank's rows / columns of each (dense) tensor
            shard, arch = self.tp.shard, self.arch
            weights = ((n, shard.shard(n, w, arch)) for n, w in weights)
        report = load_weights(self, weights, self.param_target, dtype=dtype, device=device,
                              quantization=quantization, dense_min_rows=dense_min_rows,
                              native=native)
        self.init_rope_cache()
        return report


def _text_model_name(name: str) -> str | None:
    """The text model's HF name of a (possibly multimodal, e.g. Gemma 3) checkpoint tensor:
    ``language_model.model.X`` (transformers 4) and ``model.language_model.X`` (5) become
    ``model.X``, and a base model's ``X`` (saved by LlamaModel & co.) too; vision tower and
    projector tensors give None."""
    for prefix, repl in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    if name.startswith(("layers.", "embed_tokens.", "norm.")):  # a base model's (LlamaModel)
        return "model." + name
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")):
        return None
    return name


# HF module suffix -> our parameter in DecoderLayer
_RENAMED = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
# HF module suffix of an already fused projection -> ours (rows q, k, v / gate, up)
_PRE_FUSED = {"self_attn.qkv_proj": "qkv_proj", "mlp.gate_up_proj": "gate_up_proj"}
# HF module suffix -> (q, kv, intermediate sizes) -> (our fused module, first row, rows)
_FUSED = {
    "self_attn.q_proj": lambda q, kv, i: ("qkv_proj", 0, q),
    "self_attn.k_proj": lambda q, kv, i: ("qkv_proj", q, kv),
    "self_attn.v_proj": lambda q, kv, i: ("qkv_proj", q + kv, kv),
    "self_attn.o_proj": lambda q, kv, i: ("o_proj", 0, None),
    "mlp.gate_proj": lambda q, kv, i: ("gate_up_proj", 0, i),
    "mlp.up_proj": lambda q, kv, i: ("gate_up_proj", i, i),
    "mlp.down_proj": lambda q, kv, i: ("down_proj", 0, None),
}
