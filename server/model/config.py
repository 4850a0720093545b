"""Model hyper-parameters of a Llama-family decoder, read from HF ``config.json`` or GGUF metadata.

One frozen :class:`ArchConfig` describes Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2 (tied
embeddings), Qwen2 (QKV bias), Qwen3 (q/k norm), Phi-3/Phi-4 (fused checkpoints, LongRoPE),
Mistral, Gemma 1/2/3 (GeGLU, (1 + w) norms, sandwich norms, soft-capping, interleaved
sliding-window layers, Gemma 3's local RoPE base) and the MoE Mixtral and Qwen3-MoE models;
:mod:`server.model.llama` needs nothing else.

Errors: an unsupported architecture or option raises :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from server.model.pooling import Pooling

if TYPE_CHECKING:
    from server.model.encoder_config import EncoderSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe",
                         "gemma", "gemma2", "gemma3_text", "gemma3")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
# name mapping checked for these (tests/model/test_gguf_families.py)
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                      "qwen3moe")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its options is not implemented here."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_type``: "linear", "llama3", or "longrope": Phi-3's
    LongRoPE, per-dimension ``short_factor`` / ``long_factor`` divisors and an
    ``attention_factor`` that scales cos and sin)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ArchConfig:
    """Shapes and constants of the decoder. Sizes are element counts; lengths are tokens."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # a base model without an LM head (config ``architectures`` all ``...Model``): it serves
    # embeddings (as ``pooling`` says); generation and prompt logprobs are refused
    embedding_only: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each query and key head, before RoPE
    # Mixture of experts (Mixtral, Qwen3-MoE): experts per sparse layer (0 = dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    sparse_layers: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma: gated MLP activation, embeddings scaled by sqrt(hidden), norms applied as
    # (norm_offset + w) (HF stores w, GGUF stores 1 + w), sandwich norms around attention and
    # the MLP, query scale query_pre_attn_scalar ** -0.5, tanh soft-capping of attention
    # scores and final logits (0 = off).
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Sliding-window attention: per-layer window in tokens (0 = full attention; () = all full);
    # window layers use RoPE base local_rope_theta when set (Gemma 3), without rope_scaling.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    # a BERT-family encoder (bidirectional, no KV reuse: server.model.encoder_config)
    encoder: EncoderSpec | None = None
    # how an embedding pools the final hidden states (sentence-transformers' modules.json)
    pooling: Pooling = Pooling()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.hidden_act!r} is not supported (supported: {ACTIVATIONS})")

    def window(self, layer: int) -> int:
        """Attention window of ``layer`` in tokens (0 = full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def windowed(self) -> bool:
        """The model has sliding-window layers or soft-capped attention scores."""
        return any(self.layer_windows) or self.attn_logit_softcap > 0

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ArchConfig":
        """Parse an HF ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters`` layouts)."""
        # one mapping per HF field and model family: long because the families differ, each line
        # independent
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3" and "text_config" in cfg:  # the text model of Gemma 3 VLMs
            cfg = {**cfg["text_config"], "model_type": "gemma3"}
        if model_type == "llava":  # the language model of a LLaVA checkpoint (server.model.vision)
            cfg = {"model_type": "llama", **(cfg.get("text_config") or {})}
            model_type = cfg["model_type"]
        archs = cfg.get("architectures") or []
        base_model = bool(archs) and all(str(a).endswith("Model") for a in archs)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        rope = dict(cfg.get("rope_parameters") or {})
        local_theta = cfg.get("rope_local_base_freq")
        if "full_attention" in rope:  # transformers 5: RoPE per layer type (Gemma 3)
            local = rope.get("sliding_attention") or {}
            local_theta = local.get("rope_theta", local_theta)
            rope = dict(rope["full_attention"] or {})
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "linear":
            scaling = RopeScaling("linear", factor=float(rope["factor"]))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                "llama3", factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        elif rope_type in ("longrope", "su"):
            orig = int(rope.get("original_max_position_embeddings")
                       or cfg.get("original_max_position_embeddings") or max_pos)
            factor = float(rope.get("factor") or max_pos / orig)
            attention = rope.get("attention_factor")
            if attention is None:  # the LongRoPE paper's default (HF ROPE_INIT_FUNCTIONS)
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                                / math.log(orig))
            scaling = RopeScaling(
                "longrope", factor=factor, original_max_position_embeddings=orig,
                short_factor=tuple(float(x) for x in rope["short_factor"]),
                long_factor=tuple(float(x) for x in rope["long_factor"]),
                attention_factor=float(attention))
        elif rope_type != "default":
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            # a base model's checkpoint (LlamaModel, MistralModel, Qwen3Model: embedding models
            # such as e5-mistral) has no LM head: its logits come from the embedding
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or base_model,
            embedding_only=base_model,
            qkv_bias=attn_bias or model_type == "qwen2",
            o_bias=attn_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"),
            **_moe_fields(model_type, cfg),
            **_gemma_fields(model_type, cfg, hidden),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(model_type, cfg),
            local_rope_theta=None if local_theta is None else float(local_theta),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is a mixture of experts."""
        return layer in self.sparse_layers

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], *, has_output_tensor: bool,
                  has_qkv_bias: bool, sparse_layers: tuple[int, ...] = (),
                  longrope_factors: tuple[tuple[float, ...], tuple[float, ...]] | None = None
                  ) -> "ArchConfig":
        """Parse GGUF key/value metadata (``{arch}.block_count`` etc.).

        llama3-style RoPE scaling in GGUF is carried as a ``rope_freqs.weight`` tensor that the
        loader applies directly, so it is not represented here. Tensors read by the loader:
        ``sparse_layers`` (layers with an expert router, ``ffn_gate_inp``: Mixtral is stored as
        arch "llama" with experts, Qwen3-MoE as "qwen3moe") and Phi-3's LongRoPE
        (short, long) factors (``rope_factors_short`` / ``rope_factors_long``).
        """
        # one mapping per GGUF key and architecture: long because the architectures differ, each
        # line independent
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHITECTURES})")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        layers = int(get("block_count"))
        head_dim = int(get("attention.key_length", hidden // heads))
        max_pos = int(get("context_length", 4096))
        rope_dims = int(get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise UnsupportedModelError(
                f"RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary) is not "
                "supported")
        if longrope_factors is not None:  # Phi-3 (llama.cpp's Phi3MiniModel conversion)
            orig = int(get("rope.scaling.original_context_length", max_pos))
            factor = max_pos / orig
            attention = get("rope.scaling.attn_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                                / math.log(orig))
            scaling = RopeScaling("longrope", factor=factor, original_max_position_embeddings=orig,
                                  short_factor=longrope_factors[0],
                                  long_factor=longrope_factors[1],
                                  attention_factor=float(attention))
        window = int(get("attention.sliding_window", 0) or 0)
        experts = int(get("expert_count", 0) or 0)
        moe = {} if not experts else dict(
            num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")
                                      or get("feed_forward_length")),
            moe_renormalize=True,  # llama.cpp normalizes the top-k weights of both families
            sparse_layers=sparse_layers)
        return cls(
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=has_qkv_bias,
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
            rope_scaling=scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **moe,
            **(_gemma_gguf_fields(arch, get, layers, hidden, heads)
               if arch in GEMMA_TYPES else
               {"layer_windows": (window,) * layers if 0 < window < max_pos
                and arch == "phi3" else ()}),
        )


def _moe_fields(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """MoE hyper-parameters of an HF config: Mixtral (every layer sparse, always renormalized)
    and Qwen3-MoE (``decoder_sparse_step``, ``mlp_only_layers``, ``norm_topk_prob``)."""
    layers = int(cfg["num_hidden_layers"])
    if model_type == "mixtral":
        return dict(num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), moe_renormalize=True,
                    sparse_layers=tuple(range(layers)))
    if model_type == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or ())
        return dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                    moe_renormalize=bool(cfg.get("norm_topk_prob", False)),
                    sparse_layers=tuple(i for i in range(layers) if i not in dense
                                        and step > 0 and (i + 1) % step == 0))
    return {}


def _gemma_fields(model_type: str, cfg: Mapping[str, Any], hidden: int) -> dict[str, Any]:
    """Activation and Gemma's constants of an HF config (HF ``modeling_gemma{,2,3}``)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if model_type not in GEMMA_TYPES:
        return dict(hidden_act=act)
    if model_type == "gemma":  # HF GemmaMLP: tanh-approximate GELU whatever hidden_act says
        act = "gelu_pytorch_tanh"
    return dict(hidden_act=act, embed_scale=math.sqrt(hidden), norm_offset=1.0,
                sandwich_norms=model_type != "gemma",
                query_pre_attn_scalar=(float(cfg["query_pre_attn_scalar"])
                                       if cfg.get("query_pre_attn_scalar") else None),
                attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def _gemma_gguf_fields(arch: str, get: Callable[..., Any], layers: int, hidden: int,
                       heads: int) -> dict[str, Any]:
    """Gemma 2/3 constants of a GGUF file, as llama.cpp reads them (``llama-model.cpp``):
    norms already hold 1 + w (its converter adds 1), the query scale is 1/sqrt(head_dim) except
    for the 27B models (1/sqrt(hidden / heads)), Gemma 3's window layers use RoPE base
    ``rope.freq_base_swa`` (llama.cpp's default 10000),
    and the window pattern defaults to every 2nd (Gemma 2) / 6th (Gemma 3) layer global."""
    head_dim = int(get("attention.key_length", hidden // heads))
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
    window = int(get("attention.sliding_window", 0) or 0)
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, (list, tuple)):  # per-layer flags (True = sliding window)
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    return dict(hidden_act="gelu_pytorch_tanh", embed_scale=math.sqrt(hidden), norm_offset=0.0,
                sandwich_norms=True,
                query_pre_attn_scalar=float(hidden // heads if big else head_dim),
                attn_logit_softcap=float(get("attn_logit_softcapping", 0.0) or 0.0),
                final_logit_softcap=float(get("final_logit_softcapping", 0.0) or 0.0),
                layer_windows=tuple(window if s else 0 for s in sliding) if window else (),
                local_rope_theta=(float(get("rope.freq_base_swa", 10000.0))
                                  if arch == "gemma3" else None))


def _layer_windows(model_type: str, cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Per-layer attention window in tokens (0 = full), from ``layer_types`` (transformers 5)
    or each family's older rule: Mistral (every layer), Qwen2/Qwen3 (``use_sliding_window``,
    layers from ``max_window_layers`` on), Gemma 2 (even layers), Gemma 3 (all but every
    ``sliding_window_pattern``-th). () when no layer has a window smaller than the context."""
    window = cfg.get("sliding_window")
    layers = int(cfg["num_hidden_layers"])
    if not window or int(window) >= int(cfg.get("max_position_embeddings", 4096)):
        return ()
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
        return ()
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif model_type == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    elif model_type in ("gemma3_text", "gemma3"):
        pattern = int(cfg.get("sliding_window_pattern", 6))
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type.startswith("qwen"):
        first = int(cfg.get("max_window_layers", layers))
        sliding = [i >= first for i in range(layers)]
    elif model_type in ("mistral", "mixtral", "phi3"):
        sliding = [True] * layers
    else:
        return ()
    return tuple(int(window) if s else 0 for s in sliding) if any(sliding) else ()
