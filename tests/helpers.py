"""Plain helpers for tests (importable as ``tests.helpers``)."""

from __future__ import annotations

import os

import torch

from server.model.loader import default_model_path

TINY_VOCAB = 49152  # the default model's tokenizer vocabulary
IMAGE_TOKEN = TINY_VOCAB  # "<image>", added to the tiny LLaVA's tokenizer (tiny_llava fixture)


def _exact_quantization() -> str:
    from kernels import cpu as native

    return "int4" if native.available() else "none"


# The weights of the equality tests (cache on/off, jump-forward and n-gram drafts on/off, chunk
# sizes, batch composition): quantized as the default model's GGUF weights are (int4 linears,
# int8 lm_head) on the native CPU kernels, whose rows do not depend on the batch: the
# configuration users run. Where the kernels are not built, dense weights (torch's fp32 matmul).
EXACT_QUANTIZATION = _exact_quantization()


def _exact_engine() -> dict:
    from kernels.cpu_features import at_least, cpu_isa

    # the AMX class's default runs extends of 64+ tokens on AMX tiles (dense bf16 copies where
    # the CPU has none): not the int4 kernel's rows; its deterministic mode keeps them there
    amx = EXACT_QUANTIZATION == "int4" and at_least("amx", cpu_isa())
    return {"quantization": EXACT_QUANTIZATION, **({"deterministic_inference": True} if amx else {})}


# Engine keyword arguments of the equality tests: EXACT_QUANTIZATION on row-invariant kernels
EXACT_ENGINE = _exact_engine()


def tiny_config(kind: str = "llama", **overrides):
    """A 2-layer, hidden-64 config of the given family (transformers config object)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "llama3":  # llama3 RoPE scaling, MHA, theta as in Llama 3.1
        common.update(num_key_value_heads=4)
        cfg = LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif kind == "tied":  # SmolLM2-like: tied embeddings, 3:1 GQA
        common.update(num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                      tie_word_embeddings=True)
        cfg = LlamaConfig(**common)
    elif kind == "qwen3":  # per-head q/k RMSNorm, explicit head_dim != hidden / heads
        common.update(head_dim=32)
        cfg = Qwen3Config(**common, use_sliding_window=False)
    elif kind == "phi3":  # fused qkv / gate_up weights; LongRoPE (context 512 = 2 x original)
        common.update(pad_token_id=0)
        cfg = Phi3Config(**common, original_max_position_embeddings=256, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)]})
    elif kind == "mixtral":  # 4 experts, top-2, every layer sparse
        cfg = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=None)
    elif kind == "qwen3_moe":  # q/k norm, layer 0 dense (mlp_only_layers), top-2 of 4
        common.update(head_dim=32)
        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=48, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[0],
                             use_sliding_window=False)
    elif kind == "qwen2":  # QKV bias
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif kind == "mistral_swa":  # every layer a 16-token sliding window
        cfg = MistralConfig(**common, sliding_window=16)
    elif kind == "gemma":  # GeGLU, (1 + w) norms, scaled embeddings, head_dim 32, MQA
        common.update(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True,
                      pad_token_id=0)
        cfg = GemmaConfig(**common)
    elif kind == "gemma2":  # sandwich norms, soft-capping, layer 0 a 16-token window
        common.update(head_dim=32, tie_word_embeddings=True, pad_token_id=0)
        cfg = Gemma2Config(**common, sliding_window=16, query_pre_attn_scalar=48,
                           attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    elif kind == "gemma3":  # q/k norms; window layers 0, 1, 3 with their own RoPE base
        common.update(head_dim=32, tie_word_embeddings=True, pad_token_id=0,
                      num_hidden_layers=4)
        cfg = Gemma3TextConfig(
            **common, sliding_window=16, query_pre_attn_scalar=48,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    else:
        raise ValueError(kind)
    for k, v in overrides.items():  # tuples stand for lists (make_tiny_model hashes them)
        setattr(cfg, k, list(v) if isinstance(v, tuple) else v)
    return cfg


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [len(ids), vocab] of a transformers model (fp32)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                    dtype=torch.int64)).logits[0]


def has_default_model() -> bool:
    try:
        return os.path.isfile(default_model_path())
    except Exception:
        return False


def assert_no_request_memory(cache) -> None:
    """Every KV slot is free or an unlocked (evictable) radix-cache entry; no row is held."""
    assert cache.pool.num_free + cache.tree.evictable_size == cache.pool.capacity
    assert cache.tree.protected_size == 0
    assert cache.req_table.num_free_rows == cache.req_table.max_requests


def png(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A PNG of random pixels (a different image per seed)."""
    import io

    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def huge_png() -> bytes:
    """5000 x 4000 pixels of one colour: a few KB, 20 M pixels once decoded."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5000, 4000), (9, 9, 9)).save(buf, format="PNG")
    return buf.getvalue()


def failing_once(forward):
    """``forward`` (a runner's) that raises RuntimeError("simulated kernel failure") on its
    first call and runs normally after: a fault the tests cannot cause otherwise."""
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return forward(batch)

    return flaky


# every attention and MLP projection of a Llama-family layer, as peft names them
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, out_dir: str, rank: int, alpha: int, targets, rslora: bool,
                 seed: int):
    """Save a random (non-zero B) PEFT adapter for ``hf_model``; returns the PeftModel."""
    import copy

    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
        init_lora_weights=False))
    model.save_pretrained(out_dir)
    return model.eval()


# a WordPiece vocabulary the tiny encoders' tokenizer spells any lowercase ASCII text with
_ENCODER_VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                  + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'-")
                  + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
                  + "the a is of what capital paris france cat dog sat on mat berlin".split())
ENCODER_ARCHS = ("BertModel", "XLMRobertaModel", "BertForSequenceClassification",
                 "XLMRobertaForSequenceClassification")


def make_encoder(out_dir: str, arch: str = "BertModel", pooling: str | None = None,
                 normalize: bool = True, seed: int = 0):
    """Save a tiny random BERT-family model (fp32, 2 layers, hidden 32) with a WordPiece
    tokenizer to ``out_dir``; ``pooling`` ("cls", "mean", "lasttoken") also writes a
    sentence-transformers ``modules.json`` (with a Normalize module when ``normalize``).
    Returns the transformers model."""
    import json

    import transformers
    from transformers import BertConfig, BertTokenizerFast, XLMRobertaConfig

    os.makedirs(out_dir, exist_ok=True)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(_ENCODER_VOCAB)}).save_pretrained(out_dir)
    common = dict(vocab_size=len(_ENCODER_VOCAB), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                  num_labels=1)
    cfg = (BertConfig(**common) if arch.startswith("Bert")
           else XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=0))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # LayerNorms and biases away from their 1/0 initialization
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
        with open(os.path.join(out_dir, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
        mode = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}[pooling]
        with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 32, f"pooling_mode_{mode}": True}, f)
    return model
