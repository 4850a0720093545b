"""Tensor parallelism: which heads, intermediate columns and vocabulary rows each rank holds,
the sharding of checkpoint tensors, and the collectives of the forward pass.

Layout (Megatron-LM, Shoeybi et al. 2019, §3; as in vLLM's and SGLang's ``linear.py``):

* qkv and gate_up are column-parallel: a rank computes its query heads, the KV heads they
  read, and its slice of the intermediate columns;
* o_proj and down_proj are row-parallel: each rank multiplies its slice and one all-reduce
  sums the partial outputs (one per attention block and one per MLP block); their biases are
  kept by rank 0 only, so they are added once;
* the embedding and lm_head are vocab-parallel: a rank embeds the ids in its vocabulary range
  (others contribute zeros to an all-reduce) and computes the logits of its range (an
  all-gather assembles the vocabulary).

Heads: with at least as many KV heads as ranks, whole GQA groups go to ranks (contiguous, as
even as possible: SmolLM2's 3 KV heads of 3 query heads each split 2 + 1 over two ranks); with
fewer, each KV head is replicated on ``size / kv_heads`` ranks that split its query heads. So
every rank runs ordinary GQA with a uniform group size and the kernels need no change.

Everything runs on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from server.model.config import ArchConfig, UnsupportedModelError


@dataclass(frozen=True)
class TPShard:
    """One rank's share of the model. Ranges index global heads, intermediate columns and
    (padded) vocabulary rows."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inter: range
    vocab: range  # rows of the padded vocabulary [size * ceil(V / size)]

    @classmethod
    def plan(cls, arch: ArchConfig, rank: int, size: int) -> "TPShard":
        """Raises UnsupportedModelError when the heads cannot be split into uniform groups
        or the model is a mixture of experts."""
        if arch.num_experts:
            raise UnsupportedModelError("tensor parallelism of mixture-of-experts layers is not "
                                        "supported (serve MoE models with --tp-size 1)")
        hq, hkv = arch.num_heads, arch.num_kv_heads
        group = hq // hkv
        if hkv >= size:
            base, extra = divmod(hkv, size)
            start = rank * base + min(rank, extra)
            kv = range(start, start + base + (rank < extra))
            q = range(kv.start * group, kv.stop * group)
        else:
            rep = size // hkv
            if size % hkv or group % rep:
                raise UnsupportedModelError(
                    f"{hkv} KV heads with {hq} query heads cannot be split over {size} ranks")
            head = rank // rep
            part = group // rep
            kv = range(head, head + 1)
            q = range(head * group + (rank % rep) * part, head * group + (rank % rep + 1) * part)
        inter = arch.intermediate_size
        base, extra = divmod(inter, size)
        start = rank * base + min(rank, extra)
        per_rank_vocab = -(-arch.vocab_size // size)
        return cls(rank, size, q, kv, range(start, start + base + (rank < extra)),
                   range(rank * per_rank_vocab, (rank + 1) * per_rank_vocab))

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The hyper-parameters of this rank's decoder layers (local head and column counts)."""
        return dataclasses.replace(arch, num_heads=len(self.q_heads),
                                   num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.inter))

    def shard(self, name: str, w: torch.Tensor, arch: ArchConfig) -> torch.Tensor:
        """This rank's part of the HF checkpoint tensor ``name`` (dense float)."""
        d = arch.head_dim
        q_rows = _rows(self.q_heads, d)
        kv_rows = _rows(self.kv_heads, d)
        kind = name.rsplit(".", 1)[-1]
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module == "q_proj":
            return w[q_rows]
        if module in ("k_proj", "v_proj"):
            return w[kv_rows]
        if module == "qkv_proj":  # Phi-3: [q; k; v] rows in one tensor
            q, k, v = w.split([arch.num_heads * d, arch.num_kv_heads * d,
                               arch.num_kv_heads * d])
            return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        if module in ("gate_proj", "up_proj"):
            return w[self.inter.start:self.inter.stop]
        if module == "gate_up_proj":  # Phi-3: [gate; up]
            gate, up = w.chunk(2)
            return torch.cat([gate[self.inter.start:self.inter.stop],
                              up[self.inter.start:self.inter.stop]])
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return w if self.rank == 0 else torch.zeros_like(w)
            cols = q_rows if module == "o_proj" else slice(self.inter.start, self.inter.stop)
            return w[:, cols]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = torch.zeros(len(self.vocab), w.shape[1], dtype=w.dtype)
            rows = w[self.vocab.start:min(self.vocab.stop, w.shape[0])]
            padded[:rows.shape[0]] = rows
            return padded
        return w  # norms: replicated


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


class TPGroup:
    """The collectives of one rank's forward pass over the default process group."""

    def __init__(self, shard: TPShard):
        self.shard = shard
        self.last_broadcast = 0.0  # time.monotonic() of rank 0's last batch or heartbeat

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place; returns it)."""
        dist.all_reduce(x)
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup of ids [T] -> [T, hidden]."""
        v = self.shard.vocab
        inside = (ids >= v.start) & (ids < v.stop)
        out = embedding((ids - v.start).masked_fill(~inside, 0))
        return self.all_reduce(out.masked_fill(~inside[:, None], 0.0))

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V / size] per rank -> [N, vocab_size] on every rank."""
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]
