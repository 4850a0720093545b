"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a batched reference
implementation that groups the tokens by expert.

Routing (HF ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``, the same order in both):
router logits [T, E] -> softmax in float32 over all experts -> top-k -> renormalized to sum 1
when ``renormalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``) -> cast to the
activation dtype. Each expert is a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``.

Execution: the T x k (token, expert) assignments are sorted by expert, so each expert runs one
matmul over all of its tokens (as vLLM's and SGLang's fused-MoE kernels group them), and the
weighted outputs are scattered back with ``index_add_``. Expert weights are stored as 2-D
parameters, expert-major (``gate_up``: [E * 2I, H], rows [e*2I, e*2I + I) gate and the next I
up; ``down``: [E * H, I]), so a checkpoint's per-expert tensors load as row ranges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    """Args: hidden (H), intermediate (I, per expert), num_experts (E), top_k, renormalize."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts * hidden, intermediate))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k  # the token of each sorted assignment
        scale = weights.reshape(-1)[order][:, None]
        gate_up = self.gate_up.view(self.num_experts, 2 * self.intermediate, self.hidden)
        down = self.down.view(self.num_experts, self.hidden, self.intermediate)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start:start + n]
            g, u = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down[e])
            out.index_add_(0, rows, y * scale[start:start + n])
            start += n
        return out


def expert_target(layer: int, name: str, intermediate: int, hidden: int
                  ) -> tuple[str, int, int] | None:
    """Where a checkpoint's per-expert tensor goes: (our parameter, first row, rows), or None
    when ``name`` (after ``model.layers.N.``) is not an expert weight. Accepts Mixtral's
    ``block_sparse_moe.experts.E.w1|w3|w2.weight`` (gate, up, down) and Qwen3-MoE's
    ``mlp.experts.E.gate_proj|up_proj|down_proj.weight``."""
    parts = name.split(".")
    if len(parts) != 5 or parts[1] != "experts" or parts[4] != "weight" \
            or parts[0] not in ("block_sparse_moe", "mlp"):
        return None
    e, kind = int(parts[2]), parts[3]
    base = f"layers.{layer}.moe"
    if kind in ("w1", "gate_proj"):
        return f"{base}.gate_up", e * 2 * intermediate, intermediate
    if kind in ("w3", "up_proj"):
        return f"{base}.gate_up", e * 2 * intermediate + intermediate, intermediate
    if kind in ("w2", "down_proj"):
        return f"{base}.down", e * hidden, hidden
    return None
