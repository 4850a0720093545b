"""Write a random-weight Llama-family checkpoint (HF layout: config.json, sharded safetensors,
tokenizer) for speed measurements where no real weights can be downloaded (the GPU machine has
no network).

    python -m benchmarks.random_model OUT_DIR [--shape llama3-8b|llama3-1b|tiny]
        [--dtype bfloat16] [--device cuda] [--tokenizer DIR]

Weights are N(0, 0.02) and norms 1, drawn on ``--device`` (fast on a GPU), so outputs are noise:
use it for throughput, never for quality. The tokenizer is the default model's (49,152 ids,
all below every shape's vocabulary), from ``--tokenizer``, ``$SGL_TOKENIZER_DIR`` or the
installed default model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

SHAPES = {
    # Meta-Llama-3-8B's config.json
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=8192),
    # Llama-3.2-1B's (untied here)
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                 max_position_embeddings=4096),
}
SHARD_BYTES = 4 << 30


def _tokenizer(path: str | None):
    path = path or os.environ.get("SGL_TOKENIZER_DIR")
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from server.model.loader import default_model_path, load_model

    return load_model(default_model_path()).tokenizer


def write_random_model(out_dir: str, shape: str = "llama3-8b", dtype: str = "bfloat16",
                       device: str = "cpu", tokenizer: str | None = None, seed: int = 0) -> str:
    """Write the checkpoint to ``out_dir`` (created) and return it. Raises KeyError for an
    unknown shape."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], torch_dtype=dtype, tie_word_embeddings=False,
                         rms_norm_eps=1e-5)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, os.path.join(out_dir, name),
                  metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)
        shard.clear()

    size = 0
    for name, p in skeleton.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch_dtype, device=device)
        else:
            t = (torch.randn(p.shape, generator=gen, device=device) * 0.02).to(torch_dtype)
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shard:
        flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(out_dir)
    _tokenizer(tokenizer).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    print(write_random_model(args.out_dir, args.shape, args.dtype, args.device, args.tokenizer))


if __name__ == "__main__":
    main()
