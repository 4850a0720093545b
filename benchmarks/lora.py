"""Multi-LoRA decode throughput: the base model alone vs 1, 4 and 8 adapters mixed in one batch.

    python -m benchmarks.lora [--model PATH] [--streams 16] [--tokens 64] [--rank 16]
        [--adapters 0,1,4,8] [--repeats 2] [--quantization int4]

Random PEFT adapters (every attention and MLP projection, ``--rank``) are written for the
model's shapes and served from one in-process Engine (``--max-loras-per-batch 8``). Each row
decodes ``--streams`` prompts together, ``--tokens`` new tokens each (greedy, EOS ignored), the
streams' adapters assigned round-robin; "0" is the base model on the same engine, and the
first row is the base model on an engine without LoRA slots. Reports output tokens/s and the
ratio to that first row (the goal: >= 0.8 with 8 adapters mixed). The CPU class is printed
first; rows alternate over ``--repeats`` rounds and the best of each is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from benchmarks.common import print_table
from kernels.cpu_features import cpu_description
from server.engine import Engine
from server.model.sampling import SamplingParams

PROJECTIONS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
               "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
               "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
               "mlp.down_proj": ("inter", "hidden")}


def write_adapter(out: str, arch, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (A ~ N(0, 1/in), B ~ N(0, 0.02)) for ``arch``'s shapes."""
    from safetensors.torch import save_file

    sizes = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim,
             "kv": arch.num_kv_heads * arch.head_dim, "inter": arch.intermediate_size}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                rank, sizes[fan_in], generator=g) / sizes[fan_in] ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[fan_out], rank, generator=g) * 0.02
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [m.split(".")[1] for m in PROJECTIONS]}, f)


def decode(engine: Engine, prompts: list[list[int]], loras: list[str | None], tokens: int
           ) -> float:
    """Output tokens/s of one batch (every stream's ``tokens`` new tokens; the 32-token
    prefills included)."""
    sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.make_request(p, sp, lora=lora) for p, lora in zip(prompts, loras)]
    start = time.perf_counter()
    engine.run(reqs)
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="0,1,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quantization", default="auto", help="e.g. int4 for a bf16 checkpoint "
                    "(benchmarks.random_model)")
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",")]
    print(f"CPU: {cpu_description()}")
    plain = Engine(args.model, max_total_tokens=args.streams * (args.tokens + 64),
                   quantization=args.quantization)
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    paths = []
    for i in range(max(counts)):
        paths.append(f"a{i}={tmp}/a{i}")
        write_adapter(f"{tmp}/a{i}", plain.arch, args.rank, seed=i)
    lora = Engine(args.model, max_total_tokens=args.streams * (args.tokens + 64),
                  lora_paths=tuple(paths), max_loras_per_batch=max(8, max(counts)),
                  max_lora_rank=args.rank, quantization=args.quantization)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (32,), generator=g).tolist()
               for _ in range(args.streams)]
    runs = [("base, no LoRA slots", plain, [None] * args.streams)]
    for n in counts:
        loras = [None] * args.streams if n == 0 else [f"a{i % n}" for i in range(args.streams)]
        runs.append((f"{n} adapter{'s' if n != 1 else ''} mixed" if n else "base, LoRA slots",
                     lora, loras))
    best = [0.0] * len(runs)
    for _ in range(args.repeats):
        for i, (_, engine, loras) in enumerate(runs):
            engine.flush_cache()
            best[i] = max(best[i], decode(engine, prompts, loras, args.tokens))
    print(f"{args.streams} streams x {args.tokens} tokens, rank {args.rank}, model "
          f"{plain.model_name}, quantization {plain.runner.quant_report.summary()}")
    print_table(["batch", "tok/s", "vs base"],
                [(name, f"{tps:.1f}", f"{tps / best[0]:.2f}")
                 for (name, _, _), tps in zip(runs, best)])


if __name__ == "__main__":
    main()
