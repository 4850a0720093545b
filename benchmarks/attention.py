"""Attention time per layer call, Triton vs FlashInfer, at a few batch and length mixes (GPU).

    python -m benchmarks.attention [--heads 32 --kv-heads 8 --head-dim 128] [--dtype bfloat16]

Llama-3-8B's attention shape by default. Each row times ``attend`` for one layer (``begin``,
the per-pass metadata/plan, is done once per pass and reported separately) with CUDA events,
median of 20 after 3 warm-ups, over a token pool whose slots are shuffled so K/V rows are
scattered as in a long-running server.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import print_table
from kernels import AttentionInputs, create_attention_backend

DECODE = [(1, 1024), (16, 1024), (64, 2048), (256, 1024), (32, 8192)]  # (batch, KV length)
EXTEND = [(1, 0, 2048), (4, 0, 512), (8, 1024, 128), (16, 2048, 16)]  # (batch, prefix, new)


def _time(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current stream."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_mix(backend_name: str, batch: int, prefix: int, new: int, heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype) -> tuple[float, float]:
    """(attend ms, begin ms) for ``batch`` sequences of ``prefix`` cached + ``new`` tokens."""
    dev = torch.device("cuda")
    seq = prefix + new
    capacity = batch * seq + 1
    k = torch.randn(capacity, kv_heads, head_dim, device=dev).to(dtype)
    v = torch.randn_like(k)
    backend = create_attention_backend(backend_name, [k], [v])
    slots = torch.randperm(capacity - 1, device=dev) + 1  # slot 0 is the padding slot
    table = slots.view(batch, seq)
    inputs = AttentionInputs(is_decode=new == 1 and prefix > 0, req_to_token=table,
                             req_rows=list(range(batch)), prefix_lens=[prefix] * batch,
                             extend_lens=[new] * batch,
                             out_cache_loc=table[:, prefix:].reshape(-1).contiguous())
    q = torch.randn(batch * new, heads, head_dim, device=dev).to(dtype)
    scale = head_dim ** -0.5
    begin_ms = _time(lambda: backend.begin(inputs))
    backend.begin(inputs)
    backend.attend(0, q, scale)  # FlashInfer plans at the first layer of a pass
    return _time(lambda: backend.attend(0, q, scale)), begin_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backends", default="triton,flashinfer")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    backends = args.backends.split(",")
    print(f"device: {torch.cuda.get_device_name()}; q heads {args.heads}, KV heads "
          f"{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}")
    header = ["pass", "batch", "prefix", "new"]
    for name in backends:
        header += [f"{name} attend us", f"{name} begin us"]
    if len(backends) == 2:
        header.append(f"{backends[0]} / {backends[1]}")
    rows = []
    mixes = [("decode", b, n - 1, 1) for b, n in DECODE] + [("extend", b, p, e)
                                                             for b, p, e in EXTEND]
    for kind, b, p, e in mixes:
        ms = {name: run_mix(name, b, p, e, args.heads, args.kv_heads, args.head_dim, dtype)
              for name in backends}
        row = [kind, str(b), str(p), str(e)]
        for name in backends:
            row += [f"{ms[name][0] * 1e3:.0f}", f"{ms[name][1] * 1e3:.0f}"]
        if len(backends) == 2:
            row.append(f"{ms[backends[0]][0] / ms[backends[1]][0]:.2f}x")
        rows.append(row)
        print(" | ".join(row), flush=True)  # progress (first uses JIT-compile kernels)
    print_table(header, rows)


if __name__ == "__main__":
    main()
