"""Llama-family decoder: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2 (tied embeddings),
Qwen2 (QKV bias), Qwen3 (per-head RMSNorm of queries and keys before RoPE), Phi-3/Phi-4 (fused
qkv and gate_up in the checkpoint, LongRoPE), Mistral (full attention), and the
mixture-of-experts Mixtral and Qwen3-MoE (:mod:`server.model.moe`).

Batched over a flat token dimension: the forward pass takes [T] token ids and positions of any
mix of sequences and leaves per-sequence structure to the attention backend, which reads and
writes K/V in the token-granular pool. Q/K/V and gate/up projections are fused into one matmul
each. Numerics follow HF transformers' ``modeling_llama`` (RMSNorm in float32, half-split RoPE).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.base import AttentionBackend
from server.model.compiled import attention
from server.model.config import ArchConfig
from server.model.moe import SparseMoE, expert_target
from server.model.quantization import QuantEmbedding, QuantizedWeight
from server.model.weight_loading import QuantReport, WeightLoadError, load_weights

__all__ = ["LlamaForCausalLM", "WeightLoadError", "rope_inv_freq"]


def rope_inv_freq(arch: ArchConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] float32 (HF ``ROPE_INIT_FUNCTIONS``: default,
    linear, llama3). ``freq_factors`` (GGUF ``rope_freqs``) divide them when given."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = arch.rope_scaling
    if s is not None and s.rope_type == "linear":
        inv = inv / s.factor
    elif s is not None and s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                  / (s.high_freq_factor - s.low_freq_factor))
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    return inv


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
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
        self.split = (q_size, kv_size, kv_size)
        self.scale = arch.head_dim ** -0.5
        if arch.qk_norm:  # Qwen3 (HF Qwen3Attention: q_norm / k_norm over head_dim)
            self.q_norm = nn.Parameter(torch.ones(arch.head_dim))
            self.k_norm = nn.Parameter(torch.ones(arch.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, attn_id: int | None = None) -> torch.Tensor:
        t = x.shape[0]
        h = attn.rms_norm(x, self.input_layernorm, self.eps)
        qkv = self.qkv_proj(h)
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
        o = attention(attn, attn_id, self.layer_id, q, k, v, self.scale)
        x = x + self.o_proj(o.reshape(t, -1))
        h = attn.rms_norm(x, self.post_attention_layernorm, self.eps)
        if self.moe is not None:
            return x + self.moe(h)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Args: arch; max_positions (size of the RoPE table, tokens); rope_freq_factors (GGUF)."""

    def __init__(self, arch: ArchConfig, max_positions: int,
                 rope_freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = (None if arch.tie_word_embeddings
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.max_positions = max_positions
        self.rope_freq_factors = rope_freq_factors
        self.init_rope_cache()

    def init_rope_cache(self) -> None:
        """(Re)compute the float32 cos/sin tables [max_positions, head_dim] on the model's
        device; call after moving a meta-initialized model to a real device.

        LongRoPE (Phi-3): positions below ``original_max_position_embeddings`` use the short
        factors and later ones the long factors, both scaled by the attention factor (vLLM's
        ``Phi3LongRoPEScaledRotaryEmbedding``); HF switches the whole sequence to the long
        factors once it is longer, so the two agree on sequences within the original length."""
        device = self.norm.device
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        s = self.arch.rope_scaling
        if s is not None and s.rope_type == "longrope":
            base = rope_inv_freq(self.arch)
            short = torch.outer(positions, base / torch.tensor(s.short_factor))
            long = torch.outer(positions, base / torch.tensor(s.long_factor))
            freqs = torch.where(positions[:, None] < s.original_max_position_embeddings,
                                short, long)
            scale = s.attention_factor
        else:
            freqs = torch.outer(positions, rope_inv_freq(self.arch, self.rope_freq_factors))
            scale = 1.0
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, attn_id: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final-normed hidden states [T, hidden].
        ``attn_id``: the backend's id in :mod:`server.model.compiled` when compiled."""
        x = self.embed_tokens(input_ids)
        cos = self.cos_cache[positions].to(x.dtype)
        sin = self.sin_cache[positions].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, attn_id)
        return attn.rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden]. Returns [N, vocab] float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.as_linear(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def param_target(self, name: str) -> tuple[str, int, int | None] | None:
        """Where the HF tensor ``name`` goes: (our parameter, first row, rows), or None to skip.
        Q/K/V and gate/up rows are stacked into the fused projections."""
        a = self.arch
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
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
                     dense_min_rows: int | None = None) -> QuantReport:
        """Materialize this meta-device model from HF-named tensors (see
        :func:`server.model.weight_loading.load_weights`), then build the RoPE tables.
        Raises WeightLoadError, QuantizationError."""
        report = load_weights(self, weights, self.param_target, dtype=dtype, device=device,
                              quantization=quantization, dense_min_rows=dense_min_rows)
        self.init_rope_cache()
        return report


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
