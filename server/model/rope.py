"""Rotary position embedding tables (HF ``ROPE_INIT_FUNCTIONS``: default, linear, llama3,
longrope), computed once per model as float32 cos/sin [max_positions, head_dim] in the
half-split (``rotate_half``) layout that :func:`kernels.reference.apply_rope` expects.
"""

from __future__ import annotations

import math

import torch

from server.model.config import ArchConfig


def rope_inv_freq(arch: ArchConfig, freq_factors: torch.Tensor | None = None,
                  theta: float | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] float32 (HF ``ROPE_INIT_FUNCTIONS``: default,
    linear, llama3). ``freq_factors`` (GGUF ``rope_freqs``) divide them when given. ``theta``
    set: a plain (unscaled) table of that base (Gemma 3's local layers)."""
    d = arch.head_dim
    base = arch.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = arch.rope_scaling if theta is None else None
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


def rope_tables(arch: ArchConfig, max_positions: int, freq_factors: torch.Tensor | None = None,
                theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin), each [max_positions, head_dim], on the CPU.

    LongRoPE (Phi-3): positions below ``original_max_position_embeddings`` use the short
    factors and later ones the long factors, both scaled by the attention factor (vLLM's
    ``Phi3LongRoPEScaledRotaryEmbedding``); HF switches the whole sequence to the long factors
    once it is longer, so the two agree on sequences within the original length. ``theta``:
    see :func:`rope_inv_freq`."""
    with torch.device("cpu"):  # also inside a meta-device model build
        return _rope_tables(arch, max_positions, freq_factors, theta)


def _rope_tables(arch: ArchConfig, max_positions: int, freq_factors: torch.Tensor | None,
                 theta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(max_positions, dtype=torch.float32)
    s = arch.rope_scaling
    if theta is None and s is not None and s.rope_type == "longrope":
        base = rope_inv_freq(arch)
        short = torch.outer(positions, base / torch.tensor(s.short_factor))
        long = torch.outer(positions, base / torch.tensor(s.long_factor))
        freqs = torch.where(positions[:, None] < s.original_max_position_embeddings,
                            short, long)
        scale = s.attention_factor
    else:
        freqs = torch.outer(positions, rope_inv_freq(arch, freq_factors, theta))
        scale = 1.0
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale
