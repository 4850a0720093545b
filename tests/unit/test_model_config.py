"""ArchConfig parsing: both HF config layouts, family flags, and clear refusals."""

import pytest

from server.model.config import ArchConfig, UnsupportedModelError

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_transformers4_layout_rope_scaling():
    a = ArchConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3})
    assert a.rope_theta == 5e5
    assert a.rope_scaling.rope_type == "llama3" and a.rope_scaling.factor == 8.0


def test_transformers5_layout_rope_parameters():
    a = ArchConfig.from_hf({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert a.rope_theta == 5e5 and a.rope_scaling.original_max_position_embeddings == 8192


def test_family_flags():
    q = ArchConfig.from_hf({**BASE, "model_type": "qwen2"})
    assert q.qkv_bias and not q.o_bias
    llama = ArchConfig.from_hf({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias
    t = ArchConfig.from_hf({**BASE, "tie_word_embeddings": True, "eos_token_id": [2, 7]})
    assert t.tie_word_embeddings and t.eos_token_ids == (2, 7)
    assert t.head_dim == 16 and t.kv_elements_per_token == 2 * 2 * 2 * 16


@pytest.mark.parametrize("cfg, match", [
    ({**BASE, "model_type": "gpt2"}, "model_type"),
    ({**BASE, "hidden_act": "relu"}, "activation"),
    ({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ({**BASE, "num_key_value_heads": 3}, "multiple"),
])
def test_unsupported_is_refused_clearly(cfg, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ArchConfig.from_hf(cfg)


def test_gguf_metadata():
    meta = {"general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
            "llama.embedding_length": 576, "llama.feed_forward_length": 1536,
            "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
            "llama.rope.freq_base": 1e5, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 49152, "tokenizer.ggml.eos_token_id": 2}
    a = ArchConfig.from_gguf(meta, has_output_tensor=False, has_qkv_bias=False)
    assert (a.num_layers, a.head_dim, a.num_kv_heads, a.tie_word_embeddings) == (30, 64, 3, True)
    assert a.eos_token_ids == (2,)


def test_qwen3_configs_are_read_with_their_qk_norm():
    from server.model.config import ArchConfig

    hf = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
          "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
          "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000, "max_position_embeddings": 40960, "attention_bias": False,
          "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True}
    a = ArchConfig.from_hf(hf)  # Qwen3-0.6B's shape: head_dim 128 != 1024 / 16
    assert a.qk_norm and a.head_dim == 128 and not a.qkv_bias and not a.o_bias
    g = ArchConfig.from_gguf({"general.architecture": "qwen3", "qwen3.attention.head_count": 16,
                              "qwen3.embedding_length": 1024, "qwen3.vocab_size": 151936,
                              "qwen3.feed_forward_length": 3072, "qwen3.block_count": 28,
                              "qwen3.attention.key_length": 128},
                             has_output_tensor=False, has_qkv_bias=False)
    assert g.qk_norm and g.head_dim == 128 and g.tie_word_embeddings


def test_sliding_window_layers_per_family():
    mistral = ArchConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 256})
    assert mistral.layer_windows == (256, 256) and mistral.windowed
    assert ArchConfig.from_hf({**BASE, "model_type": "mistral",
                               "sliding_window": 4096}).layer_windows == ()  # >= context
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 128, "max_window_layers": 1}
    assert ArchConfig.from_hf(qwen).layer_windows == ()  # use_sliding_window off
    assert ArchConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows == (0, 128)
    g2 = ArchConfig.from_hf({**BASE, "model_type": "gemma2", "num_hidden_layers": 4,
                             "sliding_window": 512, "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256})
    assert g2.layer_windows == (512, 0, 512, 0) and g2.attn_logit_softcap == 50.0
    assert g2.attention_scale == 256 ** -0.5 and g2.sandwich_norms and g2.norm_offset == 1.0


def test_gemma3_checkpoint_config_transformers4_layout():
    """gemma-3-4b-it's config.json: a multimodal wrapper whose text_config has the local RoPE
    base, linear scaling of the global layers and a 6-layer pattern."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024,
            "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "model_type": "gemma3_text"}
    a = ArchConfig.from_hf({"model_type": "gemma3", "text_config": text,
                            "vision_config": {"model_type": "siglip_vision_model"}})
    assert a.model_type == "gemma3" and a.qk_norm and a.hidden_act == "gelu_pytorch_tanh"
    assert a.layer_windows == (1024,) * 5 + (0,) + (1024,) * 5 + (0,)
    assert a.local_rope_theta == 10000.0 and a.rope_theta == 1e6
    assert a.rope_scaling.rope_type == "linear" and a.rope_scaling.factor == 8.0
    assert a.embed_scale == 2560 ** 0.5 and a.final_logit_softcap == 0.0
