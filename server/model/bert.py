"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa): bidirectional post-LayerNorm transformer
blocks, pooling into one vector per sequence, and the cross-encoder classifier heads.

Reference implementation: transformers' ``modeling_bert`` / ``modeling_xlm_roberta`` (their
parameter names are kept, so checkpoints load by name) and sentence-transformers' Pooling and
Normalize modules; checked against both in ``tests/model/test_encoder.py``.

Sequences arrive packed (``[T]`` tokens of B sequences back to back, as the scheduler lays out
an extend pass): the linear layers run on the T rows, attention on each sequence's rows.
"""

from __future__ import annotations

import itertools
from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from server.model.config import ArchConfig
from server.model.weight_loading import QuantReport, WeightLoadError

# checkpoint prefixes of the task models (BertForSequenceClassification keeps "bert.", ...)
_PREFIXES = ("bert.", "roberta.", "model.")


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out)


def _dense_norm(n_in: int, n_out: int, eps: float) -> nn.ModuleDict:
    return nn.ModuleDict({"dense": _linear(n_in, n_out), "LayerNorm": nn.LayerNorm(n_out, eps)})


class BertEncoder(nn.Module):
    """One BERT-family encoder with HF's parameter names.

    Args:
        arch: an :class:`ArchConfig` whose ``encoder`` is set
            (:func:`server.model.encoder_config.encoder_arch`).
    """

    def __init__(self, arch: ArchConfig):
        super().__init__()
        spec = arch.encoder
        assert spec is not None, "not an encoder's ArchConfig"
        self.arch, self.spec = arch, spec
        hidden, eps = arch.hidden_size, spec.layer_norm_eps
        self.embeddings = nn.ModuleDict({
            "word_embeddings": nn.Embedding(arch.vocab_size, hidden),
            "position_embeddings": nn.Embedding(arch.max_position_embeddings
                                                + spec.position_offset, hidden),
            "token_type_embeddings": nn.Embedding(spec.type_vocab_size, hidden),
            "LayerNorm": nn.LayerNorm(hidden, eps)})
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(nn.ModuleDict({
            "attention": nn.ModuleDict({
                "self": nn.ModuleDict({name: _linear(hidden, hidden)
                                       for name in ("query", "key", "value")}),
                "output": _dense_norm(hidden, hidden, eps)}),
            "intermediate": nn.ModuleDict({"dense": _linear(hidden, arch.intermediate_size)}),
            "output": _dense_norm(arch.intermediate_size, hidden, eps),
        }) for _ in range(arch.num_layers))})
        if spec.num_labels and spec.family == "bert":  # pooler (dense + tanh on CLS), classifier
            self.pooler = nn.ModuleDict({"dense": _linear(hidden, hidden)})
            self.classifier = _linear(hidden, spec.num_labels)
        elif spec.num_labels:  # RobertaClassificationHead: dense + tanh + out_proj on CLS
            self.classifier = nn.ModuleDict({"dense": _linear(hidden, hidden),
                                             "out_proj": _linear(hidden, spec.num_labels)})
        self.act = (lambda x: F.gelu(x, approximate="tanh")) \
            if arch.hidden_act == "gelu_pytorch_tanh" else F.gelu

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device) -> QuantReport:
        """Take every parameter from ``weights`` (HF names, with or without a task model's
        ``bert.`` / ``roberta.`` prefix; others, e.g. an unused pooler or MLM head, are
        skipped) in ``dtype`` on ``device``. Raises WeightLoadError naming a missing or
        misshapen tensor."""
        self.to_empty(device=device).to(dtype)  # built on the meta device: storage, uninitialized
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = next((name[len(p):] for p in _PREFIXES if name.startswith(p)), name)
            if key not in params:
                continue
            if tuple(tensor.shape) != tuple(params[key].shape):
                raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(params[key].shape)}")
            params[key].requires_grad_(False).copy_(tensor)
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise WeightLoadError(f"missing encoder weights: {', '.join(missing[:5])}"
                                  + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
        report = QuantReport("none")
        report.modules["dense"] = sum(isinstance(m, nn.Linear) for m in self.modules())
        report.weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        return report

    def token_types(self, input_ids: torch.Tensor, seq_lens: list[int], sep_id: int | None
                    ) -> torch.Tensor:
        """[T] int64 token types of packed sequences: 1 after a sequence's first separator
        (the second segment of a ``[CLS] A [SEP] B [SEP]`` pair, as BERT's tokenizers type it),
        else 0; all 0 for one-type models (RoBERTa)."""
        types = torch.zeros_like(input_ids)
        if self.spec.type_vocab_size < 2 or sep_id is None:
            return types
        start = 0
        for n in seq_lens:
            seps = (input_ids[start:start + n] == sep_id).nonzero()
            if len(seps):
                types[start + int(seps[0, 0]) + 1:start + n] = 1
            start += n
        return types

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Final hidden states [T, hidden] (the model's dtype) of packed sequences:
        ``input_ids``, ``positions`` (from 0 in each sequence), ``token_types`` [T] int64;
        ``seq_lens`` [B] tokens of each sequence, summing to T."""
        emb = self.embeddings
        h = (emb["word_embeddings"](input_ids)
             + emb["position_embeddings"](positions + self.spec.position_offset)
             + emb["token_type_embeddings"](token_types))
        h = emb["LayerNorm"](h)
        heads = self.arch.num_heads
        for layer in self.encoder["layer"]:
            attn = layer["attention"]
            q, k, v = (attn["self"][n](h) for n in ("query", "key", "value"))
            ctx = _attend(q, k, v, heads, seq_lens)
            h = attn["output"]["LayerNorm"](attn["output"]["dense"](ctx) + h)
            x = self.act(layer["intermediate"]["dense"](h))
            h = layer["output"]["LayerNorm"](layer["output"]["dense"](x) + h)
        return h

    def pool(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Each sequence's output, float32: [B, hidden] pooled (and L2-normalized) vectors of
        an embedding model, or [B, num_labels] relevance logits of a cross-encoder."""
        starts = [0, *itertools.accumulate(seq_lens)][:-1]
        first = hidden[starts]
        if self.spec.num_labels and self.spec.family == "bert":
            return self.classifier(torch.tanh(self.pooler["dense"](first))).float()
        if self.spec.num_labels:
            head = self.classifier
            return head["out_proj"](torch.tanh(head["dense"](first))).float()
        if self.arch.pooling.method == "cls":
            pooled = first.float()
        elif self.arch.pooling.method == "lasttoken":
            pooled = hidden[[s + n - 1 for s, n in zip(starts, seq_lens)]].float()
        else:  # mean
            pooled = torch.stack([hidden[s:s + n].float().mean(0)
                                  for s, n in zip(starts, seq_lens)])
        return F.normalize(pooled, dim=-1) if self.arch.pooling.normalize else pooled


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
            seq_lens: list[int]) -> torch.Tensor:
    """Softmax attention of each packed sequence's queries over its own keys (both ways):
    q, k, v [T, hidden] -> [T, hidden]. One call per sequence of torch's CPU flash-attention
    kernel (4-D inputs; 3-D ones take the slower math path), never padded: on 2 Zen 4 cores
    (bf16, 12 heads of 64) 64 x 12 tokens took 4.1 ms against 5.1 ms padded to one masked call,
    5 x 200 tokens 8.6 against 11.9 ms, 30/40/25/500 tokens 8.8 against 31.8 ms."""
    hidden = q.shape[-1]
    outs, start = [], 0
    for n in seq_lens:
        one = [x[start:start + n].view(1, n, heads, hidden // heads).transpose(1, 2)
               for x in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*one).transpose(1, 2).reshape(n, hidden))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)
