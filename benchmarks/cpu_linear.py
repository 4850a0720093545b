"""The native quantized linear layers (``kernels.cpu``) against this machine's limits, measured
in one run: weight bytes read per second against the copy bandwidth, and multiply-adds per
second against a large dense matmul, for the shapes of a model at several row counts.

    python -m benchmarks.cpu_linear                      # the default model's shapes (SmolLM2-135M)
    python -m benchmarks.cpu_linear --shapes 2048x2048,2048x16384,8192x2048 --rows 1,16,512

Each shape is [K, N] (in_features x out_features) as int4 (the packed Q4_1 layout), then the
default model's int8 lm_head [576, 49152] unless ``--no-lm-head``. Per cell: milliseconds a
call (median of ``--reps``), GB/s of packed weight read, and GFLOP/s. The machine's CPU class
is printed first. Weights are cache-resident when they fit (the same ones every call), so a
model's real decode, which streams every layer's weights from memory, runs slower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import copy_bandwidth
from kernels import cpu as native
from kernels.cpu_features import cpu_description
from server.model.quantization import quantize_int4, quantize_int8

# SmolLM2-135M: fused QKV, O, fused gate/up, down; the tied lm_head is int8
DEFAULT_SHAPES = "576x960,576x576,576x3072,1536x576"
LM_HEAD = (576, 49152)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def dense_gflops(n: int = 2048, dtype=torch.float32, reps: int = 5) -> float:
    """A large dense matmul's multiply-adds x 2 per second (torch/oneDNN), GFLOP/s."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_ms(lambda: a @ b, reps) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="KxN,... (in x out features)")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-lm-head", action="store_true", help="skip the int8 576x49152 head")
    args = ap.parse_args(argv)
    native.require()
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {cpu_description()}; torch threads: {torch.get_num_threads()}")
    bw, peak = copy_bandwidth("cpu"), dense_gflops()
    print(f"copy bandwidth {bw:.1f} GB/s; dense fp32 matmul 2048^3 {peak:.0f} GFLOP/s\n")
    cases = []
    for spec in args.shapes.split(","):
        k, n = (int(v) for v in spec.split("x"))
        cases.append(("int4", k, n))
    if not args.no_lm_head:
        cases.append(("int8", *LM_HEAD))
    print("| kind | K x N | rows | ms | weight GB/s | share of copy bw | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for kind, k, n in cases:
        w = torch.randn(n, k)
        if kind == "int4":
            qw = quantize_int4(w)
            packed = native.pack_int4(qw.q, qw.scale, qw.zero)
            call = lambda x: native.int4_linear(x, packed, n)  # noqa: E731
            nbytes = packed.nbytes
        else:
            qw = quantize_int8(w)
            q, s = qw.q.contiguous(), qw.scale.float().contiguous()
            call = lambda x: native.int8_linear(x, q, s)  # noqa: E731
            nbytes = q.nbytes + s.nbytes
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            ms = _median_ms(lambda: call(x), args.reps)
            gbps = nbytes / ms / 1e6
            print(f"| {kind} | {k} x {n} | {m} | {ms:.3f} | {gbps:.1f} | {gbps / bw:.0%} | "
                  f"{2 * m * k * n / ms / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
