"""Attention time per layer call on the CPU, each native kernel this machine runs side by side.

    python -m benchmarks.cpu_attention [--heads 9 --kv-heads 3 --head-dim 64]
        [--dtype bfloat16] [--seconds 1] [--layers 1]

SmolLM2-135M's attention shape by default. Each row times one call of every kernel of
``kernels.cpu.ATTENTION_KERNELS`` the machine can run (the same inputs for all: K/V in a pool
whose slots are shuffled, as in a long-running server) on a mix of prefills, extends over a
cached prefix and decode steps, and reports milliseconds and GFLOP/s (4 x head_dim flops per
(query head, attended position) pair: the causal work only). The first lines print the CPU
class and the fp32/bf16/int8 GEMM rates torch reaches in the same run. ``--layers 30`` gives
every call its own K/V pool, called in turn as a model's layers are, so the K/V comes from DRAM
as in a decode step rather than from the cache (times are still per call), and adds a column:
``torch.sum`` over the same pools in the same order (per call: the time a plain read of the
bytes the call reads takes, and its GB/s), the read limit at these per-call sizes.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import matrix_peaks, print_table, read_views
from kernels import cpu as native
from kernels.cpu_features import cpu_description

# (batch, cached prefix tokens, new tokens)
MIXES = [(1, 0, 512), (2, 0, 512), (16, 1024, 64), (16, 512, 1), (1, 4096, 1), (1, 600, 1),
         (1, 600, 9), (1, 256, 1), (1, 650, 2), (1, 650, 5), (4, 650, 1), (4, 650, 3)]


def _time(fn, seconds: float) -> float:
    """Mean seconds of ``fn()`` over ``seconds`` (after two warm-up calls)."""
    fn()
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="q and KV dtype: bfloat16 or float32")
    ap.add_argument("--seconds", type=float, default=1.0, help="timing per cell")
    ap.add_argument("--layers", type=int, default=1, help="K/V pools called in turn (30: "
                    "DRAM-resident K/V, as in a decode step of a 30-layer model)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ops = {}
    for kernel in native.ATTENTION_KERNELS:
        try:
            ops[kernel] = native.attention_op(kernel)
        except RuntimeError as exc:
            print(f"{kernel}: skipped ({exc})")
    peaks = matrix_peaks()
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print("matrix peaks (torch, 2048^3): " + ", ".join(
        f"{k} {v:.2f} T{'OP' if k == 'int8' else 'FLOP'}/s" for k, v in peaks.items()))
    torch.manual_seed(0)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    rows = []
    for batch, prefix, new in MIXES:
        seq = prefix + new
        cap = batch * seq + 1
        pools = [(torch.randn(cap, hkv, d).to(dtype), torch.randn(cap, hkv, d).to(dtype))
                 for _ in range(args.layers)]
        table = (torch.randperm(cap - 1) + 1).view(batch, seq)  # slot 0 stays unused
        q = torch.randn(batch * new, hq, d).to(dtype)
        rest = (table, torch.arange(batch), torch.full((batch,), prefix),
                torch.full((batch,), new), d ** -0.5, 0, 0.0)
        flops = 4 * d * hq * batch * sum(prefix + i + 1 for i in range(new))
        row = [f"{batch} x ({prefix} + {new})"]
        for op in ops.values():
            def layers(op=op):
                for k, v in pools:
                    op(q, k, v, *rest)
            t = _time(layers, args.seconds) / args.layers
            row.append(f"{t * 1e3:.3f} ({flops / t / 1e9:.0f})")
        if args.layers > 1:  # a plain read of the same bytes
            words = read_views([t for kv in pools for t in kv])
            t = _time(lambda: [w.sum() for w in words], args.seconds) / args.layers
            gbs = sum(w.nbytes for w in words) / args.layers / t / 1e9
            row.append(f"{t * 1e3:.3f} ({gbs:.0f} GB/s)")
        rows.append(row)
    read = ["torch.sum ms (GB/s)"] if args.layers > 1 else []
    print_table(["batch x (cached + new)"] + [f"{k} ms (GFLOP/s)" for k in ops] + read, rows)


if __name__ == "__main__":
    main()
