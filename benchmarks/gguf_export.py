"""Write a Llama-family Hugging Face checkpoint as a GGUF file llama.cpp loads, so a peer runs
the same weights as our server (e.g. ``benchmarks/random_model.py``'s Llama-3.2-1B shape).

    python -m benchmarks.gguf_export CHECKPOINT_DIR OUT.gguf [--type Q4_0|Q4_1|Q8_0]

Linear weights and the token embedding are quantized to ``--type`` (default Q4_0, the format
[2/8] names for llama.cpp) with the ``gguf`` package's reference quantizers; norms stay
float32. Q and K rows are permuted as llama.cpp's own converter does (convert_hf_to_gguf.py,
``LlamaModel.permute``: its RoPE rotates adjacent dimension pairs, Hugging Face's the two
halves of a head), so the GGUF computes what the checkpoint computes. The tokenizer metadata
is the default model's (SmolLM2's GGUF: the tokenizer ``random_model.py`` saves), padded with
unused tokens up to the checkpoint's vocabulary. Plain Llama checkpoints only (no RoPE scaling,
biases or tied weights beyond a shared embedding); raises SystemExit otherwise.
"""

from __future__ import annotations

import argparse
import json
import os

import gguf
import numpy as np
import torch
from safetensors import safe_open

from server.model.loader import default_model_path

LAYER_TENSORS = {  # Hugging Face name in model.layers.N -> GGUF name in blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * head_dim, K] rows of Q or K from Hugging Face's half-split RoPE order to
    llama.cpp's adjacent-pair order (llama.cpp convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    reader = gguf.GGUFReader(default_model_path())
    fields = reader.fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > vocab:
        raise SystemExit(f"the checkpoint's vocabulary ({vocab}) is smaller than the "
                         f"tokenizer's ({len(tokens)})")
    pad = vocab - len(tokens)
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(pad)])
    writer.add_token_types(types + [int(gguf.TokenType.UNUSED)] * pad)
    writer.add_token_merges(list(fields["tokenizer.ggml.merges"].contents()))
    for key in TOKENIZER_KEYS:
        if key in fields:
            field = fields[key]
            value_type = field.types[0]
            writer.add_key_value(key, field.contents(), value_type)


def export(checkpoint: str, out: str, qtype: gguf.GGMLQuantizationType) -> None:
    """Write ``checkpoint`` (a Llama HF directory of safetensors) to ``out`` as GGUF."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama" or cfg.get("rope_scaling") or cfg.get("attention_bias"):
        raise SystemExit("only plain Llama checkpoints (no RoPE scaling, no biases)")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(os.path.basename(os.path.normpath(checkpoint)))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type({gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                          gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
                          gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    _copy_tokenizer(writer, cfg["vocab_size"])

    index_path = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    names = {}
    for file in files:
        with safe_open(os.path.join(checkpoint, file), framework="pt") as st:
            names.update({k: file for k in st.keys()})

    def load(name: str) -> np.ndarray:
        with safe_open(os.path.join(checkpoint, names[name]), framework="pt") as st:
            return st.get_tensor(name).to(torch.float32).numpy()

    def add(gguf_name: str, w: np.ndarray) -> None:
        if w.ndim == 1:
            writer.add_tensor(gguf_name, w.astype(np.float32))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", load("model.embed_tokens.weight"))
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in LAYER_TENSORS.items():
            w = load(f"model.layers.{i}.{hf}")
            if hf == "self_attn.q_proj.weight":
                w = permute_rope(w, heads)
            elif hf == "self_attn.k_proj.weight":
                w = permute_rope(w, kv_heads)
            add(f"blk.{i}.{gg}", w)
    add("output_norm.weight", load("model.norm.weight"))
    if "lm_head.weight" in names and not cfg.get("tie_word_embeddings"):
        add("output.weight", load("lm_head.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0"])
    args = ap.parse_args()
    export(args.checkpoint, args.out, gguf.GGMLQuantizationType[args.type])
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
