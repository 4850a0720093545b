"""Hyper-parameters of a BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) read from an HF
directory: the embedding models of the bge / e5 / gte / MiniLM family and the cross-encoder
rerankers (``*ForSequenceClassification``, the bge-reranker and ms-marco layouts).

An encoder is described by an :class:`ArchConfig` (sizes, layer count, context length; always
``embedding_only``) whose ``encoder`` field holds what the decoder fields cannot say
(:class:`EncoderSpec`): post-LayerNorm blocks, learned absolute positions, token types. Its
``pooling`` is what sentence-transformers' ``modules.json`` declares, else CLS, L2-normalized
(:mod:`server.model.pooling`).

Errors: :class:`UnsupportedModelError` names the option not implemented (relative position
embeddings, an activation other than GELU, max / weighted-mean pooling, a classifier with more
than one label).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from server.model.config import ArchConfig, UnsupportedModelError
from server.model.pooling import ENCODER_POOLINGS, Pooling, declared_pooling

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
# HF hidden_act -> ArchConfig.hidden_act (BERT's "gelu" is the exact erf GELU)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_pytorch_tanh",
                "gelu_pytorch_tanh": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class EncoderSpec:
    """What a BERT-family encoder needs beyond :class:`ArchConfig`.

    Attributes:
        family: "bert" or "roberta" (RoBERTa and XLM-RoBERTa: positions start after the padding
            id, one token type, the classifier is a dense + tanh + projection head).
        type_vocab_size: token types (BERT 2: the second segment of a pair is type 1).
        layer_norm_eps: of every LayerNorm.
        position_offset: added to a token's position to index the position embeddings
            (RoBERTa: ``pad_token_id + 1``; BERT 0).
        num_labels: 1 for a cross-encoder (its one relevance logit per sequence); 0 for an
            embedding model.
    """

    family: str
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int
    num_labels: int = 0


def is_encoder(cfg: Mapping[str, Any]) -> bool:
    """Whether an HF ``config.json`` dict describes a BERT-family encoder."""
    return cfg.get("model_type") in ENCODER_TYPES


def encoder_arch(cfg: Mapping[str, Any], path: str | None = None) -> ArchConfig:
    """The :class:`ArchConfig` (with ``encoder`` set) of an encoder's ``config.json`` dict;
    ``path``: its directory, read for sentence-transformers' pooling and normalization.
    Raises UnsupportedModelError."""
    model_type = cfg["model_type"]
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{model_type}: position_embedding_type "
                                    f"{cfg['position_embedding_type']!r} is not supported "
                                    "(only 'absolute')")
    act = _ACTIVATIONS.get(cfg.get("hidden_act", "gelu"))
    if act is None:
        raise UnsupportedModelError(f"{model_type}: activation {cfg['hidden_act']!r} is not "
                                    f"supported (supported: {sorted(_ACTIVATIONS)})")
    archs = cfg.get("architectures") or []
    num_labels = 0
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        if num_labels != 1:
            raise UnsupportedModelError(f"{model_type}: a classifier with {num_labels} labels; "
                                        "cross-encoder rerankers (one relevance logit) only")
    pooling, normalize = declared_pooling(path, "cls")
    if pooling not in ENCODER_POOLINGS:
        raise UnsupportedModelError(f"{model_type}: {pooling} pooling (modules.json) is not "
                                    f"supported (supported: {ENCODER_POOLINGS})")
    family = "bert" if model_type == "bert" else "roberta"
    offset = int(cfg.get("pad_token_id", 1)) + 1 if family == "roberta" else 0
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ArchConfig(
        model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        rope_theta=0.0,
        # positions past the offset are the usable context
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - offset,
        embedding_only=True, hidden_act=act, pooling=Pooling(pooling, normalize),
        encoder=EncoderSpec(family=family, type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                            position_offset=offset, num_labels=num_labels))
